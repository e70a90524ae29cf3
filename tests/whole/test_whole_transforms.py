"""Every whole-model symmetry preserves the function of Hugging Face's own model in float64
(log-probabilities for LM heads, hidden states for a bare model), returns a new model and
leaves its input untouched."""

import pytest
import torch

pytest.importorskip("transformers")

from attnid.whole import transforms as T
from attnid.whole.check import Float64Mode, tiny_model

from .test_whole_count import CASES

LLAMA = dict(CASES["llama-untied"], num_hidden_layers=2, rms_norm_eps=1e-6)
GEMMA = CASES["gemma-untied"]
FALCON = dict(CASES["falcon-parallel-bias-untied"], num_hidden_layers=2)
GPT2 = CASES["gpt2-2layers"]  # tied
GPT2_UNTIED = dict(GPT2, tie_word_embeddings=False)
NEOX = dict(CASES["neox-parallel"], num_hidden_layers=2)
NEOX_NO_BIAS = dict(CASES["neox-partial-rotary-no-attn-bias"], num_hidden_layers=2)
BERT = dict(CASES["bert-mlm-tied"], num_hidden_layers=2)
BERT_BARE = CASES["bert-bare-model"]
ROBERTA = CASES["roberta-mlm-tied"]
ROBERTA_UNTIED = CASES["roberta-mlm-untied"]


def tied_pad_direction(m):
    """RoBERTa tied: the pad row may move only along 1 / g of the head's LayerNorm."""
    return 0.7 / m.lm_head.layer_norm.weight.detach()



def function(model):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (3, 6), generator=gen)
    ids[0, 2] = 1  # RoBERTa's pad token (an ordinary token elsewhere)
    n_types = getattr(model.config, "type_vocab_size", 0)
    kw = {"token_type_ids": torch.randint(0, n_types, (3, 6), generator=gen)} if n_types else {}
    with torch.no_grad(), Float64Mode():
        out = model(input_ids=ids, **kw)
    if hasattr(out, "logits"):
        return torch.log_softmax(out.logits, -1)
    return out.last_hidden_state


def r(n, seed, lo=0.5):
    """``n`` positive float64 numbers in [lo, lo + 1)."""
    return lo + torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def rotation(d, seed, fix_ones):
    """A random orthogonal ``[d, d]``; fixing all-ones when asked (LayerNorm)."""
    if not fix_ones:
        return torch.linalg.qr(randn(d, d, seed=seed))[0]
    ones = torch.ones(d, 1, dtype=torch.float64) / d ** 0.5
    U = torch.linalg.qr(torch.cat([ones, torch.eye(d, dtype=torch.float64)], 1))[0][:, 1:d]
    R = torch.linalg.qr(randn(d - 1, d - 1, seed=seed))[0]
    return U @ R @ U.T + ones @ ones.T


CASES_T = {
    # Llama: RMSNorm, gated MLP, untied
    "llama-norm-gain": (LLAMA, lambda m: T.norm_gain_transfer(
        m, "model.layers.1.post_attention_layernorm", r(8, 1))),
    "llama-final-norm-gain": (LLAMA, lambda m: T.norm_gain_transfer(m, "model.norm", r(8, 2))),
    "llama-rotation": (LLAMA, lambda m: T.residual_rotation(m, rotation(8, 3, False))),
    "llama-gated-mlp-scaling": (LLAMA, lambda m: T.mlp_scaling(m, 0, r(6, 4))),
    "llama-logit-shift": (LLAMA, lambda m: T.logit_shift(m, randn(8, seed=5))),
    # Falcon: one norm shared by attention and MLP, parallel residual, biases, untied
    "falcon-shared-norm-gain": (FALCON, lambda m: T.norm_gain_transfer(
        m, "transformer.h.1.input_layernorm", r(8, 36))),
    "falcon-rotation": (FALCON, lambda m: T.residual_rotation(m, rotation(8, 37, True))),
    "falcon-parallel-bias": (FALCON, lambda m: T.parallel_bias_transfer(m, 0, randn(8, seed=38))),
    "falcon-new-decoder-fold": (dict(CASES["falcon-new-decoder"], tie_word_embeddings=False),
                                T.fold_norm_gains),
    # Phi-3: fused gate_up_proj (only the up half scales)
    "phi3-fused-mlp-scaling": (CASES["phi3"], lambda m: T.mlp_scaling(m, 0, r(6, 39))),
    # Gemma: the gain stored as 1 + w
    "gemma-norm-gain": (GEMMA, lambda m: T.norm_gain_transfer(
        m, "model.layers.0.input_layernorm", r(8, 34))),
    "gemma-rotation": (GEMMA, lambda m: T.residual_rotation(m, rotation(8, 35, False))),
    "gemma-fold-norm-gains": (GEMMA, T.fold_norm_gains),
    # GPT-2: LayerNorm with biases, learned positions, Conv1D, tied
    "gpt2-norm-gain": (GPT2, lambda m: T.norm_gain_transfer(m, "transformer.h.1.ln_2", r(8, 6))),
    "gpt2-norm-bias": (GPT2, lambda m: T.norm_bias_transfer(m, "transformer.h.0.ln_1",
                                                            randn(8, seed=7))),
    "gpt2-centring": (GPT2, lambda m: T.centring_move(m, "transformer.h.1.ln_1", 0,
                                                      randn(24, seed=8))),
    "gpt2-ones-shift-attention": (GPT2, lambda m: T.ones_shift(m, 1, 0, randn(8, seed=9), 0.7)),
    "gpt2-ones-shift-mlp": (GPT2, lambda m: T.ones_shift(m, 0, 1, randn(6, seed=10), -0.3)),
    "gpt2-position-shift": (GPT2, lambda m: T.table_shift(m, 1, randn(6, seed=11))),
    "gpt2-tied-token-shift": (GPT2, lambda m: T.table_shift(m, 0, torch.full((12,), 0.4))),
    "gpt2-embedding-translation": (GPT2, lambda m: T.embedding_translation(m, randn(8, seed=12))),
    "gpt2-untied-rotation": (GPT2_UNTIED, lambda m: T.residual_rotation(m, rotation(8, 13, True))),
    "gpt2-untied-final-norm-gain": (GPT2_UNTIED, lambda m: T.norm_gain_transfer(
        m, "transformer.ln_f", r(8, 14))),
    "gpt2-untied-logit-shift": (GPT2_UNTIED, lambda m: T.logit_shift(m, randn(8, seed=15))),
    "gpt2-relu-scaling": (dict(GPT2, activation_function="relu"),
                          lambda m: T.mlp_scaling(m, 1, r(6, 16))),
    # GPT-NeoX: parallel residual, untied
    "neox-parallel-bias": (NEOX, lambda m: T.parallel_bias_transfer(m, 1, randn(8, seed=17))),
    "neox-rotation": (NEOX, lambda m: T.residual_rotation(m, rotation(8, 18, True))),
    "neox-norm-gain": (NEOX, lambda m: T.norm_gain_transfer(
        m, "gpt_neox.layers.1.post_attention_layernorm", r(8, 19))),
    "neox-ones-shift": (NEOX, lambda m: T.ones_shift(m, 0, 1, randn(6, seed=20), 0.5)),
    # GPT-NeoX without attention biases behind a biased LayerNorm, half-rotary heads
    "neox-key-offset": (NEOX_NO_BIAS, lambda m: T.key_offset(
        m, 1, torch.cat([torch.zeros(2, 2), randn(2, 2, seed=30)], 1))),
    "neox-value-offset": (NEOX_NO_BIAS, lambda m: T.value_offset(m, 0, 0.8)),
    # BERT: post-LN, token types, tied masked-LM head
    "bert-post-norm-bias": (BERT, lambda m: T.norm_bias_transfer(
        m, "bert.encoder.layer.0.output.LayerNorm", randn(8, seed=21))),
    "bert-embedding-norm-bias": (BERT, lambda m: T.norm_bias_transfer(
        m, "bert.embeddings.LayerNorm", randn(8, seed=22))),
    "bert-centring": (BERT, lambda m: T.centring_move(
        m, "bert.encoder.layer.1.attention.output.LayerNorm", 0, randn(6, seed=23))),
    "bert-ones-shift": (BERT, lambda m: T.ones_shift(m, 1, 0, randn(8, seed=24), 0.2)),
    "bert-type-translation": (BERT, lambda m: T.embedding_translation(m, randn(8, seed=25), 2)),
    "bert-position-translation": (BERT, lambda m: T.embedding_translation(m, randn(8, seed=26))),
    "bert-last-norm-gain": (BERT, lambda m: T.norm_gain_transfer(
        m, "bert.encoder.layer.1.output.LayerNorm", r(8, 27))),
    "bert-head-norm-bias": (BERT, lambda m: T.norm_bias_transfer(
        m, "cls.predictions.transform.LayerNorm", randn(8, seed=28))),
    "bert-tied-logit-constant": (BERT, lambda m: T.logit_shift(m, torch.zeros(8), 0.9)),
    "bert-bare-norm-bias": (BERT_BARE, lambda m: T.norm_bias_transfer(
        m, "embeddings.LayerNorm", randn(8, seed=29))),
    # RoBERTa: the pad token's pair of rows, the position rows below padding_idx
    "roberta-padding-translation": (ROBERTA_UNTIED, lambda m: T.padding_translation(
        m, randn(8, seed=31))),
    "roberta-tied-padding-translation": (ROBERTA, lambda m: T.padding_translation(
        m, tied_pad_direction(m))),
    "roberta-unreachable-positions": (ROBERTA, lambda m: T.unreachable_positions_move(
        m, randn(1, 8, seed=32))),
    "roberta-post-norm-bias": (ROBERTA, lambda m: T.norm_bias_transfer(
        m, "roberta.embeddings.LayerNorm", randn(8, seed=33))),
    # every gain its readers can absorb folded into them at once
    "llama-fold-norm-gains": (LLAMA, T.fold_norm_gains),
    "gpt2-untied-fold-norm-gains": (GPT2_UNTIED, T.fold_norm_gains),
    "neox-fold-norm-gains": (NEOX, T.fold_norm_gains),
    "bert-fold-norm-gains": (BERT, T.fold_norm_gains),
}


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
