"""The whole-model object of `attnid report`, the CLI, and the reproduce section."""

import json

import pytest

from attnid.cli import main

pytest.importorskip("transformers")


def run(capsys, *args: str) -> tuple[int, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out + err


def test_report_all_table_does_not_crash(capsys):
    """The README invocation (`attnid report --all`) with the table output."""
    code, out = run(capsys, "report", "--all")
    assert code == 0, out
    assert "whole" in out and "Llama-2-70b" in out and "Traceback" not in out


def test_report_json_whole_model_and_identical_layers(capsys):
    code = main(["report", "Llama-2-7b", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    rep = json.loads(out)
    w = rep["whole_model"]
    assert set(w) >= {"total", "identified", "unidentified", "near_unidentified", "ratio", "components"}
    assert w["total"] == rep["model_params"]
    assert rep["layers_identical"] is True and len(rep["layers"]) == 32


def test_verify_whole_cli_agrees(capsys):
    code = main(["verify", "--hf-config", "Llama-2-7b", "--whole", "--no-confirm", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    d = json.loads(out)
    assert d["agree"] and d["unidentified_theory"] == d["unidentified_numeric"], d


def test_missing_architectures_says_so(tmp_path, capsys):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"hidden_size": 8}))
    code, out = run(capsys, "report", str(p))
    assert code == 2
    assert "no 'architectures'" in out and "llama" in out and "Traceback" not in out


@pytest.mark.slow
def test_reproduce_section_quick():
    from attnid.paper.scales import WHOLE_SAMPLE
    from attnid.paper.whole import run_section

    s = run_section(WHOLE_SAMPLE, confirm=False)
    assert s.claims and all(c.holds for c in s.claims), s.claims
    checks = next(t for t in s.tables if t.stem == "whole_model_checks").rows
    from attnid.paper.whole import DISCRETE

    assert {r["model"] for r in checks} == {"gpt2", "Llama-2-7b", "Qwen3-8B", *DISCRETE}
    assert [r["exact"] for r in checks if r["model"] in DISCRETE] == [True, False], checks
