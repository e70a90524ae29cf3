"""`attnid audit` on the real MiniLM, its canonical form, every family, and bad input."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import numpy as np
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
    assert seconds < 60, f"audit took {seconds:.1f}s"  # about 10 s on a quiet machine: a 6x regression fails
    assert (tmp_path / "heat.png").read_bytes()[:4] == b"\x89PNG"
    assert len(r["layers"]) == 6
    for row in r["layers"]:
        for key in ("imbalance_qk", "imbalance_vo", "tau_qk", "tau_vo", "mu_qk", "mu_vo"):
            assert len(row[key]) == 12, key
        assert all(0.0 <= b <= 1.0 for b in row["imbalance_qk"] + row["imbalance_vo"])
        assert row["key_bias_invisible"] == pytest.approx([1.0] * 12)  # no RoPE: all of b_K
        assert row["removable_norm"] > 0
    # AdamW left the pretrained checkpoint far from balanced
    s = r["summary"]
    assert s["imbalance_qk_median"] > 0.05 and s["imbalance_vo_median"] > 0.05, s


def test_canonical_minilm_reads_balanced(minilm_canonical, capsys):
    code, r, err = _audit(capsys, minilm_canonical)
    assert code == 0, err
    s = r["summary"]
    assert s["imbalance_qk_max"] < 1e-5 and s["imbalance_vo_max"] < 1e-5, s
    assert all(row["removable_share"] < 1e-4 for row in r["layers"])
    assert all(row["value_bias_foldable"] == 0.0 for row in r["layers"])


def test_table_output(minilm, capsys):
    assert main(["audit", str(minilm)]) == 0
    out = capsys.readouterr().out
    assert "imbalance_qk median" in out and "removable" in out and "beta" not in out


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
    assert all(0.0 <= b <= 1.0 + 1e-12 for row in r["layers"] for b in row["imbalance_vo"])


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


# the keys docs/cli.md lists for `audit --json`, exactly (no `beta_*`: beta is ||C||_F elsewhere)
AUDIT_KEYS = ["model", "architecture", "dtype", "spec", "summary", "layers"]
SUMMARY_KEYS = ["imbalance_qk_median", "imbalance_qk_max", "imbalance_vo_median", "imbalance_vo_max",
                "removable_norm", "removable_share_mean"]
LAYER_KEYS = ["layer", "imbalance_qk", "imbalance_vo", "tau_qk", "mu_qk", "tau_vo", "mu_vo",
              "key_bias_invisible", "value_bias_foldable", "removable_norm", "removable_share"]


def test_json_keys_are_exactly_the_documented_ones(minilm, capsys):
    code, r, err = _audit(capsys, minilm)
    assert code == 0, err
    assert list(r) == AUDIT_KEYS and list(r["summary"]) == SUMMARY_KEYS
    assert all(list(row) == LAYER_KEYS for row in r["layers"])
    doc = (Path(__file__).parents[2] / "docs" / "cli.md").read_text()
    line = next(ln for ln in doc.split("\n* ") if ln.startswith("`audit --json`"))
    documented = set(re.findall(r"`(\w+)`", line))
    assert documented == set(AUDIT_KEYS + SUMMARY_KEYS + LAYER_KEYS), documented


def test_imbalance_is_beta_over_the_gram_scale():
    from attnid import Attention, AttentionSpec, randomize_
    from attnid.checkpoint.audit import audit_layer
    from attnid.symmetry import AttentionWeights, grams, metrics

    spec = AttentionSpec(d_model=12, n_heads=4, n_kv_heads=2, bias="qkvo")
    w = AttentionWeights.from_module(randomize_(Attention(spec).double(), 3))
    layer = audit_layer(w, 7)
    core = w.replace(b_Q=torch.zeros_like(w.b_Q), b_K=torch.zeros_like(w.b_K), b_V=torch.zeros_like(w.b_V))
    for side in ("qk", "vo"):
        left, right = grams(core, side)
        beta = metrics(core).side(side).beta
        want = beta / (left.flatten(-2).norm(dim=-1) + right.flatten(-2).norm(dim=-1))
        assert torch.allclose(layer.imbalance(side), want, rtol=1e-12, atol=0), side
        assert bool((layer.imbalance(side) < beta).all())  # a different number from beta
    d = layer.to_dict()
    assert d["layer"] == 7 and d["imbalance_qk"] == layer.imbalance_qk.tolist()
    assert d["tau_vo"] == layer.metrics.vo.tau.tolist() and "beta_qk" not in d


def _cli_table(capsys, minilm) -> tuple[list[list[str]], str]:
    assert main(["audit", str(minilm)]) == 0
    out = capsys.readouterr().out
    rows = [[c.strip() for c in ln.split("│")[1:-1]] for ln in out.splitlines() if ln.startswith("│")]
    return rows, out


def test_one_median_in_the_table_the_summary_line_the_json_and_the_report(minilm, capsys, monkeypatch):
    """Layer 0 of the real MiniLM reads 0.280 (the mean of the two middle heads of 12), the
    same in the CLI table, ``--json`` and the report's table; the summary line, the JSON
    summary and the report's claim read the same median over all 72 heads."""
    from attnid.checkpoint.audit import audit
    from attnid.paper.pretrained import audit_claim, audit_rows, audit_text

    monkeypatch.setenv("COLUMNS", "250")
    rows, out = _cli_table(capsys, minilm)
    code, r, err = _audit(capsys, minilm)
    assert code == 0, err
    rep = audit(minilm)
    report_rows = audit_rows(rep)
    assert len(rows) == len(report_rows) == len(r["layers"]) == 6
    for cli, js, rr in zip(rows, r["layers"], report_rows, strict=True):
        for side, col in (("qk", 1), ("vo", 2)):
            heads = js[f"imbalance_{side}"]
            want = float(np.median(heads))  # numpy's median: the arbiter of "the usual one"
            assert len(heads) == 12 and rr[f"imbalance_{side}_median"] == pytest.approx(want, rel=1e-12)
            assert cli[col] == f"{want:.3f}/{max(heads):.3f}", (cli, want)
            assert rr[f"imbalance_{side}_max"] == pytest.approx(max(heads), rel=1e-12)
    layer0 = sorted(r["layers"][0]["imbalance_qk"])
    assert rows[0][1].startswith("0.280/") and f"{layer0[6]:.3f}" == "0.293"  # not the upper middle
    every = {side: [x for js in r["layers"] for x in js[f"imbalance_{side}"]] for side in ("qk", "vo")}
    s = r["summary"]
    for side in ("qk", "vo"):
        want = float(np.median(every[side]))
        assert s[f"imbalance_{side}_median"] == pytest.approx(want, rel=1e-12)
        assert getattr(rep.summary, f"imbalance_{side}_median") == pytest.approx(want, rel=1e-12)
        assert f"imbalance_{side} median {want:.3f} max {max(every[side]):.3f}" in out, out
    # the report's text and its first claim quote the same medians
    text, evidence = audit_text(rep), audit_claim(rep).evidence  # the section's text holds audit_text
    for side in ("qk", "vo"):
        quoted = f"imbalance_{side} median {float(np.median(every[side])):.3f}"
        assert quoted in text and quoted in evidence, (quoted, text, evidence)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    from tests.checkpoint.conftest import SMALL, save_random

    return save_random(SMALL["llama"], tmp_path_factory.mktemp("finite"), "llama")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_number_is_found_anywhere_in_any_dtype(llama_dir, tmp_path, dtype, bad):
    """`Checkpoint.tensor` refuses a weight with one NaN or Inf wherever it sits (its least and
    greatest elements: `Checkpoint._finite`), in each stored floating dtype, and reads it clean."""
    from safetensors.torch import load_file, save_file

    from attnid.checkpoint.load import open_checkpoint
    from attnid.errors import AttnidError

    name = "model.layers.1.mlp.up_proj.weight"
    clean = {k: v.to(dtype) for k, v in load_file(llama_dir / "model.safetensors").items()}
    n = clean[name].numel()
    for at in (0, n // 2 + 3, n - 1):
        d = tmp_path / f"at{at}"
        shutil.copytree(llama_dir, d)
        t = dict(clean)
        t[name] = clean[name].clone().view(-1)
        t[name][at] = bad
        save_file({k: v.view(clean[k].shape) for k, v in t.items()}, d / "model.safetensors")
        with pytest.raises(AttnidError, match=re.escape(name) + " holds NaN or Inf"):
            open_checkpoint(d).tensor(name)
    save_file(clean, d / "model.safetensors")
    assert torch.equal(open_checkpoint(d).tensor(name), clean[name])
