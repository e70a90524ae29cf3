"""Whole-model counts on the real, finite input domain (docs/theory.md §13.17), against the
whole-model arbiter (Hugging Face's own classes in float64).

Each degeneracy is checked where it binds and where it just does not: an exact count must
equal the arbiter (unidentified and near-unidentified), a count flagged as a lower bound
(``exact`` False) must not exceed it."""

import json

import pytest

pytest.importorskip("transformers")

from attnid.adapters.config import bundled, load_config
from attnid.adapters.registry import adapter_for
from attnid.cli import main
from attnid.theory.discrete import constant_offset, first_points, mlp_terms
from attnid.theory.whole import count_structure
from attnid.whole.check import verify_whole
from attnid.whole.model import count_model

NOPAD = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)
# the issue's model: d 8, 2 heads, MLP 16, partial rotary (2 of 4 dims), parallel, untied
NEOX = dict(model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"], hidden_size=8,
            num_attention_heads=2, intermediate_size=16, num_hidden_layers=1, vocab_size=16,
            rotary_pct=0.5, use_parallel_residual=True, tie_word_embeddings=False,
            layer_norm_eps=1e-2, **NOPAD)
FALCON = dict(model_type="falcon", architectures=["FalconForCausalLM"], hidden_size=8,
              num_attention_heads=2, num_hidden_layers=1, vocab_size=16, ffn_hidden_size=16,
              layer_norm_epsilon=1e-2, **NOPAD)
LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=8,
             num_attention_heads=2, num_key_value_heads=2, intermediate_size=6, num_hidden_layers=1,
             vocab_size=12, max_position_embeddings=16, rms_norm_eps=1e-2, **NOPAD)
GPT2 = dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], n_embd=8, n_head=2, n_layer=1,
            n_inner=6, vocab_size=12, n_positions=6, layer_norm_epsilon=1e-2, **NOPAD)
BERT = dict(model_type="bert", architectures=["BertForMaskedLM"], hidden_size=8, num_attention_heads=2,
            intermediate_size=6, num_hidden_layers=1, vocab_size=12, max_position_embeddings=6,
            type_vocab_size=2, layer_norm_eps=1e-2, **NOPAD)

# name: (config, exact?): the parallel first layer's lookup (counted exactly, untied or bare)
LOOKUP = {
    "neox-vocab16-issue": (NEOX, True),  # 413 (the generic count said 222)
    "neox-vocab64-issue": (dict(NEOX, vocab_size=64), True),  # does not bind: 270
    "neox-vocab43-binds-by-2": (dict(NEOX, vocab_size=43), True),
    "neox-vocab44-near-only": (dict(NEOX, vocab_size=44), True),  # eps = 0 still binds
    "neox-vocab46-free": (dict(NEOX, vocab_size=46), True),
    "neox-mlp6-vocab21-binds": (dict(NEOX, intermediate_size=6, vocab_size=21), True),
    "neox-mlp6-vocab22-free": (dict(NEOX, intermediate_size=6, vocab_size=22), True),
    "neox-relu-vocab16": (dict(NEOX, hidden_act="relu"), True),
    "neox-2layers-vocab16": (dict(NEOX, num_hidden_layers=2), True),
    "neox-eps0-vocab40": (dict(NEOX, vocab_size=40, layer_norm_eps=0.0), True),
    "neox-bare-vocab16": (dict(NEOX, architectures=["GPTNeoXModel"]), True),
    "neox-width12-vocab30": (dict(NEOX, hidden_size=12, intermediate_size=12, vocab_size=30,
                                  rotary_pct=1.0), True),
    # no attention bias: the MLP bias takes the value offsets (also in the generic count)
    "neox-no-attn-bias-vocab64": (dict(NEOX, attention_bias=False, vocab_size=64), True),
    "neox-no-attn-bias-vocab16": (dict(NEOX, attention_bias=False), True),
    # Falcon: one shared norm, MQA, no biases (the value offset has no MLP bias to go to)
    "falcon-untied-vocab16": (dict(FALCON, tie_word_embeddings=False), True),
    "falcon-untied-vocab40": (dict(FALCON, tie_word_embeddings=False, vocab_size=40), True),
    "falcon-bias-untied-vocab16": (dict(FALCON, tie_word_embeddings=False, bias=True), True),
    "falcon-bare-vocab16": (dict(FALCON, architectures=["FalconModel"]), True),
    "falcon-new-decoder-gqa-vocab16": (dict(FALCON, tie_word_embeddings=False, new_decoder_architecture=True,
                                            num_attention_heads=4, num_kv_heads=2), True),
    # a tied head also reads the embedding: a lower bound while it binds, exact once free
    "falcon-tied-vocab16": (FALCON, False),
    "falcon-tied-vocab36": (dict(FALCON, vocab_size=36), False),
    "falcon-tied-vocab64": (dict(FALCON, vocab_size=64), True),
    "neox-tied-width12-vocab39": (dict(NEOX, hidden_size=12, intermediate_size=12, vocab_size=39,
                                       rotary_pct=1.0, tie_word_embeddings=True), True),
    "neox-tied-vocab24": (dict(NEOX, vocab_size=24, tie_word_embeddings=True), False),
    "neox-parallel-vocab7-below-width": (dict(NEOX, vocab_size=7), False),
}
# few tokens (V <= d), one or few positions, token types
DOMAIN = {
    "llama-vocab8-equals-width": (dict(LLAMA, vocab_size=8), False),
    "llama-vocab9-above-width": (dict(LLAMA, vocab_size=9), True),
    "llama-bare-vocab6": (dict(LLAMA, vocab_size=6, architectures=["LlamaModel"]), False),
    "neox-sequential-vocab8": (dict(NEOX, vocab_size=8, use_parallel_residual=False), False),
    "neox-sequential-vocab9": (dict(NEOX, vocab_size=9, use_parallel_residual=False), True),
    "gpt2-tied-vocab6-positions4": (dict(GPT2, vocab_size=6, n_positions=4), False),
    "gpt2-one-position": (dict(GPT2, n_positions=1), False),
    "gpt2-two-positions-vocab6": (dict(GPT2, vocab_size=6, n_positions=2), False),
    "gpt2-two-positions-vocab9": (dict(GPT2, vocab_size=9, n_positions=2), True),
    "bert-vocab6": (dict(BERT, vocab_size=6), False),
    "bert-two-positions-three-types": (dict(BERT, vocab_size=9, max_position_embeddings=2,
                                            type_vocab_size=3), True),
    "bert-one-position-two-types": (dict(BERT, max_position_embeddings=1), False),
}
CASES = {**LOOKUP, **DOMAIN}
FAST = ("neox-vocab16-issue", "falcon-tied-vocab16", "llama-vocab8-equals-width", "gpt2-one-position")


def _check(name):
    config, exact = CASES[name]
    v = verify_whole(config, name, seed=0, confirm=False)
    d = v.to_dict()
    msg = (f"{name}: theory {d['unidentified_theory']}/{d['near_unidentified_theory']} "
           f"(exact {d['exact']}), arbiter {d['unidentified_numeric']}/"
           f"{d['near_unidentified_numeric']}, gap {d['spectral_gap']:.2e}, reasons {d['reasons']}")
    assert v.theory.exact is exact, msg
    assert d["total"] == d["total_theory"], msg
    if exact:
        assert (d["unidentified_theory"], d["near_unidentified_theory"]) == (
            d["unidentified_numeric"], d["near_unidentified_numeric"]), msg
    else:
        assert d["unidentified_theory"] <= d["unidentified_numeric"], msg
        assert d["reasons"] and d["status"] == "BOUND HOLDS", msg
    assert v.agree, msg
    assert d["spectral_gap"] > 1e6, msg


@pytest.mark.parametrize("name", FAST)
def test_discrete_inputs_against_arbiter(name):
    _check(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in CASES if n not in FAST])
def test_discrete_inputs_against_arbiter_slow(name):
    _check(name)


def test_issue_model_before_and_after():
    """The issue's model: the generic terms give 222, the lookup adds 191 (docs §13.17)."""
    c = count_model(NEOX)
    assert c.exact and c.unidentified == 413, c.to_dict()
    assert c.unidentified - c.components["discrete_inputs"].unidentified == 222
    assert "discrete_inputs" not in count_model(dict(NEOX, vocab_size=64)).components


def test_lookup_excess_is_the_formula():
    """``r + off + w(w + 1) - N w`` for the issue's model: r = 280 - 16 - 17 = 247, off = 0,
    w = 7, N = 16 (rows, per derivation in docs/theory.md §13.17.1)."""
    st = adapter_for(NEOX).whole(NEOX)
    r = mlp_terms(st).identified
    assert (r, first_points(st)) == (247, 16)
    assert count_model(NEOX).components["discrete_inputs"].unidentified == r + 7 * 8 - 16 * 7


@pytest.mark.parametrize("name", bundled())
def test_bundled_models_are_exact(name):
    """Real vocabularies (32k-256k) are far from every discrete-input condition (the
    families without a closed form are counted by the arbiter: not checked here)."""
    _, config = load_config(name)
    adapter = adapter_for(config)
    if not adapter.closed_form or adapter.unsupported_whole(config):
        pytest.skip("no whole-model closed form")
    c = count_structure(adapter.whole(config))
    assert c.exact and not c.reasons, (name, c.reasons)
    assert "discrete_inputs" not in c.components


@pytest.mark.parametrize("name", ["pythia-1.4b", "falcon-7b"])
def test_parallel_bundled_models_have_a_wide_margin(name):
    """``N w`` (what the stream table shows) against ``r + off + w (w + 1)`` (what it must
    pin down): at least 1.5 times over for the bundled parallel models."""
    _, config = load_config(name)
    st = adapter_for(config).whole(config)
    w = st.d_model - 1
    need = mlp_terms(st).identified + constant_offset(st) + w * (w + 1)
    assert first_points(st) * w > 1.5 * need, (first_points(st) * w, need)


def test_report_text_and_json_flag_a_lower_bound(tmp_path, capsys):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(FALCON))
    assert main(["report", str(p), "--json"]) == 0
    w = json.loads(capsys.readouterr().out)["whole_model"]
    assert w["exact"] is False and "lower bound" in w["reasons"][0], w
    assert main(["report", str(p)]) == 0
    out = capsys.readouterr().out
    assert f"unidentified at least {w['unidentified']}" in out and "lower bound:" in out, out


def test_report_json_exact_for_the_issue_model(tmp_path, capsys):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(NEOX))
    assert main(["report", str(p), "--json"]) == 0
    w = json.loads(capsys.readouterr().out)["whole_model"]
    assert (w["exact"], w["reasons"], w["unidentified"]) == (True, [], 413), w


def test_verify_whole_checks_a_small_config_as_given(tmp_path, capsys):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(NEOX))
    code = main(["verify", "--hf-config", str(p), "--whole", "--no-confirm", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert code == 0, d
    assert d["reduced"] is False and d["config"]["vocab_size"] == 16, d["config"]
    assert d["config"]["intermediate_size"] == 16 and d["total"] == 872, d
    assert d["unidentified_numeric"] == d["unidentified_theory"] == 413, d
    code = main(["verify", "--hf-config", str(p), "--whole", "--no-confirm"])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("AGREE") and "as given: 872 parameters" in out, out


def test_verify_whole_reduces_a_large_config_and_says_so(capsys):
    code = main(["verify", "--hf-config", "gpt2", "--whole", "--no-confirm", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert code == 0 and d["agree"] and d["exact"], d
    assert d["reduced"] is True and "reduced: 124,439,808 parameters" in d["model"], d["model"]
    assert d["config"]["vocab_size"] < 100 and d["config"]["n_layer"] == 1, d["config"]


def test_verify_whole_lower_bound_holds_through_the_cli(tmp_path, capsys):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(FALCON))
    code = main(["verify", "--hf-config", str(p), "--whole", "--no-confirm"])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("BOUND HOLDS"), out
    assert "(a lower bound)" in out and "lower bound: the parallel first layer" in out, out


def test_verify_whole_raises_a_tiny_eps_and_says_so(tmp_path, capsys):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(dict(GPT2, layer_norm_epsilon=1e-12)))
    code = main(["verify", "--hf-config", str(p), "--whole", "--no-confirm", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert code == 0 and d["agree"] and not d["reduced"], d
    assert "norm eps 1e-12 raised to 1e-2" in d["model"], d["model"]
