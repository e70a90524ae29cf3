"""`attnid verify --hf-config`: the arbiter on Hugging Face's own attention class, reduced in size."""

from __future__ import annotations

from typing import Any

from torch import nn

from attnid.adapters.base import Adapter, Config
from attnid.adapters.config import load_config
from attnid.adapters.registry import adapter_for
from attnid.arbiter.compare import Verification, verify_module
from attnid.arbiter.precision import in_float64
from attnid.arbiter.rank import jacobian_rank, norms_without_eps, randomize_, set_norm_eps_
from attnid.errors import AttnidError
from attnid.theory import count


def verify_hf_config(model: str, *, seed: int = 0, confirm: bool | None = None) -> Verification:
    """Build the architecture's attention module at a reduced size (same grouping, rotary
    fraction, biases, norms), random float64 weights, eval mode; count and compare."""
    name, config = load_config(model)
    adapter = adapter_for(config)
    if not adapter.closed_form:
        raise AttnidError(f"{adapter.family} has no closed form to compare with (attnid lacks "
                          f"{adapter.missing}); `attnid report` shows its numeric count")
    full = adapter.specs(config)[0]  # the whole config checked before any work
    small = adapter.reduce(config)
    spec = adapter.spec(small)
    module, forward = adapter.hf_attention(small)
    without_eps = None
    if spec.qk_norm != "none" and spec.qk_norm_eps > 0:
        def without_eps(m: nn.Module) -> nn.Module:
            exact, _ = adapter.hf_attention(dict(small, rms_norm_eps=0.0))
            exact.load_state_dict(m.state_dict())
            return exact

    changed = "" if full.kv_group_size == spec.kv_group_size else (
        f"; kv group size {full.kv_group_size} reduced to {spec.kv_group_size}")
    arch = (config.get("architectures") or [adapter.model_type])[0]
    return verify_module(module, count(spec), label=f"{name} (attention of {arch}, reduced: "
                         f"{spec.describe()}{changed})", seed=seed,
                         confirm=confirm, without_eps=without_eps, forward=in_float64(forward),
                         d_model=spec.d_model)


def numeric_hf_count(adapter: Adapter, config: Config, *, seed: int = 0) -> dict[str, Any]:
    """The arbiter's count of one attention layer of a *reduced* config, on Hugging Face's own
    class (for families without a closed form). Near-null: the directions that become exactly
    null when the norms' epsilon is 0."""
    small = adapter.reduce(config)
    module, forward = adapter.hf_attention(small)
    randomize_(module, seed)
    set_norm_eps_(module, 1e-2)  # every norm inside, also those whose eps is hard-coded
    found = jacobian_rank(module, without_eps=norms_without_eps, forward=in_float64(forward),
                          d_model=int(small["hidden_size"]),
                          seed=seed)
    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "q_lora_rank",
            "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
    return {"reduced_config": {k: small[k] for k in keys if small.get(k) is not None},
            "params": found.n_params, "unidentified": found.nullity,
            "near_unidentified": found.near_nullity, "spectral_gap": found.spectral_gap,
            "seconds": found.seconds}
