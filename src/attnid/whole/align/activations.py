"""Matching from activations on calibration tokens (`attnid align --calibration`; docs/theory.md
§13.20): both models are run (float64, transformers' own classes) on the same token chunks,
and what is matched is what each part of the group moves:

* the residual stream, every layer's input (embeddings and each layer's output but the last,
  which the final norm has already seen): ``x -> x Q``, so Procrustes on the stacked states
  (each row centred under LayerNorm, which ignores all-ones) gives the rotation, and linear
  assignment on their column correlations the permutation;
* each head's contribution to the stream, ``z_h W_O^h`` (every per-kv-group gauge leaves it, the
  stream rotation moves it by ``Q``): heads are matched on the cosine of these, kv groups kept
  whole;
* each MLP neuron's activation (the down projection's input: a per-neuron scale multiplies it,
  a permutation reorders it): neurons matched on correlation (absolute for gated MLPs, whose
  up half may take a negative scale).

The continuous gauges are then fitted on the weights as without calibration.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from attnid.errors import AttnidError
from attnid.whole.check import Float64Mode
from attnid.whole.fit.match import assign_heads, assignment
from attnid.whole.fit.rotation import procrustes
from attnid.whole.transforms.state import ModelTensors


@dataclass(frozen=True)
class Activations:
    """One model's activations on the calibration tokens (``N`` token positions)."""

    stream: torch.Tensor  # [N (L), d]: every layer's input, stacked
    heads: list[torch.Tensor]  # per layer [H, N, d]: each head's write into the stream
    neurons: list[torch.Tensor]  # per layer [N, f]


ACTIVATION_BYTES = 8 * 1024**3  # both models' activations, float64, at most this


def activation_bytes(m: ModelTensors, tokens: int) -> int:
    """What :func:`collect` keeps for one model on ``tokens`` positions (float64): the stream at
    every layer's input ``[N, d]``, every head's write ``[H, N, d]`` and every neuron ``[N, f]``."""
    lay = m.layout
    per_token = 0
    for i in range(len(lay.layers)):
        d, f = m.weight(lay.mlps[i][1]).shape  # the down projection [out = d, in = f]
        per_token += d + m.spec(i).n_heads * d + f
    return 8 * tokens * per_token


def check_memory(m: ModelTensors, tokens: int) -> None:
    """Refuse (one line, before any work) a calibration whose activations would not fit."""
    need = 2 * activation_bytes(m, tokens)
    if need > ACTIVATION_BYTES:
        fit = max(1, tokens * ACTIVATION_BYTES // need)
        raise AttnidError(f"--calibration: matching on {tokens} tokens keeps {need / 1024**3:.1f} GiB of "
                          f"activations of the two models (at most {ACTIVATION_BYTES / 1024**3:.0f} GiB): "
                          f"give a file of at most about {fit} tokens, or match on the weights")


def module_of(m: ModelTensors) -> nn.Module:
    """A float64 transformers model holding ``m``'s tensors (eager attention)."""
    from attnid.adapters.base import load_weights, new_hf_model

    model = new_hf_model(m.config, head=True, eager=True).double().eval()
    load_weights(model, {k: v.to(torch.float64) for k, v in m.tensors.items()})
    return model


def collect(m: ModelTensors, ids: torch.Tensor, batch: int = 8) -> Activations:
    """Run ``m`` on token chunks ``ids [n, T]`` and keep what the matching reads."""
    lay = m.layout
    model = module_of(m)
    L = len(lay.layers)
    o_in: list[list[torch.Tensor]] = [[] for _ in range(L)]
    d_in: list[list[torch.Tensor]] = [[] for _ in range(L)]
    hooks = []
    for i in range(L):
        o_lin, down = lay.writers[i][0], lay.mlps[i][1]
        hooks.append(model.get_submodule(o_lin.path).register_forward_pre_hook(
            lambda _, x, i=i: o_in[i].append(x[0].reshape(-1, x[0].shape[-1]))))
        hooks.append(model.get_submodule(down.path).register_forward_pre_hook(
            lambda _, x, i=i: d_in[i].append(x[0].reshape(-1, x[0].shape[-1]))))
    states = []
    try:
        with torch.no_grad(), Float64Mode():  # transformers' norms and softmax in float64 too
            for k in range(0, ids.shape[0], batch):
                out = model(input_ids=ids[k:k + batch], output_hidden_states=True)
                hs = out.hidden_states[:-1]  # the last one is already normed
                states.append(torch.cat([h.reshape(-1, h.shape[-1]) for h in hs]))
    finally:
        for h in hooks:
            h.remove()
    heads = []
    for i in range(L):
        s = m.spec(i)
        z = torch.cat(o_in[i]).reshape(-1, s.n_heads, s.v_head_dim)  # [N, H, dv]
        W = m.weight(lay.writers[i][0]).T.reshape(s.n_heads, s.v_head_dim, -1)  # [H, dv, d]
        heads.append(torch.einsum("nhv,hvd->hnd", z, W))
    return Activations(torch.cat(states), heads, [torch.cat(x) for x in d_in])


def _centred(X: torch.Tensor, layer_norm: bool) -> torch.Tensor:
    return X - X.mean(-1, keepdim=True) if layer_norm else X


def stream_rotation(a: Activations, b: Activations, layer_norm: bool) -> torch.Tensor:
    """``Q`` minimising ``||S_B Q - S_A||`` over the stacked stream states."""
    return procrustes(_centred(b.stream, layer_norm), _centred(a.stream, layer_norm), layer_norm)


def _standard(X: torch.Tensor) -> torch.Tensor:
    X = X - X.mean(0, keepdim=True)
    return X / X.norm(dim=0, keepdim=True).clamp_min(1e-300)


def stream_permutation(a: Activations, b: Activations) -> torch.Tensor:
    """``perm [d]``: A's stream coordinate ``i`` is B's ``perm[i]`` (correlation of states)."""
    return assignment(-(_standard(a.stream).T @ _standard(b.stream)))


def head_matching(a: Activations, b: Activations, layer: int, n_kv_heads: int,
                  Q: torch.Tensor | None = None, perm: torch.Tensor | None = None) -> torch.Tensor:
    """``perm [H]`` of B's heads (B's writes taken into A's stream frame by ``Q`` or ``perm``)."""
    xa, xb = a.heads[layer], b.heads[layer]  # [H, N, d]
    if Q is not None:
        xb = xb @ Q
    if perm is not None:
        xb = xb[..., perm]
    fa, fb = xa.flatten(1), xb.flatten(1)
    fa = fa / fa.norm(dim=1, keepdim=True).clamp_min(1e-300)
    fb = fb / fb.norm(dim=1, keepdim=True).clamp_min(1e-300)
    return assign_heads(1 - fa @ fb.T, n_kv_heads)


def neuron_matching(a: Activations, b: Activations, layer: int, signed: bool) -> torch.Tensor:
    """``perm [f]`` of B's neurons (correlation; ``signed=False``: its absolute value)."""
    corr = _standard(a.neurons[layer]).T @ _standard(b.neurons[layer])  # [f, f]
    return assignment(-(corr if signed else corr.abs()))
