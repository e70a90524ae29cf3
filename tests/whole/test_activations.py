"""The activations `attnid align --calibration` matches on, collected one decoder layer at a time
(`attnid.whole.layerwise`), are the whole float64 model's: every layer's input, each head's
write into the stream and each MLP neuron, on every family with whole-model transforms (encoders too), from
a model in memory and from its checkpoint."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from attnid.testing.catalogue import TRANSFORM_FAMILIES as FAMILIES
from attnid.whole.check import Float64Mode, tiny_model
from attnid.whole.transforms.state import ModelTensors


def whole(model, ids: torch.Tensor, batch: int):
    """What `collect` keeps, from the whole float64 model (eager attention) and its hooks (each
    neuron's activations standardised: centred, unit norm)."""
    m = ModelTensors.of(model)
    lay = m.layout
    L = len(lay.layers)
    o_in, d_in, states = [[] for _ in range(L)], [[] for _ in range(L)], []
    for i in range(L):
        model.get_submodule(lay.writers[i][0].path).register_forward_pre_hook(
            lambda _, x, i=i: o_in[i].append(x[0].reshape(-1, x[0].shape[-1])))
        model.get_submodule(lay.mlps[i][1].path).register_forward_pre_hook(
            lambda _, x, i=i: d_in[i].append(x[0].reshape(-1, x[0].shape[-1])))
    with torch.no_grad(), Float64Mode():
        for k in range(0, ids.shape[0], batch):
            hs = model(input_ids=ids[k:k + batch], output_hidden_states=True).hidden_states[:-1]
            states.append(torch.cat([h.reshape(-1, h.shape[-1]) for h in hs]))
    values = []
    for i in range(L):
        s = m.spec(i)
        values.append(torch.cat(o_in[i]).reshape(-1, s.n_heads, s.v_head_dim).transpose(0, 1))
    neurons = [torch.cat(x) - torch.cat(x).mean(0) for x in d_in]  # each column standardised, as kept
    return torch.cat(states), values, [x / x.norm(dim=0) for x in neurons]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


CASES = {**FAMILIES,  # and a config without architectures (a GGUF conversion's): the bare model
         "llama-no-architectures": {k: v for k, v in FAMILIES["llama-gqa"].items() if k != "architectures"}}


@pytest.mark.parametrize("family", list(CASES))
@pytest.mark.parametrize("groups", ["one group", "a chunk a group"])
def test_streamed_activations_are_the_whole_models(family, groups, tmp_path, monkeypatch):
    from attnid.adapters.base import build_hf_model
    from attnid.checkpoint.load import open_checkpoint
    from attnid.checkpoint.units import open_units
    from attnid.whole import layerwise
    from attnid.whole.align.activations import collect

    if groups != "one group":  # every chunk its own group, streaming the layers again
        monkeypatch.setattr(layerwise, "HIDDEN_BUDGET", 1)
    model = build_hf_model(CASES[family], head=True)
    with torch.no_grad():
        model.load_state_dict(tiny_model(CASES[family]).state_dict())
    T = min(5, model.config.max_position_embeddings if hasattr(model.config, "max_position_embeddings")
            else model.config.n_positions)
    ids = torch.randint(0, model.config.vocab_size, (5, T), generator=torch.Generator().manual_seed(0))
    states, values, neurons = whole(model, ids, batch=2)
    model.save_pretrained(tmp_path / "m")
    for where, src in (("memory", ModelTensors.of(model)),
                       ("checkpoint", open_units(open_checkpoint(tmp_path / "m")))):
        got = collect(src, ids, batch=2)
        errs = [rel(got.stream, states)] + [rel(a, b) for a, b in zip(got.values, values, strict=True)]
        errs += [rel(a, b) for a, b in zip(got.neurons, neurons, strict=True)]
        assert max(errs) <= 1e-12, f"{family} from {where}, {groups}: relative errors {errs}"


@pytest.mark.parametrize("held", ["outputs", "sums"])
@pytest.mark.parametrize("block", ["one block", "a token a block"])
@pytest.mark.parametrize("frame", ["stream rotated", "stream permuted"])
def test_head_matching_from_outputs_is_the_cosine_of_the_writes(held, block, frame, monkeypatch):
    """Heads matched from their outputs (or their `HeadSums`) and the output projections (B's in
    A's stream frame), a token block at a time, equal those matched on the writes themselves
    ``z_h W_O^h`` (B's moved into A's frame afterwards): the same assignment, which is the
    shuffle B was built with (B's heads A's, shuffled within kv groups, plus noise); the sums
    give the writes' inner products and norms to float64 rounding."""
    from attnid.whole.align import activations as act

    if block != "one block":
        monkeypatch.setattr(act, "WRITE_BLOCK", 1)
    g = torch.Generator().manual_seed(0)
    H, N, dv, d, G = 6, 7, 3, 8, 3
    zA, WA = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((H, N, dv), (H, dv, d)))
    shuffle = torch.tensor([1, 0, 3, 2, 5, 4])  # within kv groups of 2
    Q = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))[0]
    perm = torch.randperm(d, generator=g)
    move = (lambda W: W @ Q.T) if frame == "stream rotated" else (lambda W: W[..., torch.argsort(perm)])
    back = (lambda X: X @ Q) if frame == "stream rotated" else (lambda X: X[..., perm])
    zB = zA[shuffle] + 0.1 * torch.randn(H, N, dv, generator=g, dtype=torch.float64)
    WB = move(WA[shuffle])  # B's projections in B's own stream frame
    none = act.StreamSums.of(torch.zeros(1, d), torch.zeros(1, d))
    step = 1 if block != "one block" else 1024
    side = lambda z: z.transpose(0, 1).reshape(N, -1)  # noqa: E731  the outputs side by side [N, H dv]
    kept = (zA, zB) if held == "outputs" else act.HeadSums.of(side(zA), side(zB), H, block=step)
    got = act.head_matching(act.Pair(none, (kept,), ()), 0, G, WA, back(WB))
    xa, xb = torch.einsum("hnv,hvd->hnd", zA, WA), back(torch.einsum("hnv,hvd->hnd", zB, WB))
    if held == "sums":
        inner, na, nb = kept.inner(WA, back(WB))
        sums = [(inner, torch.einsum("hnd,knd->hk", xa, xb)), (na, xa.square().sum((1, 2))),
                (nb, xb.square().sum((1, 2)))]
        errs = [float((x - y).norm() / y.norm()) for x, y in sums]
        assert max(errs) <= 1e-12, f"the sums' inner products and norms against the writes': {errs}"
    fa, fb = (x.flatten(1) / x.flatten(1).norm(dim=1, keepdim=True) for x in (xa, xb))
    want = act.assign_heads(1 - fa @ fb.T, G)
    assert torch.equal(got, want) and torch.equal(got, shuffle), f"{got.tolist()} vs {want.tolist()}"


@pytest.mark.parametrize("family", ["llama-gqa", "llama-tied", "gpt2-untied", "bert"])
def test_activations_hold_no_head_and_the_table_as_stored(family, tmp_path):
    """`collect` runs the layers without the head: an untied head's weights are never held, the
    embedding table is held as the checkpoint stores it (bfloat16 here, 1/4 of float64), and the
    activations are still the whole float64 model's (its bfloat16 weights converted)."""
    from attnid.adapters.base import build_hf_model
    from attnid.checkpoint.load import open_checkpoint
    from attnid.checkpoint.units import open_units
    from attnid.whole.align.activations import collect
    from attnid.whole.layerwise import LayerwiseLM, Segment

    model = build_hf_model(FAMILIES[family], head=True)
    with torch.no_grad():
        model.load_state_dict(tiny_model(FAMILIES[family]).state_dict())
    for p in model.parameters():  # the weights only: position buffers (RoPE's) as they were
        p.data = p.data.to(torch.bfloat16)
    model.save_pretrained(tmp_path / "m")
    for p in model.parameters():
        p.data = p.data.to(torch.float64)
    src = open_units(open_checkpoint(tmp_path / "m"))
    lm = LayerwiseLM(src, torch.float64, eager=True, head=False)
    inp, out = lm.model.get_input_embeddings(), lm.model.get_output_embeddings()
    untied = out.weight.data_ptr() != inp.weight.data_ptr()
    if untied:
        assert out.weight.is_meta, f"{family}: the untied head is held ({out.weight.dtype})"
    held = [p for p in lm.model.parameters() if not p.is_meta]
    assert all(p.dtype == torch.float64 for p in held), f"{family}: {[p.dtype for p in held]}"
    lm.run(Segment(src, src), [0.0], torch.zeros(1, 3, dtype=torch.long), 1,
           lambda m, x: m.base_model(input_ids=x))
    assert inp.weight.dtype == torch.bfloat16, f"{family}: the table is held in {inp.weight.dtype}"
    ids = torch.randint(0, model.config.vocab_size, (3, 5), generator=torch.Generator().manual_seed(1))
    states, values, neurons = whole(model, ids, batch=2)
    got = collect(src, ids, batch=2)
    errs = [rel(got.stream, states)] + [rel(a, b) for a, b in zip(got.values, values, strict=True)]
    errs += [rel(a, b) for a, b in zip(got.neurons, neurons, strict=True)]
    assert max(errs) <= 1e-12, f"{family}: relative errors {errs}"


def _centred(X: torch.Tensor, layer_norm: bool) -> torch.Tensor:
    return X - X.mean(-1, keepdim=True) if layer_norm else X


@pytest.mark.parametrize("layer_norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_stream_sums_give_the_fits_on_the_states(layer_norm, dtype, monkeypatch):
    """The stream's rotation and permutation from `StreamSums` (summed a block of rows at a time,
    float64) are those fitted on the stacked states themselves: Procrustes on the (centred)
    states and linear assignment on the columns' correlations; both recover the rotation and
    the permutation B was made with (plus noise)."""
    from attnid.whole.align import activations as act
    from attnid.whole.fit.match import assignment
    from attnid.whole.fit.rotation import procrustes

    g = torch.Generator().manual_seed(3)
    n, d = 200, 12
    SA = (torch.randn(n, d, generator=g, dtype=torch.float64) + 3.0 * torch.rand(d, generator=g,
                                                                               dtype=torch.float64))
    Q = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))[0]
    if layer_norm:  # a rotation of the centred stream: Q 1 = 1
        from attnid.whole.fit.rotation import procrustes_cross
        Q = procrustes_cross(Q, True)
    perm = torch.randperm(d, generator=g)
    noise = lambda: 1e-3 * torch.randn(n, d, generator=g, dtype=torch.float64)  # noqa: E731
    SBr, SBp = SA @ Q.T + noise(), SA[:, torch.argsort(perm)] + noise()  # B's coordinate perm[i] is A's i
    SA, SBr, SBp = SA.to(dtype), SBr.to(dtype), SBp.to(dtype)
    monkeypatch.setattr(act.StreamSums.of.__func__, "__defaults__", (7,))  # blocks of 7 rows
    sums = act.StreamSums.of(SA, SBr)
    got = sums.rotation(layer_norm)
    want = procrustes(_centred(SBr.double(), layer_norm), _centred(SA.double(), layer_norm), layer_norm)
    err = float((got - want).norm() / want.norm())
    assert err <= 1e-10, f"rotation from the sums against the states: relative error {err:.2e}"
    assert float((got - Q).norm() / Q.norm()) <= 1e-2, "the rotation B was made with is not recovered"
    p = act.StreamSums.of(SA, SBp).permutation()
    std = lambda X: (X - X.mean(0)) / (X - X.mean(0)).norm(dim=0)  # noqa: E731
    direct = assignment(-(std(SA.double()).T @ std(SBp.double())))
    assert torch.equal(p, direct) and torch.equal(p, perm), f"{p.tolist()} {direct.tolist()} {perm.tolist()}"
    same = act.StreamSums.of(SA, SA.clone())
    assert same.equal and torch.equal(same.rotation(layer_norm), torch.eye(d, dtype=torch.float64))


def test_activations_are_kept_in_the_checkpoints_compute_dtype(tmp_path, monkeypatch):
    """A bfloat16 checkpoint's activations are collected and kept in float32 (its gauge fits'
    arithmetic), each within float32 rounding of the float64 ones; a model in memory (float64)
    keeps float64. `pair` then matches every layer's neurons as
    `neuron_matching` does on the activations, and lets them go."""
    from attnid.adapters.base import build_hf_model
    from attnid.checkpoint.load import open_checkpoint
    from attnid.checkpoint.units import open_units
    from attnid.whole.align import activations as act

    cfg = FAMILIES["llama-gqa"]
    model = build_hf_model(cfg, head=True)
    with torch.no_grad():
        model.load_state_dict(tiny_model(cfg).state_dict())
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    model.save_pretrained(tmp_path / "m")
    src = open_units(open_checkpoint(tmp_path / "m"))
    assert act.keep_dtype(src) == torch.float32
    assert act.keep_dtype(ModelTensors.of(tiny_model(cfg))) == torch.float64
    ids = torch.randint(0, model.config.vocab_size, (3, 5), generator=torch.Generator().manual_seed(1))
    wide, kept = act.collect(src, ids, batch=2), act.collect(src, ids, batch=2, dtype=torch.float32)
    pieces = [(kept.stream, wide.stream), *zip(kept.values, wide.values, strict=True),
              *zip(kept.neurons, wide.neurons, strict=True)]
    assert all(x.dtype == torch.float32 for x, _ in pieces)
    errs = [rel(x.double(), y) for x, y in pieces]
    assert max(errs) <= 4e-6, f"float32 activations against float64: relative errors {errs}"
    want = [act.neuron_matching(kept, kept, i, signed=False) for i in range(len(kept.neurons))]
    other = act.collect(src, ids, batch=2, dtype=torch.float32)
    shuffled = [torch.randperm(x.shape[1], generator=torch.Generator().manual_seed(i))
                for i, x in enumerate(other.neurons)]
    other.neurons[:] = [x[:, s] for x, s in zip(other.neurons, shuffled, strict=True)]
    monkeypatch.setattr(act.HeadSums, "smaller", staticmethod(lambda *_: False))  # the outputs kept
    got = act.pair(kept, other, signed=False)
    assert all(torch.equal(w, torch.arange(len(w))) for w in want)
    back = [torch.argsort(s).tolist() for s in shuffled]  # A's neuron j is B's column perm[j]
    assert [g.tolist() for g in got.neurons] == back, f"neurons matched {got.neurons} against {back}"
    assert kept.neurons == [] and other.neurons == [], "the neurons' activations are still held"
    assert len(got.values) == len(kept.values) and got.values[0][0] is kept.values[0]


@pytest.mark.parametrize("family", ["llama-gqa", "gpt2-untied", "bert"])
@pytest.mark.parametrize("groups", ["batches of 2", "more chunks than forwards"])
@pytest.mark.parametrize("heads", ["outputs", "sums", "sums in files"])
def test_both_models_run_together_reduce_as_each_alone(family, groups, heads, tmp_path, monkeypatch):
    """`collect_pair` (A and B run as the two ends of one segment, each layer reduced once both
    models' rows of it are in) gives what each model collected alone and then reduced (`pair`)
    gives: the same stream sums and head outputs (or their `HeadSums`, in memory or spilled to
    files that go with the pair) to the rounding of the kept dtype (the groupings run batches
    of different sizes) and the same neuron matchings; from memory and from bfloat16
    checkpoints (float32 kept). Every chunk is in one group, the layers streamed once, also
    when the chunks are more than the runner's forwards in flight hold in batches of 2 (a
    forward a model here): then a forward runs them all (`pair_batch`)."""
    from attnid.adapters.base import build_hf_model
    from attnid.checkpoint.load import open_checkpoint
    from attnid.checkpoint.units import open_units
    from attnid.whole import layerwise
    from attnid.whole.align import activations as act

    if groups != "batches of 2":
        monkeypatch.setattr(layerwise, "HIDDEN_BUDGET", 1)  # not collect_pair's bound
        monkeypatch.setattr(layerwise, "MAX_GATES", 2)  # a forward a point
    streamed, sizes = [], []
    group = layerwise.LayerwiseLM._group

    def counted(self, path, ts, chunks, work, progress):
        streamed.append(len(ts))
        sizes.extend(len(x) for x in chunks)
        return group(self, path, ts, chunks, work, progress)

    monkeypatch.setattr(layerwise.LayerwiseLM, "_group", counted)
    monkeypatch.setattr(act.HeadSums, "smaller", staticmethod(lambda *_: heads != "outputs"))
    cfg = FAMILIES[family]
    models = [tiny_model(cfg, seed=s) for s in (0, 1)]
    for k, m in enumerate(models):
        hf = build_hf_model(cfg, head=True)
        with torch.no_grad():
            hf.load_state_dict(m.state_dict())
        for p in hf.parameters():
            p.data = p.data.to(torch.bfloat16)
        hf.save_pretrained(tmp_path / str(k))
    ids = torch.randint(0, models[0].config.vocab_size, (5, 4), generator=torch.Generator().manual_seed(2))
    signed = ModelTensors.of(models[0]).layout.mlp != "gated"
    for where, (A, B) in (("memory", [ModelTensors.of(m) for m in models]),
                          ("checkpoint", [open_units(open_checkpoint(tmp_path / str(k))) for k in (0, 1)])):
        dtype = act.keep_dtype(B)
        want = act.pair(act.collect(A, ids, batch=2, dtype=dtype), act.collect(B, ids, batch=2, dtype=dtype),
                        signed)
        streamed.clear()
        sizes.clear()
        got = act.collect_pair(A, B, ids, batch=2, dtype=dtype, signed=signed, spill=heads == "sums in files")
        case = f"{family} from {where}, {groups}"
        want_sizes = [2, 2, 1] if groups == "batches of 2" else [5]
        assert streamed == [2] and sizes == want_sizes, f"{case}: groups {streamed}, forwards {sizes}"
        files = [v.path for v in got.values if isinstance(v, act.Spilled)]
        assert len(files) == (len(got.values) if heads == "sums in files" else 0), f"{case}: {got.values}"
        held = [v.load() if isinstance(v, act.Spilled) else v for v in got.values]
        tol = 1e-12 if dtype == torch.float64 else 1e-6
        for name in ("cross", "sum_a", "sum_b", "sq_a", "sq_b"):
            x, y = getattr(got.stream, name), getattr(want.stream, name)
            err = float((x - y).norm() / y.norm())
            assert err <= tol, f"{case}: stream {name} relative error {err:.1e}"
        assert got.stream.n == want.stream.n and got.stream.equal == want.stream.equal == False, case  # noqa: E712
        if heads != "outputs":
            pairs = [((g.cross, g.gram_a, g.gram_b), (w.cross, w.gram_a, w.gram_b))
                     for g, w in zip(held, want.values, strict=True)]
        else:
            pairs = list(zip(held, want.values, strict=True))
        errs = [rel(x.double(), y.double()) for gv, wv in pairs for x, y in zip(gv, wv, strict=True)]
        assert max(errs) <= tol, f"{case}: head {heads} relative errors {errs}"
        assert all(x.dtype == dtype for v, _ in pairs for x in v), f"{case}: not kept in {dtype}"
        assert [p.tolist() for p in got.neurons] == [p.tolist() for p in want.neurons], f"{case}: neurons"
        assert all(f.exists() for f in files), f"{case}: a spilled file is gone while the pair is held"
        del got, held, pairs  # the last references to the folder: it goes at once
        assert not any(f.exists() or f.parent.exists() for f in files), f"{case}: spilled files left behind"


@pytest.mark.parametrize("level", [0.1, 1000.3])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_constant_stream_coordinate_correlates_with_nothing(level, dtype):
    """A constant coordinate of the stream (variance 0, its sums' cancellation left: about
    1e-13, or 2e-4 at a level near 1,000) correlates with nothing, as a centred column of zeros
    does, instead of dividing that rounding by a clamped zero; the other coordinates are matched
    as B was made (two pairs swapped)."""
    from attnid.whole.align import activations as act

    g = torch.Generator().manual_seed(5)
    SA = torch.randn(4864, 6, generator=g, dtype=torch.float64)
    SA[:, 2] = level
    swap = torch.tensor([1, 0, 2, 3, 5, 4])
    SA, SB = SA.to(dtype), SA[:, swap].to(dtype)
    got = act.StreamSums.of(SA, SB).permutation()
    assert got.tolist() == swap.tolist(), f"level {level}, {dtype}: {got.tolist()}"
