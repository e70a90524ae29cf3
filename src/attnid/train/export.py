"""Export attnid's small GPT (`attnid.train.model`) as a Hugging Face checkpoint.

Three styles have a transformers class that computes exactly the same function:

- **Llama** (``LlamaForCausalLM``): RMSNorm, SwiGLU, RoPE on every head dim (``rope=1``,
  ``rotate_half`` pairing and ``rope_theta`` as `attnid.rope`), GQA, attention biases on
  all of q, k, v, o or none, tied or untied head;
- **Llama without RoPE** (``PositionsLlamaForCausalLM``, attnid's own class,
  `attnid.adapters.positions_llama`: loads wherever attnid is imported): the same with
  ``rope=0``, positions learned (``model.embed_positions``) or none;
- **GPT-2** (``GPT2LMHeadModel``): LayerNorm, exact GELU (``activation_function="gelu"``),
  learned positions, biases on q, k, v, o and the MLP, no GQA, tied or untied head.

The directory holds ``config.json``, ``model.safetensors`` and a character-level tokenizer
(``tokenizer.json``: one token per character, so ``AutoTokenizer.from_pretrained`` encodes
text to exactly the ids of `attnid.train.data`). It is written into a temporary sibling,
loaded back with the transformers class and checked to compute the model's logits (float64,
`attnid.arbiter.precision.Float64Mode`), and only then moved into place.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch

from attnid.errors import AttnidError, require_extras
from attnid.numerics import TOLERANCE, relative_error
from attnid.train.model import GPT, GPTConfig
from attnid.weights import AttentionWeights

Style = Literal["llama", "attnid_llama", "gpt2"]
ARCHITECTURE: dict[Style, str] = {"llama": "LlamaForCausalLM", "attnid_llama": "PositionsLlamaForCausalLM",
                                  "gpt2": "GPT2LMHeadModel"}


def hf_style(cfg: GPTConfig) -> Style:
    """The Hugging Face class that can hold ``cfg`` (``"llama"``, ``"attnid_llama"`` or
    ``"gpt2"``), or a refusal naming what no such class represents."""
    bias = cfg.attention_spec().bias
    if cfg.qk_norm != "none":
        raise AttnidError("cannot export a model with QK-norm: neither LlamaForCausalLM nor "
                          "GPT2LMHeadModel normalises queries and keys")
    if cfg.norm == "rmsnorm" and cfg.mlp == "swiglu":
        if cfg.rope not in (0.0, 1.0):
            raise AttnidError(f"cannot export a Llama-style model with rope={cfg.rope:g}: "
                              "LlamaForCausalLM rotates every head dim (rope=1), "
                              "PositionsLlamaForCausalLM none (rope=0)")
        if bias not in (frozenset(), frozenset("qkvo")):
            raise AttnidError(f"cannot export attention biases {cfg.attn_bias!r} as Llama: its "
                              "attention_bias puts biases on all of q, k, v, o or none")
        return "llama" if cfg.rope == 1.0 else "attnid_llama"
    if cfg.norm == "layernorm" and cfg.mlp == "gelu":
        if cfg.rope != 0.0 or cfg.positions != "learned":
            raise AttnidError("cannot export a GPT-2-style model with RoPE or without positions: "
                              "GPT2LMHeadModel has a learned table")
        if cfg.n_kv_heads not in (None, cfg.n_heads):
            raise AttnidError("cannot export GQA (n_kv_heads < n_heads) as GPT-2: it has one "
                              "key/value head per query head")
        if bias != frozenset("qkvo") or not cfg.mlp_bias:
            raise AttnidError(f"cannot export attention biases {cfg.attn_bias!r}"
                              f"{'' if cfg.mlp_bias else ' without MLP biases'} as GPT-2: it has "
                              "biases on q, k, v, o and the MLP (train with --arch gpt2)")
        return "gpt2"
    raise AttnidError(f"cannot export norm={cfg.norm} with mlp={cfg.mlp}: Hugging Face has "
                      "rmsnorm + swiglu (Llama) and layernorm + gelu (GPT-2)")


def hf_config(cfg: GPTConfig) -> dict[str, Any]:
    """The ``config.json`` of ``cfg``'s export (the fields its transformers class reads)."""
    style = hf_style(cfg)
    spec = cfg.attention_spec()
    common = dict(architectures=[ARCHITECTURE[style]], model_type=style, vocab_size=cfg.vocab_size,
                  tie_word_embeddings=cfg.tie_weights, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None, dtype="float32")
    if style == "attnid_llama":
        llama = dict(hf_config(replace(cfg, rope=1.0, positions="learned")),
                     architectures=[ARCHITECTURE[style]], model_type=style, position_embedding=cfg.positions)
        return {k: v for k, v in llama.items() if not k.startswith("rope_")}
    if style == "llama":
        return dict(common, hidden_size=cfg.d_model, intermediate_size=cfg.hidden,
                    num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                    num_key_value_heads=spec.n_kv_heads, head_dim=spec.head_dim, hidden_act="silu",
                    max_position_embeddings=cfg.block_size, rms_norm_eps=cfg.norm_eps,
                    rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_base},
                    rope_theta=cfg.rope_base, attention_bias=bool(spec.bias), attention_dropout=0.0,
                    mlp_bias=cfg.mlp_bias)
    # attnid drops out after the embeddings and the MLP; GPT-2 also after the attention
    return dict(common, n_embd=cfg.d_model, n_inner=cfg.hidden, n_layer=cfg.n_layers,
                n_head=cfg.n_heads, n_positions=cfg.block_size, activation_function="gelu",
                layer_norm_epsilon=cfg.norm_eps, embd_pdrop=cfg.dropout, resid_pdrop=cfg.dropout,
                attn_pdrop=0.0)


def hf_tensors(model: GPT) -> dict[str, torch.Tensor]:
    """The model's parameters under the transformers class's names and layouts (detached
    copies; a tied head is stored once, as the token embedding)."""
    from attnid.adapters.registry import adapter_for

    cfg = model.cfg
    style = hf_style(cfg)
    adapter = adapter_for(hf_config(cfg))
    outer = "transformer." if style == "gpt2" else "model."
    out: dict[str, torch.Tensor] = {}
    for i, block in enumerate(model.blocks):
        attn = AttentionWeights.from_module(block.attn)
        out |= {outer + n: t for n, t in adapter.write(attn, i).items()}
        out |= {outer + n: t for n, t in _block(style, block, i).items()}
    if style != "gpt2":
        out |= {"model.embed_tokens.weight": model.wte.weight, "model.norm.weight": model.ln_f.weight}
        if model.wpe is not None:
            out["model.embed_positions.weight"] = model.wpe.weight
    else:
        out |= {"transformer.wte.weight": model.wte.weight, "transformer.wpe.weight": model.wpe.weight,
                "transformer.ln_f.weight": model.ln_f.weight, "transformer.ln_f.bias": model.ln_f.bias}
    if not cfg.tie_weights:
        out["lm_head.weight"] = model.lm_head.weight
    return {n: t.detach().clone().contiguous() for n, t in out.items()}


def _block(style: Style, block: torch.nn.Module, i: int) -> dict[str, torch.Tensor]:
    """A block's norms and MLP under the class's names (GPT-2's Conv1D stores ``[in, out]``)."""
    def linear(name: str, layer: torch.nn.Linear, transpose: bool) -> dict[str, torch.Tensor]:
        got = {f"{name}.weight": layer.weight.T if transpose else layer.weight}
        if layer.bias is not None:
            got[f"{name}.bias"] = layer.bias
        return got

    mlp = block.mlp
    if style != "gpt2":
        p = f"layers.{i}."
        return {f"{p}input_layernorm.weight": block.ln_1.weight,
                f"{p}post_attention_layernorm.weight": block.ln_2.weight,
                **linear(f"{p}mlp.gate_proj", mlp.gate, False), **linear(f"{p}mlp.up_proj", mlp.up, False),
                **linear(f"{p}mlp.down_proj", mlp.down, False)}
    p = f"h.{i}."
    return {f"{p}ln_1.weight": block.ln_1.weight, f"{p}ln_1.bias": block.ln_1.bias,
            f"{p}ln_2.weight": block.ln_2.weight, f"{p}ln_2.bias": block.ln_2.bias,
            **linear(f"{p}mlp.c_fc", mlp.fc, True), **linear(f"{p}mlp.c_proj", mlp.proj, True)}


def char_tokenizer(chars: str, max_length: int | None = None) -> Any:
    """A transformers tokenizer with one token per character, id ``i`` for ``chars[i]``
    (newlines and spaces included; no special tokens, nothing normalised)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if len(set(chars)) != len(chars) or any(len(c) != 1 for c in chars):
        raise AttnidError("the vocabulary must be distinct single characters")
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character
    tok.decoder = decoders.Fuse()  # decode joins the characters without spaces
    extra = {} if max_length is None else {"model_max_length": max_length}
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False, **extra)


@dataclass(frozen=True)
class Export:
    """A written export: where, as which class, and how closely that class computes the
    model's logits (float64 relative error on probe tokens)."""

    path: Path
    style: Style
    architecture: str
    error: float


def check_export(cfg: GPTConfig, out: str | Path, *, force: bool = False) -> Path:
    """Everything `export_hf` refuses, checked before any work: the style, the extras, OUT."""
    from attnid.checkpoint.output import check_new_dir

    hf_style(cfg)
    require_extras("hf", what="exporting to Hugging Face")
    return check_new_dir(out, force)


def export_hf(model: GPT, out: str | Path, chars: str, *, force: bool = False) -> Export:
    """Write ``model`` to the directory ``out`` as a Hugging Face checkpoint with the
    character tokenizer of ``chars`` (``chars[i]`` is token ``i``; `attnid.train.data`'s
    ``shakespeare().chars`` for a model trained by ``attnid train``).

    The model is not modified. ``out`` is written only once the transformers class, loaded
    from it, computes the model's logits to float64 rounding and the tokenizer gives each
    character its id; a non-empty ``out`` is replaced only with ``force``.
    """
    from safetensors.torch import save

    from attnid.checkpoint.output import staged

    cfg = model.cfg
    dst = check_export(cfg, out, force=force)
    if len(chars) != cfg.vocab_size:
        raise AttnidError(f"{len(chars)} characters for a vocabulary of {cfg.vocab_size}")
    style = hf_style(cfg)
    config = hf_config(cfg)
    with staged(dst) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "model.safetensors").write_bytes(save(hf_tensors(model), metadata={"format": "pt"}))
        char_tokenizer(chars, cfg.block_size).save_pretrained(tmp)
        error = _verify(model, tmp, chars)
    return Export(dst, style, ARCHITECTURE[style], error)


def _verify(model: GPT, path: Path, chars: str) -> float:
    """Load ``path`` with transformers and check it against ``model``; the relative error."""
    import transformers

    from attnid.adapters.base import hf_model_class
    from attnid.arbiter.precision import Float64Mode

    config = json.loads((path / "config.json").read_text())
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    with Float64Mode():  # HF builds its rotary table in float32 at init: built in float64 here
        hf, info = hf_model_class(config).from_pretrained(path, dtype=torch.float64,
                                                          output_loading_info=True)
    if any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")):
        raise AttnidError(f"transformers does not read the export as written ({info}); nothing was written")
    ours = copy.deepcopy(model).double().eval()
    T = min(model.cfg.block_size, 32)
    ids = torch.randint(0, model.cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), Float64Mode():
        want = ours(ids)[0]  # (2, T, vocab)
        got = hf.eval()(input_ids=ids).logits
    error = relative_error(got, want)
    if not error <= TOLERANCE[torch.float64]:
        raise AttnidError(f"the exported {type(hf).__name__} computes other logits than the model "
                          f"(relative error {error:.2e}); nothing was written")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    if tok(chars)["input_ids"] != list(range(len(chars))):
        raise AttnidError("the exported tokenizer does not give each character its id; nothing was written")
    return error
