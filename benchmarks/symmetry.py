"""Symmetry toolkit speed: batched metrics/projection/rebalancing against a per-head Python loop.

    python benchmarks/symmetry.py [--quick]

The loop is the approach of the paper's published scripts: one head at a time, its own
eigendecompositions and small matrix products. Both run in float64 on the same weights
and the results are checked to agree. Also: the cost of measuring every step as a share of
one AdamW training step of that model.
"""

from __future__ import annotations

import argparse
import time

import torch

from attnid import AttentionSpec
from attnid.monitor import Monitor
from attnid.symmetry import AttentionWeights, metrics, project, rebalance
from attnid.train.model import GPT, GPTConfig


def random_weights(spec: AttentionSpec, layers: int, seed: int) -> AttentionWeights:
    gen = torch.Generator().manual_seed(seed)
    return AttentionWeights(spec, **{
        n: 0.02 * torch.randn(layers, *shape, generator=gen, dtype=torch.float64)
        for n, shape in spec.param_shapes().items()})


def loop_metrics(w0: AttentionWeights, w1: AttentionWeights) -> dict[str, list]:
    """Per layer, per head: Sylvester projection (rho), beta, tau, mu, drift; QK and VO."""
    out: dict[str, list] = {k: [] for k in ("rho_qk", "rho_vo", "beta_qk", "beta_vo")}
    L, H = w0.W_Q.shape[0], w0.spec.n_heads
    for layer in range(L):
        for h in range(H):
            for side, A0, B0, A1, B1 in (
                ("qk", w0.W_Q[layer, h], w0.W_K[layer, h], w1.W_Q[layer, h], w1.W_K[layer, h]),
                ("vo", w0.W_V[layer, h], w0.W_O[layer, h].T, w1.W_V[layer, h], w1.W_O[layer, h].T),
            ):
                dA, dB = A1 - A0, B1 - B0
                Ga, Gb = A0.T @ A0, B0.T @ B0
                la, U = torch.linalg.eigh(Ga)
                lb, V = torch.linalg.eigh(Gb)
                R = A0.T @ dA - dB.T @ B0
                M = U @ ((U.T @ R @ V) / (la[:, None] + lb[None, :])) @ V.T
                tA, tB = A0 @ M, -B0 @ M.T
                rho = (tA.square().sum() + tB.square().sum()) / (dA.square().sum() + dB.square().sum())
                C0, C1 = Ga - Gb, A1.T @ A1 - B1.T @ B1
                out[f"rho_{side}"].append(float(rho))
                out[f"beta_{side}"].append(float(C1.norm()))
                _ = float(C1.trace()), float(torch.linalg.eigvalsh(A1.T @ A1)[0] +
                                              torch.linalg.eigvalsh(B1.T @ B1)[0]), float((C1 - C0).norm())
    return out


def loop_rebalance(w: AttentionWeights) -> list[torch.Tensor]:
    outs = []
    for layer in range(w.W_Q.shape[0]):
        for h in range(w.spec.n_heads):
            for A, B in ((w.W_Q[layer, h], w.W_K[layer, h]), (w.W_V[layer, h], w.W_O[layer, h].T)):
                Qa, Ra = torch.linalg.qr(A)
                Qb, Rb = torch.linalg.qr(B)
                U, s, Vh = torch.linalg.svd(Ra @ Rb.T)
                A2, B2 = Qa @ U * s.sqrt(), Qb @ Vh.T * s.sqrt()
                U2, _, Vh2 = torch.linalg.svd(A2.T @ A + B2.T @ B)
                O = U2 @ Vh2
                outs += [A2 @ O, B2 @ O]  # both balanced factors, as the batched version returns
    return outs


def batched_metrics(w0: AttentionWeights, w1: AttentionWeights) -> dict[str, torch.Tensor]:
    d = w1 - w0
    return {**metrics(w0, w1).flat(), "rho_qk": project(w0, d, "qk").rho, "rho_vo": project(w0, d, "vo").rho}


def best_of(fn, n: int = 3) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def training_share(cfg: GPTConfig, batch: int, steps: int = 3) -> tuple[float, float]:
    """(one AdamW training step, what `Monitor.step()` adds to it), from the same steps.

    Every step is monitored as in training (``with monitor.step(): opt.step()``); the
    monitor's share is the time inside its context less the optimizer step's own.
    """
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = Monitor(model)
    idx = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size))
    t_step, t_monitor = [], []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        _, loss = model(idx, idx)
        opt.zero_grad()
        loss.backward()
        t1 = time.perf_counter()
        with mon.step():
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
        t4 = time.perf_counter()
        if i:  # the first round pays one-time costs
            t_monitor.append((t4 - t1) - (t3 - t2))
            t_step.append((t1 - t0) + (t3 - t2))
    return min(t_step), min(t_monitor)


def rebalance_against_floor(w: AttentionWeights) -> tuple[float, float]:
    """(bare batched QR + SVD of the same factor pairs, `rebalance`), best of 3 each."""
    def floor() -> None:
        def rows(W: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
            return W if b is None else torch.cat([W, b.unsqueeze(-2)], -2)

        pairs = [(rows(w.W_Q, w.b_Q), rows(w.W_K, w.b_K)), (rows(w.W_V, w.b_V), w.W_O.transpose(-1, -2))]
        for A, B in pairs:
            _, Ra = torch.linalg.qr(A)
            _, Rb = torch.linalg.qr(B)
            torch.linalg.svd(Ra @ Rb.transpose(-1, -2))

    return best_of(floor), best_of(lambda: rebalance(w))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="skip the GPT-2-small training-step share")
    args = ap.parse_args()
    shapes = [("nanoGPT 6L 6H d384", 6, AttentionSpec(d_model=384, n_heads=6), 64),
              ("GPT-2 small 12L 12H d768", 12, AttentionSpec(d_model=768, n_heads=12), 8)]
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    for label, L, spec, batch in shapes:
        w0 = random_weights(spec, L, 0)
        w1 = w0 + random_weights(spec, L, 1).scale(0.01)
        ref, got = loop_metrics(w0, w1), batched_metrics(w0, w1)
        err = max(abs(a - b) for a, b in zip(ref["rho_qk"], got["rho_qk"].reshape(-1).tolist(), strict=True))
        assert err < 1e-9, f"batched and loop rho disagree by {err:.2e}"
        t_loop = best_of(lambda w0=w0, w1=w1: loop_metrics(w0, w1))
        t_batch = best_of(lambda w0=w0, w1=w1: batched_metrics(w0, w1))
        r_loop = best_of(lambda w0=w0: loop_rebalance(w0))
        r_batch = best_of(lambda w0=w0: rebalance(w0))
        print(f"{label}: metrics+projection loop {t_loop * 1e3:.1f} ms, batched {t_batch * 1e3:.1f} ms, "
              f"speed-up {t_loop / t_batch:.2f}x; rebalance loop {r_loop * 1e3:.1f} ms, batched "
              f"{r_batch * 1e3:.1f} ms, speed-up {r_loop / r_batch:.2f}x (max rho diff {err:.1e})")
        if L == 12:  # GPT-2 small, every bias, float32: rebalancing against its floor
            biased = AttentionSpec(d_model=768, n_heads=12, bias="qkvo")
            t_floor, t_reb = rebalance_against_floor(random_weights(biased, 12, 2).to(torch.float32))
            print(f"  rebalance GPT-2 small (all biases, float32) {t_reb * 1e3:.0f} ms = "
                  f"{t_reb / t_floor:.2f} x a bare batched QR + SVD of the same pairs "
                  f"({t_floor * 1e3:.0f} ms)")
        if args.quick and L == 12:
            continue
        cfg = GPTConfig(vocab_size=78 if L == 6 else 50257, n_layers=L, n_heads=spec.n_heads,
                        d_model=spec.d_model, block_size=256, attn_bias="qkvo")
        t_step, t_measure = training_share(cfg, batch)
        print(f"  Monitor.step(): {t_measure * 1e3:.0f} ms on a {t_step:.2f} s AdamW training step "
              f"(batch {batch}x256) = {100 * t_measure / t_step:.1f}% of the step")


if __name__ == "__main__":
    main()
