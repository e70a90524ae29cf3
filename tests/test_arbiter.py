"""The arbiter's own contract: one definition of near-unidentified, honest fallbacks, second looks."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from attnid import Attention, AttentionSpec, AttnidError, count, jacobian_rank, randomize_
from attnid.arbiter.compare import CLEAR_GAP, needs_second_look, verify, verify_module
from attnid.arbiter.rank import near_unidentified

NORMED = [
    AttentionSpec(d_model=8, n_heads=2, qk_norm="head", qk_norm_eps=1e-6),
    AttentionSpec(d_model=8, n_heads=4, n_kv_heads=2, rope=1.0, bias="qk", qk_norm="head", qk_norm_eps=1e-3),
]


def _eps_free(spec: AttentionSpec):
    def without_eps(layer: torch.nn.Module) -> torch.nn.Module:
        copy = Attention(replace(spec, qk_norm_eps=0.0)).double()
        copy.load_state_dict(layer.state_dict())
        return copy
    return without_eps


@pytest.mark.parametrize("spec", NORMED, ids=lambda s: s.describe())
def test_near_is_null_at_eps_zero_but_not_at_eps(spec: AttentionSpec):
    layer = randomize_(Attention(spec).double(), 0)
    at_eps = jacobian_rank(layer)
    at_zero = jacobian_rank(_eps_free(spec)(layer))
    both = jacobian_rank(layer, without_eps=_eps_free(spec))
    assert at_eps.near_nullity == 0, "near directions are never read off the spectrum"
    assert both.nullity == at_eps.nullity
    assert both.near_nullity == near_unidentified(at_eps.nullity, at_zero.nullity) > 0
    assert both.near_nullity == count(spec).near_unidentified
    assert both.rank == both.n_params - both.nullity - both.near_nullity


def test_a_small_genuine_direction_is_not_near():
    # one head's output scaled by 1e-6: tiny singular values, but every one is identified
    spec = AttentionSpec(d_model=8, n_heads=2)
    layer = randomize_(Attention(spec).double(), 0)
    with torch.no_grad():
        layer.W_O[1] *= 1e-6
    found = jacobian_rank(layer)
    assert (found.nullity, found.near_nullity) == (count(spec).unidentified, 0)


class _ItemInBackward(torch.autograd.Function):
    """Identity whose backward reads a Python float: vmap cannot batch it."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        pass

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        _ = float(g.abs().max())
        return g


def test_a_forward_vmap_cannot_batch_falls_back_and_says_so():
    spec = AttentionSpec(d_model=4, n_heads=2)
    layer = randomize_(Attention(spec).double(), 0)
    with pytest.warns(UserWarning, match="one row at a time"):
        found = jacobian_rank(layer, forward=lambda m, x: _ItemInBackward.apply(m(x)))
    assert found.nullity == count(spec).unidentified


def test_out_of_memory_is_reported_not_looped(monkeypatch):
    def oom(fn):
        def run(omega):
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return run

    monkeypatch.setattr("attnid.arbiter.rank.vmap", oom)
    layer = randomize_(Attention(AttentionSpec(d_model=4, n_heads=2)).double(), 0)
    with pytest.raises(AttnidError, match=r"out of memory.*chunk_rows"):
        jacobian_rank(layer)


def test_other_runtime_errors_propagate(monkeypatch):
    def broken(fn):
        def run(omega):
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")
        return run

    monkeypatch.setattr("attnid.arbiter.rank.vmap", broken)
    layer = randomize_(Attention(AttentionSpec(d_model=4, n_heads=2)).double(), 0)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        jacobian_rank(layer)


def test_custom_forward_runs_through_public_functional_call():
    # a forward that is not module(x): the arbiter swaps parameters with torch.func only
    spec = AttentionSpec(d_model=8, n_heads=2)
    layer = randomize_(Attention(spec).double(), 0)
    found = jacobian_rank(layer, forward=lambda m, x: 2.0 * m(x, causal=True))
    assert found.nullity == count(spec).unidentified


def test_clear_agreement_takes_no_second_look():
    result = verify(AttentionSpec(d_model=8, n_heads=2, bias="qkvo"), seed=0)
    assert result.agree and result.confirm is None
    assert result.arbiter.spectral_gap > CLEAR_GAP
    assert result.to_dict()["confirmed"] is False


def test_disagreement_takes_a_second_look():
    spec = AttentionSpec(d_model=8, n_heads=2)
    wrong = count(replace(spec, bias="k"))  # a closed form for another layer
    result = verify_module(Attention(spec).double(), wrong, label="mismatch", d_model=8)
    assert result.confirm is not None and not result.agree
    assert result.confirm.n_sequences == 2 * result.arbiter.n_sequences


def test_a_narrow_gap_takes_a_second_look():
    spec = AttentionSpec(d_model=8, n_heads=2)
    found = jacobian_rank(randomize_(Attention(spec).double(), 0))
    assert not needs_second_look(found, count(spec))
    assert needs_second_look(replace(found, spectral_gap=CLEAR_GAP / 10), count(spec))
