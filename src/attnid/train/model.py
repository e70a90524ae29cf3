"""A small nanoGPT-like model built on `attnid.Attention`, so every attention variant is available.

Pre-norm blocks; the norm is LayerNorm (GPT-2) or RMSNorm (Llama), the MLP GELU (GPT-2) or
SwiGLU (Llama: ``down(silu(gate(x)) * up(x))``); positions are rotary (`attnid.rope`, Hugging
Face's ``rotate_half`` pairing) or, with ``rope=0``, learned or none (``positions``).
`attnid.train.export` writes the GPT-2-style and Llama-style ones as Hugging Face checkpoints.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from attnid.adapters.own import POSITIONS
from attnid.attention import Attention
from attnid.errors import AttnidError
from attnid.spec import AttentionSpec

NORMS = ("layernorm", "rmsnorm")
MLP_OUTPUT = {"gelu": "proj", "swiglu": "down"}  # each MLP's layer that writes the residual stream


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 65  # characters
    block_size: int = 64  # longest context
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None  # kv groups (GQA); None = MHA
    d_model: int = 64
    attn_bias: str = "qk"  # which attention biases exist (the paper's Fig. 3 needs q and k)
    mlp_bias: bool = True
    rope: float = 0.0  # fraction of head dims rotated; 0 = learned absolute positions
    qk_norm: str = "none"
    tie_weights: bool = True  # lm_head shares the token embedding
    dropout: float = 0.0
    norm: str = "layernorm"  # layernorm (GPT-2) | rmsnorm (Llama)
    mlp: str = "gelu"  # gelu: proj(gelu(fc x)) | swiglu: down(silu(gate x) * up x)
    d_ff: int | None = None  # MLP hidden width; None: 4 d (gelu), 8 d / 3 up to a multiple of 32 (swiglu)
    norm_eps: float = 1e-5
    rope_base: float = 10000.0  # RoPE theta (Hugging Face's rope_theta)
    positions: str = "learned"  # with rope=0: learned absolute positions, or none (NoPE)

    def __post_init__(self) -> None:
        if self.positions not in POSITIONS:
            raise AttnidError(f"positions must be one of {', '.join(POSITIONS)}, got {self.positions!r}")
        if self.positions == "none" and self.rope != 0:
            raise AttnidError("positions='none' is for a model without RoPE (rope=0)")
        if self.norm not in NORMS:
            raise AttnidError(f"norm must be one of {', '.join(NORMS)}, got {self.norm!r}")
        if self.mlp not in MLP_OUTPUT:
            raise AttnidError(f"mlp must be one of {', '.join(MLP_OUTPUT)}, got {self.mlp!r}")
        if self.d_ff is not None and not (isinstance(self.d_ff, int) and self.d_ff > 0):
            raise AttnidError(f"d_ff must be a positive integer, got {self.d_ff!r}")
        if not (math.isfinite(self.norm_eps) and self.norm_eps > 0):
            raise AttnidError(f"norm_eps must be a positive number, got {self.norm_eps!r}")

    @property
    def hidden(self) -> int:
        """The MLP's hidden width (``d_ff`` or its default)."""
        if self.d_ff is not None:
            return self.d_ff
        return 4 * self.d_model if self.mlp == "gelu" else 32 * math.ceil(8 * self.d_model / 3 / 32)

    def attention_spec(self) -> AttentionSpec:
        return AttentionSpec(d_model=self.d_model, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
                             bias=self.attn_bias, rope=self.rope, rope_base=self.rope_base,
                             qk_norm=self.qk_norm)  # type: ignore[arg-type]

    def to_dict(self) -> dict:
        return asdict(self)


class MLP(nn.Module):
    """GPT-2's MLP: ``proj(gelu(fc(x)))`` (exact, erf GELU)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.hidden, bias=cfg.mlp_bias)
        self.proj = nn.Linear(cfg.hidden, cfg.d_model, bias=cfg.mlp_bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))  # (B, T, d)


class SwiGLU(nn.Module):
    """Llama's gated MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.hidden, bias=cfg.mlp_bias)
        self.up = nn.Linear(cfg.d_model, cfg.hidden, bias=cfg.mlp_bias)
        self.down = nn.Linear(cfg.hidden, cfg.d_model, bias=cfg.mlp_bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.down(F.silu(self.gate(x)) * self.up(x)))  # (B, T, d)


def make_norm(cfg: GPTConfig) -> nn.Module:
    """The config's norm over the residual stream (LayerNorm with bias, or RMSNorm), gain 1."""
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = make_norm(cfg)
        self.attn = Attention(cfg.attention_spec(), causal=True)
        self.ln_2 = make_norm(cfg)
        self.mlp = MLP(cfg) if cfg.mlp == "gelu" else SwiGLU(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, d)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        learned = cfg.rope == 0 and cfg.positions == "learned"
        self.wpe = nn.Embedding(cfg.block_size, cfg.d_model) if learned else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init)
        for block in self.blocks:  # nanoGPT: residual projections scaled by depth
            nn.init.normal_(block.attn.W_O, std=0.02 / math.sqrt(2 * cfg.n_layers))
            out = block.mlp.get_submodule(MLP_OUTPUT[cfg.mlp])
            nn.init.normal_(out.weight, std=0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)
        elif isinstance(m, Attention):
            for name, p in m.named_parameters():
                if name.startswith("W_"):
                    nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T = idx.shape
        x = self.wte(idx)  # (B, T, d)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(T, device=idx.device))
        x = self.drop(x)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, vocab)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(-1))
        return logits, loss
