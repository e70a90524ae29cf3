"""Check attnid.theory.qknorm_wide against the exact rank of the invariant map on random layers.

    .venv/bin/python scripts/check_qknorm_wide.py [N] [SEED]

Draws N random QK-norm layers with head_dim > d_model (d 1..6, head_dim up to 2d + 4,
every RoPE width, G and H/G 1..4, every q/k bias pair), and compares ``fibre`` (and the
exact scales under eps > 0) with the rank of the invariant map's Jacobian. Prints one
line per disagreement and a final count; exit code 1 if any disagree.
"""

from __future__ import annotations

import random
import sys

import torch

from attnid import AttentionSpec
from attnid.testing import invariant_jacobian, numerical_rank
from attnid.theory.qknorm_wide import fibre


def main(n: int, seed: int) -> int:
    rng = random.Random(seed)
    done = bad = 0
    while done < n:
        d = rng.randint(1, 6)
        dk = rng.randint(d + 1, 2 * d + 4)
        r = 2 * rng.randint(0, dk // 2)
        G, m = rng.choice([1, 2, 3, 4]), rng.choice([1, 2, 3, 4])
        bias = rng.choice(["", "q", "k", "qk"])
        if (G * m * (d + 1) + G * (d + 1)) * dk > 700:  # keep each Jacobian small
            continue
        spec = AttentionSpec(d_model=d, n_heads=G * m, n_kv_heads=G, head_dim=dk, rope=r / dk,
                             bias=bias, qk_norm="head", qk_norm_eps=0.0)
        J, q_last, k_last = invariant_jacobian(spec, seed=done)
        want = J.shape[1] - numerical_rank(J)
        cols = (q_last if "q" in bias else []) + (k_last if "k" in bias else [])
        want_scales = 0
        if cols:
            E = torch.zeros(J.shape[0], len(cols), dtype=J.dtype)
            E[cols, range(len(cols))] = 1.0
            want_scales = len(cols) - (numerical_rank(torch.cat([J, E], 1)) - numerical_rank(J))
        got = fibre(spec)
        got_scales = fibre(spec, free_q="q" in bias, free_k="k" in bias) - got if cols else 0
        done += 1
        if (got, got_scales) != (want, want_scales):
            bad += 1
            print(f"{spec.describe()}: fibre {got} vs {want}, exact scales {got_scales} vs "
                  f"{want_scales}")
    print(f"{done - bad} of {done} agree")
    return 1 if bad else 0


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:]]
    sys.exit(main(args[0] if args else 200, args[1] if len(args) > 1 else 0))
