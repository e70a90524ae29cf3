"""Closed-form whole-model counts: every parameter of a transformer, not only its attention.

Each component's count is derived in docs (section "Whole model"); in short, at a generic
point the unidentified directions are the tangents of these symmetries, and they are
independent of each other:

* attention, per layer: the attention closed form (``attnid.count``), on the width its
  input really spans (``d - 1`` behind a LayerNorm, whose output is orthogonal to all-ones);
* norms: each norm's gain trades against the input rows of every linear layer reading it
  (``d``); a LayerNorm's output is centred, so each reader has one invisible direction per
  output column, and a LayerNorm bias is redundant with its readers' biases (``d``);
* residual stream: rotations (``O(d)``; fixing all-ones under LayerNorm) when the unembedding is
  not tied; the scale of the stream (near-unidentified: only the norms' eps sees it); under
  LayerNorm, the all-ones component of every write; parallel layers' two output biases;
* embeddings: token rows translate against position (and token-type) rows; RoBERTa's position
  rows below ``padding_idx`` are never read, and its pad token is read only with row
  ``padding_idx`` (components ``unreachable_positions``, ``padding``);
* MLP: one scale per neuron for ReLU and gated MLPs;
* head: next-token log-probabilities ignore a shift constant across the vocabulary.

These assume every reader sees generic points of its input space. A model's input is a
token id, so the readers before the first attention see finitely many points;
:mod:`attnid.theory.discrete` adds what that costs (component ``discrete_inputs``) and sets
``exact`` False, with ``reasons``, where the count is only a lower bound (docs/theory.md
§13.17).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from attnid.errors import AttnidError
from attnid.spec import AttentionSpec
from attnid.structure import Structure
from attnid.theory.attention import Component, ComponentTotals, count
from attnid.theory.discrete import discrete_inputs, mlp_terms


@dataclass(frozen=True)
class WholeCount(ComponentTotals):
    """Totals and the breakdown by component, for one whole model."""

    structure: Structure
    components: dict[str, Component] = field(default_factory=dict)
    method: str = "closed form"
    reduced_config: dict[str, Any] | None = None  # numeric counts: the config counted
    exact: bool = True  # False: ``unidentified`` is a lower bound, for ``reasons``
    reasons: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.totals_dict(),
            "method": self.method,
            "exact": self.exact,
            "reasons": list(self.reasons),
            **({"reduced_config": self.reduced_config} if self.reduced_config else {}),
        }


def _add(out: dict[str, list[int]], name: str, params: int = 0, unid: int = 0, near: int = 0) -> None:
    acc = out.setdefault(name, [0, 0, 0])
    acc[0] += params
    acc[1] += unid
    acc[2] += near


def _readers(s: AttentionSpec, st: Structure) -> tuple[list[tuple[int, bool]], list[tuple[int, bool]]]:
    """(attention's readers, MLP's readers) of a norm: (output columns, has a bias)."""
    H, G, dk, dv = s.n_heads, s.n_kv_heads, s.head_dim, s.v_head_dim
    attn = [(H * dk, s.has_bias("q")), (G * dk, s.has_bias("k")), (G * dv, s.has_bias("v"))]
    mlp = [(st.d_ff * (2 if st.mlp == "gated" else 1), st.mlp_bias)]
    return attn, mlp


def _behind_layernorm(s: AttentionSpec, st: Structure) -> AttentionSpec:
    """The attention a LayerNorm's readers effectively are: inputs span ``d - 1`` dimensions
    (orthogonal to all-ones), and a LayerNorm bias ``b`` gives every reader an offset ``b W``
    that centring moves freely: q, k and v behave as if they had biases."""
    bias = "".join(sorted(set(s.bias) | ({"q", "k", "v"} if st.norm_bias else set())))
    return replace(s, d_model=st.d_model - 1, bias=bias)


def _norm(st: Structure, readers: list[tuple[int, bool]] | None,
          out: dict[str, list[int]]) -> None:
    """One residual norm: its gain (and bias) transfer under "norms", the centred output's
    invisible reader columns under "centring". ``readers`` None: nothing can absorb its gain
    (a tied unembedding reads it, or it is the output)."""
    d = st.d_model
    layer = st.norm == "layer"
    params = d * (2 if layer and st.norm_bias else 1)
    if readers is None:
        _add(out, "norms", params, 0)
        return
    # gain transfer (d); a LayerNorm bias is redundant with its readers' offsets (d)
    _add(out, "norms", params, d + (d if layer and st.norm_bias else 0))
    if layer:  # each reader column has one invisible direction; a biased norm's offset
        # moves with unbiased readers' columns, so only biased readers' count then
        cols = sum(n for n, b in readers if b or not st.norm_bias)
        _add(out, "centring", 0, cols)


def count_structure(st: Structure) -> WholeCount:
    """The closed form for a pre-LN or parallel layout (see the module docstring)."""
    if st.layout == "post":
        return _count_post(st)
    d, V = st.d_model, st.vocab
    layer = st.norm == "layer"
    w = d - 1 if layer else d  # the width a norm's output spans
    lm = st.function == "logprobs"
    free_unembed = lm and not st.tied  # an unembedding matrix of its own
    out: dict[str, list[int]] = {}
    for s in st.specs:
        c = count(s)
        seen = count(_behind_layernorm(s, st)) if layer else c
        _add(out, "attention", c.total, seen.unidentified, c.near_unidentified)
        attn_r, mlp_r = _readers(s, st)
        if st.layout == "parallel" and st.shared_norm:
            _norm(st, attn_r + mlp_r, out)
        else:
            _norm(st, attn_r, out)
            _norm(st, mlp_r, out)
        m = mlp_terms(st)
        _add(out, "mlp", m.params, m.scalings)
        if layer:  # the all-ones component of each write into the stream
            _add(out, "residual", 0, s.n_heads * s.v_head_dim + s.has_bias("o") + m.ones)
        if st.layout == "parallel" and st.mlp_bias:
            if s.has_bias("o"):
                _add(out, "residual", 0, w)  # two output biases added to one stream
            elif seen.spec.has_bias("v"):  # value offsets reach the stream as a constant (§4.2),
                # which the MLP's output bias takes back (§13.9)
                _add(out, "residual", 0, min(s.n_kv_heads * s.v_head_dim, w))
    _norm(st, [(V, False)] if free_unembed else None, out)  # the final norm
    # residual stream: rotations (untied LM only), scale (near: the norms' eps sees it)
    _add(out, "residual", 0, w * (w - 1) // 2 if free_unembed else 0)
    _add(out, "residual", 0, *((1, 0) if st.eps == 0 else (0, 1)))
    _embeddings(st, out)
    if lm and not st.tied:
        _add(out, "head", V * d, d)  # logits shifted by a constant across the vocabulary
    return _on_domain(st, out)


def _on_domain(st: Structure, out: dict[str, list[int]]) -> WholeCount:
    """The generic count ``out`` on the model's real, finite input domain (§13.17)."""
    generic = WholeCount(st, {k: Component(*v) for k, v in out.items()})
    terms = discrete_inputs(st, generic.unidentified, generic.total)
    if terms.unidentified or terms.near_unidentified:
        _add(out, "discrete_inputs", 0, terms.unidentified, terms.near_unidentified)
    return WholeCount(st, {k: Component(*v) for k, v in out.items()}, exact=terms.exact,
                      reasons=terms.reasons)



def _embeddings(st: Structure, out: dict[str, list[int]]) -> None:
    """Token, position and token-type tables. Under LayerNorm every row of a table that only
    feeds the stream has an invisible all-ones component; tables translate against each
    other (``(n_tables - 1) d``); translations along all-ones that only move shiftable tables
    are among the shifts already."""
    d, V = st.d_model, st.vocab
    layer = st.norm == "layer"
    tied_lm = st.function == "logprobs" and st.tied
    pad = st.padding_idx or 0  # RoBERTa: position rows 0 .. pad - 1 are never read
    tables = [n for n in (st.positions - pad, st.token_types) if n]
    unid = len(tables) * d
    if layer:
        shiftable = tables + ([] if tied_lm else [V])
        unid += sum(shiftable) - max(len(shiftable) - 1, 0)
        if tied_lm and not tables:
            unid += 1  # tied: E + c 1 1^T shifts the stream along all-ones and the logits uniformly
    _add(out, "embeddings", d * (V + sum(tables)), unid)
    if st.padding_idx is not None:
        _add(out, "unreachable_positions", pad * d, pad * d)
        # the pad token only ever sits at position row padding_idx: only their sum s is read,
        # through the embedding LayerNorm. Moving d between the two rows: d directions, less
        # the all-ones one (a row shift already); a tied pad row is also a decoder row, and
        # keeps only d along 1/g (its logit bias absorbs it). The scale of s: seen only by eps.
        unid = 1 if tied_lm else (d - 1 if layer else d)
        scale = (1, 0) if st.eps == 0 else (0, 1)
        _add(out, "padding", 0, unid + layer * scale[0], layer * scale[1])


def _count_post(st: Structure) -> WholeCount:
    """Post-LN (BERT): ``x -> LN(x + sublayer(x))``. Each norm's output feeds its readers and
    the next residual sum: no gain transfer (the residual path cannot absorb it), its bias
    is redundant with the next sublayer's output bias, its scale is seen only through the
    next norm's eps (near-unidentified, one per residual norm input). Closed form only with
    every linear bias present (BERT, RoBERTa)."""
    d, V = st.d_model, st.vocab
    if st.norm != "layer" or not st.norm_bias or not st.mlp_bias or any(
            s.bias != frozenset("qkvo") for s in st.specs) or st.mlp != "gelu":
        raise AttnidError("no whole-model closed form for this post-LN layout (only BERT's: "
                          "LayerNorm with biases, every linear bias, GELU)")
    out: dict[str, list[int]] = {}
    _embeddings(st, out)
    eps_near = (1, 0) if st.eps == 0 else (0, 1)
    _add(out, "norms", 2 * d, 0)  # the embedding LayerNorm
    _add(out, "residual", 0, *eps_near)  # the scale of the embedding sum
    for s in st.specs:
        c = count(s)
        _add(out, "attention", c.total, count(_behind_layernorm(s, st)).unidentified,
             c.near_unidentified)
        qkv = s.n_heads * s.head_dim + s.n_kv_heads * (s.head_dim + s.v_head_dim)
        # the norm before: bias redundant with b_O (d), centring of q, k, v columns
        _add(out, "norms", 0, d)
        _add(out, "centring", 0, qkv)
        _add(out, "residual", 0, s.n_heads * s.v_head_dim + 1)  # W_O rows, b_O along all-ones
        _add(out, "norms", 2 * d, d)  # attention's norm: bias redundant with the MLP's out bias
        _add(out, "centring", 0, st.d_ff)
        _add(out, "mlp", 2 * d * st.d_ff + st.d_ff + d, 0)
        _add(out, "residual", 0, st.d_ff + 1)  # W_out rows and bias along all-ones
        _add(out, "residual", 0, 2 * eps_near[0], 2 * eps_near[1])  # two residual sums' scales
        _add(out, "norms", 2 * d, 0)  # the layer's last norm (its readers are counted next)
    if st.mlm_head:
        # the last norm feeds the transform: gain, bias and centring as a pre-LN reader
        _add(out, "norms", 0, 2 * d)
        _add(out, "centring", 0, d)
        params = d * d + d + 2 * d + V  # transform dense, its LayerNorm, the decoder bias
        if st.tied:  # the transform's norm: only its bias (into the decoder bias); the shift
            unid = d + 1
        else:  # gain, bias, centring (less the column the shift shares), the shift (d + 1)
            params += V * d + V  # the decoder, and a second bias the forward never reads
            unid = 2 * d + (V - 1) + d + 1 + V
        _add(out, "head", params, unid)
    if st.pooler:
        _add(out, "head", d * d + d, d * d + d)  # the hidden states never reach the pooler
    return _on_domain(st, out)
