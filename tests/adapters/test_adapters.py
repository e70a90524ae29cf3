"""Adapters: registry, config key styles, layouts round-trip, report, the arbiter on HF classes."""

from __future__ import annotations

import json

import pytest
import torch

from attnid import AttnidError, count
from attnid.adapters import adapter_for
from attnid.adapters.base import build_hf_model
from attnid.adapters.config import bundled, load_config
from attnid.adapters.reduced import verify_hf_config
from attnid.cli import main
from attnid.report.models import model_report
from attnid.testing import assert_function_preserved, relative_error

ONE_PER_FAMILY = ["gpt2", "bert-base-uncased", "roberta-base", "Llama-2-7b", "Meta-Llama-3-8B",
                  "Mistral-7B-v0.1", "Qwen2.5-7B", "gemma-7b", "falcon-7b", "pythia-1.4b",
                  "Phi-3-mini-4k-instruct", "Qwen3-8B"]


def test_at_least_15_bundled_models_all_supported():
    names = bundled()
    assert len(names) >= 15
    for n in names:
        _, c = load_config(n)
        adapter = adapter_for(c)
        assert adapter.specs(c) if adapter.closed_form else adapter.missing


@pytest.mark.parametrize("config, message", [
    ({"architectures": ["MambaForCausalLM"], "model_type": "mamba"}, "unsupported architecture"),
    ({"architectures": ["FalconForCausalLM"], "model_type": "falcon", "alibi": True,
      "hidden_size": 64, "num_attention_heads": 4}, "ALiBi"),
])
def test_unsupported_is_refused_with_what_is_missing(config, message):
    with pytest.raises(AttnidError, match=message):
        adapter_for(config)


def test_old_and_new_config_key_styles():
    old = {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "hidden_size": 2048,
           "num_attention_heads": 16, "num_hidden_layers": 2, "rotary_pct": 0.25, "rope_theta": 5e5}
    new = {**{k: v for k, v in old.items() if k not in ("rotary_pct", "rope_theta")},
           "rope_parameters": {"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.25}}
    a, b = adapter_for(old).spec(old), adapter_for(new).spec(new)
    assert a == b and a.rope_dims == 32 and a.rope_base == 5e5
    phi = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 3072,
           "num_attention_heads": 32, "num_hidden_layers": 1,
           "rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.75}}
    assert adapter_for(phi).spec(phi).rope_dims == 72
    gpt2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 768, "n_head": 12,
            "n_layer": 12}
    assert adapter_for(gpt2).spec(gpt2).head_dim == 64


def test_report_reproduces_the_papers_llama2_70b_numbers():
    r = model_report("Llama-2-70b", with_params=False)
    assert r["qk_unidentified_per_layer_without_rope"] == 131_072
    assert r["qk_unidentified_per_layer_without_rope_if_mha"] == 1_048_576
    assert r["qk_unidentified_per_layer"] == 8 * 128  # with RoPE: one complex scalar per plane
    assert r["n_layers"] == 80 and len(r["layers"]) == 80


def test_report_json_contract(capsys, tmp_path):
    _, c = load_config("Qwen2.5-0.5B")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(c))
    for target in ("Qwen2.5-0.5B", str(path), str(tmp_path)):
        assert main(["report", target, "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        for key in ("model", "architecture", "n_layers", "attention", "layers"):
            assert key in data
        assert set(data["attention"]) >= {"total", "unidentified", "ratio"}
        assert data["layers"][0]["near_unidentified"] == 0
        assert data["attention"]["total"] == 24 * data["layers"][0]["total"]
        assert data["model_params"] == 494_032_768


@pytest.mark.slow  # every bundled model; tests/test_report_all.py runs --all on three, fast
def test_report_all_table(capsys):
    assert main(["report", "--all", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) >= 15 and {"Llama-2-70b", "gpt2", "Qwen3-8B"} <= {r["model"] for r in rows}


def test_report_errors(capsys):
    assert main(["report", "no-such-model"]) == 2
    assert capsys.readouterr().err.startswith("error: no config")


@pytest.mark.parametrize("name", ONE_PER_FAMILY)
def test_arbiter_on_hugging_face_class_agrees(name):
    result = verify_hf_config(name, confirm=False)
    d = result.to_dict()
    assert d["agree"], d
    assert d["total"] == count(adapter_for(load_config(name)[1]).spec(
        adapter_for(load_config(name)[1]).reduce(load_config(name)[1]))).total


def test_softmax_in_float32_does_not_hide_the_value_bias_translation(tmp_path):
    # measured: without Float64Mode, Hugging Face's float32 softmax sank the value-bias
    # translation of a Llama with attention_bias (arbiter 40 against the closed form's 48,
    # spectral gap 1e7); computed in float64 the two agree with a wide gap
    _, c = load_config("Llama-2-7b")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(c, attention_bias=True)))
    d = verify_hf_config(str(path), confirm=False).to_dict()
    assert d["unidentified_theory"] == 48, d
    assert d["agree"] and d["spectral_gap"] > 1e9, d


def test_verify_hf_config_cli(capsys):
    assert main(["verify", "--hf-config", "Qwen2.5-7B", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["agree"] and d["stable"] and "Qwen2" in d["model"]


@pytest.mark.parametrize("name", ONE_PER_FAMILY)
def test_layout_round_trip_on_real_module_state(name):
    _, c = load_config(name)
    adapter = adapter_for(c)
    small = dict(adapter.reduce(c), num_hidden_layers=2, n_layer=2)
    model = build_hf_model({**small, "model_type": adapter.model_type})
    state = {k: v.detach() for k, v in model.state_dict().items()}
    spec = adapter.spec(small)
    first = adapter.names(1, spec)[0]
    prefix = next(k[: -len(first)] for k in state if k.endswith(first))
    local = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    w = adapter.read(local, 1, spec)
    back = adapter.write(w, 1)
    assert set(back) == set(adapter.names(1, spec))
    for k, v in back.items():
        assert torch.equal(v, local[k]), k


FALCON_VARIANTS = {
    "falcon-bias-mha": {"architectures": ["FalconForCausalLM"], "model_type": "falcon", "hidden_size": 64,
                        "num_attention_heads": 4, "num_hidden_layers": 1, "multi_query": False,
                        "new_decoder_architecture": False, "bias": True, "alibi": False},
    "falcon-grouped": {"architectures": ["FalconForCausalLM"], "model_type": "falcon", "hidden_size": 64,
                       "num_attention_heads": 8, "num_kv_heads": 2, "num_hidden_layers": 1,
                       "new_decoder_architecture": True, "bias": False, "alibi": False},
}


@pytest.mark.parametrize("name", ONE_PER_FAMILY + list(FALCON_VARIANTS))
def test_canonical_layout_computes_what_hugging_face_computes(name):
    """HF's attention module and attnid.Attention on the adapter's canonical weights agree."""
    from attnid.arbiter.rank import randomize_
    from attnid.whole.check import Float64Mode

    c = FALCON_VARIANTS[name] if name in FALCON_VARIANTS else load_config(name)[1]
    adapter = adapter_for(c)
    small = adapter.reduce(c)
    spec = adapter.spec(small)
    # HF computes its rotary tables (built at init), some softmaxes and norms in float32 even
    # in a float64 model: built and run in Float64Mode, it computes its function in float64,
    # and the two agree to float64's tolerance (without it: ~1e-7 under RoPE)
    with Float64Mode():
        model = build_hf_model({**small, "model_type": adapter.model_type})
        holder, forward = adapter.attention_of(model)
        randomize_(holder, 3)
        state = {k: v.detach() for k, v in model.state_dict().items()}
        first = adapter.names(0, spec)[0]
        prefix = next(k[: -len(first)] for k in state if k.endswith(first))
        local = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        ours = adapter.read(local, 0, spec).to_module()
        x = torch.randn(3, 7, spec.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        # HF's attention module without a mask attends to every position
        assert_function_preserved(lambda x: forward(holder, x), lambda x: ours(x, causal=False), x)
        wrong = relative_error(ours(x, causal=True), forward(holder, x))
    assert wrong > 1e-3, f"{name}: the causal mask agrees too ({wrong:.2e}): the check would be vacuous"


@pytest.mark.parametrize("name, missing", [("OLMo-2-1124-7B", "all heads together"),
                                           ("DeepSeek-V3", "latent attention")])
def test_families_without_closed_form_are_counted_numerically(name, missing, capsys, tmp_path):
    r = model_report(name, with_params=False)
    assert r["closed_form"] is False and missing in r["note"]
    nr = r["numeric_reduced"]
    assert 0 < nr["unidentified"] < nr["params"] and nr["near_unidentified"] == 2
    assert r["attention"]["unidentified"] is None and r["attention"]["total"] > 0
    assert main(["verify", "--hf-config", name]) == 2
    assert "no closed form" in capsys.readouterr().err
    (tmp_path / "m").mkdir()
    _, c = load_config(name)
    (tmp_path / "m" / "config.json").write_text(json.dumps(c))
    assert main(["canonicalize", str(tmp_path / "m"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot canonicalize") and missing in err
