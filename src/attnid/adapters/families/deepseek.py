"""DeepSeek (V2/V3) multi-head latent attention: not supported."""

from attnid.adapters.base import Adapter, Config
from attnid.adapters.registry import register


@register
class DeepSeek(Adapter):
    architectures = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
    model_type = "deepseek_v3"
    family = "DeepSeek"

    def unsupported(self, c: Config) -> str | None:
        return ("DeepSeek multi-head latent attention (low-rank q/kv with a decoupled RoPE key) "
                "has no closed form or canonical layout in attnid yet")
