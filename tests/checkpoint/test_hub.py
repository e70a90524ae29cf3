"""Models by their Hugging Face id (``org/name``), read from a local Hugging Face cache built here
(``models--org--name/snapshots/<rev>/`` with files linked to ``blobs/``, ``refs/main``), never
downloaded: report, verify --hf-config, audit, diff and canonicalize, and the error for a model
that is not cached."""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
from pathlib import Path

import pytest

from attnid.cli import main

pytest.importorskip("huggingface_hub")
pytest.importorskip("transformers")

REV = "0123456789abcdef0123456789abcdef01234567"


def put_in_cache(cache: Path, repo_id: str, files: dict[str, Path]) -> Path:
    """Lay ``files`` out as huggingface_hub does: content in ``blobs/<sha256>``, the snapshot's
    files symbolic links to them, ``refs/main`` naming the revision."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / REV
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for name, src in files.items():
        blob = repo / "blobs" / hashlib.sha256(src.read_bytes()).hexdigest()
        shutil.copyfile(src, blob)
        (snap / name).symlink_to(Path("../../blobs") / blob.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REV)
    return snap


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face cache (HF_HUB_CACHE), offline; any network connection fails the test."""
    root = tmp_path / "hub"
    root.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # attnid must not download even when allowed to
    tried: list[object] = []

    def refuse(self, address):
        tried.append(address)
        raise OSError("the test refuses network connections")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    yield root
    assert not tried, f"attnid tried to reach the network: {tried}"


def run(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()  # what building the fixtures printed
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def _json(capsys, *args: str) -> dict:
    code, out, err = run(capsys, *args, "--json")
    assert code == 0, err
    return json.loads(out)


@pytest.fixture
def config_only(cache, tmp_path, small) -> tuple[str, Path]:
    """A cached model of which only config.json was fetched; and a local copy of that config."""
    path = tmp_path / "config.json"
    # without attention_bias: verify --hf-config disagrees on Llama's o_proj bias (on main too)
    path.write_text(json.dumps(dict(small["llama"], attention_bias=False)))
    put_in_cache(cache, "org/tiny-llama", {"config.json": path})
    return "org/tiny-llama", path


@pytest.fixture
def full(cache, tmp_path, small, random_checkpoint) -> tuple[str, Path]:
    """A cached full checkpoint (config.json + model.safetensors); and the directory it came from."""
    src = random_checkpoint(small["llama"], tmp_path, "local")
    put_in_cache(cache, "org/tiny-llama-weights", {p.name: p for p in src.iterdir() if p.is_file()})
    return "org/tiny-llama-weights", src


def test_report_reads_a_cached_config(capsys, config_only):
    name, path = config_only
    got, local = _json(capsys, "report", name), _json(capsys, "report", str(path))
    assert got.pop("model") == name and local.pop("model") == str(path)
    assert got == local and got["n_layers"] == 2


def test_verify_hf_config_reads_a_cached_config(capsys, config_only):
    code, out, err = run(capsys, "verify", "--hf-config", config_only[0])
    assert code == 0, err
    assert out.startswith(f"AGREE  {config_only[0]} (attention of LlamaForCausalLM"), out


def test_audit_reads_a_cached_checkpoint(capsys, full, digest, cache):
    name, src = full
    before = digest(cache)
    got, local = _json(capsys, "audit", name), _json(capsys, "audit", str(src))
    assert got.pop("model") == name and local.pop("model") == str(src)
    assert got == local
    assert digest(cache) == before


def test_diff_and_canonicalize_a_cached_checkpoint(capsys, full, tmp_path, digest, cache):
    name, _ = full
    before = digest(cache)
    out = tmp_path / "canonical"
    code, _, err = run(capsys, "canonicalize", name, str(out))
    assert code == 0, err
    assert digest(cache) == before  # the cache is only read
    assert not any(p.is_symlink() for p in out.rglob("*"))  # copies, not links into the cache
    code, text, err = run(capsys, "diff", name, str(out))
    assert code == 0, err
    assert "CERTIFIED" in text and text.startswith(f"{name} vs {out}")  # A vs B, in argument order, text


@pytest.mark.parametrize("args", [["report", "org/missing"], ["verify", "--hf-config", "org/missing"],
                                  ["audit", "org/missing"], ["diff", "org/missing", "org/missing"],
                                  ["canonicalize", "org/missing", "out"]])
def test_a_model_not_in_the_cache_is_one_error_line(capsys, cache, args):
    code, _, err = run(capsys, *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:"), err
    assert "org/missing" in err and "hf download org/missing" in err and str(cache) in err, err


def test_a_checkpoint_command_on_a_config_only_cache_entry_says_weights_are_missing(capsys, config_only):
    code, _, err = run(capsys, "audit", config_only[0])
    assert code == 2 and err.startswith("error:") and len(err.strip().splitlines()) == 1, err


def test_a_bundled_name_keeps_meaning_the_bundled_config(capsys, cache, tmp_path, small):
    other = tmp_path / "config.json"
    other.write_text(json.dumps(small["gpt2"]))  # 2 layers; the bundled gpt2 has 12
    put_in_cache(cache, "gpt2", {"config.json": other})
    assert _json(capsys, "report", "gpt2")["n_layers"] == 12


def test_hf_home_is_honoured(capsys, tmp_path, monkeypatch, small):
    home = tmp_path / "hf-home"
    (home / "hub").mkdir(parents=True)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    path = tmp_path / "config.json"
    path.write_text(json.dumps(small["llama"]))
    put_in_cache(home / "hub", "org/tiny-llama", {"config.json": path})
    assert _json(capsys, "report", "org/tiny-llama")["n_layers"] == 2
