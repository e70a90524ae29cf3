#!/usr/bin/env bash
# The paper's training at the paper's scale on one CUDA GPU: its four cases and the SGD lr sweep
# (6 layers, 6 heads, d 384, context 256, batch 64, 5,000 steps), the 7 distinct runs at once,
# each its own process, TF32 matmuls. The same as
#   attnid reproduce OUT --scale paper --device cuda --runs-only
# without needing typer: python3 with a CUDA torch and numpy is enough, from a checkout, nothing
# installed. It writes OUT/experiment (each run's config, metrics.jsonl, log.txt; the same-point
# drift and AdamW's anatomy); build the report from it on a machine with attnid[all]:
#   attnid reproduce OUT --scale paper --from-runs OUT/experiment
# It does NOT fit 10 minutes of one H200 yet. Measured there (torch 2.11, 2026-12-04): the 7
# runs at once took 4.1 min per 500 steps, about 41 min for the 5,000; one run alone 61 ms a
# step, against 16.3 ms for a bare forward, backward and AdamW step of the same model in TF32
# (19.8 in bf16 autocast, 32.8 in float32). With the update sizes summed on the GPU (no read
# back per layer and side every step) one run alone took 58.2 ms a step and 7 at once 88 ms of
# wall per step of all runs (300 and 7 x 120 steps): about 51 min for the whole. What is left
# is the loop's per-step work (the float64 copies and conserved-quantity traces of every layer,
# the batch built on the CPU) and the processes' time-slicing of one GPU (no MPS).
# Usage: scripts/paper_gpu.sh [OUT]   (OUT defaults to paper-report)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-paper-report}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)
python3 - "$out" <<'PY'
import json, sys, time
import torch
from attnid.paper.scales import PAPER_JOBS, train_runs
from attnid.progress import Progress

assert torch.cuda.is_available(), "this torch sees no CUDA device"
print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}, {PAPER_JOBS} runs at a time", flush=True)
t0 = time.perf_counter()
folder = train_runs(sys.argv[1], "paper", device="cuda", jobs=PAPER_JOBS, progress=Progress(rich=False))
wall = json.loads((folder / "timing.json").read_text())["wall_s"]
for name, s in wall.items():
    loop = json.loads((folder / "runs" / name / "summary.json").read_text())["seconds"]
    print(f"{name:16s} {s:6.0f} s in all, {loop:6.0f} s training")
print(f"training: {time.perf_counter() - t0:.0f} s", flush=True)
PY
echo "total: $(( $(date +%s) - start )) s; the report: attnid reproduce $out --scale paper --from-runs $out/experiment"
