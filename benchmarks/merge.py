"""Linear mode connectivity modulo symmetry: how much of the loss barrier between two models
trained from different seeds each part of the symmetry group removes, matched and refined.

    python benchmarks/merge.py [--arch llama gpt2] [--out runs/merge] [--alphas 11] [--steps N]
                               [--width D] [--seeds 0 1 2] [--tokens 32768] [--refine N [--parts]]

1. Trains (once; reused when ``--out`` already holds them) one model per seed and architecture
   on the bundled Shakespeare with attnid's own training loop and exports them as Hugging Face
   checkpoints (``merge_train.train_model``; ``--width`` and ``--steps`` shrink the recipe): a
   Llama-style model (RMSNorm, SwiGLU, RoPE, GQA, untied head) and a GPT-2-style one
   (LayerNorm, GELU, learned positions, biases, tied head).
2. For every pair of seeds and each variant of the group (`attnid.whole.align.SUBGROUPS`:
   none, permutations, orthogonal, rotation, full; ``--subgroups``), each matched on the weights
   and on activations over training text (``--matching``), aligns B onto A and measures the
   loss along the straight path ``(1 - alpha) A + alpha B`` on the held-out 10% of the corpus
   (the models never trained on it), with A's own tokenizer, chunks of the training context.
   With ``--refine N`` the variants in ``--refined`` are also refined (`attnid.whole.align.
   refine`: N steps on up to 2^17 training characters) and measured the same way, with their
   wall and CPU time; ``--parts`` also refines the full group one part at a time (last pair).
3. Prints per variant the mean and spread over the pairs of the mid-point barrier (loss at 0.5
   less the mean end loss) and of its ratio to the naive one. Writes ``NAME.json`` (``--name``;
   per pair: every curve, distance, time, and for the full group which part of the distance is
   left per layer), the first pair's figure ``merge_<arch>.png`` ((a) the loss along the path
   per variant, (b) each barrier's share of the naive one) and, with three seeds or more,
   ``NAME_refined.png`` (the shares, mean and spread) into ``--out``.

Aims: the full group's barrier below every restricted variant's; refined, at most a tenth of
the naive one (Llama) and below the matched full group (both), in at most one model's training
time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from attnid.checkpoint.align import CALIBRATION_TOKENS, REFINE_TOKENS, load_tensors
from attnid.checkpoint.barrier import mid_barrier, path_losses
from attnid.checkpoint.evaluate import load_causal_lm
from attnid.checkpoint.load import open_checkpoint
from attnid.checkpoint.tokens import read_chunks
from attnid.checkpoint.units import open_units
from attnid.progress import Progress
from attnid.whole.align import SUBGROUPS, align
from attnid.whole.align.refine import refinable_parts, refine
from attnid.whole.fit.source import TensorSource
from attnid.whole.layerwise import LayerwiseLM
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
             alphas: list[float], tokens: int, context: int, shown: Progress, *, refine_steps: int = 0,
             refined: tuple[str, ...] = (), parts: bool = False, lr: float = 1e-2,
             subgroups: tuple[str, ...] = SUBGROUPS) -> dict:
    """Every variant's barrier for one pair; with ``refine_steps``, also each variant in
    ``refined`` refined (`attnid.whole.align.refine`) on ``calibration`` (training text), and
    with ``parts`` the full group refined one part at a time."""
    ck = open_checkpoint(hf_a)
    A, B = load_tensors(open_units(ck)), load_tensors(open_units(open_checkpoint(hf_b)))
    chunks = read_chunks(ck, data, context=context, max_tokens=tokens)
    fitted = read_chunks(ck, calibration, context=context, max_tokens=REFINE_TOKENS).ids  # refinement
    calib = fitted[:CALIBRATION_TOKENS // context]  # matching on activations
    ev, a_src = LayerwiseLM(TensorSource(A)), TensorSource(A)  # the path streamed, as attnid barrier
    lm = load_causal_lm(ck)
    result: dict = {"tokens": chunks.tokens, "context": context, "calibration_tokens": int(calib.numel()),
                    "refine_tokens": int(fitted.numel()),
                    "variants": {}}
    runs = [("none", "weights")] + [(g, m) for g in subgroups if g != "none" for m in matchings]
    for subgroup, matching in runs:
        name = subgroup if subgroup == "none" else f"{subgroup} ({matching})"
        t0 = time.perf_counter()
        al = align(A, B, subgroup=subgroup, calibration=calib if matching == "activations" else None)  # type: ignore[arg-type]
        seconds = time.perf_counter() - t0
        losses = path_losses(ev, a_src, TensorSource(al.model), chunks, alphas, shown, f"{arch} {name}")
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
        if refine_steps and subgroup in refined:
            todo = [(None, f"{name} + refined")]
            if parts and subgroup == "full":
                todo += [((p,), f"{name} + refined {p} only") for p in
                         refinable_parts(al.model, subgroup, al.stream_permutation is not None)]
            for only, label in todo:
                wall, cpu = time.perf_counter(), time.process_time()
                r = refine(A, al.model, lm, fitted, refine_steps, subgroup=subgroup, parts=only, lr=lr,
                           permuted_stream=al.stream_permutation is not None, progress=shown)
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                losses = path_losses(ev, a_src, TensorSource(r.model), chunks, alphas, shown,
                                     f"{arch} {label}")
                result["variants"][label] = {
                    "barrier": mid_barrier(alphas, losses), "losses": losses, "refined": r.to_dict(),
                    "refine_seconds": wall, "refine_cpu_seconds": cpu, "align_seconds": seconds,
                    "aligned_distance": sum(float(((A.tensors[n] - t) ** 2).sum()) for n, t in
                                            r.model.tensors.items() if t.is_floating_point()) ** 0.5}
                shown.line(f"{arch} {label}: barrier {result['variants'][label]['barrier']:.4f} "
                           f"({wall:.0f} s wall, {cpu:.0f} s CPU)")
    naive = result["variants"]["none"]["barrier"]
    for v in result["variants"].values():
        v["ratio_to_naive"] = v["barrier"] / naive if naive > 0 else None
    return result


def title(arch: str, r: dict) -> str:
    return (f"{arch}-style ({r['params'] / 1e6:.2f} M parameters), seeds {r['seeds'][0]} and "
            f"{r['seeds'][1]} (held-out loss "
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


def summary(pairs: dict[str, dict]) -> dict[str, dict[str, float]]:
    """Per variant over the pairs: mean and spread (sample standard deviation) of the barrier
    and of its share of the pair's naive barrier, and the range of the share."""
    out: dict[str, dict[str, float]] = {}
    names = [n for n in next(iter(pairs.values()))["variants"]]
    for n in names:
        bs = [r["variants"][n]["barrier"] for r in pairs.values() if n in r["variants"]]
        rs = [r["variants"][n]["barrier"] / r["variants"]["none"]["barrier"] for r in pairs.values()
              if n in r["variants"]]
        out[n] = {"pairs": len(bs), "barrier_mean": statistics.fmean(bs),
                  "barrier_sd": statistics.stdev(bs) if len(bs) > 1 else 0.0,
                  "ratio_mean": statistics.fmean(rs),
                  "ratio_sd": statistics.stdev(rs) if len(rs) > 1 else 0.0,
                  "ratio_min": min(rs), "ratio_max": max(rs)}
    return out


def summary_figure(summaries: dict[str, dict[str, dict[str, float]]], path: Path, title: str) -> None:
    """Per architecture, each variant's barrier as a share of the naive one (mean over the seed
    pairs, the spread as an error bar), matched only (plain) and refined (hatched)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(summaries), figsize=(5.5 * len(summaries), 4.2), squeeze=False)
    for ax, (arch, s) in zip(axes[0], summaries.items(), strict=True):
        names = [n for n in s if n != "none" and " only" not in n]
        ys = [s[n]["ratio_mean"] for n in names]
        err = [s[n]["ratio_sd"] for n in names]
        colours = ["tab:red" if "refined" in n else "tab:blue" for n in names]
        bars = ax.bar(range(len(names)), ys, yerr=err, capsize=3, color=colours, edgecolor="black",
                      hatch=None)
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=2)
        ax.axhline(1.0, color="black", lw=1, label="naive")
        ax.axhline(0.1, color="grey", ls=":", lw=1.5, label="aim: a tenth of naive")
        ax.set_xticks(range(len(names)), [n.replace(" (weights)", "").replace(" + refined", "\n+ refined")
                                          for n in names], fontsize=7)
        ax.set_ylabel("mid-point barrier / naive barrier")
        ax.set_ylim(0, 1.3)
        ax.set_title(f"{arch}-style: naive {s['none']['barrier_mean']:.3f} +- {s['none']['barrier_sd']:.3f} "
                     f"nats ({s['none']['pairs']} seed pairs)", fontsize=9)
        ax.legend(fontsize=7, loc="upper right")
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
    ap.add_argument("--width", type=int, default=None, help="override d_model (heads of 32): smaller models")
    ap.add_argument("--positions", default="rope", choices=["rope", "learned", "none"],
                    help="the Llama-style model's positional encoding (learned / none: no RoPE)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1],
                    help="one model per seed; every pair of them is measured")
    ap.add_argument("--tokens", type=int, default=32768, help="held-out characters the loss is measured on")
    ap.add_argument("--matching", nargs="+", default=["weights", "activations"],
                    choices=["weights", "activations"],
                    help="match the stream, heads and neurons on the weights, on activations over "
                         f"{CALIBRATION_TOKENS} training characters, or both (each variant run per matching)")
    ap.add_argument("--subgroups", nargs="+", default=list(SUBGROUPS), choices=list(SUBGROUPS))
    ap.add_argument("--refine", type=int, default=0, help="refinement steps (0: none)")
    ap.add_argument("--refine-lr", type=float, default=1e-2)
    ap.add_argument("--refined", nargs="+", default=["full"], choices=["orthogonal", "rotation", "full"],
                    help="the variants refined")
    ap.add_argument("--name", default="merge", help="the outputs: NAME.json, NAME_refined.png")
    ap.add_argument("--parts", action="store_true",
                    help="on the last pair, also refine the full group one part at a time")
    ap.add_argument("--figure-from", nargs="+", type=Path, default=None, metavar="JSON",
                    help="only draw the summary figure of these runs' JSON (one per architecture) into --out")
    args = ap.parse_args()
    if args.figure_from:
        merged = {a: s for f in args.figure_from for a, s in json.loads(f.read_text())["summary"].items()}
        summary_figure(merged, args.out / f"{args.name}_refined.png", "barrier left per alignment, matched "
                       "and refined (mean and spread over seed pairs)")
        return
    from attnid.train.data import corpus
    from merge_train import CONTEXT, train_model, validation_text

    torch.manual_seed(0)
    shown = Progress()
    args.out.mkdir(parents=True, exist_ok=True)
    data, calibration = args.out / "held_out.txt", args.out / "calibration.txt"  # calibration: training text
    for path, text in ((data, validation_text()), (calibration, corpus()[:2 * REFINE_TOKENS])):
        if not path.exists() or path.read_text() != text:  # another run may be reading it
            path.write_text(text)
    alphas = [k / (args.alphas - 1) for k in range(args.alphas)]
    results, summaries = {}, {}
    for arch in args.arch:
        models = {s: train_model(arch, s, args.out / f"{arch}-{s}", steps=args.steps, width=args.width,
                                     positions=args.positions)
                  for s in args.seeds}
        pairs: dict[str, dict] = {}
        results[arch] = pairs
        combinations = list(itertools.combinations(args.seeds, 2))
        for k, (sa, sb) in enumerate(combinations):
            a, b = models[sa], models[sb]
            shown.line(f"{arch}: validation loss {a.val_loss:.3f} (seed {sa}), {b.val_loss:.3f} (seed {sb}); "
                       f"{a.params / 1e6:.2f} M parameters")
            r = run_pair(arch, a.hf, b.hf, data, calibration, args.matching, alphas, args.tokens, CONTEXT,
                         shown, refine_steps=args.refine, refined=tuple(args.refined),
                         parts=args.parts and k == len(combinations) - 1, lr=args.refine_lr,
                         subgroups=tuple(args.subgroups))
            r |= {"params": a.params, "steps": a.steps, "seeds": [sa, sb],
                  "val_loss": [a.val_loss, b.val_loss],
                  "train_seconds": [a.seconds, b.seconds],
                  "train_cpu_seconds": [a.cpu_seconds, b.cpu_seconds]}
            pairs[f"{sa}-{sb}"] = r
            if k == 0:
                figure(alphas, r, args.out / f"merge_{arch}.png", title(arch, r))
            summaries[arch] = summary(pairs)
            (args.out / f"{args.name}.json").write_text(json.dumps(  # after every pair
                {"alphas": alphas, "args": {k: str(v) for k, v in vars(args).items()}, "results": results,
                 "summary": summaries}, indent=2))
    if len(args.arch) and len(args.seeds) > 2:
        summary_figure(summaries, args.out / f"{args.name}_refined.png",
                       "barrier left per alignment, matched and refined (mean and spread over seed pairs)")
    for arch, s in summaries.items():
        print(f"\n{arch}-style: {len(results[arch])} seed pairs")
        print(f"{'variant':>42} {'barrier':>15} {'/ naive':>15} {'range':>13}")
        for n, v in s.items():
            print(f"{n:>42} {v['barrier_mean']:7.4f} +- {v['barrier_sd']:.3f} {v['ratio_mean']:7.3f} +- "
                  f"{v['ratio_sd']:.3f} {v['ratio_min']:.2f}-{v['ratio_max']:.2f}")
    print(f"\nwritten {args.out / (args.name + '.json')} and the figures")


if __name__ == "__main__":
    main()
