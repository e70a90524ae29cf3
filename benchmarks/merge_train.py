"""The training side of ``benchmarks/merge.py``: small Llama- and GPT-2-style models trained
on the bundled Shakespeare by ``attnid train``'s loop, from different seeds, and exported as
Hugging Face checkpoints (`attnid.train.export`) for ``attnid align / merge / barrier``.

    python benchmarks/merge_train.py [--arch llama gpt2] [--seeds 0 1] [--steps N] [--out DIR]

API (for ``benchmarks/merge.py``; run from the repository root, this folder is on sys.path)::

    from merge_train import MODELS, train_model, held_out_loss, validation_text
    a = train_model("llama", seed=0, out=Path("runs/llama-0"))  # -> Trained
    a.hf            # runs/llama-0/hf: config.json, model.safetensors, tokenizer
    a.val_loss      # held_out_loss of the trained model (nats per character)

Both seeds of an architecture train the same number of steps on the same schedule; the seed
sets the initialisation and the order of the batches. The models (sizes in :data:`MODELS`):

- ``llama``: RMSNorm, SwiGLU, RoPE (theta 10,000, Hugging Face's pairing), GQA (6 query
  heads on 2 key/value groups), untied head, no biases; d 192, 4 layers, about 1.6 M
  parameters; exported as ``LlamaForCausalLM``;
- ``gpt2``: LayerNorm, GELU, learned positions, biases everywhere, tied head; d 192, 4 layers,
  6 heads, about 1.8 M parameters; exported as ``GPT2LMHeadModel``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from attnid.train.data import corpus, shakespeare
from attnid.train.loop import ARCHS, TrainConfig, train
from attnid.train.model import GPT, GPTConfig

CONTEXT = 128
VOCAB = shakespeare().vocab_size
MODELS: dict[str, TrainConfig] = {
    "llama": TrainConfig(
        model=GPTConfig(**ARCHS["llama"], d_model=192, n_layers=4, n_heads=6, n_kv_heads=2,
                        block_size=CONTEXT, vocab_size=VOCAB),
        optimizer="adamw", lr=3e-3, schedule="cosine", warmup=50, steps=800, batch_size=16,
        log_every=100, eval_every=200),
    "gpt2": TrainConfig(
        model=GPTConfig(**ARCHS["gpt2"], d_model=192, n_layers=4, n_heads=6, block_size=CONTEXT,
                        vocab_size=VOCAB),
        # lr 3e-3 for 800 steps left seed 1 on a plateau (held-out 2.34 against seed 0's 1.92)
        optimizer="adamw", lr=1e-3, schedule="cosine", warmup=100, steps=1200, batch_size=16,
        log_every=100, eval_every=200),
}


@dataclass(frozen=True)
class Trained:
    """One trained and exported model."""

    arch: str
    seed: int
    hf: Path  # the Hugging Face checkpoint (`attnid.train.export.export_hf`)
    steps: int
    seconds: float  # wall-clock of training and export
    cpu_seconds: float  # CPU time of this process over the same span (all threads)
    params: int
    final_loss: float  # the last training batch's loss
    val_loss: float  # held_out_loss: every character of the validation split


def validation_text() -> str:
    """The held-out 10% of the corpus (what ``attnid barrier --data`` should read: the models
    never trained on it)."""
    text = corpus()
    return text[int(0.9 * len(text)):]


def held_out_loss(logits: Callable[[torch.Tensor], torch.Tensor], context: int = CONTEXT,
                  batch: int = 32, limit: int | None = None) -> float:
    """Mean next-character cross-entropy over the validation split, cut into consecutive
    windows of ``context + 1`` characters (deterministic: every model sees the same text).

    ``logits``: ids ``[B, T]`` -> logits ``[B, T, V]`` (attnid's model: ``lambda x: m(x)[0]``;
    a transformers model: ``lambda x: m(input_ids=x).logits``). ``limit``: at most that many
    windows (from the start), for a quicker estimate.
    """
    val = shakespeare().val
    n = (val.numel() - 1) // context
    if limit is not None:
        n = min(n, limit)
    windows = val[: n * context + 1]
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, n, batch):
            idx = torch.arange(start, min(n, start + batch))[:, None] * context + torch.arange(context + 1)
            chunk = windows[idx]  # (B, T+1)
            out = logits(chunk[:, :-1])  # (B, T, V)
            total += float(F.cross_entropy(out.reshape(-1, out.shape[-1]).double(), chunk[:, 1:].reshape(-1),
                                           reduction="sum"))
            count += chunk[:, 1:].numel()
    return total / count


def train_model(arch: str, seed: int, out: Path, *, steps: int | None = None, width: int | None = None,
                positions: str = "rope", progress: bool = True) -> Trained:
    """Train ``MODELS[arch]`` from ``seed`` (``steps`` overrides its step count, ``width`` its
    d_model: heads of 32 dims, the MLP's default width; ``positions`` ``learned`` or ``none``
    takes a Llama-style model's RoPE away, exported as ``PositionsLlamaForCausalLM``) into ``out``
    (``attnid train``'s files: config.json, metrics.jsonl, summary.json) and export it to
    ``out/hf``; return where it is and how well it does. ``out/trained.json`` records the
    result; a run already there with the same settings is reused, not retrained."""
    base = MODELS[arch]
    model = base.model if width is None else replace(base.model, d_model=width, n_heads=width // 32)
    if positions != "rope":
        if arch != "llama":
            raise SystemExit(f"--positions {positions} is for the Llama-style model")
        model = replace(model, rope=0.0, positions=positions)
    cfg = TrainConfig(**{**asdict(base), "model": model, "seed": seed,
                         "steps": steps or base.steps})
    out = Path(out)
    record = out / "trained.json"
    if record.exists() and (out / "hf" / "model.safetensors").exists():
        saved = json.loads(record.read_text())
        if saved["config"] == cfg.to_dict():
            return Trained(**{**saved["result"], "hf": Path(saved["result"]["hf"])})
    t0, c0 = time.perf_counter(), time.process_time()
    summary = train(cfg, out, progress=progress, checkpoint=False, hf=True)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert summary.hf is not None  # train(hf=True) exported it, verified against the model
    result = Trained(arch=arch, seed=seed, hf=summary.hf.path, steps=cfg.steps, seconds=seconds,
                     cpu_seconds=cpu,
                     params=sum(p.numel() for p in GPT(cfg.model).parameters()),
                     final_loss=summary.final_loss,
                     val_loss=held_out_loss(hf_logits(summary.hf.path), cfg.model.block_size))
    record.write_text(json.dumps({"config": cfg.to_dict(),
                                  "result": {**asdict(result), "hf": str(result.hf)}}, indent=2))
    return result


def hf_logits(path: Path) -> Callable[[torch.Tensor], torch.Tensor]:
    """ids ``[B, T]`` -> logits ``[B, T, V]`` of the Hugging Face checkpoint at ``path``
    (float32, eval mode), for :func:`held_out_loss`."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    return lambda ids: model(input_ids=ids).logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--steps", type=int, default=None, help="override every model's step count")
    ap.add_argument("--width", type=int, default=None, help="override every model's d_model (heads of 32)")
    ap.add_argument("--out", type=Path, default=Path("runs/merge"))
    args = ap.parse_args()
    for arch in args.arch:
        for seed in args.seeds:
            t = train_model(arch, seed, args.out / f"{arch}-{seed}", steps=args.steps, width=args.width)
            print(f"{arch} seed {seed}: {t.params / 1e6:.2f} M parameters, {t.steps} steps in "
                  f"{t.seconds:.0f} s ({t.cpu_seconds:.0f} s of CPU), final train loss "
                  f"{t.final_loss:.3f}, validation loss {t.val_loss:.3f} -> {t.hf}", flush=True)


if __name__ == "__main__":
    main()
