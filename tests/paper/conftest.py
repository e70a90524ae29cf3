"""One smoke-scale experiment (every run, the same-point and gradient-flow measurements, the
AdamW anatomy) and its training section (figures, tables, claims), shared by the tests that
read them; and the check that every number a section states is in its tables."""

from __future__ import annotations

import dataclasses

import pytest

from attnid.paper.document import Section, table_values, untabled


@pytest.fixture(scope="session")
def smoke(tmp_path_factory):
    from attnid.paper.experiment import run_experiment

    out = tmp_path_factory.mktemp("experiment")
    return run_experiment(out, scale="smoke")


@pytest.fixture(scope="session")
def training(smoke, tmp_path_factory):
    """The training section of the smoke experiment, its figures drawn under a folder of their own."""
    from attnid.paper.training import training_section

    return training_section(smoke, tmp_path_factory.mktemp("training") / "figures")


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
    """No number of ``section`` is untabled, and one planted in its text, a caption, a claim is."""
    assert untabled(section) == []
    assert not any(abs(v - float(ABSENT)) <= 5e-8 for v in table_values(section.tables))
    for where in ("text", "claim", *(("caption",) if section.figures else ())):  # the whole model: no figure
        found = untabled(_plant(section, where))
        assert len(found) == 1 and found[0].endswith(f": {ABSENT}"), (where, found)


@pytest.fixture(scope="session")
def checks_every_number():
    """Asserts that every number a section states is in its tables, planted ones found."""
    return _checks_every_number
