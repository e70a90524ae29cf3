"""The peer of `benchmarks/quantize.py`: llm-compressor's own AWQ and SpinQuant (R1 + R2) on a
Hugging Face checkpoint, written back as plain float checkpoints that `attnid eval` measures.

llm-compressor pins transformers to 5.17 or lower, so it runs in a venv of its own, beside the
same CPU torch (2.13) as attnid's::

    python3.11 -m venv .venv-llmc
    .venv-llmc/bin/pip install torch==2.13.0      # the CPU build
    .venv-llmc/bin/pip install "llmcompressor==0.14.*"
    .venv-llmc/bin/python benchmarks/quantize_peer.py MODEL OUT --calibration calib.txt

It writes, each a directory of OUT with config.json, model.safetensors, the tokenizer and
peer.json (method, scheme, seconds, the tool's version):

* ``awq-<scheme>`` (``w4``, ``w4_64``, ``w3_64``): AWQModifier's scaled float model (its scales
  folded into the norms and linear layers, nothing rounded), searched for that scheme (asymmetric
  integer weights, per output channel or in groups); the benchmark rounds it with attnid's RTN.
* ``awq-<scheme>-own``: the same model with the weights llm-compressor itself quantized
  (its scale and zero point), dequantized to float: its own rounding, not ours.
* ``spinquant``: SpinQuantModifier(rotations R1 + R2, random Hadamard: its deterministic
  Hadamard is for powers of two only, and 576 and 192 are not), rotation only, in float. As of
  0.14 it does not learn its rotations (``learnable`` is not implemented), and it first centers
  the token embeddings (a LayerNorm-model step) and folds the norms.
* ``spinquant-nocenter``: the same without centering the embeddings (under RMSNorm, centering
  changes the function; `attnid diff` says whether each rewrite kept it).

On a CPU-only machine AWQ pins its cached activations (``Tensor.pin_memory``), which needs an
accelerator: this script makes that call return the tensor itself. Times are wall seconds of
each llm-compressor run (loading and writing excluded).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

torch.Tensor.pin_memory = lambda self, *args, **kwargs: self  # type: ignore[method-assign]  # no accelerator here

QPARAMS = ("weight_scale", "weight_zero_point", "weight_g_idx", "weight_global_scale")


def scheme_of(text: str) -> tuple[int, int | None]:
    """``w4`` -> (4, None): per output channel; ``w4:64`` -> (4, 64): groups of 64 input columns."""
    bits, _, group = text.lower().removeprefix("w").partition(":")
    return int(bits), (int(group) if group else None)


def calibration_set(tokenizer, path: Path, context: int, samples: int):
    """Consecutive chunks of ``context`` tokens of the calibration text, as a datasets.Dataset."""
    from datasets import Dataset

    ids = tokenizer(path.read_text(), add_special_tokens=False)["input_ids"]
    chunks = [ids[i:i + context] for i in range(0, len(ids) - context + 1, context)][:samples]
    mask = [[1] * context for _ in chunks]
    return Dataset.from_dict({"input_ids": chunks, "attention_mask": mask}), len(chunks)


def load(model_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(model_dir))


def save(model, source: Path, out: Path, keys: set[str], meta: dict) -> None:
    """The model's float weights under their original names (quantization parameters and
    transform modules left out), the source's config (tying as the model now is) and tokenizer."""
    from safetensors.torch import save_file

    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state = {k: v.detach().to(torch.float32).contiguous().clone() for k, v in model.state_dict().items()
             if (k in keys or k == "lm_head.weight") and not k.endswith(QPARAMS)}
    if tied:
        state.pop("lm_head.weight", None)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["tie_word_embeddings"] = tied
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in source.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            shutil.copy(f, out / f.name)
    (out / "peer.json").write_text(json.dumps(meta, indent=2))


def dequantized_own(model) -> int:
    """Replace every weight llm-compressor quantized by its own fake-quantized value."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    done = 0
    with torch.no_grad():
        for m in model.modules():
            scheme = getattr(m, "quantization_scheme", None)
            if scheme is None or scheme.weights is None or not hasattr(m, "weight_scale"):
                continue
            m.weight.copy_(fake_quantize(m.weight, m.weight_scale, getattr(m, "weight_zero_point", None),
                                         scheme.weights))
            done += 1
    return done


def run_awq(source: Path, out: Path, calibration: Path, scheme: str, context: int, samples: int,
            version: str) -> None:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform import AWQModifier

    bits, group = scheme_of(scheme)
    model, tok = load(source)
    keys = set(model.state_dict())
    data, n = calibration_set(tok, calibration, context, samples)
    weights = QuantizationArgs(num_bits=bits, type="int", symmetric=False,
                               strategy="group" if group else "channel", group_size=group)
    groups = {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}
    recipe = [AWQModifier(), QuantizationModifier(config_groups=groups, ignore=["lm_head"])]
    start = time.perf_counter()
    oneshot(model=model, dataset=data, recipe=recipe, num_calibration_samples=n, max_seq_length=context)
    seconds = time.perf_counter() - start
    name = "awq-" + scheme.replace(":", "_")
    meta = dict(method="awq", scheme=scheme, seconds=seconds, tool=f"llmcompressor {version}",
                calibration=str(calibration), samples=n, context=context)
    save(model, source, out / name, keys, dict(meta, weights="scaled float (llm-compressor's AWQ scales)"))
    layers = dequantized_own(model)
    save(model, source, out / f"{name}-own", keys,
         dict(meta, weights=f"llm-compressor's own quantized weights, dequantized ({layers} layers)"))
    print(f"{name}: {seconds:.1f} s, {layers} layers quantized by llm-compressor", flush=True)


def run_spinquant(source: Path, out: Path, calibration: Path, context: int, center: bool,
                  version: str) -> None:
    import llmcompressor.modifiers.transform.spinquant.base as spin
    from llmcompressor import oneshot
    from llmcompressor.modifiers.transform import SpinQuantModifier

    model, tok = load(source)
    keys = set(model.state_dict())
    data, n = calibration_set(tok, calibration, context, 4)  # rotations need no data; oneshot wants some
    kept = spin.center_embeddings
    if not center:
        spin.center_embeddings = lambda embedding: None
    start = time.perf_counter()
    try:
        recipe = [SpinQuantModifier(rotations=["R1", "R2"], transform_type="random-hadamard")]
        oneshot(model=model, dataset=data, recipe=recipe, num_calibration_samples=n, max_seq_length=context)
    finally:
        spin.center_embeddings = kept
    seconds = time.perf_counter() - start
    name = "spinquant" if center else "spinquant-nocenter"
    save(model, source, out / name, keys,
         dict(method=name, scheme=None, seconds=seconds, tool=f"llmcompressor {version}",
              weights="rotated float (R1 + R2 random Hadamard, norms folded"
                      + (", embeddings centered)" if center else ", embeddings not centered)")))
    print(f"{name}: {seconds:.1f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path, help="Hugging Face checkpoint directory")
    ap.add_argument("out", type=Path, help="directory the peer checkpoints go into")
    ap.add_argument("--calibration", type=Path, required=True, help="calibration text")
    ap.add_argument("--schemes", nargs="+", default=["w4", "w4:64", "w3:64"])
    ap.add_argument("--methods", nargs="+", default=["awq", "spinquant", "spinquant-nocenter"],
                    choices=["awq", "spinquant", "spinquant-nocenter"])
    ap.add_argument("--context", type=int, default=256, help="tokens per calibration sample")
    ap.add_argument("--samples", type=int, default=64, help="at most this many calibration samples")
    args = ap.parse_args()
    from importlib.metadata import version

    tool = version("llmcompressor")
    torch.manual_seed(0)
    if "spinquant" in args.methods:
        run_spinquant(args.model, args.out, args.calibration, args.context, True, tool)
    if "spinquant-nocenter" in args.methods:
        run_spinquant(args.model, args.out, args.calibration, args.context, False, tool)
    if "awq" in args.methods:
        for scheme in args.schemes:
            run_awq(args.model, args.out, args.calibration, scheme, args.context, args.samples, tool)


if __name__ == "__main__":
    main()
