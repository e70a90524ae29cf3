"""What each part of `attnid rewrite --optimize` buys, on one model: the objective and the
held-out perplexity after fake RTN (`attnid eval --quantize`) of the input, QuaRot's R1 + R2
Hadamard rewrite, the AWQ-style balances, each part alone and the full search, with the wall
time of each rewrite. One JSON line per variant is appended to OUT/results.jsonl (a variant
already there is skipped, so an interrupted run resumes); the table is printed at the end.

    python benchmarks/optimize_parts.py MODEL OUT --calibration calib.txt --heldout heldout.txt \\
        [--scheme w4] [--max-tokens 4096]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = {  # name -> rewrite flags (None: the input as it is)
    "none": None,
    "quarot": ["--fold-norms", "--rotate-residual", "hadamard", "--rotate-values", "hadamard", "--untie"],
    "full": [],
    "awq": ["--optimize-parts", "awq"],
    "r1": ["--optimize-parts", "r1"],
    "norm": ["--optimize-parts", "norm"],
    "vo": ["--optimize-parts", "vo"],
    "qk": ["--optimize-parts", "qk"],
    "mlp": ["--optimize-parts", "mlp"],
}


def attnid(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "attnid", *args, "--json"], check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--calibration", required=True)
    ap.add_argument("--heldout", required=True)
    ap.add_argument("--scheme", default="w4")
    ap.add_argument("--max-tokens", default="4096")
    ap.add_argument("--only", default=None, help="comma list of variants")
    a = ap.parse_args()
    from attnid.checkpoint.optimize import objective_of

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    done = {json.loads(x)["variant"] for x in results.read_text().splitlines()} if results.exists() else set()
    names = a.only.split(",") if a.only else list(VARIANTS)
    for name in names:
        if name in done:
            continue
        flags = VARIANTS[name]
        row: dict = {"variant": name, "scheme": a.scheme}
        model = a.model
        if flags is not None:
            model = str(out / name)
            extra = [] if name == "quarot" else ["--optimize", a.scheme, "--calibration", a.calibration]
            t0 = time.perf_counter()
            r = attnid("rewrite", a.model, model, *extra, *flags, "--force")
            row["rewrite_seconds"] = time.perf_counter() - t0
            row["certified"], row["max_residual"] = r["certified"], r["max_residual"]
            if "objective" in r:
                row["objective_parts"] = r["parts_objective"]
                row["search_seconds"] = r["search_seconds"]
        row["objective"] = objective_of(model, a.scheme, a.calibration)
        for q in (None, a.scheme):
            e = attnid("eval", model, "--calibration", a.heldout, "--max-tokens", a.max_tokens,
                       *(["--quantize", q] if q else []))
            row["ppl_float" if q is None else "ppl_quantized"] = e["perplexity"]
        with results.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
    rows = [json.loads(x) for x in results.read_text().splitlines()]
    print(f"| variant | objective | ppl float | ppl {a.scheme} | rewrite s |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['objective']:.3f} | {r['ppl_float']:.2f} | {r['ppl_quantized']:.2f} | "
              f"{r.get('rewrite_seconds', 0):.0f} |")


if __name__ == "__main__":
    main()
