"""Whole-model counts on the model's real input domain: token ids, not points of ``R^d``
(docs/theory.md §13.17).

A language model reads a token id, a position and a token type. Whatever reads the
embeddings before attention first mixes positions therefore sees a *finite* set of points,
and a nonlinear reader of a finite set is identified only through its values there (a
lookup table). The generic count (:func:`attnid.theory.whole.count_structure`) assumes
the readers see generic points of their input space; this module says when that fails and
what the count then is:

* a parallel first layer (GPT-NeoX, Falcon, Phi-2): its MLP reads ``LN(E[t])`` only,
  ``N`` distinct points. The stream receives the table ``S[t] = E[t] + MLP(LN(E[t]))``
  (``N w`` numbers that a LayerNorm can see), and these must pin down the MLP (``r``
  directions the generic count identifies), the first layer's constant offset when no MLP
  bias holds it (``off``), and, when no head reads the embedding, the affine frame of the
  normalised rows ``LN(E[t])`` (``w (w + 1)``: any affine map of them is undone by the
  attention's q/k/v readers and the MLP's input rows, and only the stream table notices).
  When ``r + off + w (w + 1) > N w`` the excess is unidentified, counted exactly for an
  untied head or a bare model behind a biased LayerNorm (the parallel families), and as a
  lower bound otherwise;
* few tokens: ``V <= d`` embedding rows are not points in general position of the width
  (a lower bound);
* one position: sequences of one token never mix, so nothing in the attention's scores is
  seen (a lower bound);
* few contexts: with a learned position table the first MLP of a sequential block sees at
  most ``C`` distinct contexts; and the whole function has at most ``C`` output vectors,
  so its rank is at most ``C`` times their width (both rigorous lower bounds).

For real vocabularies (32k-256k tokens) none of these binds; ``attnid report --all`` says so
per model (``exact``).
"""

from __future__ import annotations

from dataclasses import dataclass

from attnid.structure import Structure

_BIG = 10**18  # contexts beyond this are "unbounded" for every count here


@dataclass(frozen=True)
class MLPTerms:
    """One MLP's parameters and the directions the generic count finds in it alone."""

    params: int
    centring: int  # input columns with an invisible all-ones direction (behind a LayerNorm)
    scalings: int  # per-neuron scalings (ReLU, gated)
    ones: int  # output rows and bias along all-ones, which the next LayerNorm cannot see

    @property
    def identified(self) -> int:
        """``r``: the MLP's directions that a generic input domain identifies."""
        return self.params - self.centring - self.scalings - self.ones


def mlp_terms(st: Structure) -> MLPTerms:
    """The generic count's MLP terms (docs/theory.md §13.4, §13.5, §13.10), per layer."""
    d, f = st.d_model, st.d_ff
    n_mats = 3 if st.mlp == "gated" else 2
    params = n_mats * d * f + ((f * (n_mats - 1) + d) if st.mlp_bias else 0)
    layer = st.norm == "layer"
    # a LayerNorm with a bias moves an unbiased reader's centring column with its own bias
    centring = f * (n_mats - 1) if layer and (st.mlp_bias or not st.norm_bias) else 0
    scalings = f if st.mlp in ("relu", "gated") else 0
    ones = f + st.mlp_bias if layer else 0
    return MLPTerms(params, centring, scalings, ones)


@dataclass(frozen=True)
class DomainTerms:
    """What the finite input domain adds to the generic count."""

    unidentified: int = 0
    near_unidentified: int = 0
    exact: bool = True
    reasons: tuple[str, ...] = ()


def _width(st: Structure) -> int:
    """``w``: the dimensions a norm's output spans (``d - 1`` behind a LayerNorm)."""
    return st.d_model - 1 if st.norm == "layer" else st.d_model


def positions_read(st: Structure) -> int:
    """Rows of the learned position table that inputs reach (0: rotary, no table)."""
    if not st.positions:
        return 0
    return st.positions - (st.padding_idx + 1 if st.padding_idx is not None else 0)


def first_points(st: Structure) -> int:
    """``N``: distinct inputs of the first layer's per-position part (token, position, type)."""
    return st.vocab * max(positions_read(st), 1) * max(st.token_types, 1)


def contexts(st: Structure) -> int | None:
    """Distinct (sequence, position) contexts the function has, capped at 1e18; None when
    sequences are unbounded (rotary positions). Causal: every prefix of up to ``T`` tokens;
    post-LN (bidirectional): every position of every length-``T`` sequence."""
    T = positions_read(st)
    if not T:
        return None
    per = st.vocab * max(st.token_types, 1)
    if st.layout == "post":
        return min(T * per**min(T, 64), _BIG)
    total, term = 0, 1
    for _ in range(T):
        term *= per
        total += term
        if total >= _BIG:
            return _BIG
    return total


def constant_offset(st: Structure) -> int:
    """``off``: dimensions of the first layer's constant write that the generic count
    identifies and that only an MLP bias could hold (§13.9, §13.17)."""
    s = st.specs[0]
    w = _width(st)
    if st.mlp_bias:
        return 0  # the MLP bias is part of the table already
    if s.has_bias("o"):
        return w
    if s.has_bias("v") or (st.norm == "layer" and st.norm_bias):  # a value offset, via W_O
        return min(s.n_kv_heads * s.v_head_dim, w)
    return 0


def parallel_lookup(st: Structure) -> DomainTerms:
    """The parallel first layer (docs/theory.md §13.17.1): ``r + off + w (w + 1)`` directions
    that only the stream table's ``n w`` numbers can pin down."""
    d, w, n = st.d_model, _width(st), first_points(st)
    s = st.specs[0]
    r = mlp_terms(st).identified
    shifts = st.norm == "layer" and st.norm_bias  # a LayerNorm bias: affine, not linear frames
    affine = w * (w + 1) if shifts else w * w
    need = r + constant_offset(st) + affine
    # eps = 0: the rows lie on a sphere; its affine maps keep n points on it only for
    # w (w + 1) - n of them (at least the rotations), and each row's scale is free
    need_at_zero = r + constant_offset(st) + max(affine, w * (w - 1) // 2 + n)
    seen = n * w
    if need_at_zero <= seen:
        return DomainTerms()
    c = s.n_heads * s.head_dim + s.n_kv_heads * (s.head_dim + s.v_head_dim)  # q, k, v outputs
    head_reads_e = st.function == "logprobs" and st.tied
    if shifts and not head_reads_e and c > w and n > d:
        at_eps, at_zero = max(0, need - seen), max(0, need_at_zero - seen)
        if st.eps == 0:
            return DomainTerms(at_zero, 0)
        return DomainTerms(at_eps, at_zero - at_eps)
    why = ("a tied head also reads the embedding" if head_reads_e else
           "the attention's q/k/v outputs are narrower than the width" if c <= w else
           f"only {n} rows, not more than the width" if n <= d else "no LayerNorm bias")
    return DomainTerms(max(0, r - seen), 0, False, (
        f"the parallel first layer's MLP reads only {n} distinct inputs (the normalised "
        f"embedding rows), too few to identify it beyond a lookup table ({n} x {w} < "
        f"{need_at_zero}); counted exactly only for an untied head or a bare model behind a "
        f"biased LayerNorm, here {why}: a lower bound (docs/theory.md §13.17)",))


def discrete_inputs(st: Structure, generic: int, total: int) -> DomainTerms:
    """Every discrete-input degeneracy of ``st`` (docs/theory.md §13.17), given the generic
    count's unidentified directions ``generic`` and the parameter count ``total``."""
    d, vocab, w = st.d_model, st.vocab, _width(st)
    unid, near, reasons = 0, 0, []
    if st.layout == "parallel":
        p = parallel_lookup(st)
        unid, near, reasons = p.unidentified, p.near_unidentified, list(p.reasons)
    if vocab <= d:
        reasons.append(f"the vocabulary ({vocab}) is not larger than the width ({d}): the first "
                       "layer reads too few embedding rows to be in general position, and a "
                       "tied head sees too few directions (a lower bound, docs/theory.md §13.17)")
    if st.positions and positions_read(st) <= 1:
        reasons.append("the position table admits sequences of one token only: attention never "
                       "mixes positions and its scores are never seen (a lower bound)")
    n_ctx = contexts(st)
    if n_ctx is not None and n_ctx < _BIG:
        if st.layout != "parallel":  # the first MLP reads one point per context
            r = mlp_terms(st).identified
            if n_ctx * w < r + constant_offset(st) + w * (w + 1):
                unid = max(unid, r - n_ctx * w)
                reasons.append(f"the first MLP sees at most {n_ctx} distinct contexts ({n_ctx} x "
                               f"{w} numbers for its {r} identified directions): a lower bound")
        width = vocab - 1 if st.function == "logprobs" else d
        if total - n_ctx * width > generic + unid:  # rank <= the number of outputs
            unid = total - n_ctx * width - generic
            reasons.append(f"the function has only {n_ctx} x {width} outputs, fewer than its "
                           f"{total - generic} generically identified directions: a lower bound")
    return DomainTerms(unid, near, not reasons, tuple(reasons))
