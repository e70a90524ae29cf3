"""Checks on the files a command reads and on what it prints when it refuses: nothing the user
gave is modified (:func:`fingerprint` before and after), and a refusal is one ``error:`` line
naming what is wrong (:func:`assert_one_error`)."""

from __future__ import annotations

import hashlib
from pathlib import Path


def fingerprint(d: Path) -> dict[str, object]:
    """Every file under ``d``: sha256 when small, else (size, mtime) (MiniLM's 90 MB hashed
    for every case would dominate a run; a write changes the mtime)."""
    out: dict[str, object] = {}
    for p in sorted(Path(d).rglob("*")):
        if p.is_file():
            st = p.stat()
            out[str(p.relative_to(d))] = (hashlib.sha256(p.read_bytes()).hexdigest()
                                          if st.st_size < 2**20 else (st.st_size, st.st_mtime_ns))
    return out


def assert_one_error(code: int, err: str, file: str, words: list[str]) -> str:
    """Assert exit status 2 and one ``error:`` line on stderr that names ``file`` and every one
    of ``words``; return the line."""
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
    assert file in lines[0], f"the error does not name {file}: {lines[0]}"
    for w in words:
        assert w in lines[0], f"the error does not name {w!r}: {lines[0]}"
    return lines[0]
