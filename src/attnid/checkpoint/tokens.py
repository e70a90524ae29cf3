"""Text for the loss and for calibration: a text file tokenized with a checkpoint's own
tokenizer (read offline, transformers' AutoTokenizer) and cut into chunks of the model's
context. Refused before any work: a missing, unreadable or too short file, no tokenizer next
to the checkpoint, token ids beyond the model's vocabulary."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from attnid.checkpoint.load import Checkpoint
from attnid.errors import AttnidError


@dataclass(frozen=True)
class Batches:
    """Token chunks ``[n, T]`` of the data, evaluated ``batch`` chunks at a time."""

    ids: torch.Tensor
    batch: int = 16

    @property
    def tokens(self) -> int:
        return int(self.ids.numel())


def context_of(config: dict[str, Any]) -> int:
    for key in ("n_positions", "max_position_embeddings", "n_ctx", "seq_length"):
        if isinstance(config.get(key), int) and config[key] > 1:
            return int(config[key])
    return 512


def read_chunks(ck: Checkpoint, data: str | Path, *, context: int | None = None,
                max_tokens: int = 65536, option: str = "--data") -> Batches:
    """The text of ``data`` tokenized by ``ck``'s tokenizer, in chunks of ``context`` tokens
    (at most the model's, 256 by default), at most ``max_tokens`` in all. Refused before any
    work: a missing, unreadable or too short file; no tokenizer next to the checkpoint."""
    path = Path(data)
    if not path.is_file():
        raise AttnidError(f"{option} {data}: no such file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise AttnidError(f"{option} {data}: cannot be read as UTF-8 text ({e})") from None
    tok = load_tokenizer(ck)
    limit = context_of(ck.config)
    T = min(limit, 256) if context is None else context
    if not 2 <= T <= limit:
        raise AttnidError(f"--context {T}: between 2 and the model's {limit} tokens")
    ids = tok(text[: 64 * max_tokens], return_attention_mask=False, verbose=False)["input_ids"]
    n = min(len(ids), max_tokens) // T
    if n < 1:
        raise AttnidError(f"{option} {data}: {len(ids)} tokens, fewer than one chunk of {T}")
    vocab = int(ck.config.get("vocab_size") or 0)
    chunks = torch.tensor(ids[: n * T], dtype=torch.long).reshape(n, T)
    if vocab and int(chunks.max()) >= vocab:
        raise AttnidError(f"the tokenizer of {ck.root} gives ids up to {int(chunks.max())}, beyond the "
                          f"model's vocabulary of {vocab}")
    return Batches(chunks)


def load_tokenizer(ck: Checkpoint) -> Any:
    import transformers  # optional heavy dependency: loaded only here

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        return transformers.AutoTokenizer.from_pretrained(str(ck.root), local_files_only=True)
    except Exception as e:  # whatever transformers raises: there is no usable tokenizer
        raise AttnidError(f"{ck.root}: no tokenizer transformers can load offline "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
