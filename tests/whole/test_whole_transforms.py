"""The whole-model symmetries preserve the function of Hugging Face's own Llama in float64."""

import pytest
import torch

pytest.importorskip("transformers")

from attnid.whole import transforms as T
from attnid.whole.check import Float64Mode, tiny_model

CONFIG = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=8,
              num_attention_heads=2, num_key_value_heads=2, intermediate_size=6,
              num_hidden_layers=2, vocab_size=12, max_position_embeddings=16, rms_norm_eps=1e-6,
              tie_word_embeddings=False, pad_token_id=None, bos_token_id=None, eos_token_id=None)


def logprobs(model):
    ids = torch.randint(0, 12, (3, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), Float64Mode():
        return torch.log_softmax(model(input_ids=ids).logits, -1)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


TRANSFORMS = {
    "norm_gain_transfer": lambda m: T.norm_gain_transfer(
        m, "model.layers.1.post_attention_layernorm", 0.5 + torch.rand(8, generator=_gen(1))),
    "final_norm_gain_transfer": lambda m: T.norm_gain_transfer(
        m, "model.norm", 0.5 + torch.rand(8, generator=_gen(2))),
    "residual_rotation": lambda m: T.residual_rotation(
        m, torch.linalg.qr(torch.randn(8, 8, generator=_gen(3), dtype=torch.float64))[0]),
    "mlp_scaling": lambda m: T.mlp_scaling(m, 0, 0.5 + torch.rand(6, generator=_gen(4))),
    "logit_shift": lambda m: T.logit_shift(m, torch.randn(8, generator=_gen(5))),
}


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_transform_preserves_logprobs(name):
    model = tiny_model(CONFIG, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    new = TRANSFORMS[name](model)
    a, b = logprobs(model), logprobs(new)
    rel = float((a - b).norm() / a.norm())
    assert rel < 1e-10, f"{name}: log-probabilities changed by {rel:.2e} (relative)"
    moved = max(float((new.state_dict()[k] - v).abs().max()) for k, v in before.items())
    assert moved > 1e-3, f"{name} did not move any parameter"
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items()), "input mutated"


def test_tied_model_refuses_rotation():
    model = tiny_model(dict(CONFIG, tie_word_embeddings=True), seed=0)
    with pytest.raises(ValueError):
        T.residual_rotation(model, torch.eye(8, dtype=torch.float64))
