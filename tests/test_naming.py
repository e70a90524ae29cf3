"""The renames of issue 26 (one word for one thing, docs/glossary.md): each old name still
reaches the new one for one release, an old keyword says so once (``DeprecationWarning``) and
gives exactly what the new one gives, and the old JSON key carries the new key's value."""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch

from attnid import Attention, AttentionSpec, randomize_
from attnid.weights import AttentionWeights

# (module, old name, new name): the old one is the same object as the new one
ALIASES = [
    ("attnid.weights", "group_sum_out", "kv_group_sum_out"),
    ("attnid.symmetry.conserved", "group_norm", "kv_group_norm"),
    ("attnid.symmetry.conserved", "group_trace", "kv_group_trace"),
    ("attnid.whole.transforms.heads", "group_permutation", "kv_group_permutation"),
    ("attnid.symmetry.rebalance", "Group", "QKSubgroup"),
    ("attnid.whole.align", "Group", "Subgroup"),
    ("attnid.whole.align", "GROUPS", "SUBGROUPS"),
    ("attnid.structure", "Layout", "ResidualLayout"),
]


@pytest.mark.parametrize(("module", "old", "new"), ALIASES, ids=[f"{m}.{o}" for m, o, _ in ALIASES])
def test_an_old_name_is_the_new_one(module, old, new):
    mod = importlib.import_module(module)
    assert getattr(mod, old) is getattr(mod, new), f"{module}.{old} is not {module}.{new}"


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_group_size_is_kv_group_size(n_kv_heads):
    spec = AttentionSpec(d_model=16, n_heads=4, n_kv_heads=n_kv_heads)
    assert spec.group_size == spec.kv_group_size == 4 // n_kv_heads


def _weights() -> AttentionWeights:
    spec = AttentionSpec(d_model=8, n_heads=4, n_kv_heads=2, bias="qkv")
    return AttentionWeights.from_module(randomize_(Attention(spec).double(), 0))


def _same(a: AttentionWeights, b: AttentionWeights) -> bool:
    return all(torch.equal(a[n], b[n]) for n, _ in a.items())


@pytest.mark.parametrize("fn", ["rebalance", "rebalance_qk"])
@pytest.mark.parametrize("subgroup", ["auto", "gl", "commutant"])
def test_the_group_keyword_warns_once_and_acts_as_subgroup(fn, subgroup):
    f = getattr(importlib.import_module("attnid.symmetry.rebalance"), fn)
    w = _weights()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        new = f(w, subgroup=subgroup)
        assert caught == [], [str(c.message) for c in caught]
        old = f(w, group=subgroup)
    said = [c for c in caught if issubclass(c.category, DeprecationWarning)]
    assert len(said) == 1 and "subgroup=" in str(said[0].message), [str(c.message) for c in caught]
    assert said[0].filename == __file__, f"the warning points at {said[0].filename}, not the caller"
    assert _same(new, old), f"{fn}(group={subgroup!r}) differs from {fn}(subgroup={subgroup!r})"


def test_align_group_keyword_and_the_old_json_key():
    pytest.importorskip("transformers")
    from attnid.whole.align import align
    from attnid.whole.check import tiny_model

    cfg = dict(model_type="bert", architectures=["BertForMaskedLM"], hidden_size=8, num_attention_heads=2,
               num_hidden_layers=1, intermediate_size=16, vocab_size=11, max_position_embeddings=8,
               type_vocab_size=1)
    a, b = tiny_model(cfg, 0), tiny_model(cfg, 1)
    new = align(a, b, subgroup="permutations")
    with pytest.warns(DeprecationWarning, match="subgroup="):
        old = align(a, b, group="permutations")
    assert new.subgroup == old.subgroup == old.group == "permutations"
    assert new.aligned_distance == old.aligned_distance, (new.aligned_distance, old.aligned_distance)
    js = new.to_dict()
    assert js["subgroup"] == js["group"] == "permutations", js
    assert new.report() == js
