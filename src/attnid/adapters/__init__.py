"""Hugging Face model families: configs -> specs, checkpoints <-> the canonical layout."""

from attnid.adapters.base import Adapter
from attnid.adapters.registry import adapter_for, register, supported

__all__ = ["Adapter", "adapter_for", "register", "supported"]
