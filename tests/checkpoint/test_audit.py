"""`attnid audit` on the real MiniLM, its canonical form, every family, and bad input."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch

from attnid.adapters.config import bundled, load_config
from attnid.adapters.registry import adapter_for
from attnid.cli import main


def _audit(capsys, *args: str) -> tuple[int, dict | None, str]:
    code = main(["audit", *map(str, args), "--json"])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 else None), err


def test_real_minilm_is_unbalanced_and_untouched(minilm, tmp_path, capsys, digest):
    before = digest(minilm)
    t0 = time.perf_counter()
    code, r, err = _audit(capsys, minilm, "--plot", tmp_path / "heat.png")
    seconds = time.perf_counter() - t0
    assert code == 0, err
    assert digest(minilm) == before, "the checkpoint was modified"
    assert seconds < 20, f"audit took {seconds:.1f}s"
    assert (tmp_path / "heat.png").read_bytes()[:4] == b"\x89PNG"
    assert len(r["layers"]) == 6
    for row in r["layers"]:
        for key in ("beta_qk", "beta_vo", "tau_qk", "tau_vo", "mu_qk", "mu_vo"):
            assert len(row[key]) == 12, key
        assert all(0.0 <= b <= 1.0 for b in row["beta_qk"] + row["beta_vo"])
        assert row["key_bias_invisible"] == pytest.approx([1.0] * 12)  # no RoPE: all of b_K
        assert row["removable_norm"] > 0
    # AdamW left the pretrained checkpoint far from balanced
    assert r["summary"]["beta_qk_median"] > 0.05 and r["summary"]["beta_vo_median"] > 0.05, r["summary"]


def test_canonical_minilm_reads_balanced(minilm_canonical, capsys):
    code, r, err = _audit(capsys, minilm_canonical)
    assert code == 0, err
    s = r["summary"]
    assert s["beta_qk_max"] < 1e-5 and s["beta_vo_max"] < 1e-5, s
    assert all(row["removable_share"] < 1e-4 for row in r["layers"])
    assert all(row["value_bias_foldable"] == 0.0 for row in r["layers"])


def test_table_output(minilm, capsys):
    assert main(["audit", str(minilm)]) == 0
    out = capsys.readouterr().out
    assert "beta_qk median" in out and "removable" in out


FAMILIES = {}
for _name in bundled():
    _c = load_config(_name)[1]
    try:
        _a = adapter_for(_c)
    except Exception:  # bundled configs this transformers cannot serve
        continue
    if _a.closed_form:
        FAMILIES.setdefault(_a.family, _name)


@pytest.mark.parametrize("name", sorted(FAMILIES.values()))
def test_every_canonicalizable_family(name, tmp_path, capsys, random_checkpoint):
    config = load_config(name)[1]
    small = adapter_for(config).reduce(config)
    small["num_hidden_layers"] = 2
    for k in ("n_layer", "num_layers"):
        small.pop(k, None)
    d = random_checkpoint(small, tmp_path, "m")
    code, r, err = _audit(capsys, d)
    assert code == 0, err
    assert len(r["layers"]) == 2
    assert all(0.0 <= b <= 1.0 + 1e-12 for row in r["layers"] for b in row["beta_vo"])


def _one_error(capsys, *args, message: str) -> None:
    code = main(["audit", *map(str, args)])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], err


def test_bad_input(minilm, tmp_path, capsys):
    _one_error(capsys, tmp_path / "missing", message="does not exist")
    _one_error(capsys, tmp_path, message="no config.json")
    trunc = tmp_path / "trunc"
    trunc.mkdir()
    shutil.copy(minilm / "config.json", trunc / "config.json")
    (trunc / "model.safetensors").write_bytes((minilm / "model.safetensors").read_bytes()[:50000])
    _one_error(capsys, trunc, message="truncated")
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"],
                                                   "model_type": "mamba"}))
    _one_error(capsys, other, message="unsupported architecture")


def test_nan_refused(minilm, tmp_path, capsys, variant):
    def poison(t: dict[str, torch.Tensor]) -> None:
        t["encoder.layer.2.attention.self.key.weight"][0, 0] = float("nan")

    d = variant(minilm, tmp_path / "nan", other_fn=poison)
    _one_error(capsys, d, message="NaN")
