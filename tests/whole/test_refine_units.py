"""`attnid.whole.align.refine_units`, the refinement a unit at a time (what `--refine` runs on
checkpoints), is the whole-model refinement of `attnid.whole.align.refine`: on every causal
family of the catalogue (the commands refuse masked language models: the objective is a
next-token loss), the objective and its gradient for every refinable parameter agree with the
whole float64 model's (at two path points), and a few steps give the same trace and element;
B is moved one layer unit at a time and A read a tensor at a time; a float32 graph gives the
float64 one's gradients to float32 rounding."""

from __future__ import annotations

import weakref

import pytest
import torch

pytest.importorskip("transformers")

from attnid.testing.catalogue import TRANSFORM_FAMILIES as FAMILIES
from attnid.whole.align import align
from attnid.whole.align.aligner import as_tensors
from attnid.whole.align.refine import Parameters, PathLoss, refinable_parts, refine
from attnid.whole.align.refine_units import UnitPathLoss, refine_units
from attnid.whole.check import tiny_model
from attnid.whole.fit.source import SplitSource
from attnid.whole.layerwise import LayerwiseLM
from attnid.whole.transforms import apply_element
from attnid.whole.transforms.state import ModelTensors

ALPHAS = (0.3, 0.5)


def pair(family: str, **config):
    conf = {**FAMILIES[family], **config}
    A, C = tiny_model(conf, seed=0), tiny_model(conf, seed=1)
    al = align(A, C)
    return conf, A, al


def flat(g) -> list[torch.Tensor]:
    out = [] if g.rotation is None else [g.rotation]
    out += list(g.gains.values())
    for le in g.layers:
        out += [x for x in (le.qk, le.vo, le.mlp) if x is not None]
    return out


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x - y).norm() / y.norm().clamp_min(1e-300))


CAUSAL = [f for f, c in FAMILIES.items() if not c["architectures"][0].endswith("MaskedLM")]


@pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")  # the group's own checks
@pytest.mark.parametrize("family", CAUSAL)
def test_the_gradient_is_the_whole_models(family):
    conf, A, al = pair(family)
    B = al.model
    parts = refinable_parts(B, "full", al.stream_permutation is not None)
    ids = torch.randint(0, A.config.vocab_size, (3, 6), generator=torch.Generator().manual_seed(0))

    def gradient(units: bool):
        theta = Parameters(B, parts, gl=True)
        with torch.no_grad():  # away from the identity, where every part's gradient is generic
            gen = torch.Generator().manual_seed(3)
            for p in theta.parameters():
                p.copy_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        if units:  # eager attention: the whole model's (tiny_model's)
            lm = LayerwiseLM(SplitSource(as_tensors(A)), torch.float64, eager=True)
            lm.drop_rest()  # a tensor a pass did not hand over would fail, not be the model's own
            value = UnitPathLoss(lm, SplitSource(as_tensors(A)), SplitSource(B), ALPHAS).backward(
                theta.element(), ids)
        else:
            loss = PathLoss(tiny_model(conf, seed=0), as_tensors(A), ALPHAS)
            v = loss(apply_element(B, theta.element()), ids)
            v.backward()
            value = float(v)
        return value, {n: p.grad for n, p in theta.named_parameters()}

    (vw, gw), (vu, gu) = gradient(False), gradient(True)
    assert abs(vu - vw) <= 1e-12 * abs(vw), f"{family}: objective {vu!r} a unit at a time, {vw!r} whole"
    assert set(gw) == set(gu) and all(g is not None for g in gu.values()), f"{family}: {sorted(gu)}"
    errs = {n: rel(gu[n], gw[n]) for n in gw}
    worst = max(errs, key=errs.__getitem__)
    assert errs[worst] <= 1e-12, f"{family}: gradient of {worst} {errs[worst]:.1e} from the whole model's"


@pytest.mark.parametrize("family", ["llama-gqa", "llama-tied", "gpt2-untied"])
def test_steps_are_the_whole_refinements(family):
    conf, A, al = pair(family)
    ids = torch.randint(0, A.config.vocab_size, (8, 6), generator=torch.Generator().manual_seed(0))
    kw = {"permuted_stream": al.stream_permutation is not None, "batch": 4, "alphas": ALPHAS}
    whole = refine(as_tensors(A), al.model, tiny_model(conf, seed=0), ids, 3, **kw)
    lm = LayerwiseLM(SplitSource(as_tensors(A)), torch.float64, eager=True)
    units = refine_units(SplitSource(as_tensors(A)), SplitSource(al.model), lm, ids, 3, **kw)
    assert units.parts == whole.parts and units.kept == whole.kept and units.model is None
    trace = max(abs(x - y) / abs(y) for x, y in zip(units.trace, whole.trace, strict=True))
    ends = [abs(units.loss_before - whole.loss_before), abs(units.loss_after - whole.loss_after)]
    assert trace <= 1e-12 and max(ends) <= 1e-12 * whole.loss_before, f"{family}: trace {trace:.1e}, {ends}"
    errs = [rel(x, y) for x, y in zip(flat(units.element), flat(whole.element), strict=True)]
    assert errs and max(errs) <= 1e-10, f"{family}: element {max(errs):.1e} from the whole refinement's"


class Counted(SplitSource):
    """A model in memory handed out a unit at a time (held in float32, so that each float64
    load is a copy), noting at each load how many of the layer units it handed out are still
    alive (any of their tensors), and counting single tensors read."""

    def __init__(self, m: ModelTensors) -> None:
        super().__init__(ModelTensors(m.layout, {n: t.float() for n, t in m.tensors.items()}, m.config))
        self.units: list[list[weakref.ref]] = []
        self.most = self.loads = self.reads = 0

    def load(self, unit: int, dtype: torch.dtype | None = None, *, check: bool = True) -> ModelTensors:
        m = super().load(unit, dtype, check=check)
        if 1 <= unit <= len(self.layout.layers):
            self.loads += 1
            self.units.append([weakref.ref(t) for t in m.tensors.values()])
            self.most = max(self.most, sum(any(r() is not None for r in refs) for refs in self.units))
        return m

    def tensor(self, name: str, *, check: bool = True) -> torch.Tensor:
        self.reads += 1
        return super().tensor(name, check=check)


def test_one_layer_unit_at_a_time():
    """Six layers: B is moved one layer unit at a time, each let go before the next is loaded,
    and A is read a tensor at a time (a whole model would be 6 units of each)."""
    _, A, al = pair("llama-gqa", num_hidden_layers=6)
    ids = torch.randint(0, A.config.vocab_size, (4, 6), generator=torch.Generator().manual_seed(0))
    a, b = Counted(as_tensors(A)), Counted(al.model)
    refine_units(a, b, LayerwiseLM(a, torch.float64, eager=True), ids, 2, batch=4,
                 permuted_stream=al.stream_permutation is not None)
    assert b.loads >= 2 * 6 * 2, b.loads  # each step: every layer forward, then backward
    assert b.most == 1, f"{b.most} of B's layer units alive at once"
    assert a.loads == 0 and a.reads >= 2 * 6 * 2 * 9, (a.loads, a.reads)  # 9 tensors a Llama layer


@pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")
@pytest.mark.parametrize("where", ["the identity", "a random element"])
def test_a_float32_graph_gives_every_gradient(where):
    """bfloat16 checkpoints move their units in float32, the graph with them: at the first step
    (the identity, where the forward without a graph has just applied the same rotation) and
    away from it, the objective and every parameter's gradient, the stream rotation's included,
    are the float64 graph's to float32 rounding."""
    _, A, al = pair("llama-gqa")

    def bf16(m: ModelTensors) -> ModelTensors:
        return ModelTensors(m.layout, {n: t.to(torch.bfloat16) for n, t in m.tensors.items()}, m.config)

    a, b = SplitSource(bf16(as_tensors(A))), SplitSource(bf16(al.model))
    parts = refinable_parts(al.model, "full", al.stream_permutation is not None)
    assert "rotation" in parts, parts
    ids = torch.randint(0, A.config.vocab_size, (3, 6), generator=torch.Generator().manual_seed(0))
    values, grads = {}, {}
    for dtype in (torch.float32, torch.float64):
        theta = Parameters(al.model, parts, gl=True)
        if where != "the identity":
            with torch.no_grad():
                gen = torch.Generator().manual_seed(3)
                for p in theta.parameters():
                    p.copy_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        lm = LayerwiseLM(a, torch.float64, eager=True)
        lm.drop_rest()
        loss = UnitPathLoss(lm, a, b, ALPHAS, dtype)
        values[dtype] = float(loss.value(theta.element(), ids))
        loss.backward(theta.element(), ids)
        grads[dtype] = {n: p.grad for n, p in theta.named_parameters()}
    missing = [n for n, g in grads[torch.float32].items() if g is None]
    assert not missing, f"{where}: no gradient for {missing} from the float32 graph"
    assert abs(values[torch.float32] - values[torch.float64]) <= 1e-5 * values[torch.float64], values
    errs = {n: rel(grads[torch.float32][n], g) for n, g in grads[torch.float64].items()}
    worst = max(errs, key=errs.__getitem__)
    assert errs[worst] <= 1e-4, f"{where}: gradient of {worst}: {errs[worst]:.1e} from the float64 graph's"
