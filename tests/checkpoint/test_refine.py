"""`attnid align / merge / barrier --refine N` on tiny checkpoints: the refined B is still B
(certified by `attnid diff`, B's log-probabilities end to end), its calibration loss at the
mid-point is not above the matched one, `merge --alpha 1` writes what `align` writes, and bad
input is refused in one line before any work, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from attnid.cli import main
from attnid.testing.files import assert_one_error, fingerprint

from .test_align import log_probs, pairs, run, tensors  # noqa: F401  (pairs: the fixture)

STEPS = "4"


@pytest.mark.parametrize("family", [pytest.param("llama", marks=pytest.mark.slow), "gpt2"])
def test_align_refine_is_certified_and_not_worse(family, pairs, tmp_path, capsys):  # noqa: F811
    p = pairs[family]
    before = {k: fingerprint(v) for k, v in p.items()}
    out = tmp_path / "out"
    code, r, err = run(capsys, "align", p["a"], p["c"], out, "--calibration", pairs["text"],
                       "--refine", STEPS)
    assert code == 0 and r["certified"], err
    f = r["refined"]
    assert f["steps"] == 4 and "vo" in f["parts"] and ("rotation" in f["parts"]) == (family == "llama"), f
    assert f["loss_after"] < f["loss_before"] or not f["kept"], f
    assert f["kept"], f"{family}: 4 steps did not lower the calibration loss ({f['loss_before']:.5f} -> " \
                      f"{f['loss_after']:.5f})"
    lc, lo = log_probs(p["c"]), log_probs(out)
    rel = float((lc - lo).norm() / lc.norm())
    assert rel < 1e-5, f"{family}: the refined B's log-probabilities differ from B's by {rel:.1e}"
    if family == "llama":  # GPT-2's stream is permuted, which diff does not fit (see test_align)
        code, d, err = run(capsys, "diff", p["c"], out)
        assert code == 0 and d["certified"], err
    assert {k: fingerprint(v) for k, v in p.items()} == before, "an input was modified"


@pytest.mark.slow
def test_merge_and_barrier_refine(pairs, tmp_path, capsys):  # noqa: F811
    p, text = pairs["llama"], pairs["text"]
    code, _, err = run(capsys, "align", p["a"], p["c"], tmp_path / "aligned", "--calibration", text,
                       "--refine", STEPS)
    assert code == 0, err
    code, m, err = run(capsys, "merge", p["a"], p["c"], tmp_path / "one", "--alpha", "1", "--align",
                       "--calibration", text, "--refine", STEPS)
    assert code == 0 and m["refined"]["kept"], err
    al, one = tensors(tmp_path / "aligned"), tensors(tmp_path / "one")
    worst = max(float((t - al[k]).abs().max()) for k, t in one.items())
    assert worst == 0.0, f"merge --alpha 1 --refine is not align --refine: {worst:.1e}"
    code, b, err = run(capsys, "barrier", p["a"], p["c"], "--align", "--calibration", text, "--alphas", "3",
                       "--refine", STEPS, "--refine-calibration", text)
    assert code == 0 and set(b["losses"]) == {"naive", "aligned", "refined"}, err
    ends = [ys[-1] for ys in b["losses"].values()]
    assert max(ends) - min(ends) < 1e-4 * max(ends), f"the end of a path is not B: {ends}"
    assert b["refined"]["loss_after"] < b["refined"]["loss_before"], b["refined"]


def _bad_cases(p: dict, tmp: Path) -> dict[str, tuple[list, str]]:
    a, b, text = p["llama"]["a"], p["llama"]["c"], p["text"]
    out = tmp / "out"
    return {
        "zero-steps": (["align", a, b, out, "--calibration", text, "--refine", "0"], "--refine 0"),
        "no-calibration": (["align", a, b, out, "--refine", "3"], "--calibration"),
        "missing-calibration": (["align", a, b, out, "--refine", "3", "--calibration", tmp / "no.txt"],
                                "no such file"),
        "permutations": (["align", a, b, out, "--calibration", text, "--refine", "3", "--subgroup",
                          "permutations"], "no continuous part"),
        "merge-no-align": (["merge", a, b, out, "--calibration", text, "--refine", "3"], "--align"),
        "merge-no-calibration": (["merge", a, b, out, "--align", "--refine", "3"], "--calibration"),
        "merge-negative": (["merge", a, b, out, "--align", "--calibration", text, "--refine", "-2"],
                           "--refine"),
        "barrier-no-text": (["barrier", a, b, "--calibration", text, "--align", "--refine", "3"],
                            "--refine-calibration"),
        "barrier-missing-text": (["barrier", a, b, "--calibration", text, "--align", "--refine", "3",
                                  "--refine-calibration", tmp / "no.txt"], "--refine-calibration"),
        "barrier-no-align": (["barrier", a, b, "--calibration", text, "--refine", "3",
                              "--refine-calibration", text], "--align"),
        "masked-lm": (["align", *_masked_pair(tmp), out, "--calibration", text, "--refine", "3"],
                      "causal language model"),
        "merge-masked-lm": (["merge", *_masked_pair(tmp), out, "--align", "--calibration", text,
                             "--refine", "3"], "causal language model"),
    }


def _masked_pair(tmp: Path) -> tuple[Path, Path]:
    """Where `_write_masked_pair` writes two tiny BERT masked language models."""
    return tmp / "bert-a", tmp / "bert-b"


def _write_masked_pair(tmp: Path) -> None:
    from attnid.testing.catalogue import TRANSFORM_FAMILIES
    from attnid.whole.check import tiny_model

    for seed, d in enumerate(_masked_pair(tmp)):
        tiny_model(TRANSFORM_FAMILIES["bert"], seed=seed).float().save_pretrained(d)


CASES = ["zero-steps", "no-calibration", "missing-calibration", "permutations", "merge-no-align",
         "merge-no-calibration", "merge-negative", "barrier-no-text", "barrier-missing-text",
         "barrier-no-align", "masked-lm", "merge-masked-lm"]


@pytest.mark.parametrize("case", CASES)
def test_refine_bad_input_one_error_line(case, pairs, tmp_path, capsys, monkeypatch):  # noqa: F811
    import attnid.whole.align.aligner as aligner

    def no_work(*args, **kwargs):
        raise AssertionError("the alignment ran before the input was checked")

    monkeypatch.setattr(aligner, "align_sources", no_work)
    args, words = _bad_cases(pairs, tmp_path)[case]
    if "masked" in case:
        _write_masked_pair(tmp_path)
        capsys.readouterr()
    before = {d: fingerprint(d) for d in (pairs["llama"]["a"], pairs["llama"]["c"])}
    code = main([str(x) for x in args])
    assert_one_error(code, capsys.readouterr().err, "", [words])
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".*tmp")), "something was written"
    assert {d: fingerprint(d) for d in before} == before, "an input was modified"


@pytest.mark.slow
def test_refine_keeps_b_when_no_step_helps(pairs, tmp_path, capsys, monkeypatch):  # noqa: F811
    """A refinement that does not lower the calibration loss is not kept: B as matched."""
    import attnid.whole.align.refine as refine

    monkeypatch.setattr(refine.torch.optim, "Adam", lambda params, lr: _Away(params))
    p = pairs["llama"]
    run(capsys, "align", p["a"], p["c"], tmp_path / "matched", "--calibration", pairs["text"])
    code, r, err = run(capsys, "align", p["a"], p["c"], tmp_path / "out", "--calibration", pairs["text"],
                       "--refine", "1")
    assert code == 0, err
    assert not r["refined"]["kept"], r["refined"]
    m, o = tensors(tmp_path / "matched"), tensors(tmp_path / "out")
    assert all(torch.equal(t, m[k]) for k, t in o.items()), "B as matched was not kept"


class _Away:
    """An optimiser that moves every parameter far up its gradient (the loss goes up)."""

    def __init__(self, params) -> None:  # parameters, or groups of them (as torch.optim's)
        self.params = [q for g in params for q in (g["params"] if isinstance(g, dict) else [g])]

    def zero_grad(self, set_to_none: bool = True) -> None:  # as torch.optim.Optimizer's
        for q in self.params:
            q.grad = None

    def step(self) -> None:
        with torch.no_grad():
            for q in self.params:
                q += 0.3 * torch.sign(q.grad)
