"""Quantization-ready gauges (issue 27): the perplexity of each rewrite after round-to-nearest
weight quantization, on held-out text the calibration never saw, against llm-compressor.

    python benchmarks/quantize.py --model smollm2=models/smollm2 \
        --model llama=models/llama-bench/hf --calibration calib.txt --heldout heldout.txt \
        [--peer models/peer] [--out runs/quantize] [--schemes w4 w4:64 w3:64]
        [--max-tokens 4096] [--figure benchmarks/quantize.png]

For each model and each row, the rewrite is made with the CLI (``attnid rewrite IN OUT ...``,
timed) and measured with the CLI's evaluator (``attnid eval OUT --calibration HELDOUT
--quantize SCHEME --json``: fake RTN, asymmetric min-max, of every linear layer but the head):

* ``none``: the model as it is;
* ``fold``: its norm gains folded into their readers (``--fold-norms``), QuaRot's first step;
* ``quarot``: R1 + R2 Hadamard (``--fold-norms --rotate-residual hadamard --rotate-values
  hadamard``, with ``--untie`` on a tied model);
* ``awq``: attnid's AWQ-style scaling only (``--optimize SCHEME --calibration CALIB
  --optimize-parts awq``);
* ``r1``, ``r1+vo``, ``r1+vo+qk``, ``r1+vo+qk+mlp``: each part of attnid's search added one
  at a time (``--optimize-parts r1``, ``r1,vo``, ...);
* ``full``: the whole search (``--optimize-parts r1,vo,qk,mlp,norm``).

An ``--optimize`` rewrite is searched for the scheme it is measured at (one rewrite per scheme;
``--target w4`` makes one for all). A row whose rewrite exits 2 with "no such option" (a CLI
without ``--optimize``) is recorded as not available. The peer rows come from
`benchmarks/quantize_peer.py` (llm-compressor's AWQ and SpinQuant, run in its own venv) under
``--peer/<model name>/``; each is measured by the same evaluator, and ``attnid diff`` against
the input says whether it is a symmetry of the model.

Results are kept in ``OUT/results.json`` (a run skips what is there, ``--redo`` does it again);
the tables go to ``OUT/quantize.md`` and ``OUT/quantize.json``, the figure to ``--figure``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

SCHEMES = ("w4", "w4:64", "w3:64")

# row -> rewrite flags; {target} and {calibration} are filled in, None: the model as it is
ROWS: dict[str, list[str] | None] = {
    "none": None,
    "fold": ["--fold-norms"],
    "quarot": ["--fold-norms", "--rotate-residual", "hadamard", "--rotate-values", "hadamard"],
    "awq": ["--optimize", "{target}", "--calibration", "{calibration}", "--optimize-parts", "awq"],
    "r1": ["--optimize", "{target}", "--calibration", "{calibration}", "--optimize-parts", "r1"],
    "r1+vo": ["--optimize", "{target}", "--calibration", "{calibration}", "--optimize-parts", "r1,vo"],
    "r1+vo+qk": ["--optimize", "{target}", "--calibration", "{calibration}", "--optimize-parts", "r1,vo,qk"],
    "r1+vo+qk+mlp": ["--optimize", "{target}", "--calibration", "{calibration}",
                     "--optimize-parts", "r1,vo,qk,mlp"],
    "full": ["--optimize", "{target}", "--calibration", "{calibration}",
             "--optimize-parts", "r1,vo,qk,mlp,norm"],
}

# peer row -> (directory under --peer/<model>, one per scheme?, already rounded?): a rounded
# one is measured as it is (its own rounding, not ours) and is no symmetry of the model, so
# it is not diffed
PEER: dict[str, tuple[str, bool, bool]] = {
    "llmc awq, our RTN": ("awq-{scheme}", True, False),
    "llmc awq, its own rounding": ("awq-{scheme}-own", True, True),
    "llmc spinquant": ("spinquant", False, False),
    "llmc spinquant, embeddings not centered": ("spinquant-nocenter", False, False),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", required=True, metavar="NAME=DIR",
                    help="a Hugging Face checkpoint to measure, named (repeat for each model)")
    ap.add_argument("--calibration", type=Path, required=True, help="text the searches calibrate on")
    ap.add_argument("--heldout", type=Path, required=True, help="text the perplexity is measured on")
    ap.add_argument("--peer", type=Path, default=None, help="benchmarks/quantize_peer.py's output root")
    ap.add_argument("--out", type=Path, default=Path("runs/quantize"))
    ap.add_argument("--schemes", nargs="+", default=list(SCHEMES))
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    ap.add_argument("--target", default=None, help="search every --optimize row for this scheme only")
    ap.add_argument("--max-tokens", type=int, default=4096, help="held-out tokens per measurement")
    ap.add_argument("--figure", type=Path, default=None, help="write the figure (PNG) here")
    ap.add_argument("--redo", action="store_true", help="measure again what OUT/results.json has")
    ap.add_argument("--also", nargs="*", type=Path, default=[],
                    help="other runs' OUT directories whose rows join the table and figure")
    args = ap.parse_args(argv)
    models = {}
    for spec in args.model:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            ap.error(f"--model {spec}: expected NAME=DIR")
        models[name] = Path(path)
    args.models = models
    return args


def tied(model: Path) -> bool:
    return bool(json.loads((model / "config.json").read_text()).get("tie_word_embeddings", False))


def cli(argv: list[str]) -> tuple[int, str, str, float]:
    """``attnid ARGV`` in a process of its own: exit code, stdout, stderr, wall seconds. Its
    progress (stderr) is echoed here as it comes."""
    start = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "attnid", *argv], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    err = []
    assert p.stderr is not None
    for line in p.stderr:
        err.append(line)
        print("    " + line.rstrip()[:200], file=sys.stderr, flush=True)
    out = p.stdout.read() if p.stdout else ""
    return p.wait(), out, "".join(err), time.perf_counter() - start


def evaluate(model: Path, heldout: Path, scheme: str | None, max_tokens: int) -> dict:
    """``attnid eval MODEL --calibration HELDOUT [--quantize SCHEME] --json``, in this process
    (one evaluator for every row, without a process start per measurement)."""
    from attnid.cli import main

    argv = ["eval", str(model), "--calibration", str(heldout), "--max-tokens", str(max_tokens), "--json"]
    if scheme:
        argv += ["--quantize", scheme]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(argv)
    if code != 0:
        raise SystemExit(f"attnid {' '.join(argv)}: exit {code}")
    return json.loads(buf.getvalue())


def certify(a: Path, b: Path) -> dict:
    """``attnid diff A B --json``: certified, or where it breaks."""
    code, out, err, seconds = cli(["diff", str(a), str(b), "--json"])
    if code == 2:
        return {"certified": None, "why": err.strip().splitlines()[-1] if err.strip() else "exit 2",
                "seconds": seconds}
    r = json.loads(out)
    brk = r.get("break")
    return {"certified": bool(r.get("certified")), "seconds": seconds,
            "why": None if brk is None else json.dumps(brk)[:300]}


class Results:
    """``OUT/results.json``: {model: {row: {"rewrite": {...}, "eval": {scheme or "float": {...}}}}}."""

    def __init__(self, path: Path, redo: bool) -> None:
        self.path = path
        self.data: dict = {} if redo or not path.exists() else json.loads(path.read_text())

    def row(self, model: str, row: str) -> dict:
        return self.data.setdefault(model, {}).setdefault(row, {"eval": {}})

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=1))


def rewrite(src: Path, row: str, target: str, calibration: Path, out: Path) -> dict:
    flags = [f.format(target=target, calibration=calibration) for f in ROWS[row] or []]
    if "--rotate-residual" in flags and tied(src):
        flags.append("--untie")
    code, stdout, err, seconds = cli(["rewrite", str(src), str(out), *flags, "--force", "--json"])
    r = {"command": "attnid rewrite IN OUT " + " ".join(flags), "seconds": seconds, "exit": code}
    if code == 2 and "no such option" in err.lower():
        r["status"] = "not available"
    elif code != 0:
        r["status"] = "failed: " + (err.strip().splitlines() or ["?"])[-1][:300]
    else:
        r["status"] = "ok"
        with contextlib.suppress(json.JSONDecodeError):
            j = json.loads(stdout)
            diff = j.get("diff") if isinstance(j.get("diff"), dict) else {}
            r["certified"] = j.get("certified", diff.get("certified"))
    return r


def measure(args: argparse.Namespace) -> Results:
    res = Results(args.out / "results.json", args.redo)
    missing: dict | None = None  # a CLI without --optimize: the first refusal stands for every such row
    for name, src in args.models.items():
        print(f"== {name}: {src}", flush=True)
        base = res.row(name, "none")
        if "float" not in base["eval"]:
            base["eval"]["float"] = evaluate(src, args.heldout, None, args.max_tokens)
            res.save()
        for row in args.rows:
            r = res.row(name, row)
            optimized = "--optimize" in (ROWS[row] or [])
            targets = [args.target or s for s in args.schemes] if optimized else [None]
            for target in dict.fromkeys(targets):
                key = f"rewrite {target}" if target else "rewrite"
                if ROWS[row] is None:
                    path = src
                else:
                    path = args.out / name / (row + (f"-{target}".replace(":", "_") if target else ""))
                    if key not in r or r[key]["status"] != "ok" or not (path / "config.json").exists():
                        print(f"-- {name} {row} {target or ''}: rewrite", flush=True)
                        r[key] = (dict(missing, command=None) if optimized and missing
                                  else rewrite(src, row, target or "", args.calibration, path))
                        if optimized and r[key]["status"] == "not available":
                            missing = r[key]
                        res.save()
                    if r[key]["status"] != "ok":
                        print(f"   {r[key]['status']}", flush=True)
                        continue
                for scheme in [target] if optimized and not args.target else args.schemes:
                    if scheme in r["eval"]:
                        continue
                    print(f"-- {name} {row}: eval {scheme}", flush=True)
                    r["eval"][scheme] = evaluate(path, args.heldout, scheme, args.max_tokens)
                    res.save()
        if args.peer is not None:
            measure_peer(res, name, src, args)
    return res


def measure_peer(res: Results, name: str, src: Path, args: argparse.Namespace) -> None:
    for row, (pattern, per_scheme, rounded) in PEER.items():
        r = res.row(name, row)
        for scheme in args.schemes:
            path = args.peer / name / pattern.format(scheme=scheme.replace(":", "_"))
            if not (path / "config.json").exists():
                continue
            meta = json.loads((path / "peer.json").read_text())
            r.setdefault("peer", {})[scheme if per_scheme else "all"] = meta
            if not rounded and path.name not in r.setdefault("diff", {}):
                print(f"-- {name} {row}: diff against the input", flush=True)
                r["diff"][path.name] = certify(src, path)
                res.save()
            if scheme not in r["eval"]:
                print(f"-- {name} {row}: eval {scheme}", flush=True)
                r["eval"][scheme] = evaluate(path, args.heldout, None if rounded else scheme, args.max_tokens)
                res.save()


def row_seconds(r: dict) -> float | None:
    """Wall seconds to make the row's checkpoint(s), summed over schemes (None: nothing made)."""
    times = [v["seconds"] for k, v in r.items() if k.startswith("rewrite") and v.get("status") == "ok"]
    times += [v["seconds"] for v in r.get("peer", {}).values()]
    return sum(times) if times else None


def row_certified(r: dict) -> str:
    if any(k.startswith("rewrite") and v.get("status") == "not available" for k, v in r.items()):
        return ""
    if "diff" in r:
        marks = {v["certified"] for v in r["diff"].values()}
        return "yes" if marks == {True} else "no" if False in marks else "n/a"
    flags = [v.get("certified") for k, v in r.items() if k.startswith("rewrite")]
    return "yes (rewrite's own diff)" if flags and all(flags) else ("" if not flags else "?")


def ppl(p: float) -> str:
    return f"{p:.3f}" if p < 10 else f"{p:,.2f}"


def table(data: dict, schemes: list[str]) -> str:
    """One markdown table per model: perplexity at each scheme, the time to make the row, and
    whether it is certified a symmetry of the model."""
    out = []
    for name, rows in data.items():
        fl = rows.get("none", {}).get("eval", {}).get("float", {})
        out.append(f"**{name}** (float perplexity {ppl(fl.get('perplexity', math.nan))} on "
                   f"{fl.get('predicted', 0):,} held-out tokens)\n")
        out.append("| row | " + " | ".join(schemes) + " | time to make (s) | certified |")
        out.append("| --- |" + " --- |" * (len(schemes) + 2))
        order = [*ROWS, *PEER]
        for row, r in sorted(rows.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else 99):
            status = next((v["status"] for k, v in r.items()
                           if k.startswith("rewrite") and v["status"] != "ok"), "")
            cells = [ppl(r["eval"][s]["perplexity"]) if s in r.get("eval", {}) else status if i == 0
                     else "" for i, s in enumerate(schemes)]
            t = row_seconds(r)
            out.append(f"| {row} | " + " | ".join(cells) + f" | {'' if t is None else f'{t:.0f}'} | "
                       f"{row_certified(r)} |")
        out.append("")
    return "\n".join(out)


def figure(data: dict, schemes: list[str], path: Path) -> None:
    """A panel per model: perplexity of each measured row at each scheme (log scale where it spans
    more than 3x), float dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    order = [*ROWS, *PEER]
    cmap = plt.get_cmap("tab20")
    colors = {row: cmap(i % 20) for i, row in enumerate(order)}
    fig, axes = plt.subplots(1, len(data), figsize=(4.6 * len(data) + 2.6, 4.0), squeeze=False)
    handles: dict = {}
    for ax, (name, rows) in zip(axes[0], data.items(), strict=True):
        shown = sorted((row for row, r in rows.items() if any(s in r.get("eval", {}) for s in schemes)),
                       key=lambda row: order.index(row) if row in order else 99)
        width = 0.84 / max(len(shown), 1)
        for i, row in enumerate(shown):
            ys = [rows[row]["eval"].get(s, {}).get("perplexity", math.nan) for s in schemes]
            xs = [j + (i - (len(shown) - 1) / 2) * width for j in range(len(schemes))]
            handles[row] = ax.bar(xs, ys, width, color=colors.get(row, "grey"))
        fl = rows.get("none", {}).get("eval", {}).get("float", {}).get("perplexity")
        if fl:
            handles["float"] = ax.axhline(fl, color="k", ls="--", lw=1)
            ax.text(len(schemes) - 0.55, fl, f" float {fl:.4g}", va="bottom", ha="right", fontsize=7)
        values = [v["perplexity"] for r in rows.values() for v in r.get("eval", {}).values()]
        if values and max(values) > 3 * min(values):
            ax.set_yscale("log")
        else:  # a narrow range: linear, from just below float
            ax.set_ylim(0.995 * min(values), 1.005 * max(values))
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%.4g"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xticks(range(len(schemes)), schemes)
        ax.set_title(name)
        ax.set_ylabel("held-out perplexity after RTN")
        ax.grid(axis="y", which="both", alpha=0.3)
    labels = [row for row in [*order, "float"] if row in handles]
    fig.legend([handles[k] for k in labels], labels, loc="center right", fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0, 1 - 2.4 / (4.6 * len(data) + 2.6), 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for f in (args.calibration, args.heldout):
        if not f.is_file():
            raise SystemExit(f"error: {f}: no such file")
    res = measure(args)
    for other in args.also:  # rows measured by another run (another --target, another process)
        for model, rows in json.loads((other / "results.json").read_text()).items():
            for row, r in rows.items():
                if r.get("eval") and row != "none":
                    res.data.setdefault(model, {})[row] = r
    md = table(res.data, args.schemes)
    (args.out / "quantize.md").write_text(md)
    (args.out / "quantize.json").write_text(json.dumps(res.data, indent=1))
    print(md)
    if args.figure:
        figure(res.data, args.schemes, args.figure)
        print(f"figure: {args.figure}")


if __name__ == "__main__":
    main()
