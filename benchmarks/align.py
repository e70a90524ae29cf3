"""`attnid align` and `attnid merge --align` at real sizes: a Llama-2-7B-shaped pair, streamed.

    python benchmarks/align.py [--config Llama-2-7b] [--layers N] [--dtype bfloat16] [--dir DIR] [--keep]
                                [--unrelated] [--rounds N] [--barrier] [--skip-merge]

1. Makes (once) a random checkpoint A of the config the way `benchmarks/diff.py` does (bfloat16,
   sharded at 2 GiB, written one tensor at a time), and B = A rewritten with its MLP neurons and
   heads permuted and every key/value group's values rotated (``attnid rewrite A B
   --permute-mlp --permute-heads --rotate-values random``, certified by its own diff).
2. Times, each in its own process with its peak resident memory, and with the checkpoints
   evicted from the page cache first: (a) reading every tensor of both (the baseline of
   `benchmarks/diff.py`); (b) ``attnid align A B OUT --json`` (streamed: a unit at a time, each
   pass written, then certified by diff against B); (c) ``attnid merge A B OUT --align --json``;
   with ``--unrelated``, B is another random draw of the config instead (every neuron and head
   then assigned for real: the sparse assignment of `attnid.whole.fit.match`);
   (d) with ``--barrier``, ``attnid barrier A B --align --alphas 3`` on ``--barrier-tokens``
   tokens of the shipped Shakespeare (a character-level tokenizer saved next to A): the loss at
   3 points of the naive and the aligned path, streamed a layer at a time. Its time is mostly
   the forwards (tokens x points x 2 paths), not the read: the ratio is printed with the
   forwards' count.

The timed commands read the layout from a store an earlier command filled (``ATTNID_CACHE``,
a folder under ``--dir``; `attnid.whole.transforms.layout_store`): a first command on a model
also imports transformers and builds it, about 4.5 s more (`benchmarks/diff.py` times both).

Prints the sizes, the times, their ratio to the read, the peak RSS of each (aim: at most 4 GB
and 3x the read) and how far the aligned B is from A (``aligned_distance / raw_distance``: B is
a symmetry of A, so aligning returns it to rounding). ``--layers N`` keeps the widths and takes
N layers. The checkpoints are deleted at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from diff import READ, evict, make, run  # the same checkpoints and the same baseline

REWRITE = """
import sys
from attnid.cli import main
sys.exit(main(["rewrite", sys.argv[1], sys.argv[2], "--permute-mlp", "--permute-heads", "--rotate-values",
               "random", "--seed", "1", "--json"]))
"""

COMMAND = """
import sys
from attnid.cli import main
sys.exit(main([*sys.argv[1:], "--json"]))
"""

LAYOUT = """
from attnid.checkpoint.load import open_checkpoint
from attnid.checkpoint.units import open_units
import sys
open_units(open_checkpoint(sys.argv[1]))
"""


def char_tokenizer(d: Path, vocab: int) -> Path:
    """A character-level tokenizer of the shipped Shakespeare (`attnid.train.export.char_tokenizer`,
    ids below ``vocab``) saved in ``d``; the text it reads."""
    from attnid.data import __file__ as data
    from attnid.train.export import char_tokenizer as chars_tokenizer

    text = Path(data).parent / "shakespeare.txt"
    chars = "".join(sorted(set(text.read_text(encoding="utf-8"))))
    assert len(chars) <= vocab, (len(chars), vocab)
    chars_tokenizer(chars).save_pretrained(d)
    return text


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="Llama-2-7b", help="a bundled config name or a config.json")
    ap.add_argument("--layers", type=int, default=None, help="keep the widths, take this many layers")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--dir", default="/tmp/attnid-bench-align")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints")
    ap.add_argument("--skip-merge", action="store_true", help="time align only")
    ap.add_argument("--barrier", action="store_true", help="also time attnid barrier --align")
    ap.add_argument("--unrelated", action="store_true",
                    help="B another random draw of the config instead of A's rewrite: nearest neighbours "
                         "clash and every neuron and head is assigned for real")
    ap.add_argument("--barrier-tokens", type=int, default=512, help="tokens barrier evaluates")
    ap.add_argument("--rounds", type=int, default=None,
                    help="pass --rounds N to align, merge and barrier (at most N stream-refinement rounds)")
    args = ap.parse_args()
    from attnid.adapters.config import load_config

    _, config = load_config(args.config)
    if args.layers:
        config = dict(config, num_hidden_layers=args.layers)
    root = Path(args.dir)
    a, b, out, merged = root / "a", root / "b", root / "aligned", root / "merged"
    store = {"ATTNID_CACHE": str(root / "store")}  # the layout store the timed commands read
    try:
        if not (a / "model.safetensors.index.json").exists():
            t = time.perf_counter()
            n = make(config, a, args.dtype)
            print(f"made A: {n:,} parameters ({args.dtype}) in {time.perf_counter() - t:.0f}s")
        if args.unrelated:
            b = root / "unrelated"
            if not (b / "model.safetensors.index.json").exists():
                make(config, b, args.dtype, seed=1)
                print("made B: another random draw of the config")
        elif not (b / "model.safetensors.index.json").exists():
            t_rw, m_rw, _ = run(REWRITE, str(a), str(b))
            print(f"rewrote B = A with permuted heads and neurons and rotated values: {t_rw:.0f}s, "
                  f"peak {m_rw:.2f} GiB (certified by its own diff)")
        size = sum(p.stat().st_size for d in (a, b) for p in d.glob("*.safetensors")) / 2**30
        print(f"both checkpoints: {size:.1f} GiB on disk")
        run(LAYOUT, str(a), env=store)  # as an earlier command on the model leaves it
        evict(a, b)
        t_read, m_read, _ = run(READ, str(a), str(b))
        print(f"read both (safetensors, every tensor): {t_read:.1f}s, peak {m_read:.2f} GiB")
        rows = {"config": args.config, "layers": config["num_hidden_layers"], "dtype": args.dtype,
                "gib": size, "read_s": t_read, "rounds": args.rounds}
        jobs = [("align", ["align", str(a), str(b), str(out), "--force"])]
        if not args.skip_merge:
            jobs.append(("merge", ["merge", str(a), str(b), str(merged), "--align", "--force"]))
        if args.barrier:
            text = char_tokenizer(a, int(config["vocab_size"]))
            jobs.append(("barrier", ["barrier", str(a), str(b), "--calibration", str(text), "--align",
                                     "--alphas", "3", "--context", "128",
                                     "--max-tokens", str(args.barrier_tokens)]))
        for name, argv in jobs:
            argv += [] if args.rounds is None else ["--rounds", str(args.rounds)]
            evict(a, b)
            t, m, stdout = run(COMMAND, *argv, env=store)
            r = json.loads(stdout)
            if name == "barrier":
                print(f"attnid barrier: {t:.1f}s, peak {m:.2f} GiB -> {t / t_read:.2f}x the read; "
                      f"{r['tokens']} tokens at 3 points of 2 paths; barriers "
                      + ", ".join(f"{k} {v:.4f}" for k, v in r["barriers"].items()))
                rows |= {"barrier_s": t, "barrier_ratio": t / t_read, "barrier_peak_gb": m,
                         "barrier_tokens": r["tokens"]}
                continue
            share = r["aligned_distance"] / max(r["raw_distance"], 1e-300)
            print(f"attnid {name:5s}: {t:.1f}s, peak {m:.2f} GiB -> {t / t_read:.2f}x the read; aligned "
                  f"distance {share:.2e} of the raw one, max residual {r['max_residual']:.2e}")
            rows |= {f"{name}_s": t, f"{name}_ratio": t / t_read, f"{name}_peak_gb": m,
                     f"{name}_aligned_share": share}
        print(json.dumps(rows))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
