"""One home per family: every registered family's file gives every part (`attnid.adapters.base.
PARTS`: config -> spec, tensor names, structure, whole-model layout, layer finder), or says in
``lacks`` why not; each part is exercised on the family's own tiny Hugging Face model, and the
parts agree with one another (the structure with the layout, the names with the layout's
layers, the finder with the specs)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import nn

from attnid import AttnidError
from attnid.adapters.base import PARTS, Adapter, build_hf_model
from attnid.adapters.config import bundled, load_config
from attnid.adapters.families.llama import Llama
from attnid.adapters.layout import Layout, Lin
from attnid.adapters.registry import families
from attnid.layers import find_layers
from attnid.testing.catalogue import WHOLE_CASES
from attnid.whole.transforms.layout import FAMILIES, layout_of

FAMILY = families()
# families no bundled config or WHOLE_CASES entry names: (the config to start from, overrides)
DERIVED = {"deepseek_v2": ("DeepSeek-V3", {"architectures": ["DeepseekV2ForCausalLM"]})}


@functools.cache
def _bundled_by_type() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name in bundled():
        c = load_config(name)[1]
        out.setdefault(c["model_type"], c)
    return out


def tiny_config(model_type: str) -> dict[str, Any]:
    """The family's first WHOLE_CASES config, else a bundled config of it reduced by its adapter."""
    for c in WHOLE_CASES.values():
        if c["model_type"] == model_type:
            return c
    start = _bundled_by_type().get(model_type)
    if start is None and model_type in DERIVED:
        name, over = DERIVED[model_type]
        start = {**load_config(name)[1], "model_type": model_type, **over}
    if start is None:
        pytest.fail(f"family {model_type!r} has no tiny config: add one to "
                    "attnid.testing.catalogue.WHOLE_CASES (or bundle its config.json)")
    return FAMILY[model_type]().reduce(start)


@functools.cache
def tiny(model_type: str) -> nn.Module:
    return build_hf_model(tiny_config(model_type), head=True)


def _prefix(adapter: Adapter, model: nn.Module, config: dict[str, Any]) -> str:
    first = adapter.names(0, adapter.specs(config)[0])[0]
    found = [n[: -len(first)] for n in model.state_dict() if n.endswith(first)]
    assert found, f"no tensor ends with {first!r}"
    return found[0]


def check_spec(adapter: Adapter, config: dict[str, Any], model: nn.Module) -> None:
    specs, hc = adapter.specs(config), model.config
    assert len(specs) == hc.num_hidden_layers, (len(specs), hc.num_hidden_layers)
    assert {(s.d_model, s.n_heads) for s in specs} == {(hc.hidden_size, hc.num_attention_heads)}, specs[0]


def check_names(adapter: Adapter, config: dict[str, Any], model: nn.Module) -> None:
    state, p = model.state_dict(), _prefix(adapter, model, config)
    for i, spec in enumerate(adapter.specs(config)):
        names = adapter.names(i, spec)
        absent = [n for n in names if p + n not in state]
        assert not absent, f"layer {i}: no tensor {p + absent[0]}"
        t = {n: state[p + n] for n in names}
        back = adapter.write(adapter.read(t, i, spec), i)
        assert set(back) == set(names), sorted(set(back) ^ set(names))
        err = max((back[n] - t[n]).abs().max().item() for n in names)
        assert err == 0, f"layer {i}: read then write changes the tensors by {err:.3g}"


def _paths(lay: Layout) -> list[str]:
    lins: list[Lin] = [x for n in lay.norms for x in (*n.readers, n.absorb) if x is not None]
    lins += [x for pair in (*lay.writers, *lay.mlps) for x in pair]
    lins += [g for g in (*lay.gates, lay.unembed) if g is not None]
    norms = [n.path for n in (*lay.norms, lay.final) if n is not None]
    return [x.path for x in lins] + norms + list(lay.tables) + list(lay.attn_norms)


def check_layout(adapter: Adapter, config: dict[str, Any], model: nn.Module) -> None:
    lay, n = adapter.layout(model), model.config.num_hidden_layers
    assert len(lay.writers) == len(lay.mlps) == len(lay.layers) == n, (len(lay.writers), n)
    absent = [x for x in _paths(lay) if not hasattr(_module(model, x), "weight")]
    assert not absent, f"no module with a weight at {absent[0]!r}"
    assert _paths(layout_of(model)) == _paths(lay), "layout_of does not reach the family's layout"
    if "names" not in adapter.lacks:  # each layer's attention tensors lie under its layout prefix
        p = _prefix(adapter, model, config)
        for i, spec in enumerate(adapter.specs(config)):
            outside = [x for x in adapter.names(i, spec) if not (p + x).startswith(lay.layers[i])]
            assert not outside, f"layer {i}: {p + outside[0]} is not under {lay.layers[i]!r}"


def _module(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def check_structure(adapter: Adapter, config: dict[str, Any], model: nn.Module) -> None:
    st, hc = adapter.whole(config), model.config
    assert (st.n_layers, st.d_model, st.vocab) == (hc.num_hidden_layers, hc.hidden_size, hc.vocab_size), st
    if "layout" in adapter.lacks:
        return
    lay = adapter.layout(model)  # the structure the count reads agrees with the layout transforms read
    said = dict(norm=st.norm, parallel=st.layout == "parallel", post=st.layout == "post",
                gated=st.mlp == "gated", head=st.function == "logprobs", padding_idx=st.padding_idx)
    seen = dict(norm=lay.norm, parallel=lay.parallel, post=lay.post, gated=lay.mlp == "gated",
                head=lay.unembed is not None, padding_idx=lay.padding_idx)
    assert said == seen, f"structure {said} but layout {seen}"
    if lay.unembed is not None:
        assert st.tied == lay.tied, (st.tied, lay.tied)


def check_layers(adapter: Adapter, config: dict[str, Any], model: nn.Module) -> None:
    found, specs = adapter.layers(model), adapter.specs(config)
    assert [a.spec for a in found] == specs, f"{len(found)} layers found, {len(specs)} specs"
    assert [a.name for a in find_layers(model)] == [a.name for a in found], "find_layers misses them"
    for a in found:
        w = a.get()
        assert w.spec == a.spec and all(torch.isfinite(t).all() for _, t in w.items()), a.name


CHECKS: dict[str, Callable[[Adapter, dict[str, Any], nn.Module], None]] = {
    "spec": check_spec, "names": check_names, "structure": check_structure, "layout": check_layout,
    "layers": check_layers}


def check_part(adapter: Adapter, part: str, config: dict[str, Any], model: nn.Module) -> None:
    """Exercise ``part`` of ``adapter``'s family, or its declared lack; an AssertionError names
    the family and the part."""
    where = f"family {adapter.model_type!r}, part {part!r} ({PARTS[part]})"
    if part in adapter.lacks:
        assert adapter.lacks[part].strip(), f"{where}: lacks it without saying why"
        return _check_refused(adapter, part, model, where)
    try:
        CHECKS[part](adapter, config, model)
    except (AssertionError, AttnidError, AttributeError, KeyError) as e:
        raise AssertionError(f"{where} is missing or wrong: {type(e).__name__}: {e}") from e


def _check_refused(adapter: Adapter, part: str, model: nn.Module, where: str) -> None:
    """A lacked part is refused where it would be used, never silently guessed."""
    if part == "layout":
        assert model.config.model_type not in FAMILIES, f"{where}: lacked, yet registered"
        with pytest.raises(AttnidError, match="no whole-model transforms"):
            layout_of(model)
    elif part == "layers":
        assert adapter.layers(model) == [], f"{where}: lacked, yet it finds layers"
    elif part == "names":
        assert not adapter.closed_form, f"{where}: lacked, yet checkpoints of it are read"


def test_parts_and_checks_agree():
    assert set(CHECKS) == set(PARTS)
    assert len(FAMILY) >= 14 and {"llama", "gpt2", "bert", "falcon"} <= set(FAMILY)


@pytest.mark.parametrize("model_type", list(FAMILY))
def test_lacks_names_only_parts(model_type):
    unknown = set(FAMILY[model_type].lacks) - set(PARTS)
    assert not unknown, f"family {model_type!r} lacks unknown parts {unknown} (parts: {list(PARTS)})"


@pytest.mark.parametrize("part", list(PARTS))
@pytest.mark.parametrize("model_type", list(FAMILY))
def test_every_family_has_every_part(model_type, part):
    check_part(FAMILY[model_type](), part, tiny_config(model_type), tiny(model_type))


class _Renamed(Llama):
    layer_prefix = "blocks.{i}."  # a family file whose tensor names are not its model's


class _Misplaced(Llama):
    def layout(self, model: nn.Module) -> Layout:  # a table the model does not have
        return replace(super().layout(model), tables=("model.embed_positions",))


class _Parallel(Llama):
    def layout(self, model: nn.Module) -> Layout:  # a layout the structure does not describe
        return replace(super().layout(model), parallel=True)


@pytest.mark.parametrize("adapter, part, symptom", [
    (_Renamed(), "names", "no tensor ends with"), (_Renamed(), "layers", "0 layers found"),
    (_Misplaced(), "layout", "no module with a weight at 'model.embed_positions'"),
    (_Parallel(), "structure", "structure .* but layout"),
], ids=["names", "layers", "layout", "structure"])
def test_the_part_check_can_fail(adapter, part, symptom):
    with pytest.raises(AssertionError, match=rf"family 'llama', part '{part}'.*{symptom}"):
        check_part(adapter, part, tiny_config("llama"), tiny("llama"))


def test_a_family_without_a_tiny_config_is_named():
    with pytest.raises(pytest.fail.Exception, match="family 'my_model' has no tiny config"):
        tiny_config("my_model")
