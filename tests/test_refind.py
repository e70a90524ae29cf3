"""The Monitor and the Corrector read the model's parameters as they are now, never stale copies.

Each case changes the model after the Monitor was built (shards it with FSDP2 in a one-process
group, moves it off the meta device with ``to_empty``, loads a state dict by assignment,
changes its dtype, compiles it) and trains it: the records must equal those of a Monitor built
on an unchanged model trained the same way, and must not be zeros. What attnid cannot follow
raises `AttnidError`.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from attnid import Attention, AttentionSpec, AttnidError
from attnid.monitor import Corrector, Monitor
from attnid.testing import TINY_LLAMA, random_hf_model

SPEC = AttentionSpec(d_model=16, n_heads=4, n_kv_heads=2, bias="qkvo")
STEPS = 3


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = Attention(SPEC, causal=True)
        self.b = Attention(SPEC, causal=True)
        self.head = nn.Linear(SPEC.d_model, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.b(torch.tanh(self.a(x)))).pow(2).mean()


def _llama() -> nn.Module:
    pytest.importorskip("transformers")
    return random_hf_model(dict(TINY_LLAMA, hidden_size=16, intermediate_size=32, vocab_size=32))


# attnid's own layers, and a Hugging Face model (read through its adapter)
KINDS = {"attnid": TwoLayers, "llama": _llama}


@pytest.fixture(params=list(KINDS))
def kind(request) -> str:
    return request.param


def _model(kind: str = "attnid") -> nn.Module:
    torch.manual_seed(0)
    return KINDS[kind]().double()


def _loss(run: nn.Module, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    if hasattr(run, "config"):
        ids = torch.randint(0, 32, (4, 8), generator=gen)
        return run(input_ids=ids, labels=ids).loss
    return run(torch.randn(4, 8, 16, dtype=torch.float64, generator=gen))


def _train(model: nn.Module, monitor: Monitor, corrector: Corrector | None = None,
           run: nn.Module | None = None) -> list[dict]:
    """AdamW steps on ``run`` (default ``model``), each measured; the records."""
    run = model if run is None else run
    opt = torch.optim.AdamW(run.parameters(), lr=1e-2, weight_decay=0.1)
    out = []
    for step in range(STEPS):
        opt.zero_grad()
        _loss(run, step).backward()
        with monitor.step(), (corrector.step() if corrector else contextlib.nullcontext()):
            opt.step()
        out.append(monitor.last.to_dict())
    return out


@pytest.fixture(scope="module")
def one_process_group():
    """A gloo process group of one (FSDP2 and FSDP1 shard over it; nothing is sent)."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _blocks(model: nn.Module) -> list[nn.Module]:
    return list(model.model.layers) if hasattr(model, "config") else [model.a, model.b]


def _fully_shard(model: nn.Module) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in _blocks(model):
        fully_shard(block)
    fully_shard(model)


def _first_weight(model: nn.Module) -> torch.Tensor:
    return model.model.layers[0].self_attn.q_proj.weight if hasattr(model, "config") else model.a.W_Q


def _flatten(rows) -> list[float]:
    return [x for r in rows for x in (r if isinstance(r, list) else [r])]


def _assert_same(got: list[dict], ref: list[dict], rtol: float) -> None:
    for step, (g, r) in enumerate(zip(got, ref, strict=True)):
        for key in ("rho_qk", "rho_vo", "beta_qk", "beta_vo", "update_norm", "grad_norm_bq"):
            a, b = torch.tensor(_flatten(g[key])), torch.tensor(_flatten(r[key]))
            err = float(((a - b).abs() / b.abs().clamp_min(1e-300)).max())
            assert err <= rtol, f"step {step} {key}: relative error {err:.2e} > {rtol:.0e}\n{a}\n{b}"
        assert min(_flatten(g["rho_qk"])) > 1e-8, f"step {step}: rho reads zero {g['rho_qk']}"


_REFERENCES: dict[str, list[dict]] = {}


@pytest.fixture
def reference(kind) -> list[dict]:
    """The records of a Monitor built on an unchanged model, trained the same way."""
    if kind not in _REFERENCES:
        model = _model(kind)
        _REFERENCES[kind] = _train(model, Monitor(model))
    return _REFERENCES[kind]


@pytest.mark.parametrize("built", ["before", "after"])
def test_fully_shard(one_process_group, kind, reference, built):
    model = _model(kind)
    monitor = Monitor(model) if built == "before" else None
    _fully_shard(model)
    assert type(_first_weight(model)).__name__ == "DTensor"
    _assert_same(_train(model, monitor or Monitor(model)), reference, 1e-10)


def test_to_empty_from_the_meta_device(kind, reference):
    with torch.device("meta"):
        model = KINDS[kind]().double()
    monitor = Monitor(model)  # built on meta tensors
    model.to_empty(device="cpu")
    weights = _model(kind)
    model.load_state_dict(weights.state_dict())
    with torch.no_grad():  # and the buffers state_dict leaves out (rotary frequencies)
        for b, ours in zip(model.buffers(), weights.buffers(), strict=True):
            b.copy_(ours)
    _assert_same(_train(model, monitor), reference, 1e-12)


def test_load_state_dict_assign(kind, reference):
    model = _model(kind)
    monitor = Monitor(model)
    old = _first_weight(model)
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    assert _first_weight(model) is not old  # new Parameter objects
    _assert_same(_train(model, monitor), reference, 1e-12)


def test_dtype_move(kind, reference):
    torch.manual_seed(0)
    model = KINDS[kind]()  # float32, as _model() builds it before .double()
    monitor = Monitor(model)
    model.double()
    _assert_same(_train(model, monitor), reference, 1e-12)


@pytest.mark.parametrize("built_on", ["model", "compiled"])
def test_torch_compile(kind, reference, built_on):
    model = _model(kind)
    compiled = torch.compile(model, backend="eager")
    monitor = Monitor(model if built_on == "model" else compiled)
    names = [acc.name for acc in monitor.batches.layers]
    assert names == (["a", "b"] if kind == "attnid" else ["model.layers.0.", "model.layers.1."]), names
    _assert_same(_train(model, monitor, run=compiled), reference, 1e-12)


@pytest.mark.parametrize("built", ["before", "after"])
def test_corrector_writes_into_the_shards(one_process_group, kind, built):
    model = _model(kind)
    made = (Monitor(model), Corrector(model, "project")) if built == "before" else None
    _fully_shard(model)
    monitor, corrector = made or (Monitor(model), Corrector(model, "project"))
    records = _train(model, monitor, corrector)
    rho = [x for r in records for x in _flatten(r["rho_qk"]) + _flatten(r["rho_vo"])]
    assert max(rho) < 1e-9, rho  # the applied update has no orbit part left
    assert min(_flatten(records[-1]["update_norm"])) > 1e-4


@pytest.mark.parametrize("sharded", [False, True])
def test_a_change_between_steps_is_measured(one_process_group, sharded):
    """Weights changed between two monitored steps (outside them): the next step is measured
    from the changed point, not from a snapshot kept since (sharded: the Gram matrices of the
    last step's end point are reused only while this process's pieces are unchanged)."""
    records = []
    for shard in (False, sharded):
        model = _model()
        if shard:
            _fully_shard(model)
        monitor = Monitor(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        out = []
        for step in range(STEPS):
            opt.zero_grad()
            _loss(model, step).backward()
            with monitor.step():
                opt.step()
            out.append(monitor.last.to_dict())
            with torch.no_grad():
                model.a.W_Q.mul_(1.5)  # between the steps
        records.append(out)
    _assert_same(records[1], records[0], 1e-10)
    assert records[0][1]["beta_qk"] != records[0][0]["beta_qk"]


@pytest.mark.parametrize("kind", ["attnid"])
def test_a_replaced_module_is_read_not_the_old_one(kind, reference):
    model = _model(kind)
    monitor = Monitor(model)
    old = model.a
    model.a = Attention(SPEC, causal=True).double()
    model.a.load_state_dict(old.state_dict())
    _assert_same(_train(model, monitor), reference, 1e-12)


def test_a_removed_parameter_is_an_error():
    model = _model()
    monitor = Monitor(model)
    del model.a.W_Q
    with pytest.raises(AttnidError, match=r"no longer has a parameter 'a\.W_Q'"):
        monitor.begin()


def test_a_parameter_of_the_wrong_shape_is_an_error():
    model = _model()
    monitor = Monitor(model)
    model.a.W_Q = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(AttnidError, match=r"a.W_Q has shape \[3\].*needs \[4, 16, 4\]"):
        monitor.begin()


@pytest.mark.parametrize("built", ["before", "after"])
def test_fsdp1_without_use_orig_params_is_an_error(one_process_group, kind, built):
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = _model(kind)
    monitor = Monitor(model) if built == "before" else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "switching to NO_SHARD since the world size is 1"
        wrapped = FullyShardedDataParallel(model, use_orig_params=False, device_id=torch.device("cpu"))
    with pytest.raises(AttnidError, match="use_orig_params=True"):
        (monitor or Monitor(wrapped)).begin()


def test_an_update_that_moves_nothing_is_reported_as_such():
    model = _model()
    monitor = Monitor(model)
    with pytest.warns(UserWarning, match="no attention weight moved"), monitor.step():
        pass
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        _loss(model, 0).backward()
        with monitor.step():
            opt.step()
