"""Contrastive sentence fine-tuning of a pretrained encoder (all-MiniLM-L6-v2) on the shipped
Shakespeare corpus: the two sides of a pair are positives, the rest of the batch negatives
(InfoNCE on cosine similarity over a temperature). Offline, CPU, seeded. Needs transformers
(``[hf]``). Two kinds of pairs: adjacent lines, and two word-dropout views of one line.

    pairs = line_pairs()                       # (line, next line), train / held-out split
    pairs = view_pairs()                       # (half the words of a line, another half)
    model, tok = load_encoder(path)
    loss = contrastive_loss(embed(model, tok, a), embed(model, tok, b), temperature=0.05)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnid.errors import AttnidError, require
from attnid.train.data import corpus


@dataclass(frozen=True)
class Pairs:
    train: list[tuple[str, str]]
    held_out: list[tuple[str, str]]


def line_pairs(min_chars: int = 25, held_out: int = 256, seed: int = 0) -> Pairs:
    """Adjacent non-empty lines of the corpus (both at least ``min_chars`` long), shuffled and split."""
    lines = [ln.strip() for ln in corpus().splitlines()]
    out = [(a, b) for a, b in itertools.pairwise(lines)
           if len(a) >= min_chars and len(b) >= min_chars]
    order = torch.randperm(len(out), generator=torch.Generator().manual_seed(seed)).tolist()
    out = [out[i] for i in order]
    return Pairs(train=out[held_out:], held_out=out[:held_out])


def view_pairs(keep: float = 0.5, min_words: int = 6, held_out: int = 256, seed: int = 0) -> Pairs:
    """Two word-dropout views of each line of at least ``min_words`` words: each view keeps
    every word with probability ``keep`` (in order; at least one), independently. Shuffled and
    split like :func:`line_pairs`. Retrieving a line's other view among many is a task the
    pretrained encoder does half well and a short fine-tune improves (SimCSE-style denoising)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for line in corpus().splitlines():
        words = line.split()
        if len(words) < min_words:
            continue
        views = []
        for _ in range(2):
            kept = torch.rand(len(words), generator=gen) < keep
            kept[int(torch.randint(len(words), (1,), generator=gen))] = True  # never empty
            views.append(" ".join(w for w, k in zip(words, kept.tolist(), strict=True) if k))
        out.append((views[0], views[1]))
    order = torch.randperm(len(out), generator=torch.Generator().manual_seed(seed)).tolist()
    out = [out[i] for i in order]
    return Pairs(train=out[held_out:], held_out=out[:held_out])


def load_encoder(path: str | Path) -> tuple[nn.Module, Any]:
    """(transformers model in float32, eager attention, train mode without dropout; tokenizer)."""
    require("transformers", "hf")
    import transformers

    log = transformers.utils.logging
    verbosity, bars = log.get_verbosity(), log.is_progress_bar_enabled()
    log.set_verbosity_error()  # quiet while loading, then the user's settings back
    log.disable_progress_bar()
    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(path))
        model = transformers.AutoModel.from_pretrained(str(path), attn_implementation="eager")
    except (OSError, ValueError) as e:
        raise AttnidError(f"cannot load an encoder from {path}: {e}") from None
    finally:
        log.set_verbosity(verbosity)
        if bars:
            log.enable_progress_bar()
    for m in model.modules():  # deterministic steps: no dropout
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model.float().train(), tok


def embed(model: nn.Module, tok: Any, texts: list[str], max_length: int = 32) -> torch.Tensor:
    """Mean-pooled, L2-normalised sentence embeddings ``[B, d]``."""
    enc = tok(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    return mean_pool(model(**enc).last_hidden_state, enc["attention_mask"])


def mean_pool(h: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``h [B, T, d]`` averaged over the unmasked tokens, L2-normalised: ``[B, d]``."""
    mask = attention_mask.unsqueeze(-1).to(h.dtype)
    pooled = (h * mask).sum(1) / mask.sum(1).clamp_min(1.0)
    return nn.functional.normalize(pooled, dim=-1)


def contrastive_loss(a: torch.Tensor, b: torch.Tensor, temperature: float = 0.05) -> torch.Tensor:
    """Symmetric InfoNCE: row i of ``a`` should pick row i of ``b`` among the batch."""
    logits = a @ b.T / temperature  # [B, B]
    target = torch.arange(a.shape[0])
    return 0.5 * (nn.functional.cross_entropy(logits, target) + nn.functional.cross_entropy(logits.T, target))


@dataclass(frozen=True)
class Retrieval:
    """Held-out retrieval: for each line, whether its nearest neighbour among all held-out next
    lines (cosine) is its own; and how spread the embeddings are."""

    hits: torch.Tensor  # [N] bool: the nearest candidate is the right one
    rank: torch.Tensor  # [N] int: 1 + how many candidates are nearer than the right one
    loss: torch.Tensor  # [N]: -log of the right candidate's softmax weight among all N (training temperature)
    mean_cosine: float  # mean cosine between the embeddings of different lines (1: collapsed)

    @property
    def accuracy(self) -> float:
        return float(self.hits.double().mean())

    @property
    def reciprocal_rank(self) -> torch.Tensor:
        """``[N]``: 1 / rank (1 for a hit); its mean is the mean reciprocal rank."""
        return 1.0 / self.rank.double()


@torch.no_grad()
def retrieval(model: nn.Module, tok: Any, pairs: list[tuple[str, str]], chunk: int = 128,
              temperature: float = 0.05) -> Retrieval:
    """:class:`Retrieval` of ``model`` on ``pairs`` (evaluation mode, restored after)."""
    was = model.training
    model.eval()
    starts = range(0, len(pairs), chunk)
    a = torch.cat([embed(model, tok, [p[0] for p in pairs[i:i + chunk]]) for i in starts])  # [N, d]
    b = torch.cat([embed(model, tok, [p[1] for p in pairs[i:i + chunk]]) for i in starts])  # [N, d]
    model.train(was)
    n = len(pairs)
    gram = a @ a.T  # [N, N]: unit vectors, so cosines
    spread = float((gram.sum() - gram.diagonal().sum()) / max(1, n * n - n))
    sim = a @ b.T  # [N, N]: row i's right candidate is column i
    rank = 1 + (sim > sim.diagonal().unsqueeze(1)).sum(1)  # [N]
    loss = -torch.log_softmax(sim / temperature, dim=1).diagonal()  # [N]
    return Retrieval(rank == 1, rank, loss, spread)


def retrieval_accuracy(model: nn.Module, tok: Any, pairs: list[tuple[str, str]], chunk: int = 128) -> float:
    """Share of held-out lines whose nearest neighbour among all held-out next lines is their own."""
    return retrieval(model, tok, pairs, chunk).accuracy


def batches(pairs: list[tuple[str, str]], batch_size: int, steps: int, seed: int = 0
            ) -> list[tuple[list[str], list[str]]]:
    """``steps`` seeded batches of ``batch_size`` pairs (sampling without replacement per pass)."""
    gen = torch.Generator().manual_seed(seed)
    out, pool = [], []
    for _ in range(steps):
        if len(pool) < batch_size:
            pool = torch.randperm(len(pairs), generator=gen).tolist()
        take, pool = pool[:batch_size], pool[batch_size:]
        out.append(([pairs[i][0] for i in take], [pairs[i][1] for i in take]))
    return out
