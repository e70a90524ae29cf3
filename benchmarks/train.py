"""Training-step speed: the small GPT on attnid.Attention against the same model written plainly.

    python benchmarks/train.py

Baseline: nanoGPT's CausalSelfAttention (one fused c_attn Linear, scaled_dot_product_attention,
one c_proj Linear) in an otherwise identical model, same sizes, same run. Also the share of a
step spent on orbit metrics when logging every step.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from attnid.monitor import Monitor
from attnid.train.model import GPT, GPTConfig


class PlainAttention(nn.Module):
    def __init__(self, d: int, H: int) -> None:
        super().__init__()
        self.H = H
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (t.view(B, T, self.H, d // self.H).transpose(1, 2) for t in (q, k, v))  # (B, H, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, d))


def plain_gpt(cfg: GPTConfig) -> GPT:
    model = GPT(cfg)
    for block in model.blocks:
        block.attn = PlainAttention(cfg.d_model, cfg.n_heads)
    return model


def time_steps(model: nn.Module, idx: torch.Tensor, n: int, monitor: Monitor | None = None) -> float:
    """Best step time over ``n`` steps (after one warm-up)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        _, loss = model(idx, idx)
        opt.zero_grad()
        loss.backward()
        if monitor is None:
            opt.step()
        else:
            with monitor.step():
                opt.step()

    step()
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t)
    return best


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    for label, kw, batch in (
        ("tiny (experiment default)", dict(n_layers=2, n_heads=4, d_model=64, block_size=64), 32),
        ("nanoGPT Shakespeare-char", dict(n_layers=6, n_heads=6, d_model=384, block_size=256), 64),
    ):
        cfg = GPTConfig(vocab_size=78, attn_bias="qkvo", **kw)
        torch.manual_seed(0)
        idx = torch.randint(0, 78, (batch, cfg.block_size))
        n = 10 if kw["d_model"] < 128 else 3
        plain, ours = plain_gpt(cfg), GPT(cfg)
        t_plain, t_ours = [], []
        for _ in range(2):  # interleaved, so that machine noise hits both alike
            t_plain.append(time_steps(plain, idx, n))
            t_ours.append(time_steps(ours, idx, n))
        tp, to = min(t_plain), min(t_ours)
        mon = Monitor(ours)
        before = mon.batches.snapshot()
        t_mon = min(_timed(lambda mon=mon, before=before: mon.measure(before, mon.batches.snapshot()))
                    for _ in range(3))
        print(f"{label}, batch {batch}: plain SDPA {tp * 1e3:.1f} ms/step, attnid {to * 1e3:.1f} ms/step, "
              f"ratio {to / tp:.2f}x; metrics every step {t_mon * 1e3:.1f} ms = {100 * t_mon / to:.1f}% "
              "of a step")


if __name__ == "__main__":
    main()
