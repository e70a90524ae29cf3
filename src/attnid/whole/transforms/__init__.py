"""Whole-model symmetries as function-preserving maps on Hugging Face models (GPT-2,
GPT-NeoX, Llama/Mistral/Qwen2/Qwen3, BERT, RoBERTa). Each returns a new model (a deep copy,
ties kept); the input is never touched. Split by mathematics: ``norms`` (gain, bias,
centring, gain folding), ``residual`` (rotation, all-ones shifts, parallel biases), ``mlp`` (per-neuron
scaling), ``embeddings`` (translation, logit shift), ``attention`` (offsets of bias-free
attention behind a biased LayerNorm); ``layout`` says where each acts; ``span`` collects every
tangent direction for the completeness check; ``fold`` folds gains on checkpoint tensors.

Example (needs transformers; docs/counting.md runs the same)::

    gpt2 = tiny_model(dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], n_embd=8,
                           n_head=2, n_layer=1, vocab_size=12, n_positions=6))
    new = embedding_translation(gpt2, torch.full((8,), 0.5, dtype=torch.float64))
"""

from attnid.whole.transforms.attention import key_offset, value_offset
from attnid.whole.transforms.embeddings import (
    embedding_translation,
    logit_shift,
    padding_translation,
    unreachable_positions_move,
)
from attnid.whole.transforms.layout import Layout, layout_of
from attnid.whole.transforms.mlp import mlp_scaling
from attnid.whole.transforms.norms import (
    centring_move,
    fold_norm_gains,
    norm_bias_transfer,
    norm_gain_transfer,
)
from attnid.whole.transforms.residual import (
    ones_shift,
    parallel_bias_transfer,
    residual_rotation,
    table_shift,
)

__all__ = ["Layout", "centring_move", "embedding_translation", "fold_norm_gains", "key_offset",
           "layout_of", "logit_shift", "mlp_scaling", "norm_bias_transfer", "norm_gain_transfer",
           "ones_shift", "padding_translation", "parallel_bias_transfer", "residual_rotation",
           "table_shift", "unreachable_positions_move", "value_offset"]
