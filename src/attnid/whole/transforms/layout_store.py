"""Layouts kept on disk, so that a config's layout is built with transformers once.

A layout is a pure function of a config, the family code that reads it, and the transformers
class built from it on the meta device. Importing transformers and building that class takes
about 4.5 s on 2 cores. That is most of what `attnid diff` spends on a pair of 2-layer
7B-shaped checkpoints that are not otherwise read, and it is spent again by every command run on
the same model. So each built layout is stored as JSON under a key that hashes everything it is
a function of: the config, the versions of transformers and torch, and the source of the files
that build it (`attnid.adapters` and `attnid.whole.transforms.layout`). Edit one of those files,
or upgrade transformers, and the old entries are simply never asked for again.

Where: ``$ATTNID_CACHE`` when set (``0`` or empty: keep nothing), else
``$XDG_CACHE_HOME/attnid``, else ``~/.cache/attnid``; the entries live in its ``layouts/``
folder. An entry that cannot be read or decoded is rebuilt, and a cache folder that cannot be
written is passed over without a word: the store only saves time, it decides nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import asdict, fields
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

from attnid.adapters.layout import Layout, Lin, Norm

Entry = tuple[Layout, tuple[str, ...]]  # a layout and the state_dict names of its class


def directory() -> Path | None:
    """The cache folder, or None when ``ATTNID_CACHE`` turns the store off."""
    env = os.environ.get("ATTNID_CACHE")
    if env is not None:
        return None if env in ("", "0") else Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "attnid"


@cache
def _code() -> str:
    """A hash of the versions and the source files a layout is a function of."""
    import attnid.adapters

    h = hashlib.sha256()
    for pkg in ("transformers", "torch"):
        try:
            h.update(f"{pkg}={metadata.version(pkg)};".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{pkg}=none;".encode())
    root = Path(attnid.adapters.__file__).parent
    for p in [*sorted(root.rglob("*.py")), Path(__file__).with_name("layout.py")]:
        h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()


def _path(config_json: str) -> Path | None:
    d = directory()
    if d is None:
        return None
    key = hashlib.sha256((_code() + config_json).encode()).hexdigest()[:32]
    return d / "layouts" / f"{key}.json"


def load(config_json: str) -> Entry | None:
    """The stored entry of a config (``json.dumps(config, sort_keys=True)``), or None."""
    try:
        p = _path(config_json)
        if p is None or not p.is_file():
            return None
        data = json.loads(p.read_text())
        return decode(data["layout"]), tuple(data["names"])
    except (OSError, RuntimeError, ValueError, KeyError, TypeError):  # RuntimeError: no home folder
        return None


def save(config_json: str, entry: Entry) -> None:
    """Store an entry (written to a temporary name, then renamed: never half-written)."""
    try:
        p = _path(config_json)
        if p is None:
            return
        p.parent.mkdir(parents=True, exist_ok=True)
    except (OSError, RuntimeError):  # RuntimeError: no home folder
        return
    tmp = p.with_suffix(f".{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({"layout": asdict(entry[0]), "names": list(entry[1])}))
        os.replace(tmp, p)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


# ---- JSON <-> Layout ----------------------------------------------------------------------------
def _lin(d: dict[str, Any] | None) -> Lin | None:
    if d is None:
        return None
    _known(Lin, d)
    return Lin(d["path"], d["conv1d"], None if d["rows"] is None else (d["rows"][0], d["rows"][1]))


def _norm(d: dict[str, Any] | None) -> Norm | None:
    if d is None:
        return None
    _known(Norm, d)
    return Norm(d["path"], tuple(_lins(d["readers"])), _lin(d["absorb"]), d["gain"], d["offset"])


def _lins(xs: list[Any]) -> tuple[Any, ...]:
    return tuple(_lin(x) for x in xs)


def _known(cls: type, d: dict[str, Any]) -> None:
    """Refuse (TypeError: the entry is rebuilt) a dict whose keys are not the class's fields."""
    if set(d) != {f.name for f in fields(cls)}:
        raise TypeError(f"{cls.__name__}: fields {sorted(d)}")


def decode(d: dict[str, Any]) -> Layout:
    """The `Layout` that ``dataclasses.asdict`` made ``d`` from."""
    _known(Layout, d)
    return Layout(
        norm=d["norm"], norms=tuple(_norm(n) for n in d["norms"]),
        writers=tuple(_lins(w) for w in d["writers"]), parallel=d["parallel"], tables=tuple(d["tables"]),
        mlps=tuple(_lins(m) for m in d["mlps"]), mlp=d["mlp"], unembed=_lin(d["unembed"]), tied=d["tied"],
        post=d["post"], padding_idx=d["padding_idx"], attn_norms=tuple(d["attn_norms"]),
        final=_norm(d["final"]), gates=_lins(d["gates"]), layers=tuple(d["layers"]))
