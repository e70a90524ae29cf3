"""One smoke-scale experiment (every run, the same-point and gradient-flow measurements, the
AdamW anatomy) and its training section (figures, tables, claims), shared by the tests that
read them."""

from __future__ import annotations

import pytest


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
