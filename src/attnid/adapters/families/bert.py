"""BERT and RoBERTa: separate query/key/value, output ``dense``; all four biases; post-LN."""

from torch import nn

from attnid.adapters.base import Adapter, Config, find_first
from attnid.adapters.registry import register


class _SelfAttentionAndDense(nn.Module):
    """BertSelfAttention followed by the output projection (the LayerNorm after it is not attention)."""

    def __init__(self, attn: nn.Module, dense: nn.Module) -> None:
        super().__init__()
        self.attn, self.dense = attn, dense

    def forward(self, x):
        return self.dense(self.attn(x, attention_mask=None)[0])


@register
class Bert(Adapter):
    architectures = ("BertModel", "BertForMaskedLM", "BertForSequenceClassification", "BertForPreTraining")
    model_type = "bert"
    family = "BERT"
    layer_prefix = "encoder.layer.{i}."
    q, k, v = "attention.self.query", "attention.self.key", "attention.self.value"
    o = "attention.output.dense"

    def bias(self, c: Config) -> str:
        return "qkvo"

    def rope(self, c: Config) -> float:
        return 0.0

    def reduce(self, c: Config) -> Config:
        return dict(c, hidden_size=8, num_attention_heads=2, intermediate_size=16, num_hidden_layers=1,
                    vocab_size=32, max_position_embeddings=64, pad_token_id=None)

    def attention_of(self, model):
        attn = find_first(model, "SelfAttention")
        dense = find_first(model, "SelfOutput").dense
        return _SelfAttentionAndDense(attn, dense), lambda m, x: m(x)


@register
class Roberta(Bert):
    architectures = ("RobertaModel", "RobertaForMaskedLM", "RobertaForSequenceClassification")
    model_type = "roberta"
    family = "RoBERTa"
