"""The catalogue of tiny Hugging Face configs the tests build (`attnid.testing.models.tiny_model`),
float64 at random generic points, and the function-preserving transforms they apply.

- :data:`WHOLE_CASES`: one config per family variant (tied/untied, GQA/MQA, biases, QK-norm,
  bare models, post-LN, RoBERTa's padding), the whole-model count against the arbiter;
- :data:`TRANSFORM_FAMILIES`: the families with whole-model transforms (2 layers where a
  second layer matters), the rewrites, fit and align;
- :data:`TRANSFORM_CASES`: every whole-model symmetry as ``(config, transform)``;
- :data:`TINY_LLAMA`: a biased GQA Llama (width 32, 2 layers) for training and sharding runs
  (`attnid.testing.models.random_hf_model`).

Importing this module loads no transformers (the configs are dicts; transforms run on models).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from attnid.whole import transforms as T

TINY_LLAMA: dict[str, Any] = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
    "intermediate_size": 64, "vocab_size": 64, "attention_bias": True}

_NOPAD = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)
_RMS = dict(hidden_size=8, num_attention_heads=2, num_key_value_heads=2, intermediate_size=6,
            num_hidden_layers=1, vocab_size=12, max_position_embeddings=16, rms_norm_eps=1e-2, **_NOPAD)
_GPT2 = dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], n_embd=8, n_head=2, n_layer=1,
             n_inner=6, vocab_size=12, n_positions=6, layer_norm_epsilon=1e-2, **_NOPAD)
_NEOX = dict(model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"], hidden_size=8,
             num_attention_heads=2, intermediate_size=6, num_hidden_layers=1, vocab_size=12,
             rotary_pct=1.0, use_parallel_residual=False, tie_word_embeddings=False,
             layer_norm_eps=1e-2, **_NOPAD)
_FALCON = dict(model_type="falcon", architectures=["FalconForCausalLM"], hidden_size=8,
               num_attention_heads=2, num_hidden_layers=1, vocab_size=12, layer_norm_epsilon=1e-2,
               ffn_hidden_size=6, **_NOPAD)

_BERT = dict(model_type="bert", architectures=["BertForMaskedLM"], hidden_size=8, num_attention_heads=2,
             intermediate_size=6, num_hidden_layers=1, vocab_size=12, max_position_embeddings=6,
             type_vocab_size=2, layer_norm_eps=1e-2, **_NOPAD)
_ROBERTA = dict(_BERT, model_type="roberta", architectures=["RobertaForMaskedLM"], type_vocab_size=1,
                max_position_embeddings=8, pad_token_id=1)


def _rms(model_type: str, arch: str, **kw: Any) -> dict[str, Any]:
    """A one-layer RMSNorm config of ``model_type`` with head ``arch`` (``kw`` overrides)."""
    return dict(_RMS, model_type=model_type, architectures=[arch], **kw)


WHOLE_CASES = {
    # RMSNorm, gated MLP, rotary: tied / untied, GQA, MQA, biases, QK-norm, bare model, 2 layers
    "llama-untied": _rms("llama", "LlamaForCausalLM", tie_word_embeddings=False),
    "llama-tied": _rms("llama", "LlamaForCausalLM", tie_word_embeddings=True),
    "llama-gqa-2layers": _rms("llama", "LlamaForCausalLM", num_hidden_layers=2, num_attention_heads=4,
                              head_dim=2),
    "llama-bare-model": _rms("llama", "LlamaModel"),
    "mistral-mqa": _rms("mistral", "MistralForCausalLM", num_attention_heads=4, num_key_value_heads=1,
                        head_dim=2),
    "qwen2-qkv-bias": _rms("qwen2", "Qwen2ForCausalLM"),
    "qwen2-tied": _rms("qwen2", "Qwen2ForCausalLM", tie_word_embeddings=True),
    "qwen3-qk-norm": _rms("qwen3", "Qwen3ForCausalLM", head_dim=4),
    "gemma-tied": _rms("gemma", "GemmaForCausalLM", head_dim=4),
    "gemma-untied": _rms("gemma", "GemmaForCausalLM", head_dim=4, tie_word_embeddings=False),
    "phi3": _rms("phi3", "Phi3ForCausalLM"),
    # Llama without RoPE (attnid's own class): learned positions (a second table), or none
    "llama-learned-positions": _rms("attnid_llama", "PositionsLlamaForCausalLM", tie_word_embeddings=False,
                                    position_embedding="learned", max_position_embeddings=6),
    "llama-no-positions-tied": _rms("attnid_llama", "PositionsLlamaForCausalLM", tie_word_embeddings=True,
                                    position_embedding="none"),
    # LayerNorm with biases, learned positions, GELU / ReLU
    "gpt2-tied": dict(_GPT2, tie_word_embeddings=True),
    "gpt2-untied": dict(_GPT2, tie_word_embeddings=False),
    "gpt2-relu": dict(_GPT2, activation_function="relu"),
    "gpt2-2layers": dict(_GPT2, n_layer=2),
    # GPT-NeoX: sequential / parallel, partial rotary, no attention biases, tied
    "neox-sequential": _NEOX,
    "neox-parallel": dict(_NEOX, use_parallel_residual=True, vocab_size=40),
    "neox-partial-rotary-no-attn-bias": dict(_NEOX, rotary_pct=0.5, attention_bias=False),
    "neox-tied-no-attn-bias": dict(_NEOX, attention_bias=False, tie_word_embeddings=True),
    # Falcon: shared-norm parallel MQA, sequential, biases, untied, new decoder layout
    "falcon-parallel-mqa-tied": dict(_FALCON, vocab_size=40),
    "falcon-sequential-bias": dict(_FALCON, parallel_attn=False, bias=True),
    "falcon-sequential-mha-untied": dict(_FALCON, parallel_attn=False, multi_query=False,
                                         tie_word_embeddings=False),
    "falcon-parallel-bias-untied": dict(_FALCON, vocab_size=40, bias=True, tie_word_embeddings=False),
    "falcon-new-decoder": dict(_FALCON, vocab_size=40, new_decoder_architecture=True, num_kv_heads=1),
    # _BERT: post-LN, token types, masked-LM head tied / untied, bare model with its pooler
    "bert-mlm-tied": _BERT,
    "bert-mlm-one-token-type": dict(_BERT, type_vocab_size=1),
    "bert-mlm-untied": dict(_BERT, tie_word_embeddings=False, type_vocab_size=1),
    "bert-bare-model": dict(_BERT, architectures=["BertModel"], type_vocab_size=1),
    "bert-2layers": dict(_BERT, num_hidden_layers=2, type_vocab_size=1),
    # RoBERTa: position rows below padding_idx never read, the pad token at row padding_idx
    "roberta-mlm-tied": _ROBERTA,
    "roberta-mlm-untied": dict(_ROBERTA, tie_word_embeddings=False),
    "roberta-bare-model": dict(_ROBERTA, architectures=["RobertaModel"]),
    "roberta-padding-idx-3": dict(_ROBERTA, pad_token_id=3, max_position_embeddings=9),
}


LLAMA = dict(WHOLE_CASES["llama-untied"], num_hidden_layers=2, rms_norm_eps=1e-6)
GEMMA = WHOLE_CASES["gemma-untied"]
LEARNED = dict(WHOLE_CASES["llama-learned-positions"], num_hidden_layers=2)
FALCON = dict(WHOLE_CASES["falcon-parallel-bias-untied"], num_hidden_layers=2)
GPT2 = WHOLE_CASES["gpt2-2layers"]  # tied
GPT2_UNTIED = dict(GPT2, tie_word_embeddings=False)
NEOX = dict(WHOLE_CASES["neox-parallel"], num_hidden_layers=2)
NEOX_NO_BIAS = dict(WHOLE_CASES["neox-partial-rotary-no-attn-bias"], num_hidden_layers=2)
BERT = dict(WHOLE_CASES["bert-mlm-tied"], num_hidden_layers=2)
BERT_BARE = WHOLE_CASES["bert-bare-model"]
ROBERTA = WHOLE_CASES["roberta-mlm-tied"]
ROBERTA_UNTIED = WHOLE_CASES["roberta-mlm-untied"]



GQA = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=2)
TRANSFORM_FAMILIES: dict[str, dict[str, Any]] = {
    "llama-gqa": dict(WHOLE_CASES["llama-untied"], num_hidden_layers=2, **GQA),
    "mistral-mqa": dict(WHOLE_CASES["mistral-mqa"], num_hidden_layers=2),
    "qwen2-bias-gqa": dict(WHOLE_CASES["qwen2-qkv-bias"], num_hidden_layers=2, **GQA),
    "qwen3-qk-norm": WHOLE_CASES["qwen3-qk-norm"],
    "gemma": WHOLE_CASES["gemma-untied"],
    "phi3": WHOLE_CASES["phi3"],
    "gpt2-untied": dict(WHOLE_CASES["gpt2-untied"], n_layer=2),
    "gpt2-relu-untied": dict(WHOLE_CASES["gpt2-relu"], tie_word_embeddings=False),
    "neox-parallel": dict(WHOLE_CASES["neox-parallel"], num_hidden_layers=2),
    "neox-half-rotary-no-bias": WHOLE_CASES["neox-partial-rotary-no-attn-bias"],
    "falcon-parallel-bias": WHOLE_CASES["falcon-parallel-bias-untied"],
    "falcon-new-decoder": dict(WHOLE_CASES["falcon-new-decoder"], tie_word_embeddings=False),
    "bert": dict(WHOLE_CASES["bert-mlm-tied"], num_hidden_layers=2),
    "roberta": WHOLE_CASES["roberta-mlm-tied"],
    "llama-tied": WHOLE_CASES["llama-tied"],
    "llama-learned-positions": dict(WHOLE_CASES["llama-learned-positions"], num_hidden_layers=2, **GQA),
    "llama-no-positions-tied": WHOLE_CASES["llama-no-positions-tied"],
}


def tied_pad_direction(m: nn.Module) -> torch.Tensor:
    """RoBERTa tied: the pad row may move only along 1 / g of the head's LayerNorm."""
    return 0.7 / m.lm_head.layer_norm.weight.detach()


def positive(n: int, seed: int, lo: float = 0.5) -> torch.Tensor:
    """``n`` positive float64 numbers in [lo, lo + 1)."""
    return lo + torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def randn64(*shape: int, seed: int) -> torch.Tensor:
    """Seeded standard normal float64 numbers of ``shape``."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def random_rotation(d: int, seed: int, fix_ones: bool) -> torch.Tensor:
    """A random orthogonal ``[d, d]``; fixing all-ones when asked (LayerNorm)."""
    if not fix_ones:
        return torch.linalg.qr(randn64(d, d, seed=seed))[0]
    ones = torch.ones(d, 1, dtype=torch.float64) / d ** 0.5
    U = torch.linalg.qr(torch.cat([ones, torch.eye(d, dtype=torch.float64)], 1))[0][:, 1:d]
    R = torch.linalg.qr(randn64(d - 1, d - 1, seed=seed))[0]
    return U @ R @ U.T + ones @ ones.T


TRANSFORM_CASES: dict[str, tuple[dict[str, Any], Callable[[nn.Module], nn.Module]]] = {
    # Llama: RMSNorm, gated MLP, untied
    "llama-norm-gain": (LLAMA, lambda m: T.norm_gain_transfer(
        m, "model.layers.1.post_attention_layernorm", positive(8, 1))),
    "llama-final-norm-gain": (LLAMA, lambda m: T.norm_gain_transfer(m, "model.norm", positive(8, 2))),
    "llama-rotation": (LLAMA, lambda m: T.residual_rotation(m, random_rotation(8, 3, False))),
    "llama-gated-mlp-scaling": (LLAMA, lambda m: T.mlp_scaling(m, 0, positive(6, 4))),
    "llama-logit-shift": (LLAMA, lambda m: T.logit_shift(m, randn64(8, seed=5))),
    # Llama with learned positions (attnid's class): the position table rotates with the stream
    "llama-learned-positions-rotation": (LEARNED, lambda m: T.residual_rotation(
        m, random_rotation(8, 60, False))),
    # Falcon: one norm shared by attention and MLP, parallel residual, biases, untied
    "falcon-shared-norm-gain": (FALCON, lambda m: T.norm_gain_transfer(
        m, "transformer.h.1.input_layernorm", positive(8, 36))),
    "falcon-rotation": (FALCON, lambda m: T.residual_rotation(m, random_rotation(8, 37, True))),
    "falcon-parallel-bias": (FALCON, lambda m: T.parallel_bias_transfer(m, 0, randn64(8, seed=38))),
    "falcon-new-decoder-fold": (dict(WHOLE_CASES["falcon-new-decoder"], tie_word_embeddings=False),
                                T.fold_norm_gains),
    # Phi-3: fused gate_up_proj (only the up half scales)
    "phi3-fused-mlp-scaling": (WHOLE_CASES["phi3"], lambda m: T.mlp_scaling(m, 0, positive(6, 39))),
    # Gemma: the gain stored as 1 + w
    "gemma-norm-gain": (GEMMA, lambda m: T.norm_gain_transfer(
        m, "model.layers.0.input_layernorm", positive(8, 34))),
    "gemma-rotation": (GEMMA, lambda m: T.residual_rotation(m, random_rotation(8, 35, False))),
    "gemma-fold-norm-gains": (GEMMA, T.fold_norm_gains),
    # GPT-2: LayerNorm with biases, learned positions, Conv1D, tied
    "gpt2-norm-gain": (GPT2, lambda m: T.norm_gain_transfer(m, "transformer.h.1.ln_2", positive(8, 6))),
    "gpt2-norm-bias": (GPT2, lambda m: T.norm_bias_transfer(m, "transformer.h.0.ln_1",
                                                            randn64(8, seed=7))),
    "gpt2-centring": (GPT2, lambda m: T.centring_move(m, "transformer.h.1.ln_1", 0,
                                                      randn64(24, seed=8))),
    "gpt2-ones-shift-attention": (GPT2, lambda m: T.ones_shift(m, 1, 0, randn64(8, seed=9), 0.7)),
    "gpt2-ones-shift-mlp": (GPT2, lambda m: T.ones_shift(m, 0, 1, randn64(6, seed=10), -0.3)),
    "gpt2-position-shift": (GPT2, lambda m: T.table_shift(m, 1, randn64(6, seed=11))),
    "gpt2-tied-token-shift": (GPT2, lambda m: T.table_shift(m, 0, torch.full((12,), 0.4))),
    "gpt2-embedding-translation": (GPT2, lambda m: T.embedding_translation(m, randn64(8, seed=12))),
    "gpt2-untied-rotation": (GPT2_UNTIED, lambda m: T.residual_rotation(m, random_rotation(8, 13, True))),
    "gpt2-untied-final-norm-gain": (GPT2_UNTIED, lambda m: T.norm_gain_transfer(
        m, "transformer.ln_f", positive(8, 14))),
    "gpt2-untied-logit-shift": (GPT2_UNTIED, lambda m: T.logit_shift(m, randn64(8, seed=15))),
    "gpt2-relu-scaling": (dict(GPT2, activation_function="relu"),
                          lambda m: T.mlp_scaling(m, 1, positive(6, 16))),
    # GPT-NeoX: parallel residual, untied
    "neox-parallel-bias": (NEOX, lambda m: T.parallel_bias_transfer(m, 1, randn64(8, seed=17))),
    "neox-rotation": (NEOX, lambda m: T.residual_rotation(m, random_rotation(8, 18, True))),
    "neox-norm-gain": (NEOX, lambda m: T.norm_gain_transfer(
        m, "gpt_neox.layers.1.post_attention_layernorm", positive(8, 19))),
    "neox-ones-shift": (NEOX, lambda m: T.ones_shift(m, 0, 1, randn64(6, seed=20), 0.5)),
    # GPT-NeoX without attention biases behind a biased LayerNorm, half-rotary heads
    "neox-key-offset": (NEOX_NO_BIAS, lambda m: T.key_offset(
        m, 1, torch.cat([torch.zeros(2, 2), randn64(2, 2, seed=30)], 1))),
    "neox-value-offset": (NEOX_NO_BIAS, lambda m: T.value_offset(m, 0, 0.8)),
    # BERT: post-LN, token types, tied masked-LM head
    "bert-post-norm-bias": (BERT, lambda m: T.norm_bias_transfer(
        m, "bert.encoder.layer.0.output.LayerNorm", randn64(8, seed=21))),
    "bert-embedding-norm-bias": (BERT, lambda m: T.norm_bias_transfer(
        m, "bert.embeddings.LayerNorm", randn64(8, seed=22))),
    "bert-centring": (BERT, lambda m: T.centring_move(
        m, "bert.encoder.layer.1.attention.output.LayerNorm", 0, randn64(6, seed=23))),
    "bert-ones-shift": (BERT, lambda m: T.ones_shift(m, 1, 0, randn64(8, seed=24), 0.2)),
    "bert-type-translation": (BERT, lambda m: T.embedding_translation(m, randn64(8, seed=25), 2)),
    "bert-position-translation": (BERT, lambda m: T.embedding_translation(m, randn64(8, seed=26))),
    "bert-last-norm-gain": (BERT, lambda m: T.norm_gain_transfer(
        m, "bert.encoder.layer.1.output.LayerNorm", positive(8, 27))),
    "bert-head-norm-bias": (BERT, lambda m: T.norm_bias_transfer(
        m, "cls.predictions.transform.LayerNorm", randn64(8, seed=28))),
    "bert-tied-logit-constant": (BERT, lambda m: T.logit_shift(m, torch.zeros(8), 0.9)),
    "bert-bare-norm-bias": (BERT_BARE, lambda m: T.norm_bias_transfer(
        m, "embeddings.LayerNorm", randn64(8, seed=29))),
    # RoBERTa: the pad token's pair of rows, the position rows below padding_idx
    "roberta-padding-translation": (ROBERTA_UNTIED, lambda m: T.padding_translation(
        m, randn64(8, seed=31))),
    "roberta-tied-padding-translation": (ROBERTA, lambda m: T.padding_translation(
        m, tied_pad_direction(m))),
    "roberta-unreachable-positions": (ROBERTA, lambda m: T.unreachable_positions_move(
        m, randn64(1, 8, seed=32))),
    "roberta-post-norm-bias": (ROBERTA, lambda m: T.norm_bias_transfer(
        m, "roberta.embeddings.LayerNorm", randn64(8, seed=33))),
    # every gain its readers can absorb folded into them at once
    "llama-fold-norm-gains": (LLAMA, T.fold_norm_gains),
    "gpt2-untied-fold-norm-gains": (GPT2_UNTIED, T.fold_norm_gains),
    "neox-fold-norm-gains": (NEOX, T.fold_norm_gains),
    "bert-fold-norm-gains": (BERT, T.fold_norm_gains),
}
