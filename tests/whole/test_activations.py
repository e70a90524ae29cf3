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
    """What `collect` keeps, from the whole float64 model (eager attention) and its hooks."""
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
    heads = []
    for i in range(L):
        s = m.spec(i)
        z = torch.cat(o_in[i]).reshape(-1, s.n_heads, s.v_head_dim)
        W = m.weight(lay.writers[i][0]).T.reshape(s.n_heads, s.v_head_dim, -1)
        heads.append(torch.einsum("nhv,hvd->hnd", z, W))
    return torch.cat(states), heads, [torch.cat(x) for x in d_in]


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
    states, heads, neurons = whole(model, ids, batch=2)
    model.save_pretrained(tmp_path / "m")
    for where, src in (("memory", ModelTensors.of(model)),
                       ("checkpoint", open_units(open_checkpoint(tmp_path / "m")))):
        got = collect(src, ids, batch=2)
        errs = [rel(got.stream, states)] + [rel(a, b) for a, b in zip(got.heads, heads, strict=True)]
        errs += [rel(a, b) for a, b in zip(got.neurons, neurons, strict=True)]
        assert max(errs) <= 1e-12, f"{family} from {where}, {groups}: relative errors {errs}"
