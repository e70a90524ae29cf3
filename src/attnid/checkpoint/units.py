"""A checkpoint's tensors as `ModelTensors`, one *unit* at a time: the embedding tables, each
layer (with the norms its readers read), then the rest (final norm, head). Every whole-model
transform acts within a unit (a norm with its readers, a layer's attention or MLP, a table),
or, for the residual rotation, on each unit alone; so a checkpoint of any size is rewritten or
compared holding one unit (a layer) at a time.

Names: the transformers class's ``state_dict`` names (its class built on the meta device),
each mapped to the checkpoint's own name (`attnid.checkpoint.load.Checkpoint.resolve`: an
outer prefix dropped, GPT-NeoX's ``embed_out``). A tied head stored once is simply absent,
unless the checkpoint is opened *untied* (`open_units` ``untie=True``): then it is read as the
architecture with ``tie_word_embeddings: false``, whose head reads the token table's bytes
(docs/theory.md §13.21: the function is the same; the final gain becomes a foldable norm).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from attnid.adapters.config import FileConfig, source_of
from attnid.checkpoint.load import Checkpoint
from attnid.errors import AttnidError, require
from attnid.whole.fit.source import assign_units, unit_extras
from attnid.whole.transforms.layout import Layout
from attnid.whole.transforms.state import ModelTensors


@dataclass(frozen=True)
class Units:
    """A checkpoint as a `attnid.whole.fit.source.UnitSource`."""

    ck: Checkpoint
    layout: Layout
    to_ck: dict[str, str]  # state_dict name -> checkpoint name (only those the checkpoint holds)
    unit_of: dict[str, int]  # state_dict name -> 0 tables, 1..L layer, L + 1 the rest
    config: dict  # the checkpoint's config (untied: with tie_word_embeddings false)
    untied: str | None = None  # the head's state_dict name when a tied head is read untied

    @property
    def count(self) -> int:
        return len(self.layout.layers) + 2

    def names(self, unit: int) -> list[str]:
        """The ``state_dict`` names of a unit that the checkpoint holds."""
        return [n for n, u in self.unit_of.items() if u == unit]

    def load(self, unit: int, dtype: torch.dtype | None = None, *, check: bool = True,
             only: Collection[str] | None = None) -> ModelTensors:
        """A unit's tensors (with what it needs from another unit), floating ones in ``dtype``
        (None: as stored); the checkpoint's NaN check applies unless ``check=False``. ``only``:
        just these of them."""
        out = {}
        for n in self._read(unit, only):
            t = self.ck.tensor(self.to_ck[n], check=check)
            out[n] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
        return ModelTensors(self.layout, out, self.ck.config)

    def tensor(self, name: str, *, check: bool = True) -> torch.Tensor:
        """One tensor by its ``state_dict`` name, as stored (the NaN check unless ``check=False``)."""
        return self.ck.tensor(self.to_ck[name], check=check)

    def read_ahead(self, unit: int) -> None:
        """Have a unit's bytes read into the page cache in the background (`attnid.readahead`)."""
        self.ck.read_ahead(self.to_ck[n] for n in self._read(unit))

    def _read(self, unit: int, only: Collection[str] | None = None) -> list[str]:
        """What loading a unit reads: its own names and the extras it needs from another unit
        (those in ``only``, when given)."""
        names = [*self.names(unit), *(x for x in unit_extras(self.layout, unit) if x in self.to_ck)]
        return [n for n in dict.fromkeys(names) if only is None or n in only]

    def dtype(self) -> torch.dtype:
        return self.ck.dtype()

    def label(self, name: str) -> str:
        return name if name == self.untied else self.to_ck.get(name, name)

    def shape(self, name: str) -> tuple[int, ...] | None:
        return None if name not in self.to_ck else self.ck.info(self.to_ck[name]).shape

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows of one tensor (only those are read from disk)."""
        return self.ck.rows(self.to_ck[name], start, stop)


def open_units(ck: Checkpoint, *, untie: bool = False) -> Units:
    """The unit structure of an opened checkpoint (needs transformers for the layout);
    ``untie``: a tied head is read as a head of its own holding the token table (see the
    module)."""
    from attnid.whole.transforms.layout import state_names

    lay, config = layout_of_config(ck), ck.config
    head = None
    if untie and lay.tied and lay.unembed is not None:
        config = FileConfig({**ck.config, "tie_word_embeddings": False}, source_of(ck.config))
        lay, head = layout_of_config(ck, config), f"{lay.unembed.path}.weight"
    states = state_names(config)
    to_ck = {s: c for s in states if (c := ck.resolve(s)) is not None}
    if head is not None and f"{lay.tables[0]}.weight" in to_ck:
        to_ck.setdefault(head, to_ck[f"{lay.tables[0]}.weight"])
    missing = [n for n in required_weights(lay) if n in states and n not in to_ck]
    if missing:  # every later step reads these: refused here, in one line, before any work
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        where = ck.files[0].path if len(ck.files) == 1 else ck.root / "model.safetensors.index.json"
        raise AttnidError(f"{where}: no tensor {missing[0]}{more}, which {ck.adapter.family} as "
                          f"{source_of(ck.config)} describes it needs")
    return Units(ck, lay, to_ck, assign_units(lay, to_ck), config, head)


def layout_of_config(ck: Checkpoint, config: dict | None = None) -> Layout:
    """The layout of the checkpoint's architecture (``config``: its config, by default)."""
    require("transformers", "hf")
    from attnid.whole.transforms.layout import layout_for

    try:
        return layout_for(ck.config if config is None else config)
    except AttnidError:
        raise
    except Exception as e:  # transformers cannot build the class from this config
        raise AttnidError(f"{ck.root}: transformers cannot build {ck.adapter.family} from its "
                          f"config.json: {e}") from None


def required_weights(lay: Layout) -> list[str]:
    """The weights every whole-model step reads: the tables, every norm's gain, every reader,
    writer, gate and MLP projection, and an untied head."""
    lins = [*(r for nm in lay.norms for r in nm.readers), *(w for ws in lay.writers for w in ws),
            *(m for ms in lay.mlps for m in ms), *(g for g in lay.gates if g is not None)]
    if lay.unembed is not None and not lay.tied:
        lins.append(lay.unembed)
    names = [f"{t}.weight" for t in lay.tables] + [f"{nm.path}.weight" for nm in lay.norms]
    names += [f"{lin.path}.weight" for lin in lins if not (lay.tied and lin == lay.unembed)]
    return list(dict.fromkeys(names))
