"""`Structure`: a frozen, family-independent description of a whole transformer, the
whole-model twin of :class:`attnid.spec.AttentionSpec` (a core type: it imports nothing
above ``spec``).

Everything the whole-model count depends on: the residual layout, the norms, the MLP, the
embeddings, the head, and the function the architecture names. Adapters fill it in
(``Adapter.whole(config)``) with their family's defaults; nothing here imports transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from attnid.spec import AttentionSpec

NormKind = Literal["layer", "rms"]
ResidualLayout = Literal["pre", "parallel", "post"]  # where the norms sit on the residual stream
Layout = ResidualLayout  # deprecated alias (one release): attnid.whole.transforms.Layout is the class
MLPKind = Literal["gelu", "silu", "relu", "gated"]
FunctionKind = Literal["logprobs", "hidden"]

ARCH_SUFFIXES: dict[str, FunctionKind] = {
    "ForCausalLM": "logprobs", "LMHeadModel": "logprobs", "ForMaskedLM": "logprobs",
}


def function_kind(config: dict[str, Any]) -> FunctionKind:
    """What the model computes, by the suffix of its first ``architectures`` name:
    log-probabilities over the vocabulary for LM heads, the last hidden states for a bare
    ``...Model`` (and when the field is missing)."""
    arch = (config.get("architectures") or [""])[0]
    for suffix, kind in ARCH_SUFFIXES.items():
        if arch.endswith(suffix):
            return kind
    return "hidden"


@dataclass(frozen=True)
class Structure:
    """The layout of one model: what :func:`attnid.count_model` counts."""

    family: str
    function: FunctionKind
    d_model: int
    vocab: int
    specs: tuple[AttentionSpec, ...]  # one per layer
    norm: NormKind
    norm_bias: bool  # LayerNorm with a bias (RMSNorm never has one)
    eps: float  # the residual norms' epsilon
    layout: ResidualLayout  # pre-LN, parallel attention + MLP (GPT-NeoX, Falcon, Phi-2), post-LN (BERT)
    shared_norm: bool  # parallel layout reading one norm for attention and MLP (Falcon-7B)
    mlp: MLPKind
    d_ff: int
    mlp_bias: bool
    tied: bool  # the unembedding is the token embedding
    positions: int  # rows of a learned position table (0: rotary or none)
    token_types: int  # rows of a token-type table (0: none)
    mlm_head: bool  # BERT's transform (dense, activation, LayerNorm) before the decoder
    pooler: bool  # a bare BERT model's pooler (dense + tanh), which the hidden states never reach
    padding_idx: int | None = None  # RoBERTa: position rows start after it (the pad token's own)

    @property
    def n_layers(self) -> int:
        return len(self.specs)

    def to_dict(self) -> dict[str, Any]:
        return {
            "family": self.family, "function": self.function, "d_model": self.d_model,
            "vocab": self.vocab, "n_layers": self.n_layers, "norm": self.norm,
            "norm_bias": self.norm_bias, "eps": self.eps, "layout": self.layout,
            "shared_norm": self.shared_norm, "mlp": self.mlp, "d_ff": self.d_ff,
            "mlp_bias": self.mlp_bias, "tied": self.tied, "positions": self.positions,
            "token_types": self.token_types, "mlm_head": self.mlm_head, "pooler": self.pooler,
            "padding_idx": self.padding_idx,
        }
