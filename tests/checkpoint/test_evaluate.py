"""`attnid eval`: the perplexity of a tiny random Llama against a hand computation (exp of the
mean next-token NLL, one position at a time); barrier's loss is the same evaluator's; RTN of
the linear layers raises the perplexity of a trained model; bad input is refused in one line
before any work; `--json` carries the documented fields."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from attnid.cli import main
from attnid.testing.files import assert_one_error, fingerprint

from .test_align import LLAMA, TEXT, build, save

FIELDS = {"model", "calibration", "quantize", "quantized_layers", "tokens", "context", "chunks", "predicted",
          "loss", "perplexity", "seconds"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eval")
    (root / "text.txt").write_text(TEXT)
    (root / "short.txt").write_text("To be")
    model = save(build(LLAMA, 0), root, "llama")
    return {"model": model, "text": root / "text.txt", "short": root / "short.txt"}


@pytest.fixture(scope="session")
def trained(tmp_path_factory) -> Path:
    """The Llama `attnid train --arch llama --hf` trains in 60 steps (character Shakespeare)."""
    out = tmp_path_factory.mktemp("trained") / "run"
    assert main(["train", str(out), "--arch", "llama", "--steps", "60", "--hf", "--no-progress"]) == 0
    return out / "hf"


def run(capsys, *args) -> tuple[int, dict | None, str]:
    code = main([*map(str, args), "--json"])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip() else None), err


def hand_perplexity(model_dir: Path, text: str, T: int) -> tuple[float, int]:
    """exp of the mean of -log p(token t+1 | tokens up to t), position by position."""
    import transformers

    ids = transformers.AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    nll, count = 0.0, 0
    for s in range(0, len(ids) // T * T, T):
        x = torch.tensor([ids[s:s + T]])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=x).logits[0].double(), -1)  # [T, V]
        for t in range(T - 1):
            nll -= float(logp[t, ids[s + t + 1]])
            count += 1
    return math.exp(nll / count), count


@pytest.mark.parametrize("context", [16, 50])
def test_perplexity_matches_a_hand_computation(tiny, capsys, context):
    code, r, err = run(capsys, "eval", tiny["model"], "--calibration", tiny["text"], "--context", context)
    assert code == 0, err
    want, count = hand_perplexity(tiny["model"], TEXT, context)
    rel = abs(r["perplexity"] - want) / want
    assert rel < 1e-6, f"perplexity {r['perplexity']!r} vs by hand {want!r}: relative {rel:.3g}"
    assert r["predicted"] == count == r["chunks"] * (context - 1) and r["tokens"] == r["chunks"] * context
    assert set(r) == FIELDS and r["quantize"] is None and r["quantized_layers"] == 0
    assert math.isclose(r["perplexity"], math.exp(r["loss"]), rel_tol=1e-12)


def test_barrier_loss_is_the_same_evaluator(tiny):
    """At ``alpha = 0`` the streamed path (a layer at a time) is `attnid eval`'s loss of A."""
    from attnid.checkpoint.barrier import path_losses
    from attnid.checkpoint.evaluate import load_causal_lm, token_nll
    from attnid.checkpoint.load import open_checkpoint
    from attnid.checkpoint.tokens import read_chunks
    from attnid.checkpoint.units import open_units
    from attnid.whole.layerwise import LayerwiseLM

    ck = open_checkpoint(tiny["model"])
    data = read_chunks(ck, tiny["text"], context=16)
    mine = token_nll(load_causal_lm(ck), data).mean
    u = open_units(ck)
    theirs = path_losses(LayerwiseLM(u), u, u, data, [0.0])[0]
    assert abs(mine - theirs) <= 1e-12 * abs(theirs), (mine, theirs)


def test_text_output_and_progress(tiny, capsys):
    from attnid.checkpoint.evaluate import evaluate
    from attnid.progress import Progress

    log = io.StringIO()
    r = evaluate(tiny["model"], tiny["text"], quantize="w4", context=16, progress=Progress(log, rich=False))
    lines = log.getvalue().splitlines()
    assert any("quantize w4" in x for x in lines) and any("chunks: step" in x for x in lines), lines
    assert r["quantize"] == "w4" and r["quantized_layers"] == 14
    assert main(["eval", str(tiny["model"]), "--calibration", str(tiny["text"]), "--context", "16"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith(str(tiny["model"])) and "perplexity" in out and len(out.splitlines()) == 1, out


@pytest.mark.parametrize("args,file,words", [
    (["--calibration", "{dir}/missing.txt"], "missing.txt", ["no such file"]),
    (["--calibration", "{text}", "--quantize", "w4:0"], "--quantize", ["w4:0"]),
    (["--calibration", "{text}", "--quantize", "int4"], "--quantize", ["w<bits>"]),
    (["--calibration", "{short}", "--context", "16"], "short.txt", ["fewer than one chunk"]),
    (["--calibration", "{text}", "--context", "1000"], "--context", ["64"]),
    (["--calibration", "{text}", "--max-tokens", "1"], "--max-tokens", ["1"]),
], ids=["missing-file", "group-0", "bad-scheme", "short-text", "long-context", "max-tokens"])
def test_refusals(tiny, capsys, args, file, words):
    before = fingerprint(tiny["model"].parent)
    fill = {"dir": tiny["model"].parent, "text": tiny["text"], "short": tiny["short"]}
    code, r, err = run(capsys, "eval", tiny["model"], *[a.format(**fill) for a in args])
    assert r is None
    assert_one_error(code, err, file, words)
    assert fingerprint(tiny["model"].parent) == before


def test_a_model_that_is_not_causal_is_refused(tiny, capsys, tmp_path):
    import shutil

    d = tmp_path / "classifier"
    shutil.copytree(tiny["model"], d)
    config = json.loads((d / "config.json").read_text())
    config["architectures"] = ["LlamaForSequenceClassification"]
    (d / "config.json").write_text(json.dumps(config))
    code, _, err = run(capsys, "eval", d, "--calibration", tiny["text"])
    assert_one_error(code, err, str(d), ["causal language model", "LlamaForSequenceClassification"])


def test_a_bad_scheme_is_refused_before_the_model_is_read(capsys, tmp_path):
    code, _, err = run(capsys, "eval", tmp_path / "no-model", "--calibration", tmp_path / "no.txt",
                       "--quantize", "w9")
    assert_one_error(code, err, "--quantize", ["w9", "bits between"])


def test_quantizing_raises_the_perplexity_of_a_trained_model(trained, capsys):
    text = Path(__file__).resolve().parents[2] / "src" / "attnid" / "data" / "shakespeare.txt"
    ppl = {}
    for q in (None, "w8", "w3", "w2"):
        code, r, err = run(capsys, "eval", trained, "--calibration", text, "--max-tokens", "4096",
                           *(["--quantize", q] if q else []))
        assert code == 0, err
        ppl[q] = r["perplexity"]
    assert ppl["w2"] > ppl["w3"] > ppl[None] * (1 + 1e-4), ppl  # w8 is within rounding of float
    assert abs(ppl["w8"] - ppl[None]) < 1e-3 * ppl[None], ppl
