"""Tests never reach the network: every model is built from a config or loaded from a local path."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """Every test starts from the same global seed (tests also seed their own generators)."""
    torch.manual_seed(0)
