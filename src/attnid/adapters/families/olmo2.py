"""OLMo2: QK-norm over all heads together (RMSNorm over H*dk). No closed form: counted
numerically on a reduced config of Hugging Face's own class, and reported as such."""

from typing import ClassVar

from attnid.adapters.base import Adapter, Config
from attnid.adapters.registry import register


@register
class Olmo2(Adapter):
    architectures = ("Olmo2ForCausalLM", "Olmo2Model")
    model_type = "olmo2"
    family = "OLMo2"
    closed_form = False
    missing = "a closed form and canonical layout for QK-norm over all heads together"
    lacks: ClassVar[dict[str, str]] = {"layout": missing}

    def reduce(self, c: Config) -> Config:
        return dict(super().reduce(c), rms_norm_eps=1e-2)
