"""The per-step update sums of the training loop (`attnid.train.sizes`) against the conserved
quantity itself: ``trace C(d)`` of the update ``d`` from `attnid.symmetry.conserved`, and the
squared norm of each side's tensors, on every attention variant the model builds."""

from __future__ import annotations

import pytest
import torch

from attnid.symmetry.conserved import conserved, kv_group_trace
from attnid.symmetry.tangent import side_names
from attnid.train.cuda import HostMirror
from attnid.train.model import GPT, GPTConfig
from attnid.train.sizes import UpdateSizes
from attnid.weights import SIDES, AttentionWeights

VARIANTS = {
    "mha, q and k biases": dict(),
    "all biases": dict(attn_bias="qkvo"),
    "gqa": dict(n_kv_heads=2, attn_bias="qkvo"),
    "mqa": dict(n_kv_heads=1),
    "rope half": dict(rope=0.5, n_kv_heads=2),
    "qk-norm": dict(qk_norm="head", attn_bias=""),
}


def _model(**over) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=11, block_size=8, n_layers=2, n_heads=4, d_model=16, **over)).double()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sums_equal_the_conserved_quantity_of_each_update(variant):
    model = _model(**VARIANTS[variant])
    sizes = UpdateSizes(model)
    gen = torch.Generator().manual_seed(1)
    expect = {(q, side): [0.0] * len(model.blocks) for q in ("sq", "tau") for side in SIDES}
    for _ in range(3):  # three updates summed between two records
        before = [{n: p.detach().clone() for n, p in b.attn.named_parameters()} for b in model.blocks]
        sizes.before()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        sizes.after()
        for i, b in enumerate(model.blocks):
            d = {n: p.detach() - before[i][n] for n, p in b.attn.named_parameters()}
            spec = b.attn.spec
            dw = AttentionWeights.from_tensors(spec, d)
            for side in SIDES:
                expect["sq", side][i] += sum(float(d[n].square().sum()) for n in side_names(spec, side))
                expect["tau", side][i] += kv_group_trace(conserved(dw, side), dw, side).reshape(-1)
    got = sizes.take()
    for side in SIDES:
        for i in range(len(model.blocks)):
            case = f"{variant} layer {i} {side}"
            sq, want = got[f"update_sq_{side}"][i], expect["sq", side][i]
            assert abs(sq - want) <= 1e-12 * want, f"{case}: sum of squares {sq} vs {want}"
            tau = torch.tensor(got[f"update_tau_{side}"][i], dtype=torch.float64)
            want_tau = expect["tau", side][i]
            err = float((tau - want_tau).abs().max())
            assert tau.shape == want_tau.shape and err <= 1e-12 * float(want_tau.abs().max() + 1), (
                f"{case}: trace C(d) {tau.tolist()} vs {want_tau.tolist()} (error {err:.1e})")
    again = sizes.take()  # take() starts again from zero
    assert all(v == 0 for v in again["update_sq_qk"]), again["update_sq_qk"]


def test_the_host_mirror_holds_the_weights_and_gradients():
    model = _model(attn_bias="qkvo", n_kv_heads=2).float()
    x = torch.randint(0, 11, (2, 8))
    model(x, x)[1].backward()
    mirror = HostMirror(model)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    mirror.pull(grads=True)
    for block, copy in zip(model.blocks, mirror.layers, strict=True):
        for (n, p), q in zip(block.attn.named_parameters(), copy.parameters(), strict=True):
            assert q is not p and torch.equal(q, p), f"{n}: the mirror's weight differs from the model's"
            assert torch.equal(q.grad, p.grad), f"{n}: the mirror's gradient differs from the model's"


def test_a_monitor_of_the_mirror_measures_what_a_monitor_of_the_model_does():
    """The GPU loop's order (attnid.train.loop): pull weights and gradients, step, pull again
    inside the Monitor's step; the same record as a Monitor of the model itself."""
    from attnid.monitor import Monitor

    model = _model(attn_bias="qk", n_kv_heads=2).float()
    mirror = HostMirror(model)
    of_mirror, of_model = Monitor(mirror.layers), Monitor(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, 11, (2, 8), generator=torch.Generator().manual_seed(2))
    for _ in range(2):
        opt.zero_grad()
        model(x, x)[1].backward()
        mirror.pull(grads=True)
        with of_mirror.step(), of_model.step():
            opt.step()
            mirror.pull()
        direct = of_model.last.to_dict()
        seen = of_mirror.last.to_dict()
        assert seen.keys() == direct.keys(), set(seen) ^ set(direct)
        for k in direct:
            a, b = torch.tensor(seen[k]), torch.tensor(direct[k])
            assert torch.allclose(a, b, rtol=1e-12, atol=0), f"{k}: {a.tolist()} vs {b.tolist()}"
