"""Tests never reach the network: every model is built from a config or loaded from a local path."""

import os

import pytest
import torch

if "PYTEST_XDIST_WORKER" in os.environ:  # one process per core: one thread each, or torch's
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"  # OpenMP threads spin
    torch.set_num_threads(1)  # against the other workers (and so do the commands tests launch)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """Every test starts from the same global seed (tests also seed their own generators)."""
    torch.manual_seed(0)


def pytest_make_parametrize_id(config, val, argname):
    """An `AttentionSpec` parameter is named by `describe()`: its repr shows a frozenset, whose
    order changes with the hash seed, and the test processes must collect the same ids."""
    from attnid.spec import AttentionSpec

    return val.describe() if isinstance(val, AttentionSpec) else None
