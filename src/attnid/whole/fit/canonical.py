"""Gauge fixing: each model's tensors taken to a representative that every additive and
diagonal symmetry of docs/theory.md §13 leaves unchanged, one unit (tables, a layer, the head)
at a time, in a `Frame` (B's in A's coordinates, through the probes).

* norm gains folded into their readers (§13.2): a reader of ``y = g * z + b`` is the pair
  ``(W diag(g), c + W b)``, what it applies to the normalised ``z`` (a gain the readers cannot
  take, post-LN or a tied head's, is compared as it is);
* LayerNorm (§13.3-§13.5): ``z`` is orthogonal to all-ones, so readers act through
  ``P = I - 1 1^T / d`` (centring and bias transfer fixed), and every write into the stream,
  table rows included, is taken to ``P`` of itself (all-ones shifts fixed); a tied token table
  takes only a uniform shift;
* embedding translations (§13.8): each extra table's mean row moves into the token table;
* logit shift (§13.11): an untied unembedding's rows and bias centred over the vocabulary;
* post-LN (§13.12): a norm's bias moves into the output bias of the sublayer that adds to its
  output; parallel layers (§13.9): the attention's effective output bias into the MLP's;
* attention (§4.2): every reader's bias ``c + W b`` becomes the layer's q/k/v bias (what
  `attnid.symmetry.invariants` then compares modulo the per-kv-group gauges, key-bias
  translation and value-bias folding).

What stays is the residual rotation, the permutations and the per-kv-group and per-neuron
gauges: `attnid.whole.fit.compare` fits those.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from attnid.symmetry.invariants import effective_out_bias
from attnid.weights import AttentionWeights
from attnid.whole.fit.frame import NARROW, Frame
from attnid.whole.transforms.layout import Lin, Norm
from attnid.whole.transforms.state import ModelTensors


@dataclass(frozen=True)
class Item:
    """One gauge-fixed tensor compared as it is: ``blame`` the ``state_dict`` name of the tensor
    named when it breaks, ``scale`` what rounding acts on."""

    blame: str
    value: torch.Tensor
    scale: float
    what: str = ""


@dataclass(frozen=True)
class Attention:
    """A layer's gauge-fixed attention (probed: ``d_model`` is the probe count) and, per field
    (``W_Q``, ``b_V``, ...; ``norm_bias``), the ``state_dict`` name that stores it."""

    w: AttentionWeights
    blame: dict[str, str]
    probed: bool = False  # seen through random probes (not the whole stream)


@dataclass(frozen=True)
class MLP:
    """A layer's gauge-fixed MLP, one row per neuron: ``up``, ``gate`` ``[f, k]`` (probed
    readers), ``down`` ``[f, k]`` (the probed down columns), biases ``[f]``."""

    up: torch.Tensor
    down: torch.Tensor
    gate: torch.Tensor | None
    up_bias: torch.Tensor | None
    gate_bias: torch.Tensor | None
    kind: str  # "gated", "relu", "other"
    blame: dict[str, str]
    up_scale: float = 0.0  # what rounding acts on in the up bias (c + W b)
    gate_scale: float = 0.0


Section = Item | Attention | MLP


@dataclass(frozen=True)
class Canonical:
    """A unit's gauge-fixed pieces in forward order, and the names they cover."""

    sections: list[Section]
    covered: set[str] = field(default_factory=set)


# ---- where things are ----------------------------------------------------------------------
def reading(m: ModelTensors) -> dict[str, Norm]:
    """Reader path -> the norm it reads."""
    lay = m.layout
    norms = [*lay.norms, *(() if lay.final is None else (lay.final,))]
    return {r.path: nm for nm in norms for r in nm.readers}


def _absorbing(m: ModelTensors) -> dict[str, Norm]:
    """Post-LN: writer path -> the norm whose bias its output bias takes."""
    return {nm.absorb.path: nm for nm in m.layout.norms if nm.absorb is not None}


def _centre(x: torch.Tensor, m: ModelTensors, dim: int) -> torch.Tensor:
    """``P`` along the stream dimension ``dim`` under LayerNorm (identity under RMSNorm)."""
    return x - x.mean(dim, keepdim=True) if m.layout.norm == "layer" else x


def _norm(x: torch.Tensor | None) -> float:
    return 0.0 if x is None else float(x.norm())


def gain(m: ModelTensors, nm: Norm, dtype: torch.dtype, ignore: bool = False) -> torch.Tensor:
    """The norm's gain (all ones with ``ignore``: a reader compared as stored, for diagnosis)."""
    g = m.gain(nm).to(dtype)
    return torch.ones_like(g) if ignore else g


# ---- readers and writers ---------------------------------------------------------------------
def reader(m: ModelTensors, lin: Lin, dtype: torch.dtype, *, ignore_norm: bool = False,
           frame: Frame | None = None) -> tuple[torch.Tensor, torch.Tensor | None, float]:
    """``(W diag(g) P [out, d], c + W b or None, the bias's scale)``, exact; with ``frame``
    the first is probed, ``W (diag(g) P R) [out, k]``: one product with the stored ``W`` (the
    gain and the centring fold into the probes, `Frame.folded`); a fused map's own rows only."""
    nm = reading(m)[lin.path]
    W = m.weight(lin)
    c = m.bias(lin)
    if lin.rows is not None:
        W = W[lin.rows[0]:lin.rows[1]]
        c = None if c is None else c[lin.rows[0]:lin.rows[1]]
    g, b = gain(m, nm, dtype, ignore_norm), None if ignore_norm else m.norm_bias(nm)
    layer_norm = m.layout.norm == "layer"
    Wc = (frame or Frame(None, None, dtype)).right(W, g, layer_norm)
    cc = None if c is None else c.to(dtype)
    scale = _norm(cc)
    if b is not None:
        W = W.to(dtype)
        Wb = W @ b.to(dtype)
        cc = Wb if cc is None else cc + Wb
        scale += _norm(W) * _norm(b)
    return Wc, cc, scale


def writer_bias(m: ModelTensors, lin: Lin, dtype: torch.dtype) -> tuple[torch.Tensor | None, float]:
    """A writer's output bias plus, post-LN, the bias of the norm whose output it adds to
    (``P`` of it), exact; None when neither exists."""
    c = m.bias(lin)
    nm = _absorbing(m).get(lin.path)
    b = None if nm is None else m.norm_bias(nm)
    parts = [x.to(dtype) for x in (c, b) if x is not None]
    if not parts:
        return None, 0.0
    return _centre(sum(parts), m, -1), sum(_norm(x) for x in parts)


# ---- tables and head (exact: also what the rotation is fitted on) ----------------------------
CHUNK = 8192  # rows of a large table gauge-fixed and probed at a time


def probe_rows(X: torch.Tensor, prep: Callable[[torch.Tensor, int], torch.Tensor], frame: Frame
               ) -> tuple[torch.Tensor, float]:
    """``frame.right`` of the gauge-fixed rows of ``X`` (``prep(chunk, first_row)``), a chunk of
    rows at a time (a 32000-row table never has a full-size copy), and their norm."""
    out, sq = [], 0.0
    for i in range(0, X.shape[0], CHUNK):
        rows = prep(X[i:i + CHUNK].to(frame.dtype), i)
        sq += float((rows**2).sum())
        out.append(frame.right(rows))
    return torch.cat(out), sq**0.5


def _mean_rows(X: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return sum(X[i:i + CHUNK].to(dtype).sum(0) for i in range(0, X.shape[0], CHUNK)) / X.shape[0]


def table_items(m: ModelTensors, frame: Frame) -> list[Item]:
    """Gauge-fixed embedding tables, probed, by ``state_dict`` name (the token table last):
    extra tables' mean rows moved into the token table, then ``P`` (a tied token table under
    LayerNorm: only its mean entry removed). RoBERTa: the unreachable position rows are 0, the
    mean is over the rows other tokens read, and the pad position row moves into the pad
    token's row (tied: only along ``1 / g`` of the head's LayerNorm, §13.13)."""
    cd = frame.dtype
    lay = m.layout
    names = [f"{t}.weight" for t in lay.tables]
    if not all(n in m for n in names):
        return []
    shift = torch.zeros(m.tensors[names[0]].shape[1], dtype=cd)  # moved into every token row
    pad_row: torch.Tensor | None = None  # moved into the pad token's row
    out = []
    pad = lay.padding_idx
    for k, n in enumerate(names[1:], start=1):
        T = m.tensors[n].to(cd).clone()
        positions = k == 1 and pad is not None
        mu = T[pad + 1:].mean(0) if positions else T.mean(0)
        T = T - mu[None, :]
        shift = shift + mu
        if positions:
            T[:pad] = 0.0  # never read (§13.13)
            if not lay.tied:  # the pad token's two rows are read only as their sum
                pad_row = T[pad].clone()
            elif lay.final is not None and f"{lay.final.path}.weight" in m:
                u = 1 / gain(m, lay.final, cd)  # tied: the pad rows trade only along 1 / g
                pad_row = (T[pad] @ u) / (u @ u) * u
            if pad_row is not None:
                T[pad] -= pad_row
        T = _centre(T, m, -1)
        out.append(Item(n, frame.right(T), _norm(T), "rows"))
    E = m.tensors[names[0]]
    uniform = None  # a tied table under LayerNorm: its mean entry (the pad row's move included)
    if lay.norm == "layer" and lay.tied:
        uniform = (_mean_rows(E, cd) + shift).mean() + (0 if pad_row is None else pad_row.mean() / E.shape[0])

    def prep(rows: torch.Tensor, first: int) -> torch.Tensor:
        rows = rows + shift[None, :]
        if pad_row is not None and first <= pad < first + rows.shape[0]:
            rows[pad - first] += pad_row
        if uniform is not None:
            return rows - uniform
        return _centre(rows, m, -1)

    probed, size = probe_rows(E, prep, frame)
    return [*out, Item(names[0], probed, size, "rows")]  # a changed extra table also moves the token rows


def unembedding_items(m: ModelTensors, nm: Norm, frame: Frame, ignore_norm: bool = False) -> list[Item]:
    """An untied unembedding reading ``nm``: the reader's pair ``(U diag(g) P, c + U b)``, rows
    and bias centred over the vocabulary (the logit shift), probed a chunk of rows at a time."""
    cd = frame.dtype
    lin = m.layout.unembed
    W = m.weight(lin)
    g, b = gain(m, nm, cd, ignore_norm), None if ignore_norm else m.norm_bias(nm)
    mean = _centre(_mean_rows(W, cd) * g, m, -1)
    probed, size = probe_rows(W, lambda rows, _: _centre(rows * g[None, :], m, -1) - mean[None, :], frame)
    out = [Item(f"{lin.path}.weight", probed, size, "rows")]
    c = m.bias(lin)
    logit = None if c is None else c.to(cd)
    scale = _norm(c)
    if b is not None:
        Wb = torch.cat([W[i:i + CHUNK].to(cd) @ b.to(cd) for i in range(0, W.shape[0], CHUNK)])
        logit = Wb if logit is None else logit + Wb
        scale += float(sum(float((W[i:i + CHUNK].to(cd) ** 2).sum()) for i in range(0, W.shape[0], CHUNK))
                       ) ** 0.5 * _norm(b)
    if logit is not None:
        blame = f"{lin.path}.bias" if c is not None else f"{nm.path}.bias"
        out.append(Item(blame, logit - logit.mean(), scale, "bias"))
    return out


# ---- a layer ---------------------------------------------------------------------------------
def _bias_letters(spec_bias: frozenset[str], norm_bias: bool, absorbed: bool, parallel: bool) -> str:
    letters = {x for x in "qkv" if x in spec_bias or norm_bias}
    if "o" in spec_bias or absorbed:
        letters.add("o")
    if parallel:
        letters -= {"v", "o"}  # the effective output bias goes to the MLP's (§13.9)
    return "".join(sorted(letters))


def attention(m: ModelTensors, layer: int, frame: Frame, blame_of: dict[str, str], *,
              ignore_norm: bool = False) -> tuple[Attention, torch.Tensor | None, float]:
    """Layer ``layer``'s gauge-fixed attention in ``frame``, and (parallel layouts) its
    effective output bias ``[k]`` handed to the MLP, with that bias's scale."""
    cd = frame.dtype
    w = m.attention(layer)
    assert w is not None
    w = w.to(cd)
    lay = m.layout
    nm = next(n for n in (*lay.norms, *(() if lay.final is None else (lay.final,)))
              if n.path == lay.attn_norm(layer))
    g, b = gain(m, nm, cd, ignore_norm), None if ignore_norm else m.norm_bias(nm)
    b = None if b is None else b.to(cd)
    o_lin = lay.writers[layer][0]
    absorbed = _absorbing(m).get(o_lin.path)
    a_bias = None if absorbed is None else m.norm_bias(absorbed)

    layer_norm = lay.norm == "layer"

    def read(W: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        Wc = frame.left(W, g, layer_norm)  # R^T P diag(g) W [n, k, dh]: one product
        if b is None:
            return Wc, bias
        Wb = torch.einsum("d,ndh->nh", b, W)
        return Wc, Wb if bias is None else bias + Wb

    s = w.spec
    new: dict[str, torch.Tensor | None] = {}
    new["W_Q"], new["b_Q"] = read(w.W_Q, w.b_Q)
    new["W_K"], new["b_K"] = read(w.W_K, w.b_K)
    new["W_V"], new["b_V"] = read(w.W_V, w.b_V)
    new["W_O"] = frame.right(w.W_O, centre=layer_norm)  # W_O P R
    bo = [x.to(cd) for x in (w.b_O, a_bias) if x is not None]
    new["b_O"] = frame.vector(_centre(sum(bo), m, -1)) if bo else None
    letters = _bias_letters(s.bias, b is not None, a_bias is not None, False)
    k = new["W_Q"].shape[-2]
    zeros = {"b_Q": (s.n_heads, s.head_dim), "b_K": (s.n_kv_heads, s.head_dim),
             "b_V": (s.n_kv_heads, s.v_head_dim), "b_O": (k,)}
    for n, shape in zeros.items():
        if n[-1].lower() in letters and new[n] is None:
            new[n] = torch.zeros(shape, dtype=cd)
        if n[-1].lower() not in letters:
            new[n] = None
    spec = replace(s, d_model=k, bias=letters)
    wc = AttentionWeights(spec, **new, g_Q=w.g_Q, g_K=w.g_K)
    handed, hscale = None, 0.0
    if lay.parallel:
        handed = effective_out_bias(wc) if ({"v", "o"} & set(letters)) else None
        hscale = float(sum(_norm(x) for x in bo)) + _norm(new["b_V"]) * _norm(new["W_O"])
        spec = replace(spec, bias="".join(sorted(set(letters) - {"v", "o"})))
        wc = AttentionWeights(spec, **{**new, "b_V": None, "b_O": None}, g_Q=w.g_Q, g_K=w.g_K)
    names = dict(blame_of)
    if b is not None:
        names["norm_bias"] = f"{nm.path}.bias"
    names["norm_gain"] = f"{nm.path}.weight"
    if a_bias is not None:
        names["absorbed_bias"] = f"{absorbed.path}.bias"
    return Attention(wc, names, frame.Z is not None), handed, hscale


def mlp(m: ModelTensors, layer: int, frame: Frame, *, ignore_norm: bool = False, rows: int = NARROW) -> MLP:
    """Layer ``layer``'s gauge-fixed MLP through the frame's first ``rows`` probes."""
    frame = frame.narrow(rows)
    cd = frame.dtype
    lay = m.layout
    up, down = lay.mlps[layer]
    gate = lay.gates[layer] if lay.gates else None
    U, cu, su = reader(m, up, cd, ignore_norm=ignore_norm, frame=frame)  # [f, k]
    G, cg, sg = None, None, 0.0
    if gate is not None:
        G, cg, sg = reader(m, gate, cd, ignore_norm=ignore_norm, frame=frame)
    D = frame.left(m.weight(down), centre=lay.norm == "layer").T  # (R^T P W_down)^T [f, k]
    nm = reading(m)[up.path]
    bias_of = lambda lin: f"{lin.path}.bias" if m.bias(lin) is not None else f"{nm.path}.bias"  # noqa: E731
    blame = {"up": f"{up.path}.weight", "up_bias": bias_of(up), "down": f"{down.path}.weight",
             "norm_gain": f"{nm.path}.weight"}
    if gate is not None:
        blame |= {"gate": f"{gate.path}.weight", "gate_bias": bias_of(gate)}
    return MLP(U, D, G, cu, cg, lay.mlp, blame, su, sg)


def layer_names(m: ModelTensors, layer: int) -> set[str]:
    """Every ``state_dict`` name of a layer's unit that the layer's sections cover."""
    lay = m.layout
    out = set(m.attention_names(layer))
    for lin in (*lay.writers[layer], *lay.mlps[layer], *([lay.gates[layer]] if lay.gates else [])):
        out |= {f"{lin.path}.weight", f"{lin.path}.bias"}
    readers_of = reading(m)
    for lin_path in {n.rsplit(".", 1)[0] for n in out}:
        nm = readers_of.get(lin_path)
        if nm is not None:
            out |= {f"{nm.path}.weight", f"{nm.path}.bias"}
    return {n for n in out if n in m}


# ---- a unit ----------------------------------------------------------------------------------
def _gain_item(m: ModelTensors, nm: Norm, dtype: torch.dtype) -> Item:
    """A gain the readers cannot take (post-LN, a tied or bare model's last norm): as it is."""
    g = gain(m, nm, dtype)
    return Item(f"{nm.path}.weight", g, _norm(g), "gain")


def _foldable(nm: Norm) -> bool:
    return nm.absorb is None and nm.gain


def layer_unit(m: ModelTensors, layer: int, frame: Frame, blame_of: dict[str, str], *,
               ignore_norm: bool = False) -> Canonical:
    """Layer ``layer``'s sections: gains that stay, the attention, the MLP, the MLP's output
    bias (with a parallel attention's effective output bias)."""
    cd = frame.dtype
    lay = m.layout
    readers_of = reading(m)
    sections: list[Section] = []
    att_norm = readers_of[_first_attention_reader(m, layer)]
    up, down = lay.mlps[layer]
    mlp_norm = readers_of[up.path]
    if not _foldable(att_norm):
        sections.append(_gain_item(m, att_norm, cd))
    att, handed, hscale = attention(m, layer, frame, blame_of, ignore_norm=ignore_norm)
    sections.append(att)
    if mlp_norm.path != att_norm.path and not _foldable(mlp_norm):
        sections.append(_gain_item(m, mlp_norm, cd))
    sections.append(mlp(m, layer, frame, ignore_norm=ignore_norm))
    c, scale = writer_bias(m, down, cd)
    value = None if c is None else frame.vector(c)
    if handed is not None:
        value = handed if value is None else value + handed
        scale += hscale
    if value is not None:
        o_bias = blame_of.get("b_O") or blame_of.get("b_V")
        blame = f"{down.path}.bias" if m.bias(down) is not None or o_bias is None else o_bias
        sections.append(Item(blame, value, scale, "output bias"))
    return Canonical(sections, layer_names(m, layer))


def _first_attention_reader(m: ModelTensors, layer: int) -> str:
    """The module path of a map reading the attention's norm."""
    target = m.layout.attn_norm(layer)
    return next(r.path for nm in m.layout.norms if nm.path == target for r in nm.readers)


def table_unit(m: ModelTensors, frame: Frame) -> Canonical:
    items = table_items(m, frame.narrow())
    return Canonical(list(items), {x.blame for x in items})


def head_unit(m: ModelTensors, frame: Frame, *, ignore_norm: bool = False) -> Canonical:
    """The norms read outside the layers (the final one, BERT's masked-LM transform) with their
    readers, and a tied or bare model's last norm."""
    frame = frame.narrow()
    cd = frame.dtype
    lay = m.layout
    inside = tuple(lay.layers)
    sections: list[Section] = []
    covered: set[str] = set()
    norms = {nm.path: nm for nm in (*lay.norms, *(() if lay.final is None else (lay.final,)))}
    for nm in norms.values():
        outside = [r for r in nm.readers if not r.path.startswith(inside)]
        last = nm is lay.final or (lay.final is not None and nm.path == lay.final.path)
        if (not outside and not last) or f"{nm.path}.weight" not in m:
            continue
        covered |= {f"{nm.path}.weight", f"{nm.path}.bias"}
        if not _foldable(nm):
            sections.append(_gain_item(m, nm, cd))
        for lin in outside:
            covered |= {f"{lin.path}.weight", f"{lin.path}.bias"}
            if lin == lay.unembed:
                if not lay.tied:
                    sections += unembedding_items(m, nm, frame, ignore_norm)
                continue
            W, c, scale = reader(m, lin, cd, ignore_norm=ignore_norm)
            sections.append(Item(f"{lin.path}.weight", frame.right(W), _norm(W), "rows"))
            if c is not None:
                blame = f"{lin.path}.bias" if m.bias(lin) is not None else f"{nm.path}.bias"
                sections.append(Item(blame, c, scale, "bias"))
        if last and not nm.gain:  # tied or bare: the norm's bias is compared here
            sections += _last_bias(m, nm, frame)
    return Canonical(sections, {n for n in covered if n in m})


def _last_bias(m: ModelTensors, nm: Norm, frame: Frame) -> list[Item]:
    """A tied head's logit bias ``c + E b`` (centred over the vocabulary), or the last norm's
    bias as a stream vector."""
    cd = frame.dtype
    lay = m.layout
    b = m.norm_bias(nm)
    c = None if lay.unembed is None else m.bias(lay.unembed)
    if lay.tied and c is not None:
        E = m.tensors[f"{lay.tables[0]}.weight"].to(cd)
        logit = c.to(cd) + (0 if b is None else E @ b.to(cd))
        scale = _norm(c) + (0.0 if b is None else _norm(E) * _norm(b))
        blame = f"{lay.unembed.path}.bias"
        return [Item(blame, logit - logit.mean(), scale, "bias")]
    if b is None:
        return []
    return [Item(f"{nm.path}.bias", frame.vector(b.to(cd)), _norm(b), "bias")]
