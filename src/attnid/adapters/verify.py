"""`attnid verify --hf-config`: the arbiter on Hugging Face's own attention class, reduced in size."""

from __future__ import annotations

from typing import Any

from torch import nn

from attnid.adapters.config import load_config
from attnid.adapters.registry import adapter_for
from attnid.numeric import EXACT_RTOL
from attnid.theory import count
from attnid.verify import Verification, verify_module


def verify_hf_config(model: str, *, seed: int = 0, confirm: bool = True) -> Verification:
    """Build the architecture's attention module at a reduced size (same grouping, rotary
    fraction, biases, norms), random float64 weights, eval mode; count and compare."""
    name, config = load_config(model)
    adapter = adapter_for(config)
    small = adapter.reduce(config)
    spec = adapter.spec(small)
    module, forward = adapter.hf_attention(small)
    without_eps = None
    if spec.qk_norm != "none" and spec.qk_norm_eps > 0:
        def without_eps(m: nn.Module) -> nn.Module:
            copy, _ = adapter.hf_attention(dict(small, rms_norm_eps=0.0))
            copy.load_state_dict(m.state_dict())
            return copy

    kwargs: dict[str, Any] = dict(forward=forward, d_model=spec.d_model,
                                  rtol=EXACT_RTOL[adapter.working_precision])
    result = verify_module(module, count(spec), label=f"{name} ({type(module).__name__} of "
                           f"{adapter.family}, reduced: {spec.describe()})", seed=seed,
                           confirm=confirm, without_eps=without_eps, **kwargs)
    if without_eps is None:  # no norm: nothing can be near-null by definition
        from dataclasses import replace

        result = replace(result, arbiter=replace(result.arbiter, near_nullity=0),
                         confirm=None if result.confirm is None else
                         replace(result.confirm, near_nullity=0))
    return result
