"""Config fields: read once, checked, refused in one line naming the file and the field; and
the tiny models attnid builds from configs build without transformers' warnings."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from attnid.adapters import adapter_for
from attnid.adapters.base import cfg_bool, cfg_float, cfg_int
from attnid.adapters.config import bundled, load_config, source_of
from attnid.errors import AttnidError


@pytest.mark.parametrize(("value", "ok"), [
    (64, True), (64.0, True), (0, False), (-1, False), (64.5, False), ("64", False), (True, False),
    (math.nan, False), (math.inf, False), ([64], False), ({"n": 64}, False)])
def test_cfg_int(value, ok):
    c = {"hidden_size": value}
    if ok:
        assert cfg_int(c, "hidden_size") == 64 and isinstance(cfg_int(c, "hidden_size"), int)
    else:
        with pytest.raises(AttnidError, match="'hidden_size' must be a positive integer"):
            cfg_int(c, "hidden_size")


def test_cfg_int_aliases_defaults_and_zero():
    assert cfg_int({"n_embd": 8}, "hidden_size", "n_embd") == 8
    assert cfg_int({"hidden_size": None, "n_embd": 8}, "hidden_size", "n_embd") == 8  # null = absent
    assert cfg_int({}, "head_dim", default=None) is None
    assert cfg_int({"type_vocab_size": 0}, "type_vocab_size", positive=False) == 0
    with pytest.raises(AttnidError, match=r"no 'hidden_size' \(or 'n_embd'\) field"):
        cfg_int({}, "hidden_size", "n_embd")


def test_cfg_float_and_bool():
    assert cfg_float({"rms_norm_eps": 1e-6}, "rms_norm_eps", minimum=0.0) == 1e-6
    assert cfg_float({}, "rms_norm_eps", default=1e-5) == 1e-5
    for bad in (-1e-6, "small", math.nan, True):
        with pytest.raises(AttnidError, match="'rms_norm_eps' must be a finite number"):
            cfg_float({"rms_norm_eps": bad}, "rms_norm_eps", minimum=0.0)
    assert cfg_bool({"attention_bias": True}, "attention_bias") is True
    assert cfg_bool({}, "attention_bias", default=True) is True
    with pytest.raises(AttnidError, match="'attention_bias' must be true or false, got 'false'"):
        cfg_bool({"attention_bias": "false"}, "attention_bias")  # a string would read as true


def test_refusals_name_the_file(tmp_path):
    config = load_config("Llama-2-7b")[1]
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**config, "num_attention_heads": 5}))
    _, c = load_config(str(path))
    assert source_of(c) == str(path) and source_of(load_config("gpt2")[1]) == "bundled config gpt2"
    with pytest.raises(AttnidError) as e:
        adapter_for(c).specs(c)
    message = str(e.value)
    assert message.startswith(f"{path}: ") and "num_attention_heads=5" in message, message
    path.write_text(json.dumps([config]))
    with pytest.raises(AttnidError, match="is a JSON list, not an object"):
        load_config(str(path))


@pytest.mark.parametrize("name", bundled())
def test_every_bundled_config_reads(name):
    """The checks refuse nothing real: every bundled config gives its specs (and, where a
    whole-model closed form exists, its structure)."""
    _, c = load_config(name)
    a = adapter_for(c)
    assert a.specs(c)
    if a.closed_form and a.unsupported_whole(c) is None:
        assert a.whole(c).vocab == c["vocab_size"]


def test_token_ids_outside_the_vocabulary_become_none():
    pytest.importorskip("transformers")
    from attnid.adapters.base import hf_config

    tiny = {"model_type": "gpt2", "n_embd": 8, "n_head": 2, "n_layer": 1, "vocab_size": 12}
    c = hf_config({**tiny, "bos_token_id": 50256})  # given, and GPT-2's default eos, both too big
    assert c.bos_token_id is None and c.eos_token_id is None
    c = hf_config({**tiny, "bos_token_id": 3, "eos_token_id": 4, "pad_token_id": 5})
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (3, 4, 5)  # inside: kept


QUIET = """
import json
from attnid.adapters import adapter_for
from attnid.adapters.config import bundled, load_config
from attnid.whole.check import tiny_model
tiny_model({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 8, "n_head": 2,
            "n_layer": 1, "vocab_size": 12, "n_positions": 6})      # docs/counting.md's example
for name in bundled():
    c = load_config(name)[1]
    adapter = adapter_for(c)
    adapter.hf_attention(adapter.reduce(c))                          # verify --hf-config, report
"""


@pytest.mark.slow  # every bundled config in a fresh interpreter; the rule itself is tested fast above
def test_tiny_models_build_without_token_id_warnings():
    """Reduced and tiny configs keep their family's bos/eos ids (GPT-2: 50256) beyond a tiny
    vocabulary; transformers warns about each unless attnid gives them as None. A fresh
    interpreter: transformers says each warning once per process."""
    pytest.importorskip("transformers")
    proc = subprocess.run([sys.executable, "-c", QUIET], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "token_id" not in proc.stderr, proc.stderr


def test_neox_odd_rotary_width_is_refused(tmp_path, capsys):
    # measured: rotary_pct 0.25 of head size 4 makes Hugging Face rotate 1 dim; the adapter
    # truncated it to 0 and the whole-model count read 294 against the arbiter's 270
    from attnid.cli import main

    c = {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "hidden_size": 8,
         "num_attention_heads": 2, "num_hidden_layers": 1, "intermediate_size": 16, "vocab_size": 64,
         "rotary_pct": 0.25}
    (tmp_path / "config.json").write_text(__import__("json").dumps(c))
    assert main(["report", str(tmp_path / "config.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "rotates 1 dims, an odd number" in err[0] and "config.json" in err[0], err
