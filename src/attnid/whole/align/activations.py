"""Matching from activations on calibration tokens (`attnid align --calibration`; docs/theory.md
§13.20): both models are run (float64, transformers' own classes, one decoder layer at a time
over the tensors as they are read: `attnid.whole.layerwise`) on the same token chunks, and what
is matched is what each part of the group moves:

* the residual stream, every layer's input (embeddings and each layer's output but the last,
  which the final norm has already seen): ``x -> x Q``, so Procrustes on the stacked states
  (each row centred under LayerNorm, which ignores all-ones) gives the rotation, and linear
  assignment on their column correlations the permutation;
* each head's contribution to the stream, ``z_h W_O^h`` (every per-kv-group gauge leaves it, the
  stream rotation moves it by ``Q``): heads are matched on the cosine of these, kv groups kept
  whole. Only each head's output ``z_h [N, d_v]`` is kept; its write is made from the output
  projection as the unit is aligned (B's already in A's stream coordinates), a token block
  at a time: a 7B layer's writes on 256 tokens would be 268 MB a model, ``d / d_v`` = 32 times
  its outputs;
* each MLP neuron's activation (the down projection's input: a per-neuron scale multiplies it,
  a permutation reorders it): neurons matched on correlation (absolute for gated MLPs, whose
  up half may take a negative scale).

The continuous gauges are then fitted on the weights as without calibration.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from attnid.errors import AttnidError
from attnid.whole.check import Float64Mode
from attnid.whole.fit.match import assign_heads, assignment, blocked_assignment
from attnid.whole.fit.rotation import procrustes
from attnid.whole.fit.source import TensorSource
from attnid.whole.layerwise import LayerwiseLM, Segment
from attnid.whole.transforms.state import ModelTensors

Model = Any  # a ModelTensors, or what `attnid.whole.layerwise` reads (a checkpoint's units, a TensorSource)


@dataclass(frozen=True)
class Activations:
    """One model's activations on the calibration tokens (``N`` token positions)."""

    stream: torch.Tensor  # [N (L), d]: every layer's input, stacked
    values: list[torch.Tensor]  # per layer [H, N, dv]: each head's output (the output projection's input)
    neurons: list[torch.Tensor]  # per layer [N, f], each neuron's column standardised (mean 0, norm 1)


ACTIVATION_BYTES = 8 * 1024**3  # both models' activations, float64, at most this


def _source(m: Model) -> Any:
    return TensorSource(m) if isinstance(m, ModelTensors) else m


def _spec(src: Any, layer: int) -> Any:
    return ModelTensors(src.layout, {}, src.config).spec(layer)


def activation_bytes(m: Model, tokens: int) -> int:
    """What :func:`collect` keeps for one model on ``tokens`` positions (float64): the stream at
    every layer's input ``[N, d]``, every head's output ``[H, N, dv]`` and every neuron ``[N, f]``."""
    src = _source(m)
    lay = src.layout
    per_token = 0
    for i in range(len(lay.layers)):
        down = lay.mlps[i][1]
        shape = src.shape(f"{down.path}.weight")  # stored: [out = d, in = f], Conv1D [f, d]
        d, f = shape[::-1] if down.conv1d else shape
        s = _spec(src, i)
        per_token += d + s.n_heads * s.v_head_dim + f
    return 8 * tokens * per_token


def check_memory(m: Model, tokens: int) -> None:
    """Refuse (one line, before any work) a calibration whose activations would not fit."""
    need = 2 * activation_bytes(m, tokens)
    if need > ACTIVATION_BYTES:
        fit = max(1, tokens * ACTIVATION_BYTES // need)
        raise AttnidError(f"--calibration: matching on {tokens} tokens keeps {need / 1024**3:.1f} GiB of "
                          f"activations of the two models (at most {ACTIVATION_BYTES / 1024**3:.0f} GiB): "
                          f"give a file of at most about {fit} tokens, or match on the weights")


def collect(m: Model, ids: torch.Tensor, batch: int = 8) -> Activations:
    """Run ``m`` on token chunks ``ids [n, T]`` (float64, eager attention, one decoder layer at a
    time) and keep what the matching reads."""
    src = _source(m)
    lay = src.layout
    lm = LayerwiseLM(src, torch.float64, eager=True, head=False)  # no head; the table as stored
    L = len(lay.layers)
    o_in: list[list[torch.Tensor]] = [[] for _ in range(L)]
    d_in: list[list[torch.Tensor]] = [[] for _ in range(L)]
    s_in: list[list[torch.Tensor]] = [[] for _ in range(L)]  # each layer's input, batch by batch
    flat = lambda x: x.reshape(-1, x.shape[-1])  # noqa: E731
    for i, layer in enumerate(lm.layers):
        o_proj, down = (layer.get_submodule(lin.path[len(lay.layers[i]):])
                        for lin in (lay.writers[i][0], lay.mlps[i][1]))
        o_proj.register_forward_pre_hook(lambda _, x, i=i: o_in[i].append(flat(x[0])))
        down.register_forward_pre_hook(lambda _, x, i=i: d_in[i].append(flat(x[0])))
        layer.register_forward_pre_hook(
            lambda _, a, kw, i=i: s_in[i].append(flat(a[0] if a else kw["hidden_states"])), with_kwargs=True)

    def run(model: Any, x: torch.Tensor) -> None:
        with Float64Mode():  # transformers' norms and softmax in float64 too
            model.base_model(input_ids=x, use_cache=False)

    lm.run(Segment(src, src), [0.0], ids, batch, run)
    del lm  # its tables
    rows = [torch.cat(x) for x in s_in]  # per layer [N, d], the chunks in order
    step = batch * int(ids.shape[1])  # a batch's rows: stacked batch by batch, each batch layer by layer
    states = torch.cat([r[k:k + step] for k in range(0, int(ids.numel()), step) for r in rows])
    values = []
    for i in range(L):
        s = _spec(src, i)
        z = torch.cat(o_in[i]).reshape(-1, s.n_heads, s.v_head_dim)  # [N, H, dv]
        values.append(z.transpose(0, 1).contiguous())  # [H, N, dv]
    neurons = []
    for i in range(L):  # standardised as they are kept: the matching reads nothing else of them
        neurons.append(_standardise_(torch.cat(d_in[i])))
        d_in[i].clear()
    return Activations(states, values, neurons)


def _centred(X: torch.Tensor, layer_norm: bool) -> torch.Tensor:
    return X - X.mean(-1, keepdim=True) if layer_norm else X


def stream_rotation(a: Activations, b: Activations, layer_norm: bool) -> torch.Tensor:
    """``Q`` minimising ``||S_B Q - S_A||`` over the stacked stream states."""
    return procrustes(_centred(b.stream, layer_norm), _centred(a.stream, layer_norm), layer_norm)


def _standard(X: torch.Tensor) -> torch.Tensor:
    """``X [N, n]`` with each column centred and at unit norm (a copy)."""
    return _standardise_(X.clone())


def _standardise_(X: torch.Tensor) -> torch.Tensor:
    """`_standard` in place (no second ``[N, f]``: 0.43 GB a 7B layer on 4,864 tokens)."""
    X -= X.mean(0, keepdim=True)
    return X.div_(X.norm(dim=0, keepdim=True).clamp_min_(1e-300))


def stream_permutation(a: Activations, b: Activations) -> torch.Tensor:
    """``perm [d]``: A's stream coordinate ``i`` is B's ``perm[i]`` (correlation of states)."""
    return assignment(-(_standard(a.stream).T @ _standard(b.stream)))


WRITE_BLOCK = 2**24  # elements of one block of heads' writes [H, n, d] (128 MiB in float64)


def head_matching(a: Activations, b: Activations, layer: int, n_kv_heads: int,
                  WA: torch.Tensor, WB: torch.Tensor) -> torch.Tensor:
    """``perm [H]`` of B's heads, matched on the cosine of each head's write into the stream
    ``z_h W_O^h [N, d]``, from the heads' outputs and each model's output projection per head
    ``W [H, dv, d]`` (B's in A's stream coordinates: moved by the stream's rotation or
    permutation), made a block of tokens at a time."""
    za, zb = a.values[layer], b.values[layer]  # [H, N, dv]
    WA, WB = WA.to(za.dtype), WB.to(zb.dtype)
    H, N, d = za.shape[0], za.shape[1], WA.shape[-1]
    step = max(1, WRITE_BLOCK // (H * d))
    inner = torch.zeros(H, H, dtype=za.dtype)
    na, nb = torch.zeros(H, dtype=za.dtype), torch.zeros(H, dtype=za.dtype)
    for k in range(0, N, step):
        xa = torch.bmm(za[:, k:k + step], WA)  # [H, n, d]
        xb = torch.bmm(zb[:, k:k + step], WB)
        inner += torch.einsum("hnd,knd->hk", xa, xb)
        na += xa.square().sum((1, 2))
        nb += xb.square().sum((1, 2))
    cos = inner / (na.sqrt().clamp_min(1e-300)[:, None] * nb.sqrt().clamp_min(1e-300)[None, :])
    return assign_heads(1 - cos, n_kv_heads)


def neuron_matching(a: Activations, b: Activations, layer: int, signed: bool) -> torch.Tensor:
    """``perm [f]`` of B's neurons (correlation; ``signed=False``: its absolute value), the
    ``[f, f]`` correlations made a block of rows at a time (`blocked_assignment`) from the
    standardised activations as kept (`Activations.neurons`: no copy of them made)."""
    SA, SB = a.neurons[layer], b.neurons[layer]  # [N, f]

    def cost(X: torch.Tensor, Y: torch.Tensor) -> Callable[[slice], torch.Tensor]:
        return lambda s: (X[:, s].T @ Y).neg_() if signed else (X[:, s].T @ Y).abs_().neg_()

    return blocked_assignment(cost(SA, SB), cost(SB, SA), SA.shape[1])
