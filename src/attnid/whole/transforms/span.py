"""The tangent directions of every listed whole-model symmetry at one model, as columns in
the order of ``model.named_parameters()``: what the completeness check compares with the
whole-model arbiter's null space (docs/theory.md §13.15). Transforms are differentiated by
central differences (error ~ t^2); attention's directions come from
:func:`attnid.symmetry.tangent.tangent_basis` through the family adapter."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from attnid.adapters.registry import adapter_for
from attnid.errors import AttnidError
from attnid.structure import function_kind
from attnid.symmetry.tangent import tangent_basis
from attnid.weights import AttentionWeights
from attnid.whole.check import tied_aliases, token_types, whole_forward
from attnid.whole.transforms import attention as A
from attnid.whole.transforms import embeddings as E
from attnid.whole.transforms import mlp as M
from attnid.whole.transforms import norms as N
from attnid.whole.transforms import residual as R
from attnid.whole.transforms.layout import ParamsBySuffix, get_b, get_w, layout_of


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for _, p in model.named_parameters()])


def tangent(model: nn.Module, transform: Callable[[nn.Module, float], nn.Module],
            t: float = 1e-5) -> torch.Tensor:
    """Central difference of ``transform(model, t)`` at ``t = 0``."""
    return (flat(transform(model, t)) - flat(transform(model, -t))) / (2 * t)


def attention_directions(model: nn.Module, config: dict[str, Any]) -> list[torch.Tensor]:
    """Every layer's attention orbit tangent (the attention closed form's directions)."""
    adapter = adapter_for(config)
    params = ParamsBySuffix(model)
    out = []
    for i, spec in enumerate(adapter.specs(config)):
        basis = tangent_basis(adapter.read(params, i, spec))
        for col in basis.T:
            d = adapter.write(AttentionWeights.from_flat(spec, col), i)
            changes = {params.full(k): v for k, v in d.items()}
            out.append(torch.cat([changes.get(n, torch.zeros_like(p)).reshape(-1)
                                  for n, p in model.named_parameters()]))
    return out


def _basis(n: int) -> list[torch.Tensor]:
    return list(torch.eye(n, dtype=torch.float64))


def _rotation_generators(d: int, layer_norm: bool) -> list[torch.Tensor]:
    """so(d), or so of all-ones' complement under LayerNorm: ``u_i u_j^T - u_j u_i^T``."""
    U = torch.eye(d, dtype=torch.float64)
    if layer_norm:
        ones = torch.ones(d, 1, dtype=torch.float64)
        U = torch.linalg.qr(torch.cat([ones, torch.eye(d, dtype=torch.float64)], 1))[0][:, 1:d]
    k = U.shape[1]
    return [torch.outer(U[:, i], U[:, j]) - torch.outer(U[:, j], U[:, i])
            for i in range(k) for j in range(i + 1, k)]


def offset_directions(model: nn.Module, config: dict[str, Any]) -> list[torch.Tensor]:
    """Key and value offsets of attentions without biases behind a biased LayerNorm."""
    lay = layout_of(model)
    out: list[torch.Tensor] = []
    for i, spec in enumerate(adapter_for(config).specs(config)):
        biased = lay.norm == "layer" and not lay.post and getattr(
            model.get_submodule(lay.attn_norm(i)), "bias", None) is not None
        if spec.bias or not biased:
            continue
        for gi in range(spec.n_kv_heads):
            for j in range(spec.rope_dims, spec.head_dim):
                kappa = torch.zeros(spec.n_kv_heads, spec.head_dim, dtype=torch.float64)
                kappa[gi, j] = 1.0
                out.append(tangent(model, lambda m, t, i=i, k=kappa: A.key_offset(m, i, t * k)))
        with contextlib.suppress(AttnidError):  # no value offset reaches all-ones here
            out.append(tangent(model, lambda m, t, i=i: A.value_offset(m, i, t)))
    return out


def unread_directions(model: nn.Module, config: dict[str, Any]) -> list[torch.Tensor]:
    """Coordinates of parameters the function never reads (autograd gives them no gradient):
    BERT's pooler under the hidden states, an untied decoder's unused second bias."""
    fwd = whole_forward(function_kind(config), token_types(model), tied_aliases(model))
    x = torch.zeros(1, 3, 2, dtype=torch.float64)
    model.zero_grad(set_to_none=True)
    fwd(model, x).sum().backward()
    out, offset = [], 0
    P = sum(p.numel() for p in model.parameters())
    for _, p in model.named_parameters():
        if p.grad is None:
            for k in range(p.numel()):
                col = torch.zeros(P, dtype=torch.float64)
                col[offset + k] = 1.0
                out.append(col)
        offset += p.numel()
    model.zero_grad(set_to_none=True)
    return out


@dataclass(frozen=True)
class Directions:
    """Named sets of symmetry directions ``[P, n]`` at one model (``parts``: name -> directions)."""

    parts: dict[str, torch.Tensor]

    @property
    def groups(self) -> dict[str, torch.Tensor]:  # deprecated alias (one release) of parts
        return self.parts

    def matrix(self) -> torch.Tensor:
        return torch.cat(list(self.parts.values()), dim=1)


def symmetry_directions(model: nn.Module, config: dict[str, Any]) -> Directions:
    """Every listed symmetry's tangent directions at ``model`` (a tiny float64 model)."""
    lay = layout_of(model)
    d = int(model.config.hidden_size)
    layer = lay.norm == "layer"
    g: dict[str, list[torch.Tensor]] = {k: [] for k in (
        "norm gains", "norm biases", "centring", "rotations", "ones shifts", "parallel biases",
        "translations", "padding", "mlp scaling", "logit shift", "attention", "attention offsets", "unread")}
    for nm in lay.norms:
        if nm.gain and nm.absorb is None:
            g["norm gains"] += [tangent(model, lambda m, t, p=nm.path, e=e: N.norm_gain_transfer(
                m, p, torch.exp(t * e))) for e in _basis(d)]
        biased = getattr(model.get_submodule(nm.path), "bias", None) is not None
        if layer and biased:
            g["norm biases"] += [tangent(model, lambda m, t, p=nm.path, e=e: N.norm_bias_transfer(
                m, p, t * e)) for e in _basis(d)]
        for r, lin in enumerate(nm.readers if layer else ()):
            if (biased and get_b(model, lin) is None) or (lay.tied and lin == lay.unembed):
                continue  # its centring is the bias transfer's
            g["centring"] += [tangent(model, lambda m, t, p=nm.path, r=r, e=e: N.centring_move(
                m, p, r, t * e)) for e in _basis(get_w(model, lin).shape[0])]
    if lay.unembed is not None and not lay.tied and not lay.post:
        g["rotations"] = [tangent(model, lambda m, t, A=A: R.residual_rotation(
            m, torch.linalg.matrix_exp(t * A))) for A in _rotation_generators(d, layer)]
    if lay.unembed is not None:
        zero = torch.zeros(d, dtype=torch.float64)
        g["logit shift"] = [tangent(model, lambda m, t, e=e: E.logit_shift(m, t * e))
                            for e in ([] if lay.tied else _basis(d))]
        if get_b(model, lay.unembed) is not None:
            g["logit shift"].append(tangent(model, lambda m, t: E.logit_shift(m, zero, t)))
    if layer:
        for i, writers in enumerate(lay.writers):
            for w, lin in enumerate(writers):
                n_in = get_w(model, lin).shape[1]
                g["ones shifts"] += [tangent(model, lambda m, t, i=i, w=w, e=e: R.ones_shift(
                    m, i, w, t * e)) for e in _basis(n_in)]
                if get_b(model, lin) is not None:
                    zero = torch.zeros(n_in, dtype=torch.float64)
                    g["ones shifts"].append(tangent(model, lambda m, t, i=i, w=w, z=zero:
                                                    R.ones_shift(m, i, w, z, t)))
        for k, name in enumerate(lay.tables):
            rows = model.get_submodule(name).weight.shape[0]
            cs = [torch.ones(rows, dtype=torch.float64)] if k == 0 and lay.tied else _basis(rows)
            g["ones shifts"] += [tangent(model, lambda m, t, k=k, c=c: R.table_shift(m, k, t * c))
                                 for c in cs]
    if lay.parallel:
        for i, (att, mlp) in enumerate(lay.writers):
            if get_b(model, att) is not None and get_b(model, mlp) is not None:
                g["parallel biases"] += [tangent(model, lambda m, t, i=i, e=e:
                                                 R.parallel_bias_transfer(m, i, t * e))
                                         for e in _basis(d)]
    for k in range(1, len(lay.tables)):
        g["translations"] += [tangent(model, lambda m, t, k=k, e=e: E.embedding_translation(
            m, t * e, k)) for e in _basis(d)]
    if lay.padding_idx is not None:
        pad = lay.padding_idx
        if lay.tied:
            g_head = model.get_submodule(lay.norms[-1].path).weight.detach()
            us = [1 / g_head]
        else:
            us = _basis(d)
        g["padding"] = [tangent(model, lambda m, t, u=u: E.padding_translation(m, t * u))
                        for u in us]
        g["padding"] += [tangent(model, lambda m, t, e=e: E.unreachable_positions_move(
            m, t * e.reshape(pad, d))) for e in _basis(pad * d)]
    if lay.mlp != "other":
        for i, (_, down) in enumerate(lay.mlps):
            g["mlp scaling"] += [tangent(model, lambda m, t, i=i, e=e: M.mlp_scaling(
                m, i, torch.exp(t * e))) for e in _basis(get_w(model, down).shape[1])]
    g["attention"] = attention_directions(model, config)
    g["attention offsets"] = offset_directions(model, config)
    g["unread"] = unread_directions(model, config)
    return Directions({k: torch.stack(v, 1) for k, v in g.items() if v})


@dataclass(frozen=True)
class SpanCheck:
    """The directions' span against the arbiter's null space."""

    rank: int  # dimension of the directions' span
    nullity: int  # the arbiter's null space dimension
    max_sine: float  # largest principal-angle sine between the two spaces (equal dimensions)
    leak: float  # largest part of a unit direction outside the null space


def compare_span(G: torch.Tensor, null: torch.Tensor, rtol: float = 1e-8) -> SpanCheck:
    """``G`` ``[P, n]`` against an orthonormal ``null`` ``[P, k]``."""
    G = G / G.norm(dim=0, keepdim=True).clamp_min(1e-300)
    leak = float((G - null @ (null.T @ G)).norm(dim=0).max())
    U, S, _ = torch.linalg.svd(G, full_matrices=False)
    rank = int((S[0] * rtol < S).sum())
    U = U[:, :rank]
    sines = torch.linalg.svdvals(U - null @ (null.T @ U)) if rank else torch.zeros(1)
    max_sine = float(sines.max()) if rank == null.shape[1] else 1.0
    return SpanCheck(rank, int(null.shape[1]), max_sine, leak)
