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


@pytest.mark.parametrize("block", ["one block", "a token a block"])
@pytest.mark.parametrize("frame", ["stream rotated", "stream permuted"])
def test_head_matching_from_outputs_is_the_cosine_of_the_writes(block, frame, monkeypatch):
    """Heads matched from their outputs and the output projections (B's in A's stream frame),
    a token block at a time, equal those matched on the writes themselves ``z_h W_O^h``
    (B's moved into A's frame afterwards): the same assignment, which is the shuffle B was
    built with (B's heads A's, shuffled within kv groups, plus noise)."""
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
    a, b = (act.Activations(torch.zeros(1, d), [z], []) for z in (zA, zB))
    got = act.head_matching(a, b, 0, G, WA, back(WB))
    xa, xb = torch.einsum("hnv,hvd->hnd", zA, WA), back(torch.einsum("hnv,hvd->hnd", zB, WB))
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
