"""Matching from activations on calibration tokens (`attnid align --calibration`; docs/theory.md
§13.20): both models are run (transformers' own classes, one decoder layer at a time over the
tensors as they are read: `attnid.whole.layerwise`) on the same token chunks, and what
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

Both models run, and what is kept is held, in the arithmetic of the checkpoints' own gauge fits
(`keep_dtype`: float32 for bfloat16 and float16 checkpoints, float64 under `Float64Mode`
otherwise). It is reduced as soon as both models are collected (`pair`): the stream to its
``[d, d]`` cross product and column sums (all its two fits read), the neurons to their matching
(a neuron's activation does not move with the stream, so every pass would match them the
same). Only the heads' outputs are kept through the passes: their writes move with the stream
(on 4,864 tokens of a 2-layer 7B-shaped pair, 0.32 GB, against 2.78 GiB of float64 activations
of every kind before).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from attnid.errors import AttnidError
from attnid.whole.check import Float64Mode
from attnid.whole.fit.fitter import compute_dtype
from attnid.whole.fit.match import assign_heads, assignment, blocked_assignment
from attnid.whole.fit.rotation import procrustes_cross
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


@dataclass(frozen=True)
class StreamSums:
    """What the stream's two fits read of both models' stacked states ``S [n, d]``: the cross
    product ``S_B^T S_A [d, d]``, each model's column sums and column sums of squares ``[d]``,
    all float64, and whether the states are equal (then the rotation is the identity exactly)."""

    cross: torch.Tensor
    sum_a: torch.Tensor
    sum_b: torch.Tensor
    sq_a: torch.Tensor
    sq_b: torch.Tensor
    n: int
    equal: bool

    @classmethod
    def of(cls, SA: torch.Tensor, SB: torch.Tensor, block: int = 4096) -> StreamSums:
        """Summed in float64, ``block`` rows at a time (no float64 copy of the states)."""
        d = SA.shape[1]
        f64 = torch.float64
        cross = torch.zeros(d, d, dtype=f64)
        sums, sqs = torch.zeros(2, d, dtype=f64), torch.zeros(2, d, dtype=f64)
        for k in range(0, SA.shape[0], block):
            xa, xb = SA[k:k + block].to(f64), SB[k:k + block].to(f64)
            cross += xb.T @ xa
            sums += torch.stack([xa.sum(0), xb.sum(0)])
            sqs += torch.stack([xa.square().sum(0), xb.square().sum(0)])
        return cls(cross, sums[0], sums[1], sqs[0], sqs[1], int(SA.shape[0]), torch.equal(SA, SB))

    def rotation(self, layer_norm: bool) -> torch.Tensor:
        """``Q`` minimising ``||S_B Q - S_A||`` (rows centred under LayerNorm, which ignores
        all-ones: ``(S P)^T (S P) = P S^T S P`` for the centring projection ``P``)."""
        d = self.cross.shape[0]
        if self.equal:
            return torch.eye(d, dtype=torch.float64)
        M = self.cross
        if layer_norm:
            M = M - M.mean(0, keepdim=True)
            M = M - M.mean(1, keepdim=True)
        return procrustes_cross(M, layer_norm)

    def permutation(self) -> torch.Tensor:
        """``perm [d]``: A's stream coordinate ``i`` is B's ``perm[i]``, by linear assignment on
        the correlations of the columns (``(S_A^T S_B - n mu_A mu_B^T) / (sigma_A sigma_B^T)``)."""
        n = max(self.n, 1)
        cov = self.cross.T - torch.outer(self.sum_a, self.sum_b) / n  # [d_A, d_B]
        sa = (self.sq_a - self.sum_a**2 / n).clamp_min(0).sqrt().clamp_min(1e-300)
        sb = (self.sq_b - self.sum_b**2 / n).clamp_min(0).sqrt().clamp_min(1e-300)
        return assignment(-(cov / sa[:, None] / sb[None, :]))


@dataclass(eq=False)
class Pair:
    """Both models' activations as the alignment reads them (`pair`): the stream's sums (read
    once, by the stream's fit, which then lets them go: ``None``), per layer both models' head
    outputs ``[H, N, dv]`` (A's, B's; a head's write moves with the stream, so it is matched
    again in each pass), and per layer B's neurons matched to A's."""

    stream: StreamSums | None
    values: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    neurons: tuple[torch.Tensor, ...]  # per layer perm [f]: A's neuron j is B's perm[j]


ACTIVATION_BYTES = 8 * 1024**3  # both models' activations, as kept, at most this


def _source(m: Model) -> Any:
    return TensorSource(m) if isinstance(m, ModelTensors) else m


def _spec(src: Any, layer: int) -> Any:
    return ModelTensors(src.layout, {}, src.config).spec(layer)


def keep_dtype(m: Model) -> torch.dtype:
    """The dtype the activations are kept in: the checkpoint's compute dtype (float32 for
    bfloat16 and float16, float64 otherwise; a model in memory is float64)."""
    return compute_dtype(_source(m).dtype())


def activation_bytes(m: Model, tokens: int) -> int:
    """What :func:`collect` keeps for one model on ``tokens`` positions (in `keep_dtype`): the
    stream at every layer's input ``[N, d]``, every head's output ``[H, N, dv]`` and every
    neuron ``[N, f]``."""
    src = _source(m)
    lay = src.layout
    per_token = 0
    for i in range(len(lay.layers)):
        down = lay.mlps[i][1]
        shape = src.shape(f"{down.path}.weight")  # stored: [out = d, in = f], Conv1D [f, d]
        d, f = shape[::-1] if down.conv1d else shape
        s = _spec(src, i)
        per_token += d + s.n_heads * s.v_head_dim + f
    return keep_dtype(m).itemsize * tokens * per_token


def check_memory(m: Model, tokens: int) -> None:
    """Refuse (one line, before any work) a calibration whose activations would not fit."""
    need = 2 * activation_bytes(m, tokens)
    if need > ACTIVATION_BYTES:
        fit = max(1, tokens * ACTIVATION_BYTES // need)
        raise AttnidError(f"--calibration: matching on {tokens} tokens keeps {need / 1024**3:.1f} GiB of "
                          f"activations of the two models (at most {ACTIVATION_BYTES / 1024**3:.0f} GiB): "
                          f"give a file of at most about {fit} tokens, or match on the weights")


def collect(m: Model, ids: torch.Tensor, batch: int = 8, dtype: torch.dtype = torch.float64) -> Activations:
    """Run ``m`` on token chunks ``ids [n, T]`` (in ``dtype``: float64 under `Float64Mode`, so
    that transformers' float32 casts stay float64; eager attention; one decoder layer at a
    time) and keep what the matching reads."""
    src = _source(m)
    lay = src.layout
    lm = LayerwiseLM(src, dtype, eager=True, head=False)  # no head; the table as stored
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
        with Float64Mode() if dtype == torch.float64 else nullcontext():  # norms and softmax too
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


def stream_rotation(a: Activations, b: Activations, layer_norm: bool) -> torch.Tensor:
    """``Q`` minimising ``||S_B Q - S_A||`` over the stacked stream states."""
    return StreamSums.of(a.stream, b.stream).rotation(layer_norm)


def _standard(X: torch.Tensor) -> torch.Tensor:
    """``X [N, n]`` with each column centred and at unit norm (a copy)."""
    return _standardise_(X.clone())


def _standardise_(X: torch.Tensor) -> torch.Tensor:
    """`_standard` in place (no second ``[N, f]``: 0.43 GB a 7B layer on 4,864 tokens)."""
    X -= X.mean(0, keepdim=True)
    return X.div_(X.norm(dim=0, keepdim=True).clamp_min_(1e-300))


def stream_permutation(a: Activations, b: Activations) -> torch.Tensor:
    """``perm [d]``: A's stream coordinate ``i`` is B's ``perm[i]`` (correlation of states)."""
    return StreamSums.of(a.stream, b.stream).permutation()


def pair(a: Activations, b: Activations, signed: bool) -> Pair:
    """Both models' activations reduced to what the passes read (`Pair`): the stream's sums and
    every layer's neurons matched (``signed``: `neuron_matching`'s), each layer's neuron
    activations let go of once matched (``a`` and ``b`` give them up: their lists are emptied)."""
    stream = StreamSums.of(a.stream, b.stream)
    neurons = []
    for i in range(len(a.neurons)):
        neurons.append(neuron_matching(a, b, i, signed))
        a.neurons[i] = b.neurons[i] = a.neurons[i].new_empty(0)
    a.neurons.clear()
    b.neurons.clear()
    return Pair(stream, tuple(zip(a.values, b.values, strict=True)), tuple(neurons))


WRITE_BLOCK = 2**24  # elements of one block of heads' writes [H, n, d] (128 MiB in float64)


def head_matching(acts: Pair, layer: int, n_kv_heads: int, WA: torch.Tensor, WB: torch.Tensor
                  ) -> torch.Tensor:
    """``perm [H]`` of B's heads, matched on the cosine of each head's write into the stream
    ``z_h W_O^h [N, d]``, from the heads' outputs and each model's output projection per head
    ``W [H, dv, d]`` (B's in A's stream coordinates: moved by the stream's rotation or
    permutation), made a block of tokens at a time."""
    za, zb = acts.values[layer]  # [H, N, dv]
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
