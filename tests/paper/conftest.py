"""One smoke-scale experiment (every run, the same-point and gradient-flow measurements, the
AdamW anatomy), shared by the tests that read it."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smoke(tmp_path_factory):
    from attnid.paper.experiment import run_experiment

    out = tmp_path_factory.mktemp("experiment")
    return run_experiment(out, scale="smoke")
