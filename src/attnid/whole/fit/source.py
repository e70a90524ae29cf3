"""Where the fit reads tensors from: a `UnitSource` hands out one unit at a time (0: the
embedding tables, ``1..L``: the layers with the norms their readers read, ``L + 1``: the rest),
as `ModelTensors`. A checkpoint streams its units from disk (`attnid.checkpoint.units`); a
module or a `ModelTensors` already in memory is a `TensorSource`."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any, Protocol

import torch
from torch import nn

from attnid.errors import AttnidError
from attnid.whole.transforms.layout import Layout
from attnid.whole.transforms.state import ModelTensors


class UnitSource(Protocol):
    layout: Layout
    config: dict[str, Any]

    @property
    def count(self) -> int: ...

    def load(self, unit: int, *, check: bool = True) -> ModelTensors: ...

    def read_ahead(self, unit: int) -> None: ...

    def names(self, unit: int) -> list[str]: ...

    def dtype(self) -> torch.dtype: ...

    def label(self, name: str) -> str: ...

    def shape(self, name: str) -> tuple[int, ...] | None: ...

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor: ...


def read_ahead(sources: Iterable[UnitSource], *units: int) -> None:
    """Each source's ``units`` read ahead (`attnid.readahead`), those past its last unit left
    out; a source without ``read_ahead`` (one written before it was part of `UnitSource`) is
    read when asked, as before."""
    for src in sources:
        ahead = getattr(src, "read_ahead", None)
        if ahead is not None:
            for u in units:
                if 0 <= u < src.count:
                    ahead(u)


def assign_units(lay: Layout, names: Iterable[str]) -> dict[str, int]:
    """``state_dict`` name -> unit: 0 the tables, ``i + 1`` layer ``i``, ``L + 1`` the rest; a
    norm goes with its first reader (BERT's embedding LayerNorm with layer 0)."""
    tables = {f"{t}.weight" for t in lay.tables}
    L = len(lay.layers)

    def unit(name: str) -> int:
        if name in tables:
            return 0
        return next((i + 1 for i, p in enumerate(lay.layers) if name.startswith(p)), L + 1)

    out = {n: unit(n) for n in names}
    for nm in (*lay.norms, *(() if lay.final is None else (lay.final,))):
        if nm.readers and f"{nm.readers[0].path}.weight" in out:
            u = out[f"{nm.readers[0].path}.weight"]
            for suffix in (".weight", ".bias"):
                if nm.path + suffix in out:
                    out[nm.path + suffix] = u
    return out


def unit_extras(lay: Layout, unit: int) -> list[str]:
    """Names a unit needs from another one: a tied head's table (its logit bias ``c + E b``),
    a tied RoBERTa's head gain (the pad rows' direction)."""
    if unit == len(lay.layers) + 1 and lay.tied:
        return [f"{lay.tables[0]}.weight"]
    if unit == 0 and lay.tied and lay.padding_idx is not None and lay.final is not None:
        return [f"{lay.final.path}.weight"]
    return []


def _finite(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t``, refused when a floating tensor holds NaN or Inf (a model in memory: no file to name)."""
    if t.is_floating_point() and not torch.isfinite(t).all():
        raise AttnidError(f"tensor {name} holds NaN or Inf values")
    return t


class TensorSource:
    """A model in memory (a Hugging Face module or a `ModelTensors`) as a `UnitSource`."""

    def __init__(self, model: nn.Module | ModelTensors) -> None:
        self.m = model if isinstance(model, ModelTensors) else ModelTensors.of(model)
        self.layout, self.config = self.m.layout, self.m.config
        self.unit_of = assign_units(self.layout, self.m.tensors)

    @property
    def count(self) -> int:
        return len(self.layout.layers) + 2

    def load(self, unit: int, *, check: bool = True) -> ModelTensors:
        if check:
            for n, t in self.m.tensors.items():
                _finite(n, t)
        return self.m

    def read_ahead(self, unit: int) -> None:
        """In memory already: nothing to read."""

    def names(self, unit: int) -> list[str]:
        return [n for n, u in self.unit_of.items() if u == unit]

    def dtype(self) -> torch.dtype:
        return next(t.dtype for t in self.m.tensors.values() if t.is_floating_point())

    def label(self, name: str) -> str:
        return name

    def shape(self, name: str) -> tuple[int, ...] | None:
        t = self.m.tensors.get(name)
        return None if t is None else tuple(t.shape)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.m.tensors[name][start:stop]

    def tensor(self, name: str, *, check: bool = True) -> torch.Tensor:
        """One tensor by its ``state_dict`` name (as `attnid.checkpoint.units.Units.tensor`)."""
        t = self.m.tensors[name]
        return _finite(name, t) if check else t


class SplitSource(TensorSource):
    """A model in memory handed out one unit at a time, like a checkpoint's units: a unit's own
    tensors and the extras it needs (`unit_extras`), floating ones in ``dtype`` when given."""

    def __init__(self, model: nn.Module | ModelTensors) -> None:
        super().__init__(model)
        lay = self.layout
        if lay.tied and lay.unembed is not None:  # the tied head is its table: not a unit's own
            self.unit_of.pop(f"{lay.unembed.path}.weight", None)

    def load(self, unit: int, dtype: torch.dtype | None = None, *, check: bool = True,
             only: Collection[str] | None = None) -> ModelTensors:
        names = [*self.names(unit), *(x for x in unit_extras(self.layout, unit) if x in self.m.tensors)]
        names = [n for n in dict.fromkeys(names) if only is None or n in only]
        out = {n: self.m.tensors[n] for n in names}
        if check:
            for n, t in out.items():
                _finite(n, t)
        if dtype is not None:
            out = {n: t.to(dtype) if t.is_floating_point() else t for n, t in out.items()}
        return ModelTensors(self.layout, out, self.config)
