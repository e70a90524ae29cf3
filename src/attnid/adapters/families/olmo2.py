"""OLMo2: QK-norm over all heads together (RMSNorm over H*dk): no closed form here."""

from attnid.adapters.base import Adapter, Config
from attnid.adapters.registry import register


@register
class Olmo2(Adapter):
    architectures = ("Olmo2ForCausalLM", "Olmo2Model")
    model_type = "olmo2"
    family = "OLMo2"

    def unsupported(self, c: Config) -> str | None:
        return ("OLMo2 normalises q and k over all heads together (RMSNorm over n_heads*head_dim); "
                "attnid has no closed form or canonical layout for that norm yet")
