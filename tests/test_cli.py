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


# ---- a spec refusal names the flags ----------------------------------------------------------
@pytest.mark.parametrize("args, flags", [
    (["--d-model", "10", "--heads", "3"], ["--n-heads 3", "--d-model 10", "give --head-dim"]),
    (["--d-model", "12", "--heads", "4", "--kv-heads", "3"], ["--n-kv-heads 3", "--n-heads 4"]),
    (["--d-model", "8", "--heads", "2", "--v-head-dim", "0"], ["--v-head-dim must"]),
], ids=["head-dim", "kv-heads", "v-head-dim"])
def test_a_spec_refusal_names_the_flags(capsys, args, flags):
    code, _, err = run(capsys, "count", *args)
    assert code == 2 and all(f in err for f in flags), err
    assert "_" not in err.split(":", 1)[1], f"a field name, not a flag: {err}"


def test_the_library_keeps_its_field_names():
    from attnid.errors import AttnidError

    with pytest.raises(AttnidError, match="give head_dim"):
        AttentionSpec(d_model=10, n_heads=3)


# ---- deprecated spellings: the same call as today's, and one warning line ----------------------
def _capture(monkeypatch, module: str, name: str, result):
    """Replace ``module.name`` by a recorder of its arguments that returns ``result``."""
    import importlib

    calls = []
    monkeypatch.setattr(importlib.import_module(module), name,
                        lambda *a, **kw: calls.append((a, kw)) or result)
    return calls


def _train_summary():
    from attnid.train.loop import TrainSummary

    return TrainSummary(steps=1, final_loss=1.0, world_size=1, rank=0, seconds=0.1, orbit={})


def _rewrite_result():
    return {"operations": {}, "untied": False, "architecture": "X", "layers": 1, "seed": 0,
            "max_residual": 0.0, "tolerance": 1e-7, "end_to_end_rel_diff": None, "seconds": 0.0}


def _barrier_result():
    return {"losses": {}, "barriers": {}, "alphas": [], "model_a": "a", "model_b": "b"}


# (old argv, today's argv, the library function the command calls, what it returns)
ALIASES = {
    "train --out": (["train", "--out", "d", "--steps", "1"], ["train", "d", "--steps", "1"],
                    ("attnid.train.loop", "train", _train_summary)),
    "train --out=": (["train", "--out=d"], ["train", "d"], ("attnid.train.loop", "train", _train_summary)),
    "train --preset": (["train", "--preset", "small"], ["train", "--scale", "small"],
                       ("attnid.train.loop", "train", _train_summary)),
    "barrier --data": (["barrier", "a", "b", "--data", "t.txt"],
                       ["barrier", "a", "b", "--calibration", "t.txt"],
                       ("attnid.checkpoint.barrier", "barrier", _barrier_result)),
    **{f"{cmd} --group": ([cmd, "a", "b", *out, "--group", "none", "--json"],
                          [cmd, "a", "b", *out, "--subgroup", "none", "--json"],
                          ("attnid.checkpoint.align", fn, dict))
       for cmd, out, fn in (("align", ["o"], "align_checkpoints"), ("merge", ["o"], "merge_checkpoints"))},
    "barrier --group": (["barrier", "a", "b", "--calibration", "t.txt", "--group", "none"],
                        ["barrier", "a", "b", "--calibration", "t.txt", "--subgroup", "none"],
                        ("attnid.checkpoint.barrier", "barrier", _barrier_result)),
    **{f"rewrite {flag} random": (["rewrite", "a", "o", flag, "random"], ["rewrite", "a", "o", flag],
                                  ("attnid.checkpoint.rewrite", "rewrite", _rewrite_result))
       for flag in ("--qk-planes", "--scale-mlp", "--permute-mlp", "--permute-heads")},
}


@pytest.mark.parametrize("case", list(ALIASES))
def test_a_deprecated_spelling_makes_the_same_call_with_one_warning(case, capsys, monkeypatch, tmp_path):
    old, new, (module, name, result) = ALIASES[case]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("attnid.cli.align.sized_progress", lambda *a, **kw: None)
    monkeypatch.setattr("attnid.cli.rewrite.sized_progress", lambda *a, **kw: None)
    calls = _capture(monkeypatch, module, name, result())
    code, _, err_new = run(capsys, *new)
    assert code == 0 and err_new == "", err_new
    code, _, err_old = run(capsys, *old)
    assert code == 0, err_old
    assert len(calls) == 2 and calls[0] == calls[1], f"{case}: {calls}"
    lines = err_old.splitlines()
    flag = case.split()[1].rstrip("=")
    assert len(lines) == 1 and lines[0].startswith(f"warning: {flag}"), err_old
    assert "deprecated" in lines[0] and "write" in lines[0], lines[0]


def test_every_rename_is_tested_and_in_the_changelog():
    from pathlib import Path

    from attnid.cli.deprecated import RENAMES

    changelog = (Path(__file__).resolve().parents[1] / "CHANGELOG.md").read_text()
    for r in RENAMES:
        assert any(k.startswith(f"{r.command} {r.old}") for k in ALIASES), f"{r} has no test"
        said = f"`attnid {r.command} {r.old}{' ' + r.value if r.value else ''}"
        assert said in changelog, f"CHANGELOG.md does not list {said}`"


def test_the_new_boolean_form_and_a_following_flag_are_left_alone():
    from attnid.cli.deprecated import rewrite_argv

    said = []
    argv = ["rewrite", "a", "o", "--permute-heads", "--seed", "1", "--", "--data", "x"]
    assert rewrite_argv(argv, said.append) == argv and said == []
    # no value: left for click to refuse
    assert rewrite_argv(["barrier", "--data"], said.append) == ["barrier", "--data"]


def test_train_json(capsys, tmp_path):
    code, out, err = run(capsys, "train", str(tmp_path / "t"), "--steps", "2", "--layers", "1",
                         "--d-model", "16", "--heads", "2", "--seq-len", "8", "--batch-size", "2",
                         "--eval-every", "2", "--log-every", "1", "--no-progress", "--no-checkpoint",
                         "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["steps"] == 2 and math.isfinite(data["final_loss"]) and "median_rho_qk" in data, data
    saved = json.loads((tmp_path / "t" / "summary.json").read_text())
    assert data["final_loss"] == saved["final_loss"]


# ---- what the tables and progress say ------------------------------------------------------------
def test_diff_heads_its_table_in_argument_order(capsys):
    from attnid.cli.diff import _print

    r = {"model_a": "first", "model_b": "second", "architecture": "X", "dtype": "float32", "layers": [],
         "other": {"worst_tensor": None}, "covers": [], "break": None, "tolerance": 1e-7}
    _print(r)
    assert capsys.readouterr().out.strip().splitlines()[0].strip().startswith("first vs second")


def test_align_says_how_the_stream_was_aligned_once():
    """The progress says the stage ended; how (here: why not) is the result's, printed once."""
    pytest.importorskip("transformers")
    from attnid.whole.align import align
    from attnid.whole.check import tiny_model

    cfg = dict(model_type="bert", architectures=["BertForMaskedLM"], hidden_size=8, num_attention_heads=2,
               num_hidden_layers=1, intermediate_size=16, vocab_size=11, max_position_embeddings=8,
               type_vocab_size=1)
    said: list[str] = []
    al = align(tiny_model(cfg, 0), tiny_model(cfg, 1), subgroup="full", progress=said.append)
    assert al.stream.startswith("not aligned"), al.stream
    assert said and not any("not aligned" in s for s in said), said


def _eta_left(lines: list[str]) -> list[str]:
    import re

    return [m[1] for ln in lines if (m := re.search(r", (\d+:\d\d) left\)", ln))]


def test_one_slow_run_does_not_set_the_eta_of_the_rest():
    """`report --all`: one model of 20 took 47 s, the others 0.1 s; the mean said 15 min left."""
    import io

    from attnid.progress import Progress

    stream, now = io.StringIO(), [0.0]
    p = Progress(stream, clock=lambda: now[0])
    for i, seconds in enumerate([47.0] + [0.1] * 19, 1):
        p.run(i, 20, f"m{i}")
        now[0] += seconds
    p.close()
    left = _eta_left(stream.getvalue().splitlines())
    assert left[0] == "14:53" and all(x == "0:02" or x < "0:02" for x in left[1:]), left  # 19 x 47 s, then ~0


def test_a_stage_of_unlike_runs_shows_no_eta(capsys, monkeypatch):
    import io

    from attnid.progress import Progress

    stream = io.StringIO()
    p = Progress(stream, clock=iter(range(100)).__next__)
    p.stage("models", alike=False)
    for i in (1, 2, 3):
        p.run(i, 3, "m")
    p.stage("training")
    for i in (1, 2):
        p.run(i, 2, "t")
    lines = stream.getvalue().splitlines()
    assert not _eta_left(lines[:4]) and len(_eta_left(lines[4:])) == 1, lines


def test_report_all_shows_no_eta(capsys, monkeypatch):
    """Its models are not alike (one numeric check takes 400 times a closed form): no ETA."""
    def fake(progress):
        for i in (1, 2, 3):
            progress.run(i, 3, f"model {i}")
        return []

    monkeypatch.setattr("attnid.report.models.all_reports", fake)
    code, out, err = run(capsys, "report", "--all", "--json")
    assert code == 0 and json.loads(out) == [] and "run 3/3 model 3" in err, err
    assert "ETA" not in err and " left" not in err, err
