"""Whole-model closed form against the whole-model arbiter on Hugging Face's own classes.

Each tiny config is built with the architecture's own class in float64 (RMSNorm and softmax
kept in float64), at a random generic point; the function is the one the architecture
names (centred logits for LM heads, hidden states for a bare model)."""

import sys

import pytest

pytest.importorskip("transformers")

from attnid.adapters.registry import adapter_for
from attnid.testing.catalogue import WHOLE_CASES as CASES
from attnid.theory.whole import count_structure
from attnid.whole.check import arbiter_whole, verify_whole
from attnid.whole.model import count_model


@pytest.mark.parametrize("name", list(CASES))
def test_closed_form_equals_arbiter(name):
    config = CASES[name]
    v = verify_whole(config, name, seed=0, confirm=False)
    d = v.to_dict()
    assert v.agree, (f"{name}: params {d['total']} vs {d['total_theory']}, unidentified arbiter "
                     f"{d['unidentified_numeric']} vs theory {d['unidentified_theory']}, near "
                     f"{d['near_unidentified_numeric']} vs {d['near_unidentified_theory']}, "
                     f"components {d['components']}")
    assert d["spectral_gap"] > 1e6, f"{name}: spectral gap only {d['spectral_gap']:.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama-untied", "gpt2-tied", "neox-parallel"])
def test_closed_form_stable_at_second_seed(name):
    assert verify_whole(CASES[name], name, seed=3, confirm=True).agree


def test_float32_rounding_would_hide_symmetries():
    """Without Float64Mode the RMSNorm and softmax casts round at 1e-7: the exact symmetries
    are no longer exact at the float64 threshold (the trap this arbiter avoids)."""
    import attnid.whole.check as check

    config = CASES["llama-untied"]
    exact = arbiter_whole(config, near=False).unidentified
    real = check.Float64Mode
    try:
        check.Float64Mode = _NoMode
        rounded = arbiter_whole(config, near=False).unidentified
    finally:
        check.Float64Mode = real
    assert rounded < exact, f"float32 casts found {rounded} null directions, float64 {exact}"


class _NoMode:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@pytest.mark.parametrize("model", ["gpt2", "bert-base-uncased", "roberta-base", "all-MiniLM-L6-v2",
                                   "Llama-2-7b", "Qwen3-8B", "pythia-1.4b", "falcon-7b",
                                   "gemma-7b", "Phi-3-mini-4k-instruct", "Qwen2.5-0.5B"])
def test_total_equals_hf_parameter_count(model):
    from attnid.adapters.config import load_config
    from attnid.report.models import model_params

    _, config = load_config(model)
    c = count_model(config)
    assert c.method == "closed form"
    assert c.total == model_params(config), f"{model}: {c.total} vs HF {model_params(config)}"
    assert c.identified + c.unidentified == c.total


@pytest.mark.parametrize("family", ["llama-untied", "gpt2-untied", "qwen2-tied"])
def test_a_model_object_counts_as_its_config(family, tmp_path):
    """`count_model` of a transformers model built from a config object (no ``architectures``)
    counts the model it is (its parameters, head included), as its saved config does; a
    path object, the bare model inside it, and refused types (one line each)."""
    from pathlib import Path

    transformers = pytest.importorskip("transformers")
    import torch

    from attnid.errors import AttnidError

    config = {k: v for k, v in CASES[family].items() if k != "architectures"}
    cls = getattr(transformers, CASES[family]["architectures"][0])
    model = cls(transformers.AutoConfig.for_model(**config))
    assert not model.config.architectures
    c = count_model(model)
    params = sum(p.numel() for p in model.parameters())  # a tied table once
    assert c.total == params, f"{family}: {c.total} counted, {params} parameters"
    model.save_pretrained(tmp_path)
    saved = count_model(Path(tmp_path))
    assert (saved.total, saved.unidentified) == (c.total, c.unidentified), (saved, c)
    bare = count_model(model.base_model)  # the bare model: its own class, though its config names the head's
    assert bare.total == sum(p.numel() for p in model.base_model.parameters()), (family, bare.total)
    with pytest.raises(AttnidError, match="got int"):
        count_model(3)
    with pytest.raises(AttnidError, match="not a transformers model"):
        count_model(torch.nn.Linear(2, 2))


def test_import_attnid_does_not_import_transformers():
    import subprocess

    code = "import sys, attnid; attnid.count_model; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_roberta_counts_its_unreachable_position_rows():
    """roberta-base: position rows 0 .. padding_idx - 1 (= row 0) are never read."""
    c = count_model("roberta-base")
    assert c.components["unreachable_positions"].params == 768
    assert c.components["unreachable_positions"].unidentified == 768
    assert c.components["padding"].unidentified == 1  # tied head: only the 1/g direction


def test_structure_names_the_function():
    llama = adapter_for(CASES["llama-bare-model"]).whole(CASES["llama-bare-model"])
    assert llama.function == "hidden"
    assert count_structure(llama).components["norms"].unidentified == 2 * 8  # final gain is seen
