"""The CLI contract other tools are built against."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from attnid import AttentionSpec, count
from attnid.cli import main


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_count_json_contract(capsys):
    code, out, _ = run(capsys, "count", "--d-model", "64", "--heads", "8", "--kv-heads", "2",
                       "--bias", "qkvo", "--rope", "0.5", "--json")
    assert code == 0
    data = json.loads(out)
    for key, kind in [("total", int), ("identified", int), ("unidentified", int),
                      ("ratio", float), ("near_unidentified", int), ("components", dict),
                      ("spec", dict)]:
        assert isinstance(data[key], kind), key
    spec = AttentionSpec(d_model=64, n_heads=8, n_kv_heads=2, bias="qkvo", rope=0.5)
    assert data["total"] == sum(math.prod(shape) for shape in spec.param_shapes().values())
    assert data == json.loads(json.dumps(count(spec).to_dict()))  # what the library computes
    assert data["spec"]["n_kv_heads"] == 2 and data["spec"]["bias"] == "qkvo"


def test_count_table(capsys):
    code, out, _ = run(capsys, "count", "--d-model", "64", "--heads", "4")
    assert code == 0 and "qk_gauge" in out and "0.1250" in out


def test_verify_json_contract_and_exit_code(capsys):
    code, out, _ = run(capsys, "verify", "--d-model", "8", "--heads", "4", "--kv-heads", "2",
                       "--bias", "qkv", "--rope", "1", "--seed", "2", "--json")
    data = json.loads(out)
    assert code == 0 and data["agree"] is True
    for key in ("total", "unidentified_numeric", "unidentified_theory", "agree",
                "spectral_gap", "seconds"):
        assert key in data
    assert data["unidentified_numeric"] == data["unidentified_theory"]


def test_verify_wide_qk_norm_under_rope(capsys):
    # head_dim > d_model with QK-norm and RoPE: once refused, now counted and checked
    code, out, _ = run(capsys, "verify", "--d-model", "4", "--heads", "2", "--head-dim", "6",
                       "--rope", "1", "--qk-norm", "head", "--qk-norm-eps", "0", "--json")
    data = json.loads(out)
    assert code == 0 and data["agree"] is True, data
    assert data["unidentified_numeric"] == data["unidentified_theory"]


@pytest.mark.parametrize("args", [
    ["count", "--d-model", "10", "--heads", "3"],
    ["count", "--d-model", "12", "--heads", "4", "--kv-heads", "3"],
    ["count", "--d-model", "12", "--heads", "4", "--rope", "0.5"],
    ["count", "--d-model", "-4", "--heads", "2"],
    ["count", "--d-model", "8", "--heads", "2", "--bias", "qz"],
    ["count", "--d-model", "8", "--heads", "two"],
    ["count", "--d-model", "8"],
    ["verify", "--d-model", "8", "--heads", "3"],
    ["count", "--d-model", "8", "--heads", "2", "--qk-norm", "layer"],
    ["count", "--d-model", "8", "--heads", "2", "--rope", "1.5"],
    ["verify", "--hf-config", "gpt2", "--d-model", "8"],  # the spec comes from the config
    ["verify", "--hf-config", "Llama-2-7b", "--whole", "--rope", "1"],
    ["verify", "--d-model", "8", "--n-heads", "2", "--whole"],
    ["report", "gpt2", "--all"],
    ["audit", "gpt2", "--plot", "/no/such/folder/x.png"],
])
def test_user_errors_give_one_line_and_exit_2(capsys, args):
    code, _out, err = run(capsys, *args)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert "Traceback" not in err


def test_console_entry_points():
    for cmd in ([sys.executable, "-m", "attnid", "count", "--d-model", "8", "--heads", "2",
                 "--json"],):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["unidentified"] == 64
    proc = subprocess.run([sys.executable, "-m", "attnid", "count", "--d-model", "7",
                           "--heads", "2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error:")


def test_verify_exits_1_when_theory_and_arbiter_disagree(capsys, monkeypatch):
    import dataclasses

    import attnid.arbiter.compare as v

    real = v.verify

    def off_by_one(spec, **kw):
        r = real(spec, **kw)
        return dataclasses.replace(r, arbiter=dataclasses.replace(r.arbiter, nullity=r.arbiter.nullity + 1))

    monkeypatch.setattr(v, "verify", off_by_one)
    code, out, _ = run(capsys, "verify", "--d-model", "8", "--heads", "2", "--json", "--no-confirm")
    assert code == 1 and json.loads(out)["agree"] is False
