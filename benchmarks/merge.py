"""Linear mode connectivity modulo symmetry: how much of the loss barrier between two models
trained from different seeds each part of the symmetry group removes.

    python benchmarks/merge.py [--arch llama gpt2] [--out runs/merge] [--alphas 11] [--steps N]
                               [--tokens 32768]

1. Trains (once; reused when ``--out`` already holds them) two models per architecture from
   seeds 0 and 1 on the bundled Shakespeare with attnid's own training loop and exports them
   as Hugging Face checkpoints (``merge_train.train_model``): a Llama-style model (RMSNorm,
   SwiGLU, RoPE, GQA, untied head) and a GPT-2-style one (LayerNorm, GELU, learned positions,
   biases, tied head).
2. For each pair and each variant of the group (`attnid.whole.align.SUBGROUPS`: none,
   permutations, orthogonal, rotation, full), each matched on the weights and on activations
   over training text (``--matching``), aligns B onto A and measures the loss along the
   straight path ``(1 - alpha) A + alpha B`` on the held-out 10% of the corpus (the models never
   trained on it), with A's own tokenizer, chunks of the training context.
3. Prints per variant the mid-point barrier (loss at 0.5 less the mean end loss), its ratio to
   the naive one and the aligned distance; and, for the full group, which part of the distance
   is left per layer (the residual's share per tensor kind). Writes ``merge.json`` and one
   figure per architecture (``merge_<arch>.png``: (a) the loss along the path per variant,
   (b) each barrier's share of the naive one) into ``--out``.

Aim: the full group's barrier at most a fifth of the naive one, and below every restricted
variant's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from attnid.checkpoint.align import CALIBRATION_TOKENS, load_tensors
from attnid.checkpoint.barrier import Evaluator, mid_barrier, path_losses
from attnid.checkpoint.load import open_checkpoint
from attnid.checkpoint.tokens import read_chunks
from attnid.checkpoint.units import open_units
from attnid.progress import Progress
from attnid.whole.align import SUBGROUPS, align
from attnid.whole.transforms.state import ModelTensors


def kind(name: str) -> str:
    """The kind of a stored tensor, for the per-layer account of what is left."""
    for key in ("q_proj", "k_proj", "v_proj", "o_proj", "c_attn", "c_proj", "gate_proj", "up_proj",
                "down_proj", "c_fc", "norm", "ln_", "embed", "wte", "wpe", "lm_head"):
        if key in name:
            return "mlp.c_proj" if key == "c_proj" and ".mlp." in name else key
    return "other"


def leftover(A: ModelTensors, B: ModelTensors) -> dict[str, dict[str, float]]:
    """Per layer prefix (and ``other``): squared distance of each tensor kind after alignment."""
    out: dict[str, dict[str, float]] = {}
    layers = A.layout.layers
    for n, t in A.tensors.items():
        if not t.is_floating_point():
            continue
        where = next((p.rstrip(".") for p in layers if n.startswith(p)), "outside the layers")
        row = out.setdefault(where, {})
        row[kind(n)] = row.get(kind(n), 0.0) + float(((t - B.tensors[n]) ** 2).sum())
    return out


def run_pair(arch: str, hf_a: Path, hf_b: Path, data: Path, calibration: Path, matchings: list[str],
             alphas: list[float], tokens: int, context: int, shown: Progress) -> dict:
    ck = open_checkpoint(hf_a)
    A, B = load_tensors(open_units(ck)), load_tensors(open_units(open_checkpoint(hf_b)))
    chunks = read_chunks(ck, data, context=context, max_tokens=tokens)
    calib = read_chunks(ck, calibration, context=context, max_tokens=CALIBRATION_TOKENS).ids
    ev = Evaluator(ck)
    result: dict = {"tokens": chunks.tokens, "context": context, "calibration_tokens": int(calib.numel()),
                    "variants": {}}
    runs = [("none", "weights")] + [(g, m) for g in SUBGROUPS[1:] for m in matchings]
    for subgroup, matching in runs:
        name = subgroup if subgroup == "none" else f"{subgroup} ({matching})"
        t0 = time.perf_counter()
        al = align(A, B, subgroup=subgroup, calibration=calib if matching == "activations" else None)  # type: ignore[arg-type]
        seconds = time.perf_counter() - t0
        losses = path_losses(ev, A, al.model, chunks, alphas, shown, f"{arch} {name}")
        rep = al.to_dict()
        result["variants"][name] = {
            "barrier": mid_barrier(alphas, losses), "losses": losses, "stream": al.stream,
            "raw_distance": al.raw_distance, "aligned_distance": al.aligned_distance,
            "shares": rep["shares"], "align_seconds": seconds,
            "layers": [{"layer": x["layer"], "raw": x["raw_distance"], "aligned": x["aligned_distance"]}
                       for x in rep["layers"]]}
        if subgroup == "full":
            result[f"full_leftover ({matching})"] = leftover(A, al.model)
        shown.line(f"{arch} {name}: barrier {result['variants'][name]['barrier']:.4f}, distance "
                   f"{al.raw_distance:.2f} -> {al.aligned_distance:.2f} ({seconds:.1f} s)")
    naive = result["variants"]["none"]["barrier"]
    for v in result["variants"].values():
        v["ratio_to_naive"] = v["barrier"] / naive if naive > 0 else None
    return result


def title(arch: str, r: dict) -> str:
    return (f"{arch}-style ({r['params'] / 1e6:.2f} M parameters), seeds 0 and 1 (held-out loss "
            f"{r['val_loss'][0]:.3f} / {r['val_loss'][1]:.3f}): barrier per alignment")


def figure(alphas: list[float], r: dict, path: Path, title: str) -> None:
    """Two panels: (a) the loss along the path per variant (matching on the weights solid, on
    activations dashed, one colour per part of the group); (b) each variant's mid-point barrier
    as a share of the naive one, with the aim (one fifth) drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = r["variants"]
    subgroups = [g for g in SUBGROUPS if g != "none"]
    colours = dict(zip(("none", *subgroups), ("black", "tab:blue", "tab:orange", "tab:green", "tab:red"),
                       strict=True))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    ax.plot(alphas, variants["none"]["losses"], color="black", lw=2, label="naive (no alignment)")
    drawn: dict[tuple[float, ...], list[str]] = {}  # one line per distinct curve (none hidden)
    lines = []
    for g in subgroups:
        for m, style in (("weights", "-"), ("activations", "--")):
            v = variants.get(f"{g} ({m})")
            if v is None:
                continue
            key = tuple(v["losses"])
            if key in drawn:  # the same curve as a smaller variant's (e.g. no rotation is a symmetry)
                drawn[key].append(g)
                continue
            drawn[key] = [g]
            lines.append((key, m, style, g))
    for key, m, style, g in lines:
        ax.plot(alphas, list(key), style, color=colours[g], marker="o" if m == "weights" else "s", ms=3,
                label=f"{' = '.join(drawn[key])}, {m}")
    ax.set_xlabel("alpha (0: A, 1: B)")
    ax.set_ylabel("held-out loss (nats per character)")
    ax.set_title("(a) loss along the straight path", fontsize=9)
    ax.legend(fontsize=7, ncol=2, loc="upper left", framealpha=0.9)
    ax.set_ylim(top=ax.get_ylim()[1] + 0.35 * (ax.get_ylim()[1] - ax.get_ylim()[0]))  # room for the legend
    width = 0.38
    for k, (m, hatch) in enumerate((("weights", ""), ("activations", "//"))):
        xs = [i + (k - 0.5) * width for i in range(len(subgroups))]
        ys = [variants[f"{g} ({m})"]["ratio_to_naive"] if f"{g} ({m})" in variants else float("nan")
              for g in subgroups]
        bars = bx.bar(xs, ys, width, color=[colours[g] for g in subgroups], hatch=hatch, edgecolor="black",
                      label=f"matched on {m}")
        bx.bar_label(bars, fmt="%.2f", fontsize=7)
    bx.axhline(1.0, color="black", lw=1, label="naive")
    bx.axhline(0.2, color="grey", ls=":", lw=1.5, label="aim: a fifth of naive")
    bx.set_xticks(range(len(subgroups)), subgroups, fontsize=8)
    bx.set_ylabel("mid-point barrier / naive barrier")
    bx.set_ylim(0, 1.5)
    bx.set_title(f"(b) barrier left (naive: {variants['none']['barrier']:.3f} nats)", fontsize=9)
    bx.legend(fontsize=7, loc="upper center", ncol=2)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", nargs="+", default=["llama", "gpt2"], choices=["llama", "gpt2"])
    ap.add_argument("--out", type=Path, default=Path("runs/merge"))
    ap.add_argument("--alphas", type=int, default=11)
    ap.add_argument("--steps", type=int, default=None, help="override the training steps (a quick run)")
    ap.add_argument("--tokens", type=int, default=32768, help="held-out characters the loss is measured on")
    ap.add_argument("--matching", nargs="+", default=["weights", "activations"],
                    choices=["weights", "activations"],
                    help="match the stream, heads and neurons on the weights, on activations over "
                         f"{CALIBRATION_TOKENS} training characters, or both (each variant run per matching)")
    args = ap.parse_args()
    from attnid.train.data import corpus
    from merge_train import CONTEXT, train_model, validation_text

    torch.manual_seed(0)
    shown = Progress()
    args.out.mkdir(parents=True, exist_ok=True)
    data = args.out / "held_out.txt"
    data.write_text(validation_text())
    calibration = args.out / "calibration.txt"  # training text: never the held-out part
    calibration.write_text(corpus()[:2 * CALIBRATION_TOKENS])
    alphas = [k / (args.alphas - 1) for k in range(args.alphas)]
    results = {}
    for arch in args.arch:
        a, b = (train_model(arch, s, args.out / f"{arch}-{s}", steps=args.steps) for s in (0, 1))
        shown.line(f"{arch}: validation loss {a.val_loss:.3f} (seed 0), {b.val_loss:.3f} (seed 1); "
                   f"{a.params / 1e6:.2f} M parameters")
        r = run_pair(arch, a.hf, b.hf, data, calibration, args.matching, alphas, args.tokens, CONTEXT, shown)
        r |= {"params": a.params, "steps": a.steps, "val_loss": [a.val_loss, b.val_loss],
              "train_seconds": [a.seconds, b.seconds]}
        results[arch] = r
        figure(alphas, r, args.out / f"merge_{arch}.png", title(arch, r))
    (args.out / "merge.json").write_text(json.dumps({"alphas": alphas, "results": results}, indent=2))
    for arch, r in results.items():
        print(f"\n{arch}-style ({r['params'] / 1e6:.2f} M parameters, {r['steps']} steps, held-out loss "
              f"{r['val_loss'][0]:.3f} / {r['val_loss'][1]:.3f}, {r['tokens']} tokens)")
        print(f"{'variant':>26} {'barrier':>9} {'/ naive':>8} {'distance':>9}  stream")
        for g, v in r["variants"].items():
            ratio = "n/a" if v["ratio_to_naive"] is None else f"{v['ratio_to_naive']:.3f}"
            print(f"{g:>26} {v['barrier']:9.4f} {ratio:>8} {v['aligned_distance']:9.2f}  {v['stream']}")
        for key in (k for k in r if k.startswith("full_leftover")):
            print(f"full group {key[len('full_leftover '):]}: what is left (squared distance per layer, "
                  "share per tensor kind):")
            for where, row in r[key].items():
                total = sum(row.values())
                parts = ", ".join(f"{k} {v / total:.2f}" for k, v in sorted(row.items(), key=lambda x: -x[1]))
                print(f"  {where}: {total:.2f} ({parts})")
    print(f"\nwritten {args.out / 'merge.json'} and the figures merge_<arch>.png")


if __name__ == "__main__":
    main()
