"""Every whole-model symmetry preserves the function of Hugging Face's own model in float64
(log-probabilities for LM heads, hidden states for a bare model), returns a new model and
leaves its input untouched."""

import pytest
import torch

pytest.importorskip("transformers")

from attnid.testing.catalogue import (
    BERT,
    GPT2,
    GPT2_UNTIED,
    LLAMA,
    NEOX,
    NEOX_NO_BIAS,
    ROBERTA,
)
from attnid.testing.catalogue import TRANSFORM_CASES as CASES_T
from attnid.testing.catalogue import positive as r
from attnid.testing.catalogue import randn64 as randn
from attnid.testing.catalogue import random_rotation as rotation
from attnid.testing.models import model_function as function
from attnid.whole import transforms as T
from attnid.whole.check import tiny_model


@pytest.mark.parametrize("name", list(CASES_T))
def test_transform_preserves_the_function(name):
    config, transform = CASES_T[name]
    model = tiny_model(config, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    new = transform(model)
    a, b = function(model), function(new)
    rel = float((a - b).norm() / a.norm())
    assert rel < 1e-10, f"{name}: the function changed by {rel:.2e} (relative)"
    moved = max(float((new.state_dict()[k] - v).abs().max()) for k, v in before.items())
    assert moved > 1e-3, f"{name} did not move any parameter"
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items()), "input mutated"
    assert new is not model


REFUSED = {
    "tied-rotation": (GPT2, lambda m: T.residual_rotation(m, torch.eye(8, dtype=torch.float64))),
    "layernorm-rotation-moving-ones": (GPT2_UNTIED, lambda m: T.residual_rotation(
        m, rotation(8, 3, False))),
    "post-ln-gain": (BERT, lambda m: T.norm_gain_transfer(m, "bert.embeddings.LayerNorm", r(8, 1))),
    "gelu-scaling": (GPT2, lambda m: T.mlp_scaling(m, 0, r(6, 1))),
    "relu-negative-scale": (dict(GPT2, activation_function="relu"),
                            lambda m: T.mlp_scaling(m, 0, -r(6, 1))),
    "tied-token-rows": (GPT2, lambda m: T.table_shift(m, 0, randn(12, seed=1))),
    "rms-centring": (LLAMA, lambda m: T.centring_move(m, "model.norm", 0, randn(12, seed=1))),
    "rotated-key-offset": (NEOX_NO_BIAS, lambda m: T.key_offset(m, 0, randn(2, 4, seed=1))),
    "biased-attention-offset": (NEOX, lambda m: T.value_offset(m, 0, 1.0)),
    "tied-pad-row-off-direction": (ROBERTA, lambda m: T.padding_translation(m, randn(8, seed=1))),
    "bert-has-no-padding-offset": (BERT, lambda m: T.unreachable_positions_move(
        m, randn(1, 8, seed=1))),
    "sequential-parallel-bias": (GPT2, lambda m: T.parallel_bias_transfer(m, 0, randn(8, seed=1))),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_transform_refuses_what_is_no_symmetry(name):
    config, transform = REFUSED[name]
    with pytest.raises(ValueError):
        transform(tiny_model(config, seed=0))


@pytest.mark.parametrize("config", [LLAMA, GPT2, NEOX, BERT], ids=["llama", "gpt2-tied", "neox", "bert"])
def test_fold_norm_gains_sets_every_foldable_gain_to_one(config):
    new = T.fold_norm_gains(tiny_model(config, seed=0))
    lay = T.layout_of(new)
    foldable = [n.path for n in lay.norms if n.absorb is None and n.gain]
    assert foldable, "nothing to fold"
    for path in foldable:
        g = new.get_submodule(path).weight
        assert torch.equal(g, torch.ones_like(g)), f"{path}: gain {g}"
