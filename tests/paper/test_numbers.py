"""Every number a section prints (text, captions, claims) is a cell of its tables, to the
precision printed: `attnid.paper.document.untabled`, checked against planted errors, and on
the training section of the smoke experiment and the whole-model section (the pretrained
section: tests/paper/test_pretrained.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from attnid.paper.document import (
    Claim,
    Context,
    Figure,
    Section,
    Table,
    quoted_numbers,
    table_values,
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


# ---- on real sections -------------------------------------------------------------------------
ABSENT = "0.1234567"  # printed to 7 decimals: no measured cell lies within 5e-8 of it by chance


def _plant(section: Section, where: str) -> Section:
    """``section`` with :data:`ABSENT` appended to its text, its first caption or its first claim."""
    if where == "text":
        return dataclasses.replace(section, text=section.text + f" {ABSENT}")
    if where == "caption":
        f = section.figures[0]
        return dataclasses.replace(section, figures=(dataclasses.replace(f, caption=f.caption + f" {ABSENT}"),
                                                     *section.figures[1:]))
    c = section.claims[0]
    return dataclasses.replace(section, claims=(dataclasses.replace(c, evidence=c.evidence + f" {ABSENT}"),
                                                *section.claims[1:]))


def _checks_every_number(section: Section) -> None:
    assert untabled(section) == []
    assert not any(abs(v - float(ABSENT)) <= 5e-8 for v in table_values(section.tables))
    for where in ("text", "claim", *(("caption",) if section.figures else ())):  # the whole model: no figure
        found = untabled(_plant(section, where))
        assert len(found) == 1 and found[0].endswith(f": {ABSENT}"), (where, found)


def test_every_number_of_the_training_section_is_in_its_tables(training):
    _checks_every_number(training)


def test_a_wrong_digit_or_sign_in_a_training_caption_is_found(training):
    """The caption's own numbers, changed: a sign flipped (beta_vo's signed change) and one
    measured value scaled; each is reported unless a table happens to hold the changed value."""
    values = table_values(training.tables)
    fig = next(f for f in training.figures if f.path.name == "fig2_vo.png")
    checked = 0
    for q in quoted_numbers(fig.caption)[:6]:
        if q.sign not in ("+", "-"):
            continue
        flipped = ("-" if q.sign == "+" else "+") + q.text[1:]
        if any(quoted_numbers(flipped)[0].matches(v) for v in values):
            continue  # a table holds the opposite value too: not a planted error
        wrong = dataclasses.replace(fig, caption=fig.caption.replace(q.text, flipped, 1))
        figures = tuple(wrong if f is fig else f for f in training.figures)
        section = dataclasses.replace(training, figures=figures)
        assert f"caption of fig2_vo.png: {flipped}" in untabled(section), (q.text, flipped)
        checked += 1
    assert checked, quoted_numbers(fig.caption)  # not vacuous


@pytest.mark.parametrize("stem", ["training_second_order", "training_same_point", "training_fits",
                                  "training_flow", "training_sweep", "training_anatomy",
                                  "training_rebalancing", "training_bias_gradients", "training_variants",
                                  "training_limits"])
def test_each_training_table_holds_numbers_that_only_it_holds(training, stem):
    """Without the table some stated number is untabled: no table is there for nothing."""
    assert stem in {t.stem for t in training.tables}
    rest = tuple(t for t in training.tables if t.stem != stem)
    assert untabled(dataclasses.replace(training, tables=rest))


@pytest.mark.slow
def test_every_number_of_the_whole_model_section_is_in_its_tables(tmp_path):
    from attnid.paper.whole import whole_model_section

    _checks_every_number(whole_model_section(Context(tmp_path, True, Progress(enabled=False))))
