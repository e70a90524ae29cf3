"""What the positional encoding does to merging (Tran et al., ICML 2026): the same seed-pair
protocol as ``benchmarks/merge.py`` on Llama-style models that differ only in their positions:
RoPE (``LlamaForCausalLM``; Q/K gauge: the RoPE commutant, ``dk / 2`` planes of 2x2 rotation-
scalings), learned absolute positions and none (attnid's ``PositionsLlamaForCausalLM``; Q/K
gauge: all of GL(dk) per key/value group), at two widths.

    python benchmarks/merge_positions.py [--widths 64 128] [--positions rope learned none]
                                         [--out runs/positions] [--figure docs/merge_positions.png]

1. For each width and encoding, runs (once; a finished run in ``OUT/<positions>-<width>`` is
   reused) ``benchmarks/merge.py --arch llama --positions P --width W --steps 600 --seeds 0 1 2
   --alphas 3 --tokens 16384 --matching weights --subgroups none full --refine 300``: three
   models, three pairs, each pair's mid-point barrier naive, after the full group matched on
   the weights, and after 300 steps of refinement.
2. Prints and writes (``OUT/positions.json``) per width and encoding: held-out loss of the
   models, the naive barrier (nats per character), the shares of it left after matching and
   after refinement (mean +- sd over the pairs), and the matched weight distance left.
3. Draws the figure: per width, each encoding's share left, matched and refined.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

PROTOCOL = ["--arch", "llama", "--steps", "600", "--seeds", "0", "1", "2", "--alphas", "3",
            "--tokens", "16384", "--matching", "weights", "--subgroups", "none", "full", "--refine", "300",
            "--name", "merge"]
MATCHED, REFINED = "full (weights)", "full (weights) + refined"
LABEL = {"rope": "RoPE", "learned": "learned positions", "none": "no positions (NoPE)"}


def run(positions: str, width: int, out: Path) -> dict:
    """The finished ``merge.py`` run of one encoding and width (run here when missing)."""
    where = out / f"{positions}-{width}"
    result = where / "merge.json"
    if not result.exists() or len(json.loads(result.read_text())["results"]["llama"]) < 3:
        cmd = [sys.executable, str(Path(__file__).parent / "merge.py"), *PROTOCOL, "--positions", positions,
               "--width", str(width), "--out", str(where)]
        print("running", " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=True)
    return json.loads(result.read_text())


def row(data: dict) -> dict:
    """Per encoding and width: the means and spreads over the seed pairs."""
    pairs = list(data["results"]["llama"].values())
    s = data["summary"]["llama"]
    val = [v for p in pairs for v in p["val_loss"]]
    dist = [p["variants"][MATCHED]["aligned_distance"] for p in pairs]
    return {"pairs": len(pairs), "params": pairs[0]["params"],
            "val_loss": [min(val), max(val)],
            "naive": [s["none"]["barrier_mean"], s["none"]["barrier_sd"]],
            "matched": [s[MATCHED]["ratio_mean"], s[MATCHED]["ratio_sd"]],
            "refined": [s[REFINED]["ratio_mean"], s[REFINED]["ratio_sd"]],
            "refined_barrier": [s[REFINED]["barrier_mean"], s[REFINED]["barrier_sd"]],
            "matched_distance": statistics.mean(dist),
            "refine_cpu_seconds": statistics.mean(p["variants"][REFINED]["refine_cpu_seconds"]
                                                  for p in pairs),
            "train_cpu_seconds": statistics.mean(c for p in pairs for c in p["train_cpu_seconds"])}


def figure(table: dict[str, dict[str, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    widths = list(table)
    fig, axes = plt.subplots(1, len(widths), figsize=(5 * len(widths), 4.2), squeeze=False, sharey=True)
    for ax, w in zip(axes[0], widths, strict=True):
        names = list(table[w])
        x = range(len(names))
        bars_of = (("matched", "tab:blue", "full group, matched on the weights"),
                   ("refined", "tab:red", "full group, refined 300 steps"))
        for k, (key, colour, label) in enumerate(bars_of):
            ys = [table[w][n][key][0] for n in names]
            err = [table[w][n][key][1] for n in names]
            bars = ax.bar([i + (k - 0.5) * 0.38 for i in x], ys, 0.38, yerr=err, capsize=3, color=colour,
                          edgecolor="black", label=label)
            ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=2)
        ax.set_xticks(list(x), [f"{LABEL[n]}\nnaive {table[w][n]['naive'][0]:.2f} nats" for n in names],
                      fontsize=7)
        ax.axhline(0.1, color="grey", ls=":", lw=1.5, label="a tenth of naive")
        ax.set_title(f"d = {w} ({table[w][names[0]]['params'] / 1e6:.2f} M parameters, "
                     f"{table[w][names[0]]['pairs']} seed pairs)", fontsize=9)
        ax.set_ylim(0, 1.0)
        ax.legend(fontsize=7, loc="upper right")
    axes[0][0].set_ylabel("mid-point barrier / naive barrier (mean, sd)")
    fig.suptitle("Llama-style pairs by positional encoding: barrier left after the full group", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", nargs="+", type=int, default=[64, 128])
    ap.add_argument("--positions", nargs="+", default=["rope", "learned", "none"], choices=list(LABEL))
    ap.add_argument("--out", type=Path, default=Path("runs/positions"))
    ap.add_argument("--figure", type=Path, default=Path("docs/merge_positions.png"))
    args = ap.parse_args()
    table = {w: {p: row(run(p, w, args.out)) for p in args.positions} for w in args.widths}
    (args.out / "positions.json").write_text(json.dumps(table, indent=2))
    figure(table, args.figure)
    print(f"\n{'width':>5} {'positions':>20} {'held-out':>13} {'naive':>15} {'matched / naive':>17} "
          f"{'refined / naive':>17} {'distance':>9}")
    for w, rows in table.items():
        for p, r in rows.items():
            print(f"{w:>5} {LABEL[p]:>20} {r['val_loss'][0]:.3f}-{r['val_loss'][1]:.3f} "
                  f"{r['naive'][0]:7.3f} +- {r['naive'][1]:.3f} "
                  f"{r['matched'][0]:9.3f} +- {r['matched'][1]:.3f} "
                  f"{r['refined'][0]:9.3f} +- {r['refined'][1]:.3f} {r['matched_distance']:9.2f}")
    print(f"\nwritten {args.out / 'positions.json'} and {args.figure}")


if __name__ == "__main__":
    main()
