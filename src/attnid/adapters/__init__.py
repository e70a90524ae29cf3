"""Hugging Face model families: configs -> specs, checkpoints <-> the canonical layout.

Importing this package registers every family (`families/`; each file owns its config ->
spec, tensor names, structure, whole-model layout and layer finder) and the layer finder that
lets `attnid.monitor` see Hugging Face models (`hooks`, which asks the model's family).
"""

from attnid.adapters import families, hooks  # noqa: F401  (each registers itself)
from attnid.adapters.base import Adapter
from attnid.adapters.registry import adapter_for, register, supported

__all__ = ["Adapter", "adapter_for", "register", "supported"]
