"""`attnid.whole.align.refine_units`, the refinement a unit at a time (what `--refine` runs on
checkpoints), is the whole-model refinement of `attnid.whole.align.refine`: on every causal
family of the catalogue (the commands refuse masked language models: the objective is a
next-token loss), the objective and its gradient for every refinable parameter agree with the
whole float64 model's (at two path points), and a few steps give the same trace and element;
B is moved one layer unit at a time and A read a tensor at a time; a float32 graph gives the
float64 one's gradients to float32 rounding."""

from __future__ import annotations

import weakref
from collections.abc import Collection

import pytest
import torch

pytest.importorskip("transformers")

from attnid.testing.catalogue import TRANSFORM_FAMILIES as FAMILIES
from attnid.whole.align import align
from attnid.whole.align import refine_units as refine_units_module
from attnid.whole.align.aligner import as_tensors
from attnid.whole.align.refine import Parameters, PathLoss, refinable_parts, refine
from attnid.whole.align.refine_units import UnitPathLoss, refine_units
from attnid.whole.check import Float64Mode, tiny_model
from attnid.whole.fit.source import SplitSource
from attnid.whole.layerwise import LayerwiseLM
from attnid.whole.transforms import apply_element
from attnid.whole.transforms.state import ModelTensors

ALPHAS = (0.3, 0.5)


def pair(family: str, uniform: bool = False, **config):
    """A and B (seeds 0 and 1) and B aligned onto A; ``uniform``: the final norm's gain 1.3 in
    both (a tied head behind it then rotates with its table)."""
    conf = {**FAMILIES[family], **config}
    A, C = tiny_model(conf, seed=0), tiny_model(conf, seed=1)
    if uniform:
        final = as_tensors(A).layout.final.path
        with torch.no_grad():
            for m in (A, C):
                m.get_submodule(final).weight.fill_(1.3)
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
@pytest.mark.parametrize("pieces", [False, True])  # tables, heads, MLPs 5 rows, 6 tokens at a time
@pytest.mark.parametrize("family", CAUSAL)
def test_the_gradient_is_the_whole_models(family, pieces, monkeypatch):
    compare_gradients(family, pieces, monkeypatch)


@pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")
@pytest.mark.parametrize("pieces", [False, True])
@pytest.mark.parametrize(("family", "config"),
                         [("llama-tied", {}), ("gpt2-untied", {"tie_word_embeddings": True})])
def test_the_gradient_through_a_tied_table(family, config, pieces, monkeypatch):
    """A tied head behind a uniform final gain rotates with its table: the rotation's gradient
    takes the table's from the head's part and from the tables' part, behind an RMSNorm and a
    LayerNorm (whose bias rotates too). (The catalogue's tied models have non-uniform final
    gains: no rotation, so no gradient reaches a tied table there.)"""
    parts = compare_gradients(family, pieces, monkeypatch, uniform=True, **config)
    assert "rotation" in parts, f"{family}: the tied stream did not rotate ({parts})"


@pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")
@pytest.mark.filterwarnings("ignore:Sliding Window Attention is enabled")
def test_the_gradient_through_layers_of_two_kinds(monkeypatch):
    """Layers handed different arguments: a Qwen2 whose second layer attends in a sliding
    window under sdpa, where layer 0 gets no mask and layer 1 a ``[b, 1, T, T]`` one, run in
    parts of one sequence: the later layer's mask is cut with its batch."""
    compare_gradients("qwen2-bias-gqa", True, monkeypatch, eager=False, use_sliding_window=True,
                      sliding_window=4, max_window_layers=1)


def compare_gradients(family: str, pieces: bool, monkeypatch, uniform: bool = False, eager: bool = True,
                      **config) -> list[str]:
    """The refinement's objective and gradient a unit at a time against the whole model's, at a
    random element; the parts refined. ``eager=False``: the unit-at-a-time forward with
    transformers' default attention (sdpa), against the whole model's eager one."""
    if pieces:  # 3 sequences of 6 tokens: every part, the forward's layers too, a sequence at a time
        monkeypatch.setattr(refine_units_module, "BLOCK", 5)
        monkeypatch.setattr(refine_units_module, "MICRO_TOKENS", 6)
    conf, A, al = pair(family, uniform, **config)
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
            lm = LayerwiseLM(SplitSource(as_tensors(A)), torch.float64, eager=eager)
            lm.drop_rest()  # a tensor a pass did not hand over would fail, not be the model's own
            value = UnitPathLoss(lm, SplitSource(as_tensors(A)), SplitSource(B), ALPHAS).backward(
                theta.element, ids)
        else:
            loss = PathLoss(tiny_model(conf, seed=0), as_tensors(A), ALPHAS)
            v = loss(apply_element(B, theta.element()), ids)
            v.backward()
            value = float(v)
        return value, {n: p.grad for n, p in theta.named_parameters()}

    with Float64Mode():  # transformers' float32 norms (Gemma's) in float64: in parts, sums regroup
        (vw, gw), (vu, gu) = gradient(False), gradient(True)
    assert abs(vu - vw) <= 1e-12 * abs(vw), f"{family}: objective {vu!r} a unit at a time, {vw!r} whole"
    assert set(gw) == set(gu) and all(g is not None for g in gu.values()), f"{family}: {sorted(gu)}"
    errs = {n: rel(gu[n], gw[n]) for n in gw}
    worst = max(errs, key=errs.__getitem__)
    assert errs[worst] <= 1e-12, f"{family}: gradient of {worst} {errs[worst]:.1e} from the whole model's"
    return list(parts)


def test_parts_of_the_batch_cut_what_runs_per_sequence():
    """A part of the batch cuts the arguments whose first dimension follows the batch, read
    from the arguments on 2 and 3 sequences (`_per_sequence`), not from shapes: with 4
    sequences of 4 tokens a shared ``[T, d]`` table looks like the batch and stays whole, a
    per-sequence ``[b]`` vector is cut; where the probe saw nothing (a later layer's mask
    where layer 0 has None) a tensor of two or more dimensions whose first is the batch is
    cut; an argument that changes otherwise with the batch is refused."""
    from attnid.errors import AttnidError

    T, d = 4, 3
    shared = torch.randn(T, d)

    def arguments(n: int) -> tuple[tuple, dict]:
        g = torch.Generator().manual_seed(n)
        return ((torch.randn(n, T, d, generator=g),),
                {"table": shared, "lengths": torch.arange(n), "mask": torch.randn(n, 1, T, T, generator=g),
                 "cos": torch.randn(1, T, d), "pair": (torch.randn(n, T), None), "flag": True})

    rows = refine_units_module._per_sequence(arguments(2), arguments(3))
    args, kw = arguments(4)
    part = slice(1, 3)
    (a,), got = refine_units_module._rows((args, kw), part, rows, 4)
    assert torch.equal(a, args[0][part]) and torch.equal(got["mask"], kw["mask"][part])
    assert torch.equal(got["lengths"], kw["lengths"][part])
    assert torch.equal(got["pair"][0], kw["pair"][0][part]) and got["pair"][1] is None
    assert got["table"] is shared and got["cos"] is kw["cos"] and got["flag"] is True
    # a later layer's arguments where layer 0 had none, or another tensor: judged by shape
    later = {**kw, "flag": torch.zeros(4, 1, T, T), "extra": torch.zeros(4, 2), "pos": torch.zeros(4),
             "cos": torch.zeros(4, T, d)}  # a shared place holding a per-sequence tensor here
    _, got = refine_units_module._rows((args, later), part, rows, 4)
    assert got["flag"].shape[0] == 2 and got["extra"].shape[0] == 2 and got["pos"].shape[0] == 4, got
    assert got["cos"].shape[0] == 2 and got["table"] is shared, got
    assert torch.equal(refine_units_module._rows(shared, part, None, 4), shared[part])  # no probe: the rule
    with pytest.raises(AttnidError, match="not cut by sequences"):
        refine_units_module._per_sequence(torch.zeros(2 * 3, T), torch.zeros(3 * 3, T + 1))


@pytest.mark.parametrize("family", ["llama-gqa", "llama-tied", "gpt2-untied", "phi3"])
def test_pieces_move_as_their_group(family, monkeypatch):
    """Each group's pieces (`UnitPathLoss._blocks`, 5 rows each) cover its cut tensors once, and
    moved one at a time they give the group's moved tensors: rows of a table and a head,
    neurons of a plain MLP (GPT-2's conv1d and Phi-3's fused MLP stay whole)."""
    monkeypatch.setattr(refine_units_module, "BLOCK", 5)
    _, A, al = pair(family)
    src = SplitSource(al.model)
    loss = UnitPathLoss(LayerwiseLM(SplitSource(as_tensors(A)), torch.float64, eager=True),
                        SplitSource(as_tensors(A)), src, ALPHAS)
    parts = refinable_parts(al.model, "full", al.stream_permutation is not None)
    theta = Parameters(al.model, parts, gl=True)
    with torch.no_grad():
        for p in theta.parameters():
            p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1), dtype=p.dtype))
        g = theta.element()
        split = set()
        for k in sorted(set(loss.group.values())):
            members = [n for n, j in loss.group.items() if j == k]
            here = loss._load(members)
            whole = apply_element(here, g).tensors
            got: dict[str, list[torch.Tensor]] = {}
            dims: dict[str, int] = {}
            for names, m, gb, cut in loss._blocks(members, here, g):
                moved = apply_element(m, gb).tensors
                for n in names:
                    got.setdefault(n, []).append(moved[n])
                    dims[n] = cut[n][0] if n in cut else -1
            for n in members:
                parts = got[n]
                if len(parts) > 1:
                    split.add(n)
                x = torch.cat(parts, dims[n]) if dims[n] >= 0 else parts[0]
                assert len(parts) == 1 or dims[n] >= 0, f"{family}: {n} uncut yet given {len(parts)} times"
                err = rel(x, whole[n])
                assert err <= 1e-12, f"{family}: {n} moved in pieces is {err:.1e} from its group's"
    lay = al.model.layout
    table = f"{lay.tables[0]}.weight"
    assert table in split, f"{family}: the token table was not split ({sorted(split)})"
    plain = not any(x.rows or x.conv1d for x in lay.mlps[0])
    down = f"{lay.mlps[0][1].path}.weight"
    assert (down in split) == plain, f"{family}: the MLP split {down in split}, plain {plain}"


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
    """A model in memory handed out a unit (or part of one) at a time (held in float32, so that
    each float64 load is a copy), noting at each layer load how many of the loads it handed out
    are still alive (any of their tensors) and the most tensors one load held, and counting
    single tensors read."""

    def __init__(self, m: ModelTensors) -> None:
        super().__init__(ModelTensors(m.layout, {n: t.float() for n, t in m.tensors.items()}, m.config))
        self.units: list[list[weakref.ref]] = []
        self.most = self.loads = self.reads = self.widest = 0

    def load(self, unit: int, dtype: torch.dtype | None = None, *, check: bool = True,
             only: Collection[str] | None = None) -> ModelTensors:
        m = super().load(unit, dtype, check=check, only=only)
        if 1 <= unit <= len(self.layout.layers):
            self.loads += 1
            self.widest = max(self.widest, len(m.tensors))
            self.units.append([weakref.ref(t) for t in m.tensors.values()])
            self.most = max(self.most, sum(any(r() is not None for r in refs) for refs in self.units))
        return m

    def tensor(self, name: str, *, check: bool = True) -> torch.Tensor:
        self.reads += 1
        return super().tensor(name, check=check)


def test_one_group_of_a_layer_at_a_time():
    """Six layers: B is moved a group of coupled tensors at a time (a Llama layer's attention
    with its norm: 5 tensors; its MLP with its norm: 4), each let go before the next is read,
    and A is read a tensor at a time (a whole model would be 6 units of each)."""
    _, A, al = pair("llama-gqa", num_hidden_layers=6)
    ids = torch.randint(0, A.config.vocab_size, (4, 6), generator=torch.Generator().manual_seed(0))
    a, b = Counted(as_tensors(A)), Counted(al.model)
    refine_units(a, b, LayerwiseLM(a, torch.float64, eager=True), ids, 2, batch=4,
                 permuted_stream=al.stream_permutation is not None)
    # each step, each layer's 2 groups: the forward, then the backward's mix and its pull
    assert b.loads >= 2 * 6 * 3 * 2, b.loads
    assert b.most == 1, f"{b.most} of B's loads alive at once"
    assert b.widest == 5, f"a load held {b.widest} tensors (a Llama layer unit holds 9)"
    assert a.loads == 0 and a.reads >= 2 * 6 * 2 * 9, (a.loads, a.reads)  # 9 tensors a Llama layer


def test_the_largest_gradient_is_pulled_first(monkeypatch):
    """Within each pull (the head's, each layer's, the tables'), the groups go largest gradient
    first: a layer's MLP (its gradient the larger) before its attention, which is moved whole."""
    _, A, al = pair("llama-gqa", num_hidden_layers=2, intermediate_size=96)
    ids = torch.randint(0, A.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    pulls: list[list[tuple[int, frozenset]]] = []
    pull, group = UnitPathLoss._pull, UnitPathLoss._pull_group

    def outer(self, g, t, cot):
        pulls.append([])
        return pull(self, g, t, cot)

    def inner(self, members, g, t, cot):
        pulls[-1].append((sum(cot[n].numel() for n in members if n in cot), frozenset(members)))
        return group(self, members, g, t, cot)

    monkeypatch.setattr(UnitPathLoss, "_pull", outer)
    monkeypatch.setattr(UnitPathLoss, "_pull_group", inner)
    a = as_tensors(A)
    lm = LayerwiseLM(SplitSource(a), torch.float64, eager=True)
    refine_units(SplitSource(a), SplitSource(al.model), lm, ids, 1, batch=2,
                 permuted_stream=al.stream_permutation is not None)
    layers = [p for p in pulls if any(any("mlp" in n for n in m) for _, m in p)]
    assert len(layers) == 2, f"{len(layers)} layer pulls (2 layers, one step)"
    for p in pulls:
        sizes = [k for k, _ in p]
        assert sizes == sorted(sizes, reverse=True), f"groups pulled in gradient sizes {sizes}"
    for p in layers:
        assert any("mlp" in n for n in p[0][1]), "a layer's attention was pulled before its MLP"


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
        loss.backward(theta.element, ids)
        grads[dtype] = {n: p.grad for n, p in theta.named_parameters()}
    missing = [n for n, g in grads[torch.float32].items() if g is None]
    assert not missing, f"{where}: no gradient for {missing} from the float32 graph"
    assert abs(values[torch.float32] - values[torch.float64]) <= 1e-5 * values[torch.float64], values
    errs = {n: rel(grads[torch.float32][n], g) for n, g in grads[torch.float64].items()}
    worst = max(errs, key=errs.__getitem__)
    assert errs[worst] <= 1e-4, f"{where}: gradient of {worst}: {errs[worst]:.1e} from the float64 graph's"
