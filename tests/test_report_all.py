"""`attnid report --all`: a narrow default table, every column with --wide or --json, progress
per model, and never Python's ``None`` in a table."""

from __future__ import annotations

import json

import pytest

from attnid.cli import main
from attnid.report.models import model_report, narrow_row, summary_row

pytest.importorskip("transformers")

# the longest bundled name, a family without a closed form (numeric on a reduced config), GPT-2
MODELS = ["Phi-3-mini-4k-instruct", "OLMo-2-1124-7B", "gpt2"]


_REPORTS: dict[tuple[str, bool], dict] = {}


@pytest.fixture
def few(monkeypatch):
    """`report --all` over three bundled models (all twenty take about a minute), each model's
    report computed once for this module (the tests compare its tables, not its arithmetic)."""
    import copy

    import attnid.report.models as M

    real = M.model_report

    def once(model: str, *, with_params: bool = True) -> dict:
        if (model, with_params) not in _REPORTS:
            _REPORTS[model, with_params] = real(model, with_params=with_params)
        return copy.deepcopy(_REPORTS[model, with_params])

    monkeypatch.setattr(M, "bundled", lambda: MODELS)
    monkeypatch.setattr(M, "model_report", once)


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def test_narrow_by_default(few, capsys):
    assert main(["report", "--all"]) == 0
    out, err = capsys.readouterr()
    widths = [len(line) for line in lines(out)]
    assert max(widths) <= 100, out
    header = next(line for line in lines(out) if "model" in line and "layers" in line)
    for col in ("attention ratio", "whole-model ratio", "near-unidentified"):
        assert col in header
    assert "qk_unid" not in out and "None" not in out
    olmo = next(line for line in lines(out) if "OLMo" in line)
    assert "(reduced)" in olmo  # no closed form: the arbiter's count on a reduced config, said
    gpt2 = next(line for line in lines(out) if "gpt2" in line)
    ratio = model_report("gpt2", with_params=False)["attention"]["ratio"]
    assert f"{ratio:.4g}" in gpt2  # the closed form's ratio, to 4 significant digits
    # progress: one line per model on stderr
    for i, name in enumerate(MODELS, 1):
        assert f"run {i}/{len(MODELS)} {name}" in err


def test_wide_and_json_show_every_column(few, capsys):
    assert main(["report", "--all", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["model"] for r in rows] == MODELS
    assert all(set(r) == set(rows[0]) for r in rows) and "qk_unid_per_layer" in rows[0]
    assert main(["report", "--all", "--wide"]) == 0
    out = capsys.readouterr().out
    for key in rows[0]:
        assert key in out, key  # every JSON column is in the wide table
    assert "None" not in out and "n/a" in out  # OLMo's closed-form cells


def test_wide_needs_all(capsys):
    assert main(["report", "gpt2", "--wide"]) == 2
    assert capsys.readouterr().err.startswith("error: --wide")


def test_rows_are_the_report(few):
    r = model_report("gpt2")
    row, full = narrow_row(r), summary_row(r)
    assert row["attention ratio"] == r["attention"]["ratio"] == pytest.approx(full["ratio"], abs=1e-6)
    assert row["whole-model ratio"] == r["whole_model"]["ratio"]
    assert row["near-unidentified"] == r["attention"]["near_unidentified"]
