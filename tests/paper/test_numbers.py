"""Every number a section prints (text, captions, claims) is a cell of its tables, to the
precision printed: `attnid.paper.document.untabled`, checked against planted errors, and on
the whole-model section (the training section: tests/paper/test_second_order.py, beside the
smoke experiment it is built from; the pretrained section: tests/paper/test_pretrained.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from attnid.paper.document import (
    Claim,
    Context,
    Figure,
    Section,
    Table,
    quoted_numbers,
    untabled,
)
from attnid.progress import Progress

ROWS = [{"run": "AdamW lr 0.0001", "beta_vo_per_time": -1.4e-05, "gain": 0.0391, "share": 0.1445, "n": 512}]


def _section(caption: str, evidence: str = "", text: str = "") -> Section:
    return Section("S", text, (Table("t", ROWS),), (Figure(Path("f.png"), caption),),
                   (Claim("S", "a claim", True, evidence),) if evidence else ())


@pytest.mark.parametrize(("text", "want"), [
    ("moves -1.4e-05 at lr 0.0625", [("-", 1.4e-05), ("", 0.0625)]),
    ("gain +0.039 [-0.003, +0.081]", [("+", 0.039), ("-", 0.003), ("+", 0.081)]),
    ("removes 14.5% of it", [("", 0.145)]),
    ("all-MiniLM-L6-v2, rho_qk, C_0, float32, x10, step-1", [("", 1.0)]),
    ("1,024 lines, ±0.02.", [("", 1024.0), ("±", 0.02)]),
    ("docs/theory.md §9.3, § 13.17; the paper's Fig. 2, Figs. 2-4, Section 5, section 13, Table 1: 0.5",
     [("", 0.5)]),  # references are names, not quantities
])
def test_numbers_are_read_as_printed_and_names_are_skipped(text, want):
    got = [(q.sign, q.value) for q in quoted_numbers(text)]
    assert [s for s, _ in got] == [s for s, _ in want]
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-12)


def test_numbers_from_the_table_pass_at_the_precision_printed():
    sec = _section("per unit of time -1.4e-05 at lr 0.0001; gain +0.039; 14.5% removable",
                   evidence="over 512 lines, gain 0.04", text="share 0.14")
    assert untabled(sec) == []


@pytest.mark.parametrize(("caption", "bad"), [
    ("per unit of time 1.4e-05 at lr 0.0001", "1.4e-05"),  # the sign lost
    ("per unit of time -1.5e-05 at lr 0.0001", "-1.5e-05"),  # a wrong digit
    ("gain +0.0392", "+0.0392"),  # more digits than the table supports
    ("14.6% removable", "14.6%"),
    ("over 513 lines", "513"),
])
def test_a_planted_wrong_number_is_found(caption, bad):
    assert untabled(_section(caption)) == [f"caption of f.png: {bad}"]


def test_claims_and_text_are_read_too():
    assert untabled(_section("ok", evidence="gain 0.05")) == ["claim 'a claim': 0.05"]
    assert untabled(_section("ok", text="share 0.15")) == ["text: 0.15"]


# ---- on a real section ------------------------------------------------------------------------
@pytest.mark.slow
def test_every_number_of_the_whole_model_section_is_in_its_tables(tmp_path, checks_every_number):
    from attnid.paper.whole import whole_model_section

    checks_every_number(whole_model_section(Context(tmp_path, True, Progress(enabled=False))))
