"""Monitor and Corrector around a real optimizer step."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from attnid import Attention, AttentionSpec, AttnidError
from attnid.monitor import Corrector, Monitor, parse_correction
from attnid.symmetry import AttentionWeights, metrics


class TwoLayers(nn.Module):
    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__()
        self.a = Attention(spec, causal=True)
        self.b = Attention(spec, causal=True)
        self.head = nn.Linear(spec.d_model, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.b(torch.tanh(self.a(x)))).mean()


SPECS = [AttentionSpec(d_model=16, n_heads=4, bias="qkvo"),
         AttentionSpec(d_model=16, n_heads=4, n_kv_heads=2, bias="qk", rope=1.0)]


def _model(spec: AttentionSpec) -> TwoLayers:
    torch.manual_seed(0)
    return TwoLayers(spec).double()


def _step(model, opt, x):
    opt.zero_grad()
    model(x).backward()


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe())
def test_monitor_records_every_metric(spec: AttentionSpec):
    model = _model(spec)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = Monitor(model)
    x = torch.randn(4, 8, 16, dtype=torch.float64)
    _step(model, opt, x)
    with mon.step():
        opt.step()
    last = mon.last.to_dict()
    for key in ("rho_qk", "rho_vo", "beta_qk", "beta_vo", "tau_qk", "tau_vo", "mu_qk", "drift_qk",
                "drift_vo", "update_norm", "grad_norm_bq", "grad_norm_bk"):
        assert key in last and len(last[key]) == 2, key
    assert len(last["rho_qk"][0]) == spec.n_kv_heads
    assert len(last["grad_norm_bq"][0]) == spec.n_heads
    assert max(max(r) for r in last["rho_qk"]) < 1e-9, "SGD moves along no orbit"
    if not spec.rope:  # the key bias gets no gradient; the query bias does
        assert max(max(r) for r in last["grad_norm_bk"]) < 1e-12
        assert min(min(r) for r in last["grad_norm_bq"]) > 1e-8


class MixedLayers(nn.Module):
    """Two layers of different specs: one with query/key biases and 4 groups, one without and 2."""

    def __init__(self) -> None:
        super().__init__()
        self.a = Attention(AttentionSpec(d_model=16, n_heads=4, bias="qk"))
        self.b = Attention(AttentionSpec(d_model=16, n_heads=4, n_kv_heads=2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))).square().mean()


def test_step_record_is_typed_per_layer_and_its_dict_is_the_documented_json():
    torch.manual_seed(0)
    model = MixedLayers().double()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    mon = Monitor(model)
    assert mon.last is None
    _step(model, opt, torch.randn(2, 6, 16, dtype=torch.float64))
    w0 = AttentionWeights.from_module(model.a).clone()
    with mon.step():
        opt.step()
    last = mon.last
    assert [layer.rho_qk.shape for layer in last.layers] == [(4,), (2,)]  # per layer, its own groups
    a, b = last.layers
    assert a.grad_norm_bq.shape == (4,) and b.grad_norm_bq is None and b.grad_norm_bk is None
    want = metrics(w0, AttentionWeights.from_module(model.a)).flat()
    for key, t in a.metrics.flat().items():
        assert torch.allclose(t, want[key], rtol=1e-12, atol=0), key
    d = last.to_dict()
    assert list(d) == ["beta_qk", "tau_qk", "mu_qk", "drift_qk", "beta_vo", "tau_vo", "mu_vo", "drift_vo",
                       "rho_qk", "rho_vo", "update_norm"]  # b has no biases: no gradient-norm keys
    assert d["rho_qk"] == [a.rho_qk.tolist(), b.rho_qk.tolist()]
    assert d["beta_vo"] == [a.metrics.vo.beta.tolist(), b.metrics.vo.beta.tolist()]
    assert d["update_norm"] == [float(a.update_norm), float(b.update_norm)]
    assert torch.equal(last.rho("vo"), torch.cat([a.rho_vo, b.rho_vo]))
    assert json.loads(json.dumps(d)) == d  # JSON-ready as it is
    assert float(a.update_norm) > 0 and float(a.rho_qk.max()) > 1e-4  # Adam moves along the orbit


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe())
def test_project_correction_leaves_no_tangent_motion(spec: AttentionSpec):
    model = _model(spec)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    mon, fix = Monitor(model), Corrector(model, "project")
    x = torch.randn(4, 8, 16, dtype=torch.float64)
    for _ in range(3):
        _step(model, opt, x)
        with mon.step(), fix.step():
            opt.step()
        assert float(mon.last.rho("qk").max()) < 1e-10
        assert float(mon.last.rho("vo").max()) < 1e-10


def test_rebalance_every_n_is_function_preserving():
    spec = SPECS[0]
    model = _model(spec)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    fix = Corrector(model, "rebalance:2")
    x = torch.randn(4, 8, 16, dtype=torch.float64)
    for i in range(1, 5):
        _step(model, opt, x)
        opt.step()
        with torch.no_grad():
            before = float(model(x))
        with fix.step():
            pass
        with torch.no_grad():
            after = float(model(x))
        assert abs(after - before) <= 1e-10 * max(1.0, abs(before)), (before, after)
        beta = max(float(metrics(AttentionWeights.from_module(m)).qk.beta.max())
                   for m in (model.a, model.b))
        if i % 2 == 0:
            assert beta < 1e-10
        else:
            assert beta > 1e-6


@pytest.mark.parametrize("mode", ["rebalance:0", "rebalance:x", "sometimes"])
def test_bad_correction_mode(mode):
    with pytest.raises(AttnidError):
        parse_correction(mode)


@pytest.mark.parametrize("arch, extra", [
    ("GPT2LMHeadModel", dict(model_type="gpt2", n_embd=16, n_head=4, n_layer=2, vocab_size=32,
                             n_positions=16)),
    ("LlamaForCausalLM", dict(model_type="llama", hidden_size=16, num_attention_heads=4,
                              num_key_value_heads=2, num_hidden_layers=2, intermediate_size=32,
                              vocab_size=32, attention_bias=True)),
], ids=["gpt2", "llama"])
def test_hooks_work_on_hugging_face_models(arch, extra):
    import transformers

    conf = transformers.AutoConfig.for_model(extra.pop("model_type"), **extra)
    torch.manual_seed(0)
    model = getattr(transformers, arch)(conf).double()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    mon, fix = Monitor(model), Corrector(model, "project")
    assert len(mon.layer_names) == 2
    ids = torch.randint(0, 32, (2, 8))
    for _ in range(2):
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        with mon.step(), fix.step():
            opt.step()
    assert float(mon.last.rho("qk").max()) < 1e-10
    assert float(mon.last.rho("vo").max()) < 1e-10
    reb = Corrector(model, "rebalance")
    model.eval()
    with torch.no_grad():
        before = model(input_ids=ids).logits
        with reb.step():
            pass
        after = model(input_ids=ids).logits
    err = float((after - before).norm() / before.norm())
    assert err < 1e-10, f"rebalancing a Hugging Face model changed its logits by {err:.2e}"


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe())
def test_float32_model_is_measured_like_its_float64_copy(spec: AttentionSpec):
    # the monitor keeps float32 snapshots (big products in float32, small ones in float64):
    # its metrics must match a float64 measurement of the very same two points
    torch.manual_seed(1)
    model = TwoLayers(spec)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = Monitor(model)
    x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # the second step reuses the first one's end point
        _step(model, opt, x)
        before = mon.batches.snapshot()  # the same two points, copied by the test
        with mon.step():
            opt.step()
        after = mon.batches.snapshot()
    assert before[0].W_Q.dtype == torch.float32
    ref = mon.measure([w.to(torch.float64) for w in before], [w.to(torch.float64) for w in after])
    for key in ("rho_qk", "rho_vo", "beta_qk", "beta_vo", "mu_qk", "drift_vo", "update_norm"):
        got, want = torch.tensor(mon.last.to_dict()[key]), torch.tensor(ref.to_dict()[key])
        err = float((got - want).abs().max() / want.abs().max())
        assert err < 1e-5, f"{key}: float32 snapshots vs float64 relative error {err:.2e}"


def test_begin_end_measure_what_step_measures():
    """The split form a Trainer callback uses gives the block form's numbers, and end() alone fails."""
    spec = SPECS[0]
    x = torch.randn(4, 8, 16, dtype=torch.float64)
    results = []
    for split in (False, True):
        model = _model(spec)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        mon = Monitor(model)
        _step(model, opt, x)
        if split:
            mon.begin()
            opt.step()
            results.append(mon.end().to_dict())
        else:
            with mon.step():
                opt.step()
            results.append(mon.last.to_dict())
        assert mon.after is not None and len(mon.after) == 1
    block, split_form = results
    assert block.keys() == split_form.keys()
    for key in block:
        a, b = torch.tensor(block[key]), torch.tensor(split_form[key])
        assert torch.allclose(a, b, rtol=1e-12, atol=0), (key, (a - b).abs().max().item())
    assert max(max(r) for r in block["rho_qk"]) > 1e-3, "Adam's step must move along the orbit here"
    with pytest.raises(AttnidError, match="begin"):
        Monitor(_model(spec)).end()


@pytest.mark.parametrize("change_between", [False, True], ids=["consecutive", "weights-changed-between"])
def test_reused_buffers_measure_each_step_like_a_fresh_computation(change_between: bool):
    """The monitor writes its snapshots and the update into two reused buffers; every step
    must still measure exactly the two points around it (also when something changes the
    weights between steps, so that the last end point is stale)."""
    spec = SPECS[0]
    model = _model(spec)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    mon = Monitor(model)
    x = torch.randn(4, 8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    ptrs = []
    for step in range(4):
        _step(model, opt, x)
        if change_between and step == 2:
            with torch.no_grad():
                model.a.W_Q.mul_(1.5)
        before = [w.clone() for w in mon.batches.snapshot()]
        with mon.step():
            opt.step()
        after = [w.clone() for w in mon.batches.snapshot()]
        ref = Monitor(model).measure(before, after)  # a fresh monitor: nothing reused
        for key in ("rho_qk", "rho_vo", "beta_qk", "mu_qk", "mu_vo", "drift_qk", "update_norm"):
            got, want = torch.tensor(mon.last.to_dict()[key]), torch.tensor(ref.to_dict()[key])
            err = float((got - want).abs().max() / want.abs().max())
            assert err < 1e-12, f"step {step} {key}: relative error {err:.1e}"
        ptrs.append(mon.after[0].W_Q.data_ptr())
    assert len(set(ptrs)) == 2, f"expected two snapshot buffers reused, got {ptrs}"


def test_monitor_follows_a_model_that_changes_dtype_and_measure_takes_mixed_dtypes():
    spec = SPECS[0]
    model = _model(spec)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    mon = Monitor(model)
    x = torch.randn(4, 8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    for step in range(5):
        if step == 2:  # mid-run: the buffers no longer fit and are replaced
            model.float()
            x = x.float()
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        _step(model, opt, x)
        before = [w.clone() for w in mon.batches.snapshot()]
        with mon.step():
            opt.step()
        after = [w.clone() for w in mon.batches.snapshot()]
        ref = Monitor(model).measure(before, after)
        got, want = mon.last.rho("qk"), ref.rho("qk")
        assert torch.equal(got, want), f"step {step}: {got} vs {want}"
    assert {b[0].W_Q.dtype for b in mon._buffers} == {torch.float32}, "float64 buffers kept"
    # public measure() with a float64 point and a float32 one: promoted, not cast down
    mixed = mon.measure([w.to(torch.float64) for w in before], after)
    ref = Monitor(model).measure([w.to(torch.float64) for w in before], [w.to(torch.float64) for w in after])
    err = float((mixed.rho("vo") - ref.rho("vo")).abs().max())
    assert err < 1e-6, f"mixed-dtype measure differs by {err:.1e}"
