"""BERT and RoBERTa: separate query/key/value, output ``dense``; all four biases; post-LN."""

from dataclasses import replace

from torch import nn

from attnid.adapters.base import Adapter, Config, cfg, cfg_float, cfg_int, find_first
from attnid.adapters.layout import Layout, Lin, Norm, activation, base_prefix
from attnid.adapters.registry import register
from attnid.structure import Structure


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
    tie_default = True
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

    def whole(self, c: Config) -> Structure:
        arch = (c.get("architectures") or [""])[0]
        act = str(cfg(c, "hidden_act", default="gelu"))
        return replace(super().whole(c), norm="layer", norm_bias=True,
                       eps=cfg_float(c, "layer_norm_eps", default=1e-12, minimum=0.0), layout="post",
                       mlp="relu" if act == "relu" else "gelu", mlp_bias=True,
                       positions=cfg_int(c, "max_position_embeddings", default=512),
                       token_types=cfg_int(c, "type_vocab_size", default=2, positive=False),
                       mlm_head=arch.endswith("ForMaskedLM"), pooler=arch.endswith("Model"))

    def layout(self, model: nn.Module) -> Layout:
        return _bert_layout(model)

    def attention_of(self, model):
        attn = find_first(model, "SelfAttention")
        dense = find_first(model, "SelfOutput").dense
        return _SelfAttentionAndDense(attn, dense), lambda m, x: m(x)


@register
class Roberta(Bert):
    architectures = ("RobertaModel", "RobertaForMaskedLM", "RobertaForSequenceClassification")
    model_type = "roberta"
    family = "RoBERTa"

    def whole(self, c: Config) -> Structure:
        """As BERT, but a token's position row is padding_idx + (non-pad tokens so far): the
        rows below padding_idx are never read, and the pad token always sits at row padding_idx."""
        return replace(super().whole(c), padding_idx=cfg_int(c, "pad_token_id", default=1, positive=False))

    def layout(self, model: nn.Module) -> Layout:
        return _bert_layout(model, "roberta", ("lm_head", "lm_head.", "lm_head."))


def _bert_layout(model: nn.Module, base: str = "bert", head: tuple[str, str, str] = (
        "cls", "cls.predictions.transform.", "cls.predictions.")) -> Layout:
    """Post-LN: ``x -> LN(x + sublayer(x))``. Each norm feeds the next sublayer's readers and
    its residual sum; the last one feeds the masked-LM transform (a pre-LN reader), whose own
    LayerNorm feeds the decoder. ``head``: (attribute, transform prefix, decoder prefix)."""
    b = base_prefix(model, base)
    L = [f"{b}encoder.layer.{i}." for i in range(model.config.num_hidden_layers)]
    e = f"{b}embeddings."
    qkv = lambda p: tuple(Lin(f"{p}attention.self.{x}") for x in ("query", "key", "value"))  # noqa: E731
    norms, before = [], f"{e}LayerNorm"
    for p in L:
        norms.append(Norm(before, qkv(p), Lin(f"{p}attention.output.dense")))
        norms.append(Norm(f"{p}attention.output.LayerNorm", (Lin(f"{p}intermediate.dense"),),
                          Lin(f"{p}output.dense")))
        before = f"{p}output.LayerNorm"
    unembed, tied = None, False
    attr, tr, dec = head
    if hasattr(model, attr):
        unembed = Lin(f"{dec}decoder")
        tied = model.get_submodule(unembed.path).weight is model.get_submodule(
            f"{e}word_embeddings").weight
        norms.append(Norm(before, (Lin(f"{tr}dense"),)))
        ln = "LayerNorm" if attr == "cls" else "layer_norm"
        norms.append(Norm(f"{tr}{ln}", (unembed,), gain=not tied))
    tables = (f"{e}word_embeddings", f"{e}position_embeddings", f"{e}token_type_embeddings")
    pad = model.config.pad_token_id if base == "roberta" else None
    return Layout("layer", tuple(norms),
                  tuple((Lin(f"{p}attention.output.dense"), Lin(f"{p}output.dense")) for p in L),
                  False, tables,
                  tuple((Lin(f"{p}intermediate.dense"), Lin(f"{p}output.dense")) for p in L),
                  activation(model), unembed, tied, post=True, padding_idx=pad,
                  final=norms[-1] if unembed is not None else Norm(before, (), gain=False), layers=tuple(L))
