"""Whole-model closed form against the whole-model arbiter on Hugging Face's own classes.

Each tiny config is built with the architecture's own class in float64 (RMSNorm and softmax
kept in float64), at a random generic point; the function is the one the architecture
names (centred logits for LM heads, hidden states for a bare model)."""

import sys

import pytest

pytest.importorskip("transformers")

from attnid.adapters.registry import adapter_for
from attnid.theory.whole import count_structure
from attnid.whole.check import arbiter_whole, verify_whole
from attnid.whole.model import count_model

NOPAD = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)
RMS = dict(hidden_size=8, num_attention_heads=2, num_key_value_heads=2, intermediate_size=6,
           num_hidden_layers=1, vocab_size=12, max_position_embeddings=16, rms_norm_eps=1e-2, **NOPAD)
GPT2 = dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], n_embd=8, n_head=2, n_layer=1,
            n_inner=6, vocab_size=12, n_positions=6, layer_norm_epsilon=1e-2, **NOPAD)
NEOX = dict(model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"], hidden_size=8,
            num_attention_heads=2, intermediate_size=6, num_hidden_layers=1, vocab_size=12,
            rotary_pct=1.0, use_parallel_residual=False, tie_word_embeddings=False,
            layer_norm_eps=1e-2, **NOPAD)
FALCON = dict(model_type="falcon", architectures=["FalconForCausalLM"], hidden_size=8,
              num_attention_heads=2, num_hidden_layers=1, vocab_size=12, layer_norm_epsilon=1e-2,
              ffn_hidden_size=6, **NOPAD)

BERT = dict(model_type="bert", architectures=["BertForMaskedLM"], hidden_size=8, num_attention_heads=2,
            intermediate_size=6, num_hidden_layers=1, vocab_size=12, max_position_embeddings=6,
            type_vocab_size=2, layer_norm_eps=1e-2, **NOPAD)
ROBERTA = dict(BERT, model_type="roberta", architectures=["RobertaForMaskedLM"], type_vocab_size=1,
               max_position_embeddings=8, pad_token_id=1)


def rms(model_type, arch, **kw):
    return dict(RMS, model_type=model_type, architectures=[arch], **kw)


CASES = {
    # RMSNorm, gated MLP, rotary: tied / untied, GQA, MQA, biases, QK-norm, bare model, 2 layers
    "llama-untied": rms("llama", "LlamaForCausalLM", tie_word_embeddings=False),
    "llama-tied": rms("llama", "LlamaForCausalLM", tie_word_embeddings=True),
    "llama-gqa-2layers": rms("llama", "LlamaForCausalLM", num_hidden_layers=2, num_attention_heads=4,
                             head_dim=2),
    "llama-bare-model": rms("llama", "LlamaModel"),
    "mistral-mqa": rms("mistral", "MistralForCausalLM", num_attention_heads=4, num_key_value_heads=1,
                       head_dim=2),
    "qwen2-qkv-bias": rms("qwen2", "Qwen2ForCausalLM"),
    "qwen2-tied": rms("qwen2", "Qwen2ForCausalLM", tie_word_embeddings=True),
    "qwen3-qk-norm": rms("qwen3", "Qwen3ForCausalLM", head_dim=4),
    "gemma-tied": rms("gemma", "GemmaForCausalLM", head_dim=4),
    "gemma-untied": rms("gemma", "GemmaForCausalLM", head_dim=4, tie_word_embeddings=False),
    "phi3": rms("phi3", "Phi3ForCausalLM"),
    # LayerNorm with biases, learned positions, GELU / ReLU
    "gpt2-tied": dict(GPT2, tie_word_embeddings=True),
    "gpt2-untied": dict(GPT2, tie_word_embeddings=False),
    "gpt2-relu": dict(GPT2, activation_function="relu"),
    "gpt2-2layers": dict(GPT2, n_layer=2),
    # GPT-NeoX: sequential / parallel, partial rotary, no attention biases, tied
    "neox-sequential": NEOX,
    "neox-parallel": dict(NEOX, use_parallel_residual=True, vocab_size=40),
    "neox-partial-rotary-no-attn-bias": dict(NEOX, rotary_pct=0.5, attention_bias=False),
    "neox-tied-no-attn-bias": dict(NEOX, attention_bias=False, tie_word_embeddings=True),
    # Falcon: shared-norm parallel MQA, sequential, biases, untied, new decoder layout
    "falcon-parallel-mqa-tied": dict(FALCON, vocab_size=40),
    "falcon-sequential-bias": dict(FALCON, parallel_attn=False, bias=True),
    "falcon-sequential-mha-untied": dict(FALCON, parallel_attn=False, multi_query=False,
                                         tie_word_embeddings=False),
    "falcon-parallel-bias-untied": dict(FALCON, vocab_size=40, bias=True, tie_word_embeddings=False),
    "falcon-new-decoder": dict(FALCON, vocab_size=40, new_decoder_architecture=True, num_kv_heads=1),
    # BERT: post-LN, token types, masked-LM head tied / untied, bare model with its pooler
    "bert-mlm-tied": BERT,
    "bert-mlm-one-token-type": dict(BERT, type_vocab_size=1),
    "bert-mlm-untied": dict(BERT, tie_word_embeddings=False, type_vocab_size=1),
    "bert-bare-model": dict(BERT, architectures=["BertModel"], type_vocab_size=1),
    "bert-2layers": dict(BERT, num_hidden_layers=2, type_vocab_size=1),
    # RoBERTa: position rows below padding_idx never read, the pad token at row padding_idx
    "roberta-mlm-tied": ROBERTA,
    "roberta-mlm-untied": dict(ROBERTA, tie_word_embeddings=False),
    "roberta-bare-model": dict(ROBERTA, architectures=["RobertaModel"]),
    "roberta-padding-idx-3": dict(ROBERTA, pad_token_id=3, max_position_embeddings=9),
}


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
