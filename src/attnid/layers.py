"""Where attention layers are found in a model: a registry of *layer finders*.

A finder takes a model and returns one :class:`LayerAccessor` per attention layer it
recognises (read and write the layer in canonical form, read its gradients). attnid's own
`Attention` is found by the finder below; `attnid.adapters` registers one for Hugging Face
models when it is imported (`attnid.adapters.hooks`), which asks the model's family for its
layers (``Adapter.layers``, in the family's own file). Consumers (`attnid.monitor`) only call
:func:`find_layers`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from attnid.attention import Attention
from attnid.errors import AttnidError
from attnid.sharding import HIDDEN, Placement, clean_name, hidden_by_fsdp, placements, resolve
from attnid.spec import AttentionSpec
from attnid.weights import AttentionWeights


@dataclass(frozen=True, eq=False)
class LayerAccessor:
    """How to read and write one attention layer in canonical form.

    The layer's tensors are named by ``paths`` (``read``/``write``'s names -> where each lives
    in ``root``) and found again at every access (`attnid.sharding.resolve`): a parameter that
    sharding, ``to_empty`` or ``load_state_dict(assign=True)`` replaced since is the one read,
    never the stale tensor. Sharded parameters are gathered one layer at a time; reading a
    sharded layer is a collective, which every process must join in the same order.
    """

    name: str
    spec: AttentionSpec
    root: nn.Module
    paths: dict[str, str]  # tensor name (as read/write name it) -> its path in root
    shapes: dict[str, tuple[int, ...]]  # tensor name -> its whole shape
    read: Callable[[dict[str, torch.Tensor]], AttentionWeights]
    write: Callable[[AttentionWeights], dict[str, torch.Tensor]]

    def shards(self) -> LayerShards:
        """The layer's tensors as they lie now: this process's pieces (views) and how to
        gather them (collective only for FSDP1, which exchanges the pieces' lengths)."""
        found = {n: resolve(self.root, path) for n, path in self.paths.items()}
        where = placements(found, self.shapes, self.paths)
        return LayerShards(self, where, {n: pl.piece() for n, pl in where.items()})

    def get(self) -> AttentionWeights:
        """The layer now (views when it is all on this process; gathered when sharded)."""
        return self.shards().weights()

    def set(self, w: AttentionWeights) -> None:
        """Write ``w`` into the layer (each process its own slice), in each tensor's dtype."""
        where = self.shards().placements
        for n, t in self.write(w).items():
            where[n].write_(t)

    def grads(self) -> dict[str, torch.Tensor]:
        """The layer's gradients in canonical form (gathered when sharded); empty when a
        tensor has none."""
        where = self.shards().placements
        got = {n: pl.grad() for n, pl in where.items()}  # every process asks for every one
        if any(g is None for g in got.values()):
            return {}
        return dict(self.read(got).items())


@dataclass(frozen=True, eq=False)
class LayerShards:
    """One layer's pieces on this process (views of the model, or a copy) and their placements."""

    layer: LayerAccessor
    placements: dict[str, Placement]
    pieces: dict[str, torch.Tensor]

    @property
    def sharded(self) -> bool:
        return any(pl.sharded for pl in self.placements.values())

    def copy(self, into: LayerShards | None = None) -> LayerShards:
        """The pieces copied (into ``into``'s memory when it has the same shapes and dtypes)."""
        like = lambda t: (t.shape, t.dtype, t.device)  # noqa: E731
        if into is not None and all(n in into.pieces and like(t) == like(into.pieces[n])
                                    for n, t in self.pieces.items()):
            for n, t in self.pieces.items():
                into.pieces[n].copy_(t)
            return LayerShards(self.layer, self.placements, into.pieces)
        return LayerShards(self.layer, self.placements, {n: t.clone() for n, t in self.pieces.items()})

    def weights(self) -> AttentionWeights:
        """The whole layer from the pieces (a collective when sharded)."""
        return self.layer.read({n: self.placements[n].full(t) for n, t in self.pieces.items()})


LayerFinder = Callable[[nn.Module], list[LayerAccessor]]
_FINDERS: list[LayerFinder] = []


def register_layer_finder(finder: LayerFinder) -> LayerFinder:
    """Teach `find_layers` another kind of attention layer (adapters do this)."""
    _FINDERS.append(finder)
    return finder


@register_layer_finder
def attnid_layers(model: nn.Module) -> list[LayerAccessor]:
    """Every `attnid.Attention` inside ``model``."""
    out = []
    for name, mod in model.named_modules():
        if isinstance(mod, Attention):
            name, spec = clean_name(name), mod.spec
            out.append(LayerAccessor(
                name=name, spec=spec, root=model,
                paths={n: f"{name}.{n}" if name else n for n in spec.param_shapes()},
                shapes=dict(spec.param_shapes()),
                read=lambda t, spec=spec: AttentionWeights.from_tensors(spec, t),
                write=lambda w: dict(w.items()),
            ))
    return out


def find_layers(model: nn.Module) -> list[LayerAccessor]:
    """Accessors for every attention layer any registered finder recognises (inside DDP,
    DataParallel and DeepSpeed's engine: in the model they wrap)."""
    model = unwrap(model)
    layers = [acc for finder in _FINDERS for acc in finder(model)]
    if not layers and hidden_by_fsdp(model):
        raise AttnidError(HIDDEN)
    if not layers:
        raise AttnidError("no attention layer found in the model (no registered adapter matched)")
    return layers


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside data-parallel wrappers that do not forward attribute access (DDP,
    DataParallel, DeepSpeed's engine); FSDP and ``torch.compile`` forward it and stay."""
    while isinstance(getattr(model, "module", None), nn.Module) and (
            isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel))
            or type(model).__name__ == "DeepSpeedEngine"):
        model = model.module
    return model
