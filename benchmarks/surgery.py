"""Surgery speed and memory: canonicalize a ~1B-parameter Llama-shaped checkpoint.

    python benchmarks/surgery.py [--dir /tmp/attnid-bench-1b]

Makes (once) a randomly initialised Llama-shaped checkpoint of about 1.1B parameters
(TinyLlama's shape, float32, one safetensors file), then in the same run times, each in its
own process with its peak resident memory:
  (a) `attnid canonicalize` (streamed a unit at a time, certified by `attnid diff`);
  (b) a plain copy: safetensors `load_file` then `save_file` of the same checkpoint.
TransformerLens is not a dependency and is not installed here, so no comparison with it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
          "num_attention_heads": 32, "num_key_value_heads": 4, "num_hidden_layers": 22,
          "intermediate_size": 5632, "vocab_size": 32000, "rope_theta": 10000.0,
          "rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "tie_word_embeddings": False}

MAKE = """
import json, sys, torch, transformers
c = json.loads(sys.argv[2])
conf = transformers.AutoConfig.for_model(c.pop("model_type"), **c)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(conf)
model.save_pretrained(sys.argv[1], max_shard_size="100GB")
print(sum(p.numel() for p in model.parameters()))
"""

COPY = """
import sys
from safetensors.torch import load_file, save_file
t = load_file(sys.argv[1] + "/model.safetensors")
save_file(t, sys.argv[2] + "/model.safetensors", metadata={"format": "pt"})
"""


PEAK = """
import atexit, resource, sys
atexit.register(lambda: print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr))
"""


def run(code: str, *argv: str) -> tuple[float, float, str]:
    """Wall seconds and the child's own peak RSS (GB), printed by it at exit. Dirty pages of
    earlier runs are flushed first, so that no run pays for another's writes."""
    os.sync()
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", PEAK + code, *argv], capture_output=True, text=True)
    wall = time.perf_counter() - t
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    peak_kb = int(proc.stderr.strip().splitlines()[-1])
    return wall, peak_kb / 2**20, proc.stdout


CANON = """
import sys
from attnid.cli import main
sys.exit(main(["canonicalize", sys.argv[1], sys.argv[2], "--json"]))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/attnid-bench-1b")
    args = ap.parse_args()
    root = Path(args.dir)
    src = root / "llama-1b"
    if not (src / "model.safetensors").exists():
        src.mkdir(parents=True, exist_ok=True)
        wall, _, out = run(MAKE, str(src), json.dumps(CONFIG))
        print(f"made a {int(out):,}-parameter checkpoint in {wall:.0f}s")
    size = (src / "model.safetensors").stat().st_size / 2**30
    copy_dir, canon_dir = root / "copy", root / "canonical"
    for d in (copy_dir, canon_dir):
        shutil.rmtree(d, ignore_errors=True)
    copy_dir.mkdir(parents=True)
    t_can, m_can, out = run(CANON, str(src), str(canon_dir))
    t_copy, m_copy, _ = run(COPY, str(src), str(copy_dir))
    rep = json.loads(out)
    print(f"checkpoint {size:.2f} GiB (float32)")
    print(f"plain load+save copy: {t_copy:.1f}s, peak {m_copy:.2f} GB")
    print(f"attnid canonicalize : {t_can:.1f}s, peak {m_can:.2f} GB  -> time ratio {t_can / t_copy:.2f}x")
    print(f"  certified (worst residual {rep['max_residual']:.2e}), {rep['heads_balanced']} heads balanced, "
          "end to end: " + ("skipped (over 2 GiB: the diff certificate only)"
                            if rep["end_to_end_rel_diff"] is None else f"{rep['end_to_end_rel_diff']:.2e}"))


if __name__ == "__main__":
    main()
