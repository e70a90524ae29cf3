"""`attnid diff` at real sizes: a Llama-2-7B-shaped checkpoint, rewritten with R1 + R2, diffed.

    python benchmarks/diff.py [--config Llama-2-7b] [--layers N] [--dtype bfloat16] [--dir DIR] [--keep]

1. Makes (once) a random checkpoint of the config (default: the bundled Llama-2-7b config, in
   bfloat16, sharded at 2 GiB with a ``model.safetensors.index.json``), written one tensor at a
   time (`attnid.io.write_streaming`): the model is never held in memory. Norm gains are drawn
   away from 1 (a generic point: folding them matters).
2. Rewrites it with QuaRot's R1 + R2: ``attnid rewrite A B --fold-norms --rotate-residual
   hadamard --rotate-values random`` (which itself verifies with `attnid diff`).
3. Times, each in its own process with its peak resident memory, and with both checkpoints
   evicted from the page cache first (``posix_fadvise(DONTNEED)``, so that each run reads from
   disk): (a) reading every tensor of both checkpoints through safetensors (the baseline;
   safetensors hands out memory-mapped tensors, so it touches a byte of every page: ``numel()``
   alone would read next to nothing); (b) ``attnid diff A B --json`` twice, with an empty
   layout store and then with the one the first run filled (``ATTNID_CACHE``, a fresh folder:
   `attnid.whole.transforms.layout_store`): a first command on a model imports transformers and
   builds the layout, later ones read it.

Prints the sizes, the times, their ratios to the read, diff's peak RSS and its verdict (aim: at
most 3x the baseline and 4 GB). ``--layers N`` keeps the widths and takes N layers (a quick run of the same
per-layer work). The checkpoints (27 GB at 7B) are deleted at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PEAK = """
import atexit, resource, sys
atexit.register(lambda: print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr))
"""

READ = """
import sys
import torch
from safetensors import safe_open
from pathlib import Path
total = 0
for d in sys.argv[1:]:
    for p in sorted(Path(d).glob("*.safetensors")):
        with safe_open(str(p), "pt") as f:
            for n in f.keys():
                t = f.get_tensor(n)
                t.reshape(-1).view(torch.uint8)[::4096].sum()  # mapped: a byte of each page read
                total += t.numel()
print(total)
"""

DIFF = """
import sys
from attnid.cli import main
sys.exit(main(["diff", sys.argv[1], sys.argv[2], "--json"]))
"""

REWRITE = """
import sys
from attnid.cli import main
sys.exit(main(["rewrite", sys.argv[1], sys.argv[2], "--fold-norms", "--rotate-residual", "hadamard",
               "--rotate-values", "random", "--seed", "1", "--json"]))
"""


def evict(*dirs: Path) -> None:
    """Drop the files' pages from the page cache (written pages are flushed first)."""
    os.sync()
    for d in dirs:
        for p in d.glob("*.safetensors"):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def run(code: str, *argv: str, ok: tuple[int, ...] = (0,), env: dict[str, str] | None = None
        ) -> tuple[float, float, str]:
    """Wall seconds, the child's peak RSS (GiB: kB / 2**20) and its stdout (``env``: added to the child's)."""
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", PEAK + code, *argv], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})
    wall = time.perf_counter() - t
    if proc.returncode not in ok:
        raise SystemExit(proc.stderr[-3000:])
    peak_kb = int(proc.stderr.strip().splitlines()[-1])
    return wall, peak_kb / 2**20, proc.stdout


def make(config: dict, out: Path, dtype: str, shard_bytes: int = 2 * 2**30, seed: int = 0) -> int:
    """A random checkpoint of ``config`` in ``out``, one tensor at a time (``seed``: another
    draw); returns its parameters."""
    import torch

    from attnid.adapters.base import new_hf_model
    from attnid.io import NAMES, write_streaming

    dt = getattr(torch, dtype)
    with torch.device("meta"):
        model = new_hf_model(config, head=True)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}  # tied names once
    out.mkdir(parents=True, exist_ok=True)
    shards, current, size = [], [], 0
    for n, s in shapes.items():
        nbytes = dt.itemsize * max(1, int(torch.tensor(s).prod()))
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(n)
        size += nbytes
    shards.append(current)

    def produce(name: str) -> torch.Tensor:
        gen = torch.Generator().manual_seed(sum(name.encode()) * 7919 + len(name) + 1_000_003 * seed)
        shape = shapes[name]
        if "norm" in name:
            t = 0.5 + torch.rand(shape, generator=gen)
        elif name.endswith("bias"):
            t = 0.1 * torch.randn(shape, generator=gen)
        else:
            t = 0.02 * torch.randn(shape, generator=gen)
        return t.to(dt)

    weight_map = {}
    for k, names in enumerate(shards, 1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        entries = [(n, NAMES[dt], shapes[n]) for n in names]
        write_streaming(out / file, entries, produce, {"format": "pt"})
        weight_map |= dict.fromkeys(names, file)
    total = sum(dt.itemsize * int(torch.tensor(s).prod()) for s in shapes.values())
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": dtype}, indent=2))
    return sum(int(torch.tensor(s).prod()) for s in shapes.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="Llama-2-7b", help="a bundled config name or a config.json")
    ap.add_argument("--layers", type=int, default=None, help="keep the widths, take this many layers")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--dir", default="/tmp/attnid-bench-diff")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints")
    args = ap.parse_args()
    from attnid.adapters.config import load_config

    _, config = load_config(args.config)
    if args.layers:
        config = dict(config, num_hidden_layers=args.layers)
    root = Path(args.dir)
    a, b = root / "a", root / "b"
    try:
        if not (a / "model.safetensors.index.json").exists():
            t = time.perf_counter()
            n = make(config, a, args.dtype)
            print(f"made A: {n:,} parameters ({args.dtype}) in {time.perf_counter() - t:.0f}s")
        shutil.rmtree(b, ignore_errors=True)
        t_rw, m_rw, out = run(REWRITE, str(a), str(b))
        rw = json.loads(out)
        size = sum(p.stat().st_size for d in (a, b) for p in d.glob("*.safetensors")) / 2**30
        print(f"rewrote B = A with R1 (Hadamard) + R2: {t_rw:.0f}s, peak {m_rw:.2f} GiB, certified by "
              f"its own diff (max residual {rw['max_residual']:.2e})")
        evict(a, b)
        t_read, m_read, _ = run(READ, str(a), str(b))
        # the layout store (attnid.whole.transforms.layout_store) empty, then holding this
        # config's layout: a first run on a model imports transformers and builds it
        store = Path(tempfile.mkdtemp(prefix="attnid-bench-store-"))
        timed = []
        for _ in ("first", "stored"):
            evict(a, b)
            timed.append(run(DIFF, str(a), str(b), ok=(0, 1), env={"ATTNID_CACHE": str(store)}))
        shutil.rmtree(store, ignore_errors=True)
        (t_first, m_first, _), (t_diff, m_diff, out) = timed
        r = json.loads(out)
        worst = max(row["residual"] for row in r["layers"])
        print(f"both checkpoints: {size:.1f} GiB on disk")
        print(f"read both (safetensors, every tensor): {t_read:.1f}s, peak {m_read:.2f} GiB")
        print(f"attnid diff A B, layout stored       : {t_diff:.1f}s, peak {m_diff:.2f} GiB -> "
              f"{t_diff / t_read:.2f}x the read")
        print(f"attnid diff A B, first on the config : {t_first:.1f}s, peak {m_first:.2f} GiB -> "
              f"{t_first / t_read:.2f}x the read (transformers imported, the layout built)")
        print(f"  certified {r['certified']} (worst layer residual {worst:.2e}, tolerance "
              f"{r['tolerance']:.1e}, {r['probes']} probes); rotation {r['rotation']}")
        print(json.dumps({"config": args.config, "layers": config["num_hidden_layers"], "dtype": args.dtype,
                          "gib": size, "read_s": t_read, "diff_s": t_diff,
                          "diff_first_s": t_first, "ratio": t_diff / t_read,
                          "diff_peak_gb": m_diff, "rewrite_s": t_rw, "rewrite_peak_gb": m_rw,
                          "certified": r["certified"], "worst_residual": worst}))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
