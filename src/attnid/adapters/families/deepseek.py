"""DeepSeek V2/V3 multi-head latent attention (low-rank q and kv with a decoupled RoPE key).
No closed form: counted numerically on a reduced config of Hugging Face's own class."""

from attnid.adapters.base import Adapter, Config, cfg
from attnid.adapters.registry import register


@register
class DeepSeekV3(Adapter):
    architectures = ("DeepseekV3ForCausalLM", "DeepseekV3Model")
    model_type = "deepseek_v3"
    family = "DeepSeek-V3"
    closed_form = False
    missing = "a closed form and canonical layout for multi-head latent attention"
    lacks = dict.fromkeys(("names", "layout", "layers"), missing)

    def reduce(self, c: Config) -> Config:
        small = dict(c, hidden_size=16, num_attention_heads=2, num_key_value_heads=2,
                     q_lora_rank=8 if cfg(c, "q_lora_rank") else None, kv_lora_rank=8,
                     qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4, intermediate_size=32,
                     moe_intermediate_size=8, n_routed_experts=2, num_experts_per_tok=1,
                     n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
                     num_hidden_layers=1, vocab_size=32, max_position_embeddings=64,
                     rope_scaling=None, rms_norm_eps=1e-2, pad_token_id=None, bos_token_id=None,
                     eos_token_id=None)
        small.pop("rope_parameters", None)
        return small


@register
class DeepSeekV2(DeepSeekV3):
    architectures = ("DeepseekV2ForCausalLM", "DeepseekV2Model")
    model_type = "deepseek_v2"
    family = "DeepSeek-V2"
