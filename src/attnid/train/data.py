"""Character-level Shakespeare, shipped in the package (no network): split and seeded batches."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

import torch

SHA256 = "2b8947ca81c13af7ae0dd47006a4bb8556844dbe426228c316830fe768bb9638"


@lru_cache(maxsize=1)
def corpus() -> str:
    return resources.files("attnid.data").joinpath("shakespeare.txt").read_text(encoding="ascii")


@dataclass(frozen=True)
class CharData:
    """Encoded corpus: 90% train, 10% validation, vocabulary of every character seen."""

    train: torch.Tensor  # [N_train] int64
    val: torch.Tensor  # [N_val] int64
    chars: str

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.chars[i] for i in ids.tolist())

    def batch(self, split: str, batch_size: int, seq_len: int, gen: torch.Generator
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)`` of shape ``[B, T]``; ``y`` is ``x`` shifted by one. Deterministic in ``gen``."""
        data = self.train if split == "train" else self.val
        start = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=gen)
        idx = start[:, None] + torch.arange(seq_len + 1)[None, :]  # [B, T+1]
        chunk = data[idx]
        return chunk[:, :-1], chunk[:, 1:]


@lru_cache(maxsize=1)
def shakespeare() -> CharData:
    text = corpus()
    chars = "".join(sorted(set(text)))
    lookup = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([lookup[c] for c in text], dtype=torch.long)
    n = int(0.9 * ids.numel())
    return CharData(train=ids[:n], val=ids[n:], chars=chars)
