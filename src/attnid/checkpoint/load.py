"""Open a checkpoint for reading: a model directory, a ``config.json``, or a ``.safetensors``
file next to its ``config.json``. Attention layers come out as float64 `AttentionWeights`
through the family's adapter; other tensors are read on demand. Nothing is written.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from attnid.adapters.base import Adapter
from attnid.adapters.config import load_config
from attnid.adapters.registry import adapter_for
from attnid.errors import AttnidError
from attnid.io import all_names, read_header, read_tensor, weight_files, weight_prefix
from attnid.spec import AttentionSpec
from attnid.weights import AttentionWeights


@dataclass(frozen=True)
class Checkpoint:
    """An opened checkpoint (tensors are read lazily; the files are only ever read)."""

    path: Path
    config: dict[str, Any]
    adapter: Adapter
    specs: list[AttentionSpec]
    index: dict[str, tuple[Path, dict[str, Any], int]]  # tensor name -> (file, header, data start)
    prefix: str  # outer prefix before the adapter's layer names (e.g. "model.")

    @property
    def n_layers(self) -> int:
        return len(self.specs)

    def attention_names(self, i: int) -> list[str]:
        return [self.prefix + n for n in self.adapter.names(i, self.specs[i])]

    def tensor(self, name: str) -> torch.Tensor:
        p, header, start = self.index[name]
        t = read_tensor(p, header, start, name)
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise AttnidError(f"{self.path}: {name} holds NaN or Inf values")
        return t

    def layer(self, i: int) -> AttentionWeights:
        """Layer ``i``'s attention in canonical form, float64."""
        raw = {n[len(self.prefix):]: self.tensor(n).double() for n in self.attention_names(i)}
        return self.adapter.read(raw, i, self.specs[i])

    def layers(self) -> Iterator[AttentionWeights]:
        for i in range(self.n_layers):
            yield self.layer(i)

    def dtype(self) -> torch.dtype:
        """The dtype of the attention weights (the rounding level of the checkpoint)."""
        return self.tensor(self.attention_names(0)[0]).dtype

    def other_names(self) -> list[str]:
        mine = {n for i in range(self.n_layers) for n in self.attention_names(i)}
        return [n for n in self.index if n not in mine]


def open_checkpoint(model: str | Path) -> Checkpoint:
    """Open ``model`` (directory, config.json, or .safetensors with config.json beside it)."""
    path = Path(model)
    if not path.exists():
        raise AttnidError(f"{model} does not exist")
    if path.is_dir():
        root, files = path, None
    elif path.suffix == ".json":
        root, files = path.parent, None
    elif path.suffix == ".safetensors":
        root, files = path.parent, [path]
    else:
        raise AttnidError(f"{model} is not a model directory, a config.json or a .safetensors file")
    _, config = load_config(str(root if path.suffix != ".json" else path))
    adapter = adapter_for(config)
    if not adapter.closed_form:
        raise AttnidError(f"cannot read {adapter.family} checkpoints: attnid lacks {adapter.missing}")
    specs = adapter.specs(config)
    if files is None:
        files = weight_files(root)
    for f in files:
        read_header(f)  # a clear error for a truncated or corrupt file
    index = all_names(files)
    prefix = weight_prefix(index, adapter.names(0, specs[0])[0])
    ck = Checkpoint(path=path, config=config, adapter=adapter, specs=specs, index=index, prefix=prefix)
    for i in range(ck.n_layers):
        for n in ck.attention_names(i):
            if n not in index:
                raise AttnidError(f"{model} lacks {n} (layer {i} of {adapter.family})")
    return ck

