"""A small nanoGPT-like model built on `attnid.Attention`, so every attention variant is available."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from attnid.attention import Attention
from attnid.spec import AttentionSpec


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 65  # characters
    block_size: int = 64  # longest context
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None  # GQA groups; None = MHA
    d_model: int = 64
    attn_bias: str = "qk"  # which attention biases exist (the paper's Fig. 3 needs q and k)
    mlp_bias: bool = True
    rope: float = 0.0  # fraction of head dims rotated; 0 = learned absolute positions
    qk_norm: str = "none"
    tie_weights: bool = True  # lm_head shares the token embedding
    dropout: float = 0.0

    def attention_spec(self) -> AttentionSpec:
        return AttentionSpec(d_model=self.d_model, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
                             bias=self.attn_bias, rope=self.rope, qk_norm=self.qk_norm)  # type: ignore[arg-type]

    def to_dict(self) -> dict:
        return asdict(self)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=cfg.mlp_bias)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=cfg.mlp_bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg.attention_spec(), causal=True)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, d)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.block_size, cfg.d_model) if cfg.rope == 0 else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init)
        for block in self.blocks:  # nanoGPT: residual projections scaled by depth
            nn.init.normal_(block.attn.W_O, std=0.02 / math.sqrt(2 * cfg.n_layers))
            nn.init.normal_(block.mlp.proj.weight, std=0.02 / math.sqrt(2 * cfg.n_layers))

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
