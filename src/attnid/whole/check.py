"""The whole-model arbiter: the Jacobian rank of a Hugging Face model's function w.r.t. every
parameter, on a tiny config, computed in float64 throughout.

The function is the one the architecture names (``architectures`` in config.json):
``...ForCausalLM`` / ``...LMHeadModel`` / ``...ForMaskedLM``: log-probabilities over the
vocabulary at every position, i.e. logits centred over the vocabulary (the kernel of
log-softmax's Jacobian is the constant shift, which the centring quotients out); a bare
``...Model``: the last hidden states. Inputs: every token at every position of sequences as
long as the learned position table (or ``seq_len`` without one), every token type, and at
least ``3P / (T d)`` sequences: each position reaches the parameters below the head through
its ``d``-dimensional hidden state (docs/theory.md §13.16).

Traps handled here: Hugging Face computes RMSNorm, softmax and some attention scores in
float32 even inside a float64 model; :class:`Float64Mode` keeps every such cast in float64 (the
same function, without the 1e-7 rounding that hides exact symmetries). An embedding's
``padding_idx`` zeroes its row's gradient, so it is cleared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from attnid.adapters.base import build_hf_model
from attnid.adapters.config import load_config
from attnid.adapters.registry import adapter_for
from attnid.arbiter.compare import CLEAR_GAP
from attnid.arbiter.precision import Float64Mode
from attnid.arbiter.rank import ArbiterResult, jacobian_rank, norms_without_eps, randomize_
from attnid.errors import AttnidError
from attnid.structure import function_kind
from attnid.theory import Component
from attnid.theory.whole import WholeCount, count_structure


def tiny_model(config: dict[str, Any], seed: int = 0) -> nn.Module:
    """The architecture's own class at ``config``: float64, eval, eager attention, random
    generic weights, no padding rows."""
    model = build_hf_model(config, head=True)
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            m.padding_idx = None
    randomize_(model, seed)
    with torch.no_grad():  # small linear biases: every ReLU unit is active on some inputs only
        for m in model.modules():
            bias = getattr(m, "bias", None)
            if isinstance(bias, nn.Parameter) and "Norm" not in type(m).__name__:
                bias.mul_(0.1)
    return model


def position_table(model: nn.Module) -> int | None:
    """Rows of the learned position table (None with rotary positions)."""
    for name, m in model.named_modules():
        if isinstance(m, nn.Embedding) and ("position" in name or name.endswith("wpe")):
            return m.num_embeddings
    return None


def token_types(model: nn.Module) -> int:
    for name, m in model.named_modules():
        if isinstance(m, nn.Embedding) and "token_type" in name:
            return m.num_embeddings
    return 0


def inputs_for(model: nn.Module, vocab: int, seq_len: int, n_sequences: int, seed: int
               ) -> torch.Tensor:
    """``[n, T, 2]`` float64 (token id, token type): the first ``vocab`` sequences put every
    token at every position (token ``(j + t) mod V``), the rest are random."""
    gen = torch.Generator().manual_seed(30_000 + seed)
    n = max(n_sequences, vocab)
    ids = torch.randint(0, vocab, (n, seq_len), generator=gen)
    cover = (torch.arange(vocab)[:, None] + torch.arange(seq_len)[None]) % vocab
    ids[:vocab] = cover
    types = torch.zeros_like(ids)
    n_types = token_types(model)
    if n_types > 1:
        types = torch.randint(0, n_types, (n, seq_len), generator=gen)
        types[: vocab // 2 + 1] = torch.arange(seq_len)[None] % n_types
    return torch.stack([ids, types], dim=-1).to(torch.float64)


def tied_aliases(model: nn.Module) -> list[tuple[str, str]]:
    """``(alias, canonical)`` parameter names that share one tensor (tied embeddings)."""
    first: dict[int, str] = {}
    out = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out.append((name, first[id(p)]))
        else:
            first[id(p)] = name
    return out


def whole_forward(kind: str, n_types: int, aliases: list[tuple[str, str]]):
    """``forward(model, x)`` for the arbiter. Tied parameters: the arbiter swaps in only the
    canonical name, so each alias is pointed at it for the call (and restored after)."""

    def forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        ids = x[..., 0].long()
        kw: dict[str, Any] = {"token_type_ids": x[..., 1].long()} if n_types else {}
        saved = []
        for alias, canon in aliases:
            owner, _, attr = alias.rpartition(".")
            mod = model.get_submodule(owner)
            saved.append((mod, attr, mod._parameters[attr]))
            mod._parameters[attr] = _lookup(model, canon)
        try:
            with Float64Mode():
                out = model(input_ids=ids, **kw)
        finally:
            for mod, attr, old in saved:
                mod._parameters[attr] = old
        if kind == "logprobs":
            logits = out.logits
            return logits - logits.mean(-1, keepdim=True)
        return out.last_hidden_state

    return forward


def _lookup(model: nn.Module, name: str) -> torch.Tensor:
    owner, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(owner), attr)


@dataclass(frozen=True)
class WholeArbiter:
    """The arbiter's count of a whole tiny model; ``near`` from a second run at eps = 0."""

    result: ArbiterResult
    near_unidentified: int
    kind: str
    seq_len: int

    @property
    def unidentified(self) -> int:
        return self.result.nullity


def arbiter_whole(config: dict[str, Any], *, seed: int = 0, seq_len: int = 6,
                  n_sequences: int | None = None, near: bool = True,
                  return_null_space: bool = False) -> WholeArbiter:
    """Nullity of the whole model's function at a random point of ``config`` (keep it tiny)."""
    model = tiny_model(config, seed)
    kind = function_kind(config)
    n_types = token_types(model)
    table = position_table(model)
    pad = adapter_for(config).whole(config).padding_idx
    # RoBERTa reads position rows pad + 1 .. pad + T (pad tokens: row pad)
    T = table - pad - 1 if table and pad is not None else table or seq_len
    vocab = int(config["vocab_size"])
    P = sum(p.numel() for p in model.parameters())
    # each position's outputs reach the parameters below the head through its d-dimensional
    # hidden state: count d rows per position (vocab-wide logits overstate it: too few
    # sequences left 24 false null directions on pythia's reduced config)
    width = int(model.config.hidden_size)
    n = n_sequences or max(vocab, -(-3 * P // (T * width)), 8)
    x = inputs_for(model, vocab, T, n, seed)
    fwd = whole_forward(kind, n_types, tied_aliases(model))
    found = jacobian_rank(model, x, forward=fwd, seed=seed, return_null_space=return_null_space,
                          without_eps=norms_without_eps if near else None)
    return WholeArbiter(found, found.near_nullity, kind, T)





REDUCED_KEYS = ("hidden_size", "n_embd", "num_attention_heads", "n_head", "num_key_value_heads",
                "num_kv_heads", "head_dim", "intermediate_size", "n_inner", "ffn_hidden_size",
                "vocab_size", "num_hidden_layers", "n_layer", "max_position_embeddings",
                "n_positions", "type_vocab_size", "tie_word_embeddings")


def reduced_whole_config(adapter: Any, config: dict[str, Any]) -> dict[str, Any]:
    """The attention's reduced config (same grouping, rotary fraction, biases, norms) with a
    tiny whole model around it: one layer, 6 MLP units, a 6-row position table, eps 1e-2 (so
    near-unidentified directions stand clear), the config's own tying, and the smallest
    vocabulary from ``max(16, 2 d + 8)`` up at which no discrete-input condition binds
    (docs/theory.md §13.17: the closed form is exact there, as for the full-size model)."""
    small = adapter.reduce(config)
    st = adapter.whole(config)
    d = int(small.get("hidden_size") or small.get("n_embd"))
    out = dict(small, vocab_size=max(16, 2 * d + 8), tie_word_embeddings=st.tied,
               pad_token_id=st.padding_idx, bos_token_id=None, eos_token_id=None)
    for key in ("num_hidden_layers", "n_layer"):
        if key in out or key == "num_hidden_layers":
            out[key] = 1
    for key in ("intermediate_size", "n_inner", "ffn_hidden_size"):
        if key in out or (key == "ffn_hidden_size" and adapter.model_type == "falcon"):
            out[key] = 6
    for key in ("max_position_embeddings", "n_positions"):
        if key in out:
            out[key] = 6
    for key in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon"):
        out[key] = 1e-2
    while not _generic(adapter.whole(out)):
        out["vocab_size"] += 8
    return out


def _generic(st: Any) -> bool:
    """No discrete-input condition binds (docs/theory.md §13.17)."""
    c = count_structure(st)
    return c.exact and "discrete_inputs" not in c.components


def numeric_whole(adapter: Any, config: dict[str, Any], *, seed: int = 0):
    """The arbiter's whole-model count of a reduced config (families without a closed form)."""
    small = reduced_whole_config(adapter, config)
    found = arbiter_whole(small, seed=seed)
    r = found.result
    return WholeCount(adapter.whole(small),
                      {"whole (reduced config)": Component(r.n_params, r.nullity, found.near_unidentified)},
                      method="numeric: the whole-model arbiter on a reduced config of the same structure",
                      reduced_config={k: small[k] for k in REDUCED_KEYS if small.get(k) is not None})


@dataclass(frozen=True)
class WholeVerification:
    """The whole-model closed form next to the arbiter, at one or two random points.

    An exact count must equal the arbiter's; a count flagged as a lower bound
    (``theory.exact`` False, docs/theory.md §13.17) must not exceed it."""

    label: str
    theory: Any  # WholeCount
    arbiter: WholeArbiter
    confirm: WholeArbiter | None
    config: dict[str, Any] | None = None  # the sizes checked (REDUCED_KEYS)
    reduced: bool = False  # True: a reduced config of the same structure, not the one given

    @property
    def stable(self) -> bool:
        c = self.confirm
        return c is None or (c.unidentified, c.near_unidentified) == (
            self.arbiter.unidentified, self.arbiter.near_unidentified)

    @property
    def agree(self) -> bool:
        a, t = self.arbiter, self.theory
        if not (self.stable and a.result.n_params == t.total):
            return False
        if t.exact:
            return (a.unidentified, a.near_unidentified) == (t.unidentified, t.near_unidentified)
        return t.unidentified <= a.unidentified  # a lower bound (near: not bounded)

    @property
    def status(self) -> str:
        """AGREE (exact and equal), BOUND HOLDS (a lower bound, not exceeded), DISAGREE."""
        if not self.agree:
            return "DISAGREE"
        return "AGREE" if self.theory.exact else "BOUND HOLDS"

    def to_dict(self) -> dict[str, Any]:
        a = self.arbiter.result
        return {
            "model": self.label, "function": self.arbiter.kind, "total": a.n_params,
            "total_theory": self.theory.total, "unidentified_numeric": a.nullity,
            "unidentified_theory": self.theory.unidentified,
            "near_unidentified_numeric": self.arbiter.near_unidentified,
            "near_unidentified_theory": self.theory.near_unidentified, "agree": self.agree,
            "status": self.status, "exact": self.theory.exact, "reasons": list(self.theory.reasons),
            "reduced": self.reduced, "config": self.config,
            "stable": self.stable, "spectral_gap": a.spectral_gap, "n_sequences": a.n_sequences,
            "seq_len": a.seq_len, "n_rows": a.n_rows, "seconds": a.seconds,
            "components": self.theory.to_dict()["components"],
            "structure": self.theory.structure.to_dict() | {"specs": None},
        }


def verify_whole(config: dict[str, Any], label: str, *, seed: int = 0, confirm: bool | None = None,
                 reduced: bool = False) -> WholeVerification:
    """Closed form against the whole-model arbiter on ``config`` (already tiny).

    ``confirm``: ``None`` takes the second look (another seed, twice the sequences) only when
    the count disagrees or its spectral gap is narrow, as `attnid.arbiter.compare` does
    (docs/theory.md §12.3); ``True`` always, ``False`` never.
    """
    theory = count_structure(adapter_for(config).whole(config))
    first = arbiter_whole(config, seed=seed)
    if confirm is None:
        gap = first.result.spectral_gap
        confirm = not WholeVerification(label, theory, first, None).agree or (
            gap is not None and gap < CLEAR_GAP)
    second = arbiter_whole(config, seed=seed + 1,
                           n_sequences=2 * first.result.n_sequences) if confirm else None
    shown = {k: config[k] for k in REDUCED_KEYS if config.get(k) is not None}
    return WholeVerification(label, theory, first, second, shown, reduced)


# The arbiter's cost grows about as P^2.7 (measured on 2 busy cores: 872 parameters about
# 5 s, 2,868 about 50 s, 4,304 about 3 minutes): configs up to this size are checked as given.
AS_GIVEN_MAX_PARAMS = 3000


EPS_KEYS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon")


def _eps_clear(adapter: Any, config: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The config with a norm eps below 1e-6 (but not 0) raised to 1e-2: the count does not
    depend on eps > 0, but near-unidentified directions (seen only through eps, §12.5) must
    stand clear of float64 rounding to be told from exact ones."""
    eps = adapter.whole(config).eps
    if not 0 < eps < 1e-6:
        return config, ""
    keys = [k for k in EPS_KEYS if k in config] or list(EPS_KEYS)
    return {**config, **dict.fromkeys(keys, 1e-2)}, (
        f"; norm eps {eps:g} raised to 1e-2 so that near-unidentified directions stand clear "
        "of rounding")


def verify_whole_hf_config(model: str, *, seed: int = 0, confirm: bool | None = None,
                           max_params: int = AS_GIVEN_MAX_PARAMS) -> WholeVerification:
    """``attnid verify --hf-config MODEL --whole``: the config as given when it has at most
    ``max_params`` parameters, else a reduced config of the same structure (said in the
    label and in ``reduced``)."""
    name, config = load_config(model)
    adapter = adapter_for(config)
    if not adapter.closed_form or adapter.unsupported_whole(config):
        raise AttnidError(f"{adapter.family} has no whole-model closed form to compare with; "
                          "`attnid report` shows its numeric whole-model count")
    arch = (config.get("architectures") or [adapter.model_type])[0]
    total = count_structure(adapter.whole(config)).total
    if total <= max_params:
        given, note = _eps_clear(adapter, config)
        return verify_whole(given, f"{name} ({arch}, whole model, as given: {total} parameters"
                            f"{note})", seed=seed, confirm=confirm)
    small = reduced_whole_config(adapter, config)
    shown = {k: small[k] for k in REDUCED_KEYS if small.get(k) is not None}
    return verify_whole(small, f"{name} ({arch}, whole model, reduced: {total:,} parameters "
                        f"is over the {max_params:,} checked as given; checked {shown})",
                        seed=seed, confirm=confirm, reduced=True)
