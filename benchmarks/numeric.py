"""Arbiter speed: end to end, against the naive route and against the dense-SVD floor.

    python benchmarks/numeric.py            # sizes up to ~9,000 parameters
    python benchmarks/numeric.py --big      # plus a ~20,000-parameter layer (about an hour)
    python benchmarks/numeric.py --big-only # just the arbiter on that layer (~40 minutes)
    python benchmarks/numeric.py --verify   # `attnid verify` (default settings) at P = 4,096

(a) `attnid.jacobian_rank` end to end (inputs, sketch, SVD);
(b) naive: `torch.autograd.functional.jacobian` on the same inputs, then
    `torch.linalg.matrix_rank`;
(c) floor: `torch.linalg.svdvals` of a random float64 P x P matrix.
Prints a/b and a/c per size. ``--verify``: `attnid.verify` with its default settings (a
second look only when needed) against (c) at the same P, and the forced second look.
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from attnid import Attention, AttentionSpec, count, jacobian_rank, randomize_, verify
from attnid.arbiter.rank import default_forward, forward_call, sequences_needed


def naive(layer: Attention, x: torch.Tensor) -> int:
    names = [n for n, _ in layer.named_parameters()]
    params = tuple(p.detach() for _, p in layer.named_parameters())

    def f(*ps: torch.Tensor) -> torch.Tensor:
        return forward_call(layer, dict(zip(names, ps, strict=False)), x, default_forward).reshape(-1)

    jac = torch.autograd.functional.jacobian(f, params, vectorize=True)
    J = torch.cat([j.reshape(j.shape[0], -1) for j in jac], dim=1)
    return J.shape[1] - int(torch.linalg.matrix_rank(J))


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--big", action="store_true", help="also decide a ~20,000-parameter layer")
    ap.add_argument("--naive-max", type=int, default=4100, help="largest P for the naive route")
    ap.add_argument("--big-only", action="store_true",
                    help="only decide a ~20,000-parameter layer with the arbiter (time, peak memory)")
    ap.add_argument("--verify", action="store_true",
                    help="only `attnid verify` (default settings) at P = 4,096 against the floor")
    args = ap.parse_args()
    if args.verify:
        verify_against_floor()
        return
    if args.big_only:
        spec = AttentionSpec(d_model=72, n_heads=8)
        res, t = timed(lambda: jacobian_rank(randomize_(Attention(spec).double(), 0)))
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        print(f"P={res.n_params}: nullity {res.nullity} (theory {count(spec).unidentified}), gap "
              f"{res.spectral_gap:.1e}, {t:.0f}s, peak resident memory {peak:.2f} GB")
        return
    torch.manual_seed(0)
    sizes = [(16, 2), (24, 4), (32, 4), (44, 4)] + ([(72, 8)] if args.big else [])
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    # one-time process start-up (functorch, LAPACK) is paid before timing anything
    jacobian_rank(randomize_(Attention(AttentionSpec(d_model=4, n_heads=2)).double(), 0))
    torch.linalg.svdvals(torch.randn(64, 64, dtype=torch.float64))
    print(f"{'P':>7} {'null':>6} {'theory':>6} {'arbiter s':>10} {'naive s':>9} {'floor s':>8}"
          f" {'a/b':>6} {'a/c':>6}")
    for d, H in sizes:
        spec = AttentionSpec(d_model=d, n_heads=H)
        layer = randomize_(Attention(spec).double(), 0)
        P = count(spec).total
        res, t_a = timed(lambda layer=layer: jacobian_rank(layer))
        _, t_c = timed(lambda P=P: torch.linalg.svdvals(torch.randn(P, P, dtype=torch.float64)))
        t_b = float("nan")
        if args.naive_max >= P:
            n_seq = sequences_needed(P, 8, d)
            x = torch.randn(n_seq, 8, d, dtype=torch.float64)
            null_b, t_b = timed(lambda layer=layer, x=x: naive(layer, x))
            assert null_b == res.nullity, (null_b, res.nullity)
        print(f"{P:>7} {res.nullity:>6} {count(spec).unidentified:>6} {t_a:>10.2f} {t_b:>9.2f}"
              f" {t_c:>8.2f} {t_a / t_b:>6.2f} {t_a / t_c:>6.2f}", flush=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"peak resident memory {peak:.2f} GB")


def verify_against_floor(d_model: int = 32, n_heads: int = 4) -> None:
    """`attnid verify --d-model 32 --n-heads 4` (P = 4,096): default, and with the second look
    forced, each against one dense svdvals of the same size, measured in the same run."""
    spec = AttentionSpec(d_model=d_model, n_heads=n_heads)
    P = count(spec).total
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, P = {P}")
    verify(AttentionSpec(d_model=4, n_heads=2))  # process start-up paid before timing
    _, t_floor = timed(lambda: torch.linalg.svdvals(torch.randn(P, P, dtype=torch.float64)))
    res, t_default = timed(lambda: verify(spec))
    forced, t_forced = timed(lambda: verify(spec, confirm=True))
    assert res.agree and forced.agree, (res.to_dict(), forced.to_dict())
    print(f"verify (default: second look {'taken' if res.confirm else 'not needed'}, gap "
          f"{res.arbiter.spectral_gap:.1e}) {t_default:.1f} s = {t_default / t_floor:.2f} x the floor "
          f"({t_floor:.1f} s); with the second look forced {t_forced:.1f} s = "
          f"{t_forced / t_floor:.2f} x", flush=True)


if __name__ == "__main__":
    main()
