#!/usr/bin/env bash
# The paper's training at the paper's scale on one CUDA GPU: its four cases and the SGD lr sweep
# (6 layers, 6 heads, d 384, context 256, batch 64, 5,000 steps), the 7 distinct runs at once,
# each its own process, TF32 matmuls, forward and backward replayed as CUDA graphs. The same as
#   attnid reproduce OUT --scale paper --device cuda --runs-only
# without needing typer: python3 with a CUDA torch and numpy is enough, from a checkout, nothing
# installed. First it checks the graph replay against the same training op by op (200 steps of
# the paper's model without dropout, one process: the losses must agree) and times both; a
# replay that disagrees or fails is not used. It writes OUT/experiment (each run's config,
# metrics.jsonl, log.txt; the same-point drift and AdamW's anatomy); build the report from it
# on a machine with attnid[all]:
#   attnid reproduce OUT --scale paper --from-runs OUT/experiment
# Measured on one H200: see benchmarks/README.md.
# Usage: scripts/paper_gpu.sh [OUT]   (OUT defaults to paper-report)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-paper-report}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
start=$(date +%s)
python3 - "$out" <<'PY'
import json, sys, tempfile, time
from dataclasses import replace
from pathlib import Path
import torch
from attnid.paper.runs import precision
from attnid.paper.scales import PAPER_JOBS, train_runs
from attnid.progress import Progress
from attnid.train.loop import PRESETS, TrainConfig, train
from attnid.train.model import GPTConfig

assert torch.cuda.is_available(), "this torch sees no CUDA device"
print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}", flush=True)


def check(steps: int = 200) -> bool:
    """The graph replay against op by op: same losses (no dropout), and each one's ms a step."""
    cfg = TrainConfig(model=GPTConfig(**{**PRESETS["paper"], "dropout": 0.0}), steps=steps, batch_size=64,
                      log_every=10, eval_every=10**9, device="cuda")
    losses, ms = {}, {}
    for graph in (False, True):
        with tempfile.TemporaryDirectory() as d, precision("tf32"):
            s = train(replace(cfg, cuda_graph=graph), Path(d), progress=False, checkpoint=False)
            recs = [json.loads(ln) for ln in (Path(d) / "metrics.jsonl").read_text().splitlines()]
        losses[graph], ms[graph] = [r["loss"] for r in recs], s.seconds / steps * 1e3
    worst = max(abs(a - b) / abs(a) for a, b in zip(losses[False], losses[True], strict=True))
    ok = worst < 1e-3
    print(f"check, {steps} steps alone: op by op {ms[False]:.1f} ms a step, graph {ms[True]:.1f} ms; "
          f"losses differ by {worst:.1e} (relative, worst of {len(losses[True])} records): "
          f"{'graph used' if ok else 'graph NOT used'}", flush=True)
    return ok


try:
    graph = check()
except Exception as e:  # a replay that fails is not used
    print(f"check failed: {type(e).__name__}: {e}; graph NOT used", flush=True)
    graph = False
t0 = time.perf_counter()
folder = train_runs(sys.argv[1], "paper", device="cuda", jobs=PAPER_JOBS, cuda_graph=graph,
                    progress=Progress(rich=False))
wall = json.loads((folder / "timing.json").read_text())["wall_s"]
for name, s in wall.items():
    loop = json.loads((folder / "runs" / name / "summary.json").read_text())["seconds"]
    print(f"{name:16s} {s:6.0f} s in all, {loop:6.0f} s training", flush=True)
print(f"training, {PAPER_JOBS} runs at once: {time.perf_counter() - t0:.0f} s", flush=True)
PY
echo "total: $(( $(date +%s) - start )) s; the report: attnid reproduce $out --scale paper --from-runs $out/experiment"
