"""Streaming safetensors: read headers without loading data; write a file one tensor at a time.

Peak memory of a rewrite is what the caller holds (one layer), whatever the file size.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from attnid.errors import AttnidError

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
          "U8": torch.uint8, "BOOL": torch.bool}
NAMES = {v: k for k, v in DTYPES.items()}


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """``(header, data_start)`` of a safetensors file; a clear error if it is not one."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise AttnidError(f"{path} is not a safetensors file (truncated)")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8 or n > 100_000_000:
                raise AttnidError(f"{path} is corrupt (header length {n} beyond the file)")
            header = json.loads(f.read(n))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AttnidError(f"{path} is not a readable safetensors file: {e}") from None
    end = 8 + n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        _, hi = info["data_offsets"]
        if end + hi > size:
            raise AttnidError(f"{path} is truncated: tensor {name} runs past the end of the file")
    return header, end


def read_bytes(path: Path, header: dict[str, Any], start: int, name: str) -> bytes:
    """A tensor's raw little-endian bytes, as stored."""
    lo, hi = header[name]["data_offsets"]
    with path.open("rb") as f:
        f.seek(start + lo)
        return f.read(hi - lo)


def read_tensor(path: Path, header: dict[str, Any], start: int, name: str) -> torch.Tensor:
    """One tensor as a torch tensor; one clear error for a dtype outside :data:`DTYPES`."""
    info = header[name]
    dtype = DTYPES.get(info["dtype"])
    if dtype is None:
        raise AttnidError(f"{path}: {name} is stored as {info['dtype']}, which attnid cannot "
                          f"rewrite (it reads {', '.join(DTYPES)})")
    data = bytearray(read_bytes(path, header, start, name))
    t = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
    return t.reshape(info["shape"])


def write_streaming(path: Path, entries: list[tuple[str, str, list[int], int]],
                    produce: Callable[[str], torch.Tensor | bytes],
                    metadata: dict[str, str] | None = None) -> None:
    """Write ``entries`` (name, dtype name, shape, byte size) in order; ``produce(name)`` gives
    each tensor, or, for a tensor copied unchanged, its raw bytes (then any dtype, also ones
    outside :data:`DTYPES` such as ``F8_E4M3``, is written as it was stored)."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, dtype, shape, nbytes in entries:
            t = produce(name)
            if isinstance(t, torch.Tensor):
                if NAMES.get(t.dtype) != dtype or list(t.shape) != list(shape):
                    raise AttnidError(f"internal: {name} changed dtype or shape")
                t = memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())
            if len(t) != nbytes:
                raise AttnidError(f"internal: {name} has {len(t)} bytes, expected {nbytes}")
            f.write(t)


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors shards of a model directory (single file or indexed shards)."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            wm = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise AttnidError(f"{index} is corrupt: {e}") from None
        files = sorted(set(wm.values()))
        missing = [f for f in files if not (model_dir / f).exists()]
        if missing:
            raise AttnidError(f"{model_dir} is missing shard(s): {', '.join(missing)}")
        return [model_dir / f for f in files]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    raise AttnidError(f"{model_dir} has no safetensors weights (model.safetensors or an index)")


def all_names(files: Iterable[Path]) -> dict[str, tuple[Path, dict[str, Any], int]]:
    out = {}
    for p in files:
        header, start = read_header(p)
        for name in header:
            if name != "__metadata__":
                out[name] = (p, header, start)
    return out


def weight_prefix(index: Iterable[str], first: str) -> str:
    """The prefix a checkpoint puts before the adapter's tensor names (``"model."``, ``""``):
    found from the first tensor name ``first`` the adapter expects."""
    for name in index:
        if name.endswith(first) and (len(name) == len(first) or name[-len(first) - 1] == "."):
            return name[: -len(first)]
    raise AttnidError(f"checkpoint has no tensor named like {first!r}: wrong architecture in config?")
