"""`attnid align`, `attnid merge`, `attnid barrier` on tiny checkpoints with a character-level
tokenizer: B = a random group element applied to A is aligned back onto A to float32 rounding,
and the output is certified by `attnid diff` against B (exit 0) and runs to B's
log-probabilities; merging a model with itself is the identity, alpha = 0 gives A and alpha =
1 the aligned B; the barrier of a model with itself is zero and the aligned path of A to its
own rewrite is flat; bad input is refused in one line before any work, nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from attnid.cli import main
from attnid.testing.files import assert_one_error, fingerprint

LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=32, num_attention_heads=4,
             num_key_value_heads=2, num_hidden_layers=2, intermediate_size=48, vocab_size=64,
             max_position_embeddings=64, tie_word_embeddings=False)
GPT2 = dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], n_embd=32, n_head=4, n_layer=2, n_inner=48,
            vocab_size=64, n_positions=64)
TEXT = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer. " * 8


def char_tokenizer(d: Path, vocab: int = 64) -> None:
    """A character-level tokenizer (ids below ``vocab``) saved next to a checkpoint."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    chars = {chr(c): i + 1 for i, c in enumerate(range(32, 32 + vocab - 1))}
    tok = Tokenizer(models.WordLevel({"<unk>": 0, **chars}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(d)


def save(model, root: Path, name: str, tokenizer: bool = True) -> Path:
    d = root / name
    model.float().save_pretrained(d)
    if tokenizer:
        char_tokenizer(d)
    return d


def build(config: dict, seed: int):
    import transformers

    c = dict(config)
    conf = transformers.AutoConfig.for_model(c.pop("model_type"), **c)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(conf).double()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ("norm" in n or "ln_" in n) and n.endswith("weight"):
                p.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """Per family: A, B (A moved by a random group element), C (another seed), the text."""
    from attnid.whole import transforms as T

    from ..whole.test_fit import element

    root = tmp_path_factory.mktemp("align")
    out = {}
    for name, config in (("llama", LLAMA), ("gpt2", GPT2)):
        A, C = build(config, 0), build(config, 1)
        B = T.apply_element(A, element(A))
        out[name] = {k: save(m, root, f"{name}-{k}") for k, m in (("a", A), ("b", B), ("c", C))}
    (root / "text.txt").write_text(TEXT)
    out["text"] = root / "text.txt"
    return out


def run(capsys, *args) -> tuple[int, dict | None, str]:
    code = main([*map(str, args), "--json"])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip() else None), err


def tensors(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(d / "model.safetensors")


def log_probs(d: Path) -> torch.Tensor:
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64).eval()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return torch.log_softmax(m(input_ids=ids).logits, -1)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("calibration", [False, True], ids=["weights", "activations"])
def test_align_recovers_a_rewrite_and_is_certified(family, calibration, pairs, tmp_path, capsys):
    p = pairs[family]
    before = {k: fingerprint(v) for k, v in p.items()}
    out = tmp_path / "out"
    extra = ["--calibration", pairs["text"]] if calibration else []
    code, r, err = run(capsys, "align", p["a"], p["b"], out, *extra)
    assert code == 0, err
    rel = r["aligned_distance"] / r["raw_distance"]
    assert r["raw_distance"] > 1 and rel < 1e-6, f"{family}: aligned/raw {rel:.1e} (float32 rounding ~1e-7)"
    assert r["certified"] and r["end_to_end_rel_diff"] < 1e-5, r
    assert r["matching"] == ("activations" if calibration else "weights")
    a = tensors(p["a"])
    worst = max(float((t.double() - a[k].double()).norm() / a[k].double().norm().clamp_min(1e-30))
                for k, t in tensors(out).items())
    assert worst < 1e-5, f"{family}: a tensor of the output is {worst:.1e} (relative) from A's"
    code, d, err = run(capsys, "diff", p["b"], out)
    assert code == 0 and d["certified"], err
    lb, lo = log_probs(p["b"]), log_probs(out)
    assert float((lb - lo).norm() / lb.norm()) < 1e-5
    assert {k: fingerprint(v) for k, v in p.items()} == before, "an input was modified"
    assert len(r["layers"]) == 2 and set(r["shares"]) >= {"stream", "permutations", "qk", "vo", "mlp"}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_align_of_unrelated_models_is_certified(family, pairs, tmp_path, capsys):
    p = pairs[family]
    """Llama (untied): the stream rotates, and `attnid diff` certifies the output as it is.
    GPT-2 (tied, non-uniform final gain): the stream can only be permuted, which `attnid diff`
    does not fit; align certifies after undoing it (exact: no arithmetic), and the output runs
    to B's log-probabilities."""
    code, r, err = run(capsys, "align", p["a"], p["c"], tmp_path / "out")
    assert code == 0 and r["certified"], err
    assert r["aligned_distance"] < r["raw_distance"], r
    code, d, err = run(capsys, "diff", p["c"], tmp_path / "out")
    if family == "llama":
        assert r["stream"].startswith("rotation") and code == 0, err
    else:
        assert r["stream"].startswith("permutation") and code == 1 and d["break"]["layer"] is None, d["break"]
    lc, lo = log_probs(p["c"]), log_probs(tmp_path / "out")
    assert float((lc - lo).norm() / lc.norm()) < 1e-5


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_merge_ends_and_identity(family, pairs, tmp_path, capsys):
    p = pairs[family]
    a = tensors(p["a"])
    code, _, err = run(capsys, "merge", p["a"], p["a"], tmp_path / "same")
    assert code == 0, err
    same = tensors(tmp_path / "same")
    assert all(torch.equal(t, a[k]) for k, t in same.items()), "merge of A with A is not A"
    code, _, err = run(capsys, "merge", p["a"], p["c"], tmp_path / "zero", "--alpha", "0", "--align")
    assert code == 0, err
    assert all(torch.equal(t, a[k]) for k, t in tensors(tmp_path / "zero").items()), "alpha 0 is not A"
    run(capsys, "align", p["a"], p["c"], tmp_path / "aligned")
    code, r, err = run(capsys, "merge", p["a"], p["c"], tmp_path / "one", "--alpha", "1", "--align")
    assert code == 0 and r["aligned"], err
    al = tensors(tmp_path / "aligned")
    one = tensors(tmp_path / "one")
    assert all(torch.equal(t, al[k]) for k, t in one.items()), "alpha 1 is not aligned B"
    code, r, err = run(capsys, "merge", p["a"], p["c"], tmp_path / "half")
    c = tensors(p["c"])
    mid = tensors(tmp_path / "half")
    assert all(torch.allclose(t, (a[k] + c[k]) / 2, atol=1e-6) for k, t in mid.items())


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_barrier(family, pairs, tmp_path, capsys):
    p = pairs[family]
    code, r, err = run(capsys, "barrier", p["a"], p["a"], "--calibration", pairs["text"], "--alphas", "3")
    assert code == 0, err
    ys = r["losses"]["naive"]
    assert r["barriers"]["naive"] == 0.0 and max(ys) == min(ys), r
    plot = tmp_path / "barrier.png"
    code, r, err = run(capsys, "barrier", p["a"], p["b"], "--align", "--calibration", pairs["text"],
                       "--alphas", "5", "--plot", plot)
    assert code == 0 and plot.stat().st_size > 1000, err
    ys = r["losses"]["aligned"]
    assert max(ys) - min(ys) < 1e-4 * max(ys), f"the aligned path to A's own rewrite is not flat: {ys}"
    assert abs(r["barriers"]["aligned"]) < 1e-4 and r["alphas"] == [0, 0.25, 0.5, 0.75, 1]
    assert r["losses"]["naive"][0] == ys[0] and abs(r["losses"]["naive"][-1] - ys[-1]) < 1e-4


def _bad_cases(p: dict, root: Path, tmp: Path) -> dict[str, tuple[list, str]]:
    a, b, text = p["llama"]["a"], p["llama"]["c"], p["text"]
    out = tmp / "out"
    return {
        "other-architecture-align": (["align", a, p["gpt2"]["a"], out], "not the same architecture"),
        "other-architecture-merge": (["merge", a, p["gpt2"]["a"], out], "not the same architecture"),
        "other-architecture-barrier": (["barrier", a, p["gpt2"]["a"], "--calibration", text],
                                       "not the same architecture"),
        "missing-data": (["barrier", a, b, "--calibration", tmp / "none.txt"], "--calibration"),
        "short-data": (["barrier", a, b, "--calibration", root / "short.txt"], "fewer than one chunk"),
        "missing-calibration": (["align", a, b, out, "--calibration", tmp / "none.txt"], "--calibration"),
        "missing-tokenizer": (["barrier", root / "bare", b, "--calibration", text], "tokenizer"),
        "alpha-high": (["merge", a, b, out, "--alpha", "1.5"], "--alpha"),
        "alpha-nan": (["merge", a, b, out, "--alpha", "nan"], "--alpha"),
        "alphas-two": (["barrier", a, b, "--calibration", text, "--alphas", "2"], "--alphas"),
        "subgroup": (["align", a, b, out, "--subgroup", "rotations"], "--subgroup"),
        "out-is-a": (["align", a, b, a], "OUT_DIR"),
        "out-is-b": (["merge", a, b, b], "OUT_DIR"),
        "out-not-empty": (["align", a, b, root], "not empty"),
        "plot-folder": (["barrier", a, b, "--calibration", text, "--plot", tmp / "no" / "x.png"], "--plot"),
        "plot-format": (["barrier", a, b, "--calibration", text, "--plot", tmp / "x.nope"], "nope"),
        "context": (["barrier", a, b, "--calibration", text, "--context", "1000"], "--context"),
        "missing-model": (["align", tmp / "nothing", b, out], "nothing"),
        "nan-weights-barrier": (["barrier", a, root / "nan", "--calibration", text], "NaN"),
        "nan-weights-calibration": (["align", a, root / "nan", out, "--calibration", text], "NaN"),
        "rounds-align": (["align", a, b, out, "--rounds", "-1"], "--rounds -1"),
        "rounds-merge": (["merge", a, b, out, "--align", "--rounds", "-2"], "--rounds -2"),
        "rounds-barrier": (["barrier", a, b, "--calibration", text, "--align", "--rounds", "-1"], "--rounds"),
    }


CASE_NAMES = ["other-architecture-align", "other-architecture-merge", "other-architecture-barrier",
              "missing-data", "short-data", "missing-calibration", "missing-tokenizer", "alpha-high",
              "alpha-nan", "alphas-two", "subgroup", "out-is-a", "out-is-b", "out-not-empty", "plot-folder",
              "plot-format", "context", "missing-model", "nan-weights-barrier", "nan-weights-calibration",
              "rounds-align", "rounds-merge", "rounds-barrier"]


@pytest.fixture(scope="module")
def bad_root(pairs, tmp_path_factory):
    import shutil

    root = tmp_path_factory.mktemp("bad")
    (root / "short.txt").write_text("ab")
    shutil.copytree(pairs["llama"]["a"], root / "bare", ignore=shutil.ignore_patterns("tokenizer*"))
    shutil.copytree(pairs["llama"]["c"], root / "nan")  # one weight of a layer NaN
    from safetensors.torch import load_file, save_file

    f = root / "nan" / "model.safetensors"
    state = load_file(f)
    state["model.layers.1.mlp.up_proj.weight"][0, 0] = float("nan")
    save_file(state, f, metadata={"format": "pt"})
    return root


@pytest.mark.parametrize("case", CASE_NAMES)
def test_bad_input_one_error_line(case, pairs, bad_root, tmp_path, capsys):
    args, words = _bad_cases(pairs, bad_root, tmp_path)[case]
    before = {d: fingerprint(d) for d in (pairs["llama"]["a"], pairs["llama"]["c"], bad_root)}
    code = main([str(x) for x in args])
    assert_one_error(code, capsys.readouterr().err, "", [words])
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".*tmp")), "something was written"
    assert {d: fingerprint(d) for d in before} == before, "an input was modified"


def test_files_inside_a_model_directory_are_accepted(pairs, tmp_path, capsys):
    """A and B may be given as the directory, its config.json or its .safetensors (as for diff)."""
    p = pairs["llama"]
    code, r, err = run(capsys, "align", p["a"], p["b"] / "config.json", tmp_path / "aligned")
    assert code == 0 and r["certified"], err
    code, _, err = run(capsys, "merge", p["a"] / "model.safetensors", p["b"], tmp_path / "merged")
    assert code == 0, err


def test_merge_and_barrier_refuse_an_alignment_that_is_not_b(pairs, tmp_path, capsys, monkeypatch):
    """``merge --align`` and ``barrier --align`` certify the aligned B against B (as ``align``
    does): an aligner that changed B's function by 5% in one value projection is refused."""
    import dataclasses

    import attnid.whole.align.aligner as aligner
    from attnid.whole.transforms.state import ModelTensors

    real = aligner.align_unit

    def broken(*args, **kwargs):
        r = real(*args, **kwargs)
        t = dict(r.model.tensors)
        for name in [n for n in t if n.endswith("layers.0.self_attn.v_proj.weight")]:
            t[name] = t[name] * 1.05
        return dataclasses.replace(r, model=ModelTensors(r.model.layout, t, r.model.config))

    monkeypatch.setattr(aligner, "align_unit", broken)
    p = pairs["llama"]
    code, _, err = run(capsys, "merge", p["a"], p["c"], tmp_path / "merged", "--align")
    assert code == 2 and "not certified" in err and not (tmp_path / "merged").exists(), err
    code, _, err = run(capsys, "barrier", p["a"], p["c"], "--align", "--calibration", pairs["text"],
                       "--alphas", "3")
    assert code == 2 and "not certified" in err, err


@pytest.fixture(scope="module")
def tied_pair(tmp_path_factory):
    """A tied Llama (non-uniform final gain) and its untied R1 + R2 rewrite with heads and neurons
    permuted (what QuaRot and SpinQuant write)."""
    root = tmp_path_factory.mktemp("tied")
    a = save(build({**LLAMA, "tie_word_embeddings": True}, 0), root, "tied")
    b = root / "untied"
    assert main(["rewrite", str(a), str(b), "--untie", "--rotate-residual", "hadamard", "--rotate-values",
                 "random", "--permute-heads", "--permute-mlp"]) == 0
    return {"tied": a, "untied": b}


@pytest.mark.parametrize("order", [("tied", "untied"), ("untied", "tied")], ids=["tied-A", "tied-B"])
def test_align_and_merge_a_tied_and_an_untied_model(order, tied_pair, tmp_path, capsys):
    """A tied model and an untied one are aligned and merged as two untied models (as `attnid
    diff` compares them): the aligned B is certified, runs to B's log-probabilities and is
    written untied; the merge is written untied too."""
    a, b = (tied_pair[k] for k in order)
    before = {k: fingerprint(v) for k, v in tied_pair.items()}
    out = tmp_path / "out"
    code, r, err = run(capsys, "align", a, b, out)
    assert code == 0 and r["certified"], err
    assert r["aligned_distance"] < r["raw_distance"], r
    assert "lm_head.weight" in tensors(out), "the aligned model is not written untied"
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    lb, lo = log_probs(b), log_probs(out)
    assert float((lb - lo).norm() / lb.norm()) < 1e-5, float((lb - lo).norm() / lb.norm())
    code, m, err = run(capsys, "merge", a, b, tmp_path / "merged", "--align")
    assert code == 0 and m["untied"] == ("lm_head.weight" if order[0] == "tied" else None), err
    assert "lm_head.weight" in tensors(tmp_path / "merged")
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["tie_word_embeddings"] is False
    assert {k: fingerprint(v) for k, v in tied_pair.items()} == before, "an input was modified"


def test_the_certificate_reads_the_output_with_its_permutations_undone(pairs, tmp_path, monkeypatch):
    """`certify` reads the aligned output with its head and neuron permutations undone (exact
    indexing, each a symmetry): `attnid diff`'s matching then finds every neuron at its namesake
    and never searches, and the certificate does not rest on them: with a wrong neuron
    permutation it searches and certifies all the same."""
    import attnid.whole.fit.match as match
    from attnid.checkpoint.align import aligned_files, certify
    from attnid.checkpoint.load import open_checkpoint
    from attnid.checkpoint.units import open_units
    from attnid.whole.transforms.element import LayerElement

    p = pairs["llama"]
    ua, ub = (open_units(open_checkpoint(p[k], purpose="align")) for k in ("a", "c"))
    al, written, _, _ = aligned_files(ua, ub, tmp_path / "out", "full")
    layers = al.element.layers
    assert all(not torch.equal(el.neurons, torch.arange(el.neurons.numel())) for el in layers), layers
    searches, sketched = [], match._sketched
    monkeypatch.setattr(match, "_sketched", lambda *x: searches.append(1) or sketched(*x))
    gen = torch.Generator().manual_seed(0)
    wrong = tuple(LayerElement(heads=el.heads, neurons=torch.randperm(el.neurons.numel(), generator=gen))
                  for el in layers)
    for hint, want in (((), True), (layers, False), (wrong, True)):
        searches.clear()
        worst, tol = certify(ub, written, al.stream_permutation, hint)
        assert worst <= tol and bool(searches) == want, (
            f"{len(hint)} hints: worst residual {worst:.1e} (tolerance {tol:.1e}), {len(searches)} searches")


def test_a_certificate_told_no_rotation_moved_the_stream_still_fits_one(pairs):
    """`certify(..., rotated=False)` (the alignment rotated no stream: no rotation fitted) falls
    back to fitting one when the output is rotated after all, so a wrong hint costs time, never
    a refusal; the unrotated comparison alone does refuse it (B is A under a random element
    with a stream rotation)."""
    from attnid.checkpoint.align import certify
    from attnid.checkpoint.load import open_checkpoint
    from attnid.checkpoint.units import open_units
    from attnid.whole.fit import fit

    ub = open_units(open_checkpoint(pairs["llama"]["b"]))
    worst, tol = certify(ub, pairs["llama"]["a"], None, (), rotated=False)
    assert worst <= tol, f"residual {worst:.2e} against {tol:.1e}"
    f = fit(ub, open_units(open_checkpoint(pairs["llama"]["a"])), rotate=False)
    unrotated = max(x.residual for r in f.units for x in r.residuals)
    assert unrotated > 1e3 * tol, f"the unrotated comparison passed ({unrotated:.1e})"


@pytest.mark.parametrize("failure", ["OSError", "RuntimeError"])
def test_head_sums_that_cannot_be_written_refuse_in_one_line(failure, pairs, tmp_path, capsys, monkeypatch):
    """`--calibration` keeps each layer's head sums in a temporary file (`Spilled`); a write
    that fails as on a full disk (an `OSError`, or the `RuntimeError` torch raises for a failed
    write: `torch.save` to /dev/full) gives one `error:` line naming the folder and TMPDIR,
    exit 2, no OUT_DIR, nothing left in the temporary folder, and the inputs as they were."""
    import errno
    import os
    import tempfile

    p = pairs["llama"]
    before = {k: fingerprint(p[k]) for k in ("a", "b")}
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr(tempfile, "tempdir", None)  # TMPDIR read again
    tries = []

    def full(obj, path, *args, **kwargs):
        tries.append(path)
        if failure == "OSError":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    monkeypatch.setattr(torch, "save", full)
    out = tmp_path / "out"
    code, _, err = run(capsys, "align", p["a"], p["b"], out, "--calibration", pairs["text"])
    assert tries, "no head sums were spilled (the test's calibration is too short for HeadSums)"
    why = "No space left on device" if failure == "OSError" else "the write failed"
    line = assert_one_error(code, err, str(scratch), ["head sums", why, "TMPDIR"])
    assert "enforce" not in line, line
    assert not out.exists(), "OUT_DIR was made"
    assert list(scratch.iterdir()) == [], f"left in the temporary folder: {list(scratch.iterdir())}"
    assert {k: fingerprint(p[k]) for k in ("a", "b")} == before, "an input was modified"


def test_head_sums_without_room_are_refused_before_any_work(pairs, tmp_path, capsys, monkeypatch):
    """The temporary folder's free space is checked against every layer's head sums before any
    work (`activations.check_disk`): too little is one `error:` line naming the folder, the
    size and TMPDIR, exit 2, and neither a forward nor a file."""
    import shutil
    import tempfile

    from attnid.whole.align import activations as act
    from attnid.whole.align import aligner

    p = pairs["llama"]
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr(tempfile, "tempdir", None)
    real = shutil.disk_usage
    monkeypatch.setattr(act.shutil, "disk_usage", lambda path: real(path)._replace(free=1000))
    ran = []
    monkeypatch.setattr(aligner, "collect_pair", lambda *a, **k: ran.append(1))
    out = tmp_path / "out"
    code, _, err = run(capsys, "align", p["a"], p["b"], out, "--calibration", pairs["text"])
    assert_one_error(code, err, str(scratch), ["heads' sums", "0.0 GB free", "TMPDIR"])
    assert not ran and not out.exists() and list(scratch.iterdir()) == [], (ran, list(scratch.iterdir()))
