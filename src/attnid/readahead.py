"""Read a streamed pass's next bytes while it computes on the current ones.

The checkpoint commands read a unit (a layer of both models), compute on it, and read the next.
Read from disk, each unit's bytes wait for the disk while nothing is computed. :func:`ahead`
hands byte ranges of files to one background thread. The thread reads them in 8 MiB pieces
into one scratch buffer, so they land in the kernel's page cache. The pass's own read of those
bytes is then a copy from memory, and the disk works while the pass computes. A file read
releases the GIL, so the thread costs the computation next to nothing.

Nothing is held in this process: the scratch buffer is reused, and only the page cache, which
the kernel evicts under memory pressure, keeps the bytes. ``posix_fadvise(WILLNEED)`` would be
the system's way to ask for this, but Linux limits it to its readahead window (measured here: a
1 GiB range read no faster after it). A range the thread cannot read (a file gone, a short file)
is skipped: the pass's own read reports it as it always has. Callers ask for at most a unit or
two ahead, so the page cache holds no more than that beyond what the pass reads.
"""

from __future__ import annotations

import json
import os
import queue
import struct
import threading
from collections.abc import Iterable
from pathlib import Path

PIECE = 8 << 20  # bytes read per system call

Span = tuple[Path, int, int]  # (file, first byte, number of bytes)


class _Reader:
    def __init__(self) -> None:
        self.todo: queue.SimpleQueue[Span] = queue.SimpleQueue()
        self.asked: set[tuple[Path, int]] = set()  # (file, first byte): each span read once
        self.pending = 0  # spans asked for and not yet read
        self.done = threading.Condition()
        threading.Thread(target=self._run, name="attnid-readahead", daemon=True).start()

    def ask(self, spans: Iterable[Span]) -> int:
        n = 0
        with self.done:
            for path, start, size in spans:
                if size > 0 and (path, start) not in self.asked:
                    self.asked.add((path, start))
                    self.pending += 1
                    self.todo.put((path, start, size))
                    n += size
        return n

    def _run(self) -> None:
        view = memoryview(bytearray(PIECE))
        while True:
            path, start, size = self.todo.get()
            try:
                with open(path, "rb", buffering=0) as f:
                    f.seek(start)
                    left = size
                    while left > 0 and (got := f.readinto(view[:min(left, PIECE)])):
                        left -= got
            except Exception:  # a hint only: the pass's own read reports what is wrong
                pass
            finally:
                with self.done:
                    self.pending -= 1
                    self.done.notify_all()


_READER: _Reader | None = None
_START = threading.Lock()


def ahead(spans: Iterable[Span]) -> int:
    """Have the background thread read ``spans`` into the page cache, in order, each span once
    per process; the bytes newly asked for. ``ATTNID_READAHEAD=0`` turns it off (0 returned)."""
    global _READER
    if os.environ.get("ATTNID_READAHEAD", "1") == "0":
        return 0
    with _START:
        if _READER is None:
            _READER = _Reader()
    return _READER.ask(spans)


def idle(timeout: float = 60.0) -> bool:
    """Wait until every span asked for has been read (tests, benchmarks); False on timeout."""
    r = _READER
    if r is None:
        return True
    with r.done:
        return r.done.wait_for(lambda: r.pending == 0, timeout)


def layer_of(name: str) -> int:
    """The layer a tensor name belongs to, for the read order: its first all-digit part
    (``model.layers.3.mlp.up_proj.weight`` -> 3), -1 for the tensors outside the layers."""
    return next((int(p) for p in name.split(".") if p.isdigit()), -1)


def checkpoint(path: str | Path, layers: int = 1) -> int:
    """Start reading a checkpoint where a streamed pass starts: the tensors outside the layers
    (tables, final norm, head), then the first ``layers`` layers, by the safetensors headers
    alone (no torch: this can run while torch is imported). ``path``: a model directory (its
    ``model.safetensors.index.json`` shards, else every .safetensors file), its config.json or
    a .safetensors file; anything else, or a header that cannot be used, is passed over (0):
    the command's own reading reports it. The bytes asked for."""
    if os.environ.get("ATTNID_READAHEAD", "1") == "0":
        return 0
    spans: list[tuple[int, Span]] = []
    try:
        files = _files(Path(path))
    except Exception:  # a path the OS refuses: the command names it
        return 0
    for f in files:
        try:
            spans += [(layer_of(name), span) for name, span in header_spans(f) if layer_of(name) < layers]
        except Exception:  # a header this cannot use: the command names what is wrong
            continue
    spans.sort(key=lambda x: (x[0], str(x[1][0]), x[1][1]))
    return ahead(s for _, s in spans)


def _files(p: Path) -> list[Path]:
    if p.is_file():
        if p.suffix == ".safetensors":
            return [p]
        p = p.parent  # a config.json
    elif not p.is_dir():
        return []  # a name (a bundled config, a hub id): nothing local to read
    index = p / "model.safetensors.index.json"
    if index.is_file():
        shards = json.loads(index.read_text()).get("weight_map", {}).values()
        return sorted({p / str(s) for s in shards})
    return sorted(p.glob("*.safetensors"))


def header_spans(f: Path) -> list[tuple[str, Span]]:
    """(name, span) of each tensor a safetensors header lists, offsets checked (none when one
    is not a pair of integers ``0 <= first <= last``); `attnid.io` reads its spans here too."""
    with open(f, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        if n >= 100_000_000:
            return []
        header = json.loads(fh.read(n))
    out = []
    for name, v in header.items() if isinstance(header, dict) else ():
        if name == "__metadata__":
            continue
        a, b = v["data_offsets"]
        if not (isinstance(a, int) and isinstance(b, int) and 0 <= a <= b):
            return []
        out.append((name, (f, 8 + n + a, b - a)))
    return out
