"""`attnid.whole.align.refine`: every value of the refinement's parameters is a group element
(the rotation orthogonal and, under LayerNorm, fixing all-ones; Q/K maps in the RoPE
commutant; orthogonal maps for the orthogonal variants), so B moved by it computes B's
function to float64 rounding; a few steps lower the mid-point loss on calibration tokens."""

import pytest
import torch

pytest.importorskip("transformers")

from attnid.errors import AttnidError
from attnid.rope import project_commutant
from attnid.testing import TOLERANCE
from attnid.testing.catalogue import TRANSFORM_FAMILIES as FAMILIES
from attnid.whole.align import align
from attnid.whole.align.aligner import as_tensors
from attnid.whole.align.refine import Parameters, refinable_parts, refine
from attnid.whole.check import tiny_model
from attnid.whole.transforms import apply_element

from .test_align import function_error


def randomised(theta: Parameters, seed: int) -> Parameters:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in theta.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return theta


@pytest.mark.parametrize("family", ["llama-gqa", "gpt2-untied", "neox-half-rotary-no-bias", "llama-tied"])
@pytest.mark.parametrize("subgroup", ["full", "orthogonal"])
def test_every_parameter_value_is_a_symmetry(family, subgroup):
    A, C = tiny_model(FAMILIES[family], seed=0), tiny_model(FAMILIES[family], seed=1)
    al = align(A, C, subgroup=subgroup)
    B = al.model
    parts = refinable_parts(B, subgroup, al.stream_permutation is not None)
    assert ("rotation" in parts) == (subgroup == "full" and family != "llama-tied"), parts
    with torch.no_grad():
        g = randomised(Parameters(B, parts, gl=subgroup == "full"), 1).element()
    moved = apply_element(B, g)
    err = function_error(C, moved)
    assert err < TOLERANCE[torch.float64], f"{family} {subgroup}: B moved differs from B by {err:.1e}"
    dist = sum(float((moved.tensors[n] - B.tensors[n]).norm())
               for n in B.tensors if B.tensors[n].is_floating_point())
    assert dist > 1.0, f"{family}: the random element moved B by only {dist:.1e}"
    for i, le in enumerate(g.layers):
        spec = B.spec(i)
        off = float((project_commutant(le.qk, spec) - le.qk).norm())
        assert off < 1e-12, f"layer {i}: Q/K map {off:.1e} from the RoPE commutant"
        if subgroup == "orthogonal":
            for X in (le.qk, le.vo):
                eye = torch.eye(X.shape[-1], dtype=X.dtype)
                e = float((X.transpose(-1, -2) @ X - eye).abs().max())
                assert e < 1e-12, f"layer {i}: an orthogonal variant's map is {e:.1e} from orthogonal"
    if g.rotation is not None:
        Q = g.rotation
        e = float((Q.T @ Q - torch.eye(Q.shape[0], dtype=Q.dtype)).abs().max())
        assert e < 1e-12, f"the stream rotation is {e:.1e} from orthogonal"
        if B.layout.norm == "layer":
            ones = torch.ones(Q.shape[0], dtype=Q.dtype)
            assert float((Q @ ones - ones).abs().max()) < 1e-12, "under LayerNorm Q must fix all-ones"


@pytest.mark.slow
def test_refine_lowers_the_mid_point_loss_and_keeps_the_function():
    A, C = tiny_model(FAMILIES["llama-gqa"], seed=0), tiny_model(FAMILIES["llama-gqa"], seed=1)
    al = align(A, C)
    ids = torch.randint(0, A.config.vocab_size, (16, 8), generator=torch.Generator().manual_seed(0))
    r = refine(as_tensors(A), al.model, tiny_model(FAMILIES["llama-gqa"], seed=0).float(), ids, 5,
               permuted_stream=al.stream_permutation is not None, batch=8)
    assert r.kept and r.loss_after < r.loss_before, (r.loss_before, r.loss_after)
    err = function_error(C, r.model)
    assert err < TOLERANCE[torch.float64], f"the refined B differs from B by {err:.1e}"
    only = refine(as_tensors(A), al.model, tiny_model(FAMILIES["llama-gqa"], seed=0).float(), ids, 2,
                  parts=["vo"], batch=8)
    assert only.parts == ("vo",) and only.element.rotation is None
    with pytest.raises(AttnidError, match="cannot refine rotation"):
        refine(as_tensors(A), al.model, A, ids, 1, subgroup="orthogonal", parts=["rotation"])


def test_the_rotation_parameter_steps_as_a_full_skew_one():
    """The rotation's parameter is its skew ``S``'s strict upper triangle (half a ``[d, d]``, and
    half of Adam's moments); Adam with `Parameters.groups` (twice ``eps`` for it) moves ``S``
    exactly as it moves a full ``[d, d]`` ``X`` with ``S = (X - X^T) / 2`` (with one ``eps``:
    1.2e-8 of the move apart here)."""
    from attnid.whole.transforms.orthogonal import cayley, skew

    theta = Parameters(as_tensors(tiny_model(FAMILIES["llama-gqa"], seed=0)), ("rotation",), gl=True)
    d = theta.d
    assert theta.rotation.numel() == d * (d - 1) // 2, theta.rotation.shape
    X = torch.nn.Parameter(torch.zeros(d, d, dtype=torch.float64))
    W = torch.randn(d, d, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def f(Q: torch.Tensor) -> torch.Tensor:  # a function of the rotation with no symmetry of its own
        return ((Q - W) ** 2).sum() + (Q @ W).trace() ** 2

    mine, full = torch.optim.Adam(theta.groups(), lr=0.05), torch.optim.Adam([X], lr=0.05)
    for _ in range(5):
        for opt, Q in ((mine, lambda: theta.element().rotation), (full, lambda: cayley(skew(X)))):
            opt.zero_grad()
            f(Q()).backward()
            opt.step()
    with torch.no_grad():
        a, b = theta.element().rotation, cayley(skew(X))
    moved = float((b - torch.eye(d, dtype=b.dtype)).norm())
    err = float((a - b).norm()) / moved
    assert moved > 0.1, f"five steps moved the rotation by only {moved:.1e}"
    assert err < 1e-13, f"the triangle's rotation differs from the full parameter's by {err:.1e} of its move"
