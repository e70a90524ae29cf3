"""Safetensors files: read through the safetensors library, written one tensor at a time.

Reading: :class:`TensorFile` opens a file with ``safetensors.safe_open`` (the header validated
by the library: offsets, shapes against byte sizes, dtypes), and reads one tensor at a time:
the floating ones by a plain read of their bytes into memory the caller owns (not through the
library's memory map, whose pages would stay mapped into the process, counted in its resident
memory, for as long as the file is open: a whole checkpoint, for a tool that streams it).
:func:`weight_files` finds a model directory's shards (one file, or a
``model.safetensors.index.json`` whose map is checked against the shards' contents).

Writing: :func:`write_streaming` is hand-written because the library has nothing like it:
``safetensors.torch.save_file`` serialises a dict that must hold every tensor of the file at
once, so rewriting a 7B checkpoint that way needs the whole shard in memory. Here tensors are
produced and written one by one, so peak memory is what the caller holds (a layer).

Every refusal is one :class:`~attnid.errors.AttnidError` naming the file (and, where the
library's message allows it, the tensor and the field).
"""

from __future__ import annotations

import json
import re
import struct
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from attnid.errors import AttnidError, require
from attnid.readahead import header_spans

# the floating dtypes attnid rewrites (any dtype torch and safetensors know is read and copied)
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100_000_000  # the library's own limit on the header's size
INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorInfo:
    """What a file's header says of one tensor: its safetensors dtype name and shape."""

    dtype: str
    shape: tuple[int, ...]


class TensorFile:
    """One safetensors file, opened for reading (nothing but the header is read until asked).

    >>> import tempfile, pathlib
    >>> from safetensors.torch import save_file
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "w.safetensors"
    >>> save_file({"w": torch.ones(2, 3)}, str(path))
    >>> f = TensorFile(path)
    >>> f.names, f.info("w")
    (['w'], TensorInfo(dtype='F32', shape=(2, 3)))
    >>> f.tensor("w").sum().item()
    6.0
    """

    def __init__(self, path: str | Path) -> None:
        require("safetensors", "hf")
        from safetensors import SafetensorError, safe_open

        self.path = Path(path)
        if not self.path.is_file():
            raise AttnidError(f"{self.path} does not exist or is not a file")
        try:
            self._file = safe_open(str(self.path), framework="pt")
            self.names: list[str] = list(self._file.keys())
            self.metadata: dict[str, str] | None = self._file.metadata()
            self._info = {}
            for n in self.names:
                s = self._file.get_slice(n)
                self._info[n] = TensorInfo(str(s.get_dtype()), tuple(int(x) for x in s.get_shape()))
            self._span = _data_spans(self.path)  # each tensor: (first byte, size), validated above
        except (SafetensorError, OSError, ValueError) as e:
            raise AttnidError(f"{self.path} is not a valid safetensors file: {_diagnose(self.path, e)}"
                              ) from None

    def __contains__(self, name: str) -> bool:
        return name in self._info

    def info(self, name: str) -> TensorInfo:
        return self._info[name]

    def span(self, name: str) -> tuple[Path, int, int]:
        """Where a tensor's bytes lie: (this file, its first byte, its size in bytes)."""
        return (self.path, *self._span[name])

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of one tensor (only those bytes are read; a copy in memory)."""
        info = self._info[name]
        if info.dtype in DTYPES and info.shape and sys.byteorder == "little":
            stop = max(start, min(stop, info.shape[0]))
            return self._read(name, (stop - start, *info.shape[1:]), start)
        try:
            return self._file.get_slice(name)[start:stop]
        except Exception as e:  # the library's error types differ between versions and dtypes
            raise AttnidError(f"{self.path}: tensor {name} cannot be read ({self._info[name].dtype}): "
                              f"{e}") from None

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor, as stored (a copy in memory)."""
        info = self._info[name]
        if info.dtype in DTYPES and sys.byteorder == "little":
            return self._read(name, info.shape, 0)
        try:
            return self._file.get_tensor(name)
        except Exception as e:  # the library's error types differ between versions and dtypes
            raise AttnidError(f"{self.path}: tensor {name} cannot be read ({self._info[name].dtype}): "
                              f"{e}") from None


    def _read(self, name: str, shape: tuple[int, ...], row: int) -> torch.Tensor:
        """``shape`` worth of a floating tensor's bytes from row ``row`` on, read into a new
        tensor (one ``readinto``; safetensors stores little-endian, C order)."""
        dtype = DTYPES[self._info[name].dtype]
        numel = 1
        for x in shape:
            numel *= x
        per_row = 1
        for x in self._info[name].shape[1:]:
            per_row *= x
        out = torch.empty(numel * dtype.itemsize, dtype=torch.uint8)
        with self.path.open("rb", buffering=0) as f:
            f.seek(self._span[name][0] + row * per_row * dtype.itemsize)
            got = f.readinto(memoryview(out.numpy()))
        if got != out.numel():
            raise AttnidError(f"{self.path}: tensor {name} cannot be read (the file ends early)")
        return out.view(dtype).reshape(shape)


def _data_spans(path: Path) -> dict[str, tuple[int, int]]:
    """Each tensor's first byte in the file (``8 + header + data_offsets[0]``) and its size
    (`attnid.readahead.header_spans`, on a header the library has validated)."""
    return {name: (start, size) for name, (_, start, size) in header_spans(path)}


def _diagnose(path: Path, error: Exception) -> str:
    """The library's refusal, made specific where it is vague: the tensor and the field."""
    message = re.sub(r"^Error while deserializing header: ", "", str(error))
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                return f"it has {size} bytes, fewer than the 8 that give the header's length"
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER or 8 + n > size:
                return (f"its first 8 bytes give a header of {n} bytes, more than "
                        + (f"the library's limit ({MAX_HEADER})" if n > MAX_HEADER else
                           f"the {size - 8} bytes that follow them"))
            header = json.loads(f.read(n))
    except (OSError, ValueError):
        return message
    if not isinstance(header, dict):
        return f"its header is a JSON {type(header).__name__}, not an object of tensors"
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict):
            return f"tensor {name}: its entry is not an object"
        for key in ("dtype", "shape", "data_offsets"):
            if key not in entry:
                return f"tensor {name}: no {key!r} field"
        shape, offsets = entry["shape"], entry["data_offsets"]
        if not (isinstance(shape, list) and all(isinstance(x, int) and x >= 0 for x in shape)):
            return f"tensor {name}: 'shape' {shape!r} is not a list of non-negative integers"
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(x, int) and x >= 0 for x in offsets) and offsets[0] <= offsets[1]):
            return f"tensor {name}: 'data_offsets' {offsets!r} is not an increasing pair of byte offsets"
        dtype = entry["dtype"]
        if not isinstance(dtype, str) or (dtype not in _BITS and dtype not in ("F4", "F6_E2M3", "F6_E3M2")):
            return f"tensor {name}: unknown 'dtype' {dtype!r}"
        if dtype in _BITS and _numel(shape) * _BITS[dtype] != 8 * (offsets[1] - offsets[0]):
            return (f"tensor {name}: 'shape' {shape} of {dtype} needs {_numel(shape) * _BITS[dtype] // 8} "
                    f"bytes, its 'data_offsets' hold {offsets[1] - offsets[0]}")
        if 8 + n + offsets[1] > path.stat().st_size:
            return (f"truncated: tensor {name} ends at byte {8 + n + offsets[1]}, the file has "
                    f"{path.stat().st_size}")
    end = 0  # the tensors, in offset order, must tile the data without gap or overlap
    for name, entry in sorted(((k, v) for k, v in header.items() if k != "__metadata__"),
                              key=lambda kv: kv[1]["data_offsets"][0]):
        if entry["data_offsets"][0] != end:
            return (f"tensor {name}: 'data_offsets' {entry['data_offsets']} "
                    f"{'overlap' if entry['data_offsets'][0] < end else 'leave a gap after'} the bytes "
                    f"before it (which end at {end})")
        end = entry["data_offsets"][1]
    return message


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors shards of a model directory: ``model.safetensors``, or the files a
    ``model.safetensors.index.json`` names (checked: a JSON object with a ``weight_map`` of
    tensor names to shard files, every shard present)."""
    index = model_dir / INDEX
    if index.exists():
        return sorted({model_dir / f for f in _weight_map(index).values()})
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    raise AttnidError(f"{model_dir} has no safetensors weights (model.safetensors or an index)")


def _weight_map(index: Path) -> dict[str, str]:
    try:
        data = json.loads(index.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AttnidError(f"{index} is not valid JSON: {e}") from None
    wm = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise AttnidError(f"{index}: 'weight_map' is missing or not an object of tensor names to files")
    for f in sorted(set(wm.values())):
        if Path(f).name != f:
            raise AttnidError(f"{index}: shard {f!r} is not a file name inside the model directory")
        if not (index.parent / f).is_file():
            raise AttnidError(f"{index.parent} is missing shard {f} (named in {index.name})")
    return wm


def open_files(model_dir: Path, files: list[Path] | None = None) -> dict[str, TensorFile]:
    """Tensor name -> the open file holding it, for a model directory's shards (or the given
    files). Shards found through an index must hold exactly what its map says."""
    indexed = files is None and (model_dir / INDEX).exists()
    opened = [TensorFile(p) for p in (weight_files(model_dir) if files is None else files)]
    out: dict[str, TensorFile] = {}
    for f in opened:
        for n in f.names:
            if n in out:
                raise AttnidError(f"tensor {n} is stored twice: in {out[n].path.name} and {f.path.name}")
            out[n] = f
    if indexed:
        wm = _weight_map(model_dir / INDEX)
        for n, f in out.items():
            if wm.get(n) != f.path.name:
                raise AttnidError(f"{model_dir / INDEX}: tensor {n} is in {f.path.name}, but the "
                                  f"index says {wm.get(n) or 'nothing'}")
        missing = sorted(set(wm) - set(out))
        if missing:
            raise AttnidError(f"{model_dir / INDEX} names tensor {missing[0]} in {wm[missing[0]]}, "
                              "which does not hold it")
    return out


def write_streaming(path: Path, entries: list[tuple[str, str, tuple[int, ...]]],
                    produce: Callable[[str], torch.Tensor],
                    metadata: dict[str, str] | None = None) -> None:
    """Write ``entries`` (name, safetensors dtype name, shape) in order; ``produce(name)`` gives
    each tensor, which must have that shape and a dtype of that byte size (a tensor copied
    unchanged keeps its stored bytes, whatever its dtype). See the module docstring for why
    this is not ``safetensors.torch.save_file``."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    sizes = {}
    for name, dtype, shape in entries:
        nbytes = _itemsize(dtype) * _numel(shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        sizes[name] = nbytes
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, dtype, shape in entries:
            t = produce(name)
            if tuple(t.shape) != tuple(shape) or (dtype in DTYPES and t.dtype != DTYPES[dtype]):
                raise AttnidError(f"internal: {name} changed dtype or shape")
            data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            if data.nbytes != sizes[name]:
                raise AttnidError(f"internal: {name} has {data.nbytes} bytes, expected {sizes[name]}")
            f.write(memoryview(data))


_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8,
         "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32,
         "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64}


def _itemsize(dtype: str) -> int:
    if dtype not in _BITS:
        raise AttnidError(f"cannot write tensors of safetensors dtype {dtype}")
    return _BITS[dtype] // 8


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for x in shape:
        n *= int(x)
    return n


def weight_prefix(index: Iterable[str], first: str) -> str:
    """The prefix a checkpoint puts before the adapter's tensor names (``"model."``, ``""``):
    found from the first tensor name ``first`` the adapter expects."""
    for name in index:
        if name.endswith(first) and (len(name) == len(first) or name[-len(first) - 1] == "."):
            return name[: -len(first)]
    raise AttnidError(f"checkpoint has no tensor named like {first!r}: wrong architecture in config?")
