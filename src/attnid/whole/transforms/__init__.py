"""Whole-model symmetries as function-preserving maps (GPT-2, GPT-NeoX, Llama/Mistral/Qwen2/
Qwen3/Gemma, Falcon, Phi-3, BERT, RoBERTa), written once on `ModelTensors` (a model's tensors
by ``state_dict`` name and its layout: a checkpoint's, or a module's) and accepting a Hugging
Face model too (a new model comes back, ties kept); the input is never touched. Split by
mathematics: ``norms`` (gain, bias, centring, gain folding), ``residual`` (rotation, all-ones
shifts, parallel biases), ``mlp`` (per-neuron scaling, neuron permutations), ``heads``
(per-kv-group V/O and Q/K transforms, head permutations), ``embeddings`` (translation, logit
shift), ``attention`` (offsets of bias-free attention behind a biased LayerNorm);
``orthogonal`` builds rotations (Hadamard, random); ``element`` is one group element applied
at once; ``layout`` says where each acts; ``state`` holds `ModelTensors`; ``span`` collects
every tangent direction for the completeness check.

Example (needs transformers; docs/counting.md runs the same)::

    gpt2 = tiny_model(dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], n_embd=8,
                           n_head=2, n_layer=1, vocab_size=12, n_positions=6))
    new = embedding_translation(gpt2, torch.full((8,), 0.5, dtype=torch.float64))
"""

from attnid.whole.transforms.attention import key_offset, value_offset
from attnid.whole.transforms.element import GroupElement, LayerElement, apply_element
from attnid.whole.transforms.embeddings import (
    embedding_translation,
    logit_shift,
    padding_translation,
    unreachable_positions_move,
)
from attnid.whole.transforms.heads import (
    attention_gauge,
    head_permutation,
    query_key_transform,
    value_transform,
)
from attnid.whole.transforms.layout import Layout, layout_for, layout_of
from attnid.whole.transforms.mlp import mlp_scaling, neuron_permutation
from attnid.whole.transforms.norms import (
    centring_move,
    fold_norm_gains,
    norm_bias_transfer,
    norm_gain_transfer,
)
from attnid.whole.transforms.orthogonal import hadamard, random_orthogonal
from attnid.whole.transforms.residual import (
    ones_shift,
    parallel_bias_transfer,
    residual_rotation,
    table_shift,
)
from attnid.whole.transforms.state import ModelTensors

__all__ = ["GroupElement", "LayerElement", "Layout", "ModelTensors", "apply_element", "attention_gauge",
           "centring_move", "embedding_translation", "fold_norm_gains", "hadamard",
           "head_permutation", "key_offset", "layout_for", "layout_of", "logit_shift",
           "mlp_scaling", "neuron_permutation", "norm_bias_transfer", "norm_gain_transfer",
           "ones_shift", "padding_translation", "parallel_bias_transfer", "query_key_transform",
           "random_orthogonal", "residual_rotation", "table_shift", "unreachable_positions_move",
           "value_offset", "value_transform"]
