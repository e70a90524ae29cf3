"""The search of `attnid rewrite --optimize`: the group element that lowers the
quantization objective (`attnid.quantize.objective`), one part after the other (docs/theory.md
§13.23). Every step compares candidates on the real objective (RTN included) and keeps the
current element among them, so no step raises the objective.

Parts (`PARTS`), in this order:

* ``r1``: the residual rotation: none, Hadamard, Hadamard times random signs (QuaRot's
  randomised Hadamard), and the better of those two refined by Cayley-Adam on a weight-
  incoherence proxy (`attnid.quantize.incoherence`), on the whole model's objective;
* ``norm``: each norm's gain against its readers' input columns, the AWQ-style family
  ``s = rms(x)^-alpha * colmax(W)^beta`` (``beta = 1`` is the closed-form optimum of the
  shared-range noise model: every column's largest weight equal);
* ``vo``: per key/value group an invertible ``A`` (values ``W_V A``, output rows ``A^-1 W_O``):
  an orthogonal part (identity, Hadamard, the eigenbasis of the group's values) times the
  diagonal balance of the same family;
* ``qk``: per key/value group a RoPE-commutant ``M`` scaling each rotated plane (and each
  pass-through dim): the balance family between the queries' and the keys' planes;
* ``mlp``: per-neuron scales of the up projection against the down projection's columns.

``awq``: the diagonal balances only (``norm``, ``mlp`` and the diagonal of ``vo``): AWQ's
scalings with AWQ's V->O added, no rotation.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from itertools import product

import torch

from attnid.errors import AttnidError
from attnid.quantize.incoherence import refine_rotation
from attnid.quantize.objective import (
    KINDS,
    LayerCalibration,
    Terms,
    layer_terms,
    mlp_norm,
    objective_value,
)
from attnid.quantize.rtn import Scheme
from attnid.rope import plane_dims
from attnid.spec import AttentionSpec
from attnid.weights import AttentionWeights
from attnid.whole.transforms.element import GroupElement, LayerElement, apply_element
from attnid.whole.transforms.layout import Norm
from attnid.whole.transforms.norms import norm_gain_transfer
from attnid.whole.transforms.orthogonal import hadamard, hadamard_supported
from attnid.whole.transforms.state import ModelTensors

__all__ = ["PARTS", "Search", "parse_parts"]

PARTS = ("r1", "norm", "vo", "qk", "mlp")
ALPHAS = (0.0, 0.25, 0.5, 0.75, 1.0)
BETAS = (0.0, 0.5, 1.0)
SPREAD = 8.0  # the largest factor a diagonal balance moves a channel by
R1_STEPS = 100  # Cayley-Adam steps refining the best Hadamard start (0: no refinement)
R1_ROWS = 4096  # at most this many reader rows and writer columns score the proxy (seeded sample)


def parse_parts(text: str | None) -> tuple[frozenset[str], bool]:
    """``(parts, awq)`` of ``--optimize-parts`` (a comma list of `PARTS`, or ``awq``; None: all)."""
    if text is None:
        return frozenset(PARTS), False
    if text.strip() == "awq":
        return frozenset({"norm", "vo", "mlp"}), True
    parts = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        raise AttnidError(f"--optimize-parts {text!r}: a comma list of {', '.join(PARTS)}, or awq"
                          + (f" (unknown: {', '.join(bad)})" if bad else ""))
    return frozenset(parts), False


def balance(x_rms: torch.Tensor, w_side: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
    """The diagonal family ``x_rms^-alpha * w_side^beta``, normalised to geometric mean 1
    (a common factor is a symmetry of the objective) and kept within ``[1/SPREAD, SPREAD]``
    (a well-conditioned element: the rewrite's rounding grows with its condition number)."""
    floor = 1e-8
    s = x_rms.clamp_min(floor).pow(-alpha) * w_side.clamp_min(floor).pow(beta)
    return _normalised(s)


@dataclass
class Search:
    """The search state: the model's layers (``base(i)``, float32, the input folded when
    ``fold``), their calibration, the element found so far, and the terms of every layer."""

    base: Callable[[int], ModelTensors]  # layer i's unit (folded when the search folds)
    calib: Sequence[LayerCalibration]
    scheme: Scheme
    act: Callable[[torch.Tensor], torch.Tensor]
    parts: frozenset[str]
    awq: bool = False
    seed: int = 0
    r1_steps: int = R1_STEPS
    line: Callable[[str], None] = lambda _: None
    run: Callable[[int, int, str], None] = lambda i, n, name: None
    rotation: torch.Tensor | None = None
    gains: dict[str, torch.Tensor] = field(default_factory=dict)
    layers: list[LayerElement] = field(default_factory=list)
    terms: list[Terms] = field(default_factory=list)
    report: dict[str, dict[str, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.L = len(self.calib)
        self.layers = [LayerElement() for _ in range(self.L)]
        self._rotated: dict[int, ModelTensors] = {}

    # ---- the element and its layers ---------------------------------------------------
    def element(self) -> GroupElement:
        return GroupElement(rotation=self.rotation, gains=dict(self.gains), layers=tuple(self.layers))

    def rotated(self, i: int) -> ModelTensors:
        """Layer ``i`` with the residual rotation and the gain transfers applied (cached)."""
        if i not in self._rotated:
            self._rotated[i] = apply_element(self.base(i), GroupElement(rotation=self.rotation,
                                                                        gains=dict(self.gains)))
        return self._rotated[i]

    def layer(self, i: int, le: LayerElement | None = None) -> ModelTensors:
        """Layer ``i`` under the whole element (``le``: this layer's part instead of the found one)."""
        parts = list(self.layers)
        parts[i] = self.layers[i] if le is None else le
        return apply_element(self.rotated(i), GroupElement(layers=tuple(parts)))

    def eval(self, m: ModelTensors, i: int, kinds: Sequence[str]) -> Terms:
        refs = self.terms[i] if i < len(self.terms) else None  # references: the same for all
        return layer_terms(m, i, self.calib[i], self.scheme, self.rotation, self.act, kinds, refs)

    def inputs(self, m: ModelTensors, nm: Norm, x: torch.Tensor) -> torch.Tensor:
        """A norm's readers' input ``[n, d]`` in ``m``: ``x`` (gain 1, unrotated) rotated, times the gain."""
        x = x.flatten(0, 1)
        if self.rotation is not None:
            x = x @ self.rotation.to(x.dtype)
        return x * m.gain(nm).to(x.dtype)

    def attention_inputs(self, i: int) -> tuple[AttentionWeights, torch.Tensor]:
        """Layer ``i``'s attention under the element found so far and its input ``[n, d]`` (float64)."""
        m = self.layer(i)
        return m.attention(i), self.inputs(m, _attn_norm(m, i), self.calib[i].attn_in).double()

    def value(self) -> float:
        return objective_value(self.terms)

    # ---- the whole search -------------------------------------------------------------
    def start(self) -> float:
        self.terms = []
        for i in range(self.L):
            self.run(i + 1, self.L, f"objective of layer {i}")
            self.terms.append(self.eval(self.layer(i), i, KINDS))
        return self.value()

    def optimize(self) -> dict[str, dict[str, float]]:
        """Each selected part in turn; returns ``{part: {before, after, seconds}}``."""
        steps = [("r1", self.search_rotation), ("norm", self.search_norms), ("vo", self.search_values),
                 ("qk", self.search_queries), ("mlp", self.search_mlp)]
        for name, step in steps:
            if name not in self.parts:
                continue
            t0, before = time.perf_counter(), self.value()
            self.line(f"part {name}: objective {before:.4f}")
            step()
            self.report[name] = {"before": before, "after": self.value(),
                                 "seconds": time.perf_counter() - t0}
            self.line(f"part {name}: objective {before:.4f} -> {self.value():.4f} "
                      f"({self.report[name]['seconds']:.1f}s)")
        return self.report

    # ---- r1 ------------------------------------------------------------------------------
    def search_rotation(self) -> None:
        d = self.rotated(0).weight(self.rotated(0).layout.mlps[0][1]).shape[0]
        if not hadamard_supported(d):
            raise AttnidError(f"--optimize-parts r1: no Hadamard matrix of order {d} is known here")
        gen = torch.Generator().manual_seed(self.seed)
        H = hadamard(d).to(torch.float64)
        cands = [H, H * torch.where(torch.rand(d, generator=gen) < 0.5, -1.0, 1.0).double()[:, None]]
        best, best_terms = self.value(), self.terms
        keep = self.rotation
        names = ["Hadamard", "Hadamard x signs", "refined"]
        start, start_v = 0, float("inf")  # the better Hadamard: where the refinement starts
        for j in range(3 if self.r1_steps else 2):
            if j < 2:
                Q = cands[j]
            else:
                Q, trace = refine_rotation(*self.residual_sides(gen), cands[start], steps=self.r1_steps,
                                           progress=lambda k, n: self.run(k, n, "refining R1"))
                self.line(f"  refining {names[start]}: incoherence proxy {trace[0]:.4f} -> {trace[-1]:.4f} "
                          f"in {self.r1_steps} steps")
            self.rotation, self._rotated = Q, {}
            terms = []
            for i in range(self.L):
                self.run(j * self.L + i + 1, len(names) * self.L, f"rotation {names[j]}, layer {i}")
                terms.append(self.eval(self.layer(i), i, KINDS))
            v = objective_value(terms)
            self.line(f"  rotation {names[j]}: {v:.4f}")
            if j < 2 and v < start_v:
                start, start_v = j, v
            if v < best:
                best, best_terms, keep = v, terms, Q
        self.rotation, self.terms, self._rotated = keep, best_terms, {}

    def residual_sides(self, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``(readers [n, d], writers [d, m])``: the rows of every map reading the residual stream
        and the columns of every map writing it, over all layers (float32, the folded inputs; a
        seeded sample of at most `R1_ROWS` of each)."""
        readers, writers = [], []
        for i in range(self.L):
            m = self.base(i)
            lay = m.layout
            for nm in (_attn_norm(m, i), mlp_norm(lay, i)):
                readers += [m.weight(r).float() for r in nm.readers if m.has(r)]
            writers += [m.weight(w).float() for w in lay.writers[i] if m.has(w)]
        R, W = torch.cat(readers), torch.cat(writers, 1)
        pick = lambda n: torch.randperm(n, generator=gen)[:R1_ROWS]  # noqa: E731
        return R[pick(R.shape[0])], W[:, pick(W.shape[1])]

    # ---- norms -----------------------------------------------------------------------------
    def search_norms(self) -> None:
        for i in range(self.L):
            self.run(i + 1, self.L, f"norm gains of layer {i}")
            m = self.rotated(i)
            lay = m.layout
            for nm, kinds, x in ((_attn_norm(m, i), ("q", "k", "v"), self.calib[i].attn_in),
                                 (mlp_norm(lay, i), ("gate", "up") if lay.mlp == "gated" else ("up",),
                                  self.calib[i].mlp_in)):
                m = self.rotated(i)
                x_rms = self.inputs(m, nm, x).square().mean(0).sqrt().double()
                colmax = torch.stack([m.weight(r).abs().amax(0) for r in nm.readers]).amax(0).double()
                best_terms = {k: self.terms[i][k] for k in kinds}
                best, keep = objective_value([best_terms]), None
                for a, b in product(ALPHAS, BETAS):
                    if a == 0 and b == 0:
                        continue
                    s = balance(x_rms, colmax, a, b)
                    cand = norm_gain_transfer(m, nm.path, s)
                    t = self.eval(apply_element(cand, GroupElement(layers=tuple(self.layers))), i, kinds)
                    v = objective_value([t])
                    if v < best:
                        best, best_terms, keep = v, t, s
                if keep is not None:
                    old = self.gains.get(nm.path)
                    self.gains[nm.path] = keep if old is None else old * keep
                    self._rotated[i] = norm_gain_transfer(m, nm.path, keep)
                    self.terms[i] |= best_terms

    # ---- V/O ---------------------------------------------------------------------------------
    def search_values(self) -> None:
        for i in range(self.L):
            self.run(i + 1, self.L, f"V/O of layer {i}")
            w, Xf = self.attention_inputs(i)
            s = w.spec
            G, dv = s.n_kv_heads, s.v_head_dim
            W_V, W_O = w.W_V.double(), w.W_O.double()  # [G, d, dv], [H, dv, d]
            bases = [torch.eye(dv, dtype=torch.float64).expand(G, dv, dv)]
            if not self.awq:
                if hadamard_supported(dv):
                    bases.append(hadamard(dv).double().expand(G, dv, dv))
                cov = torch.einsum("nd,gde->gne", Xf, W_V)  # values [G, n, dv]
                bases.append(torch.linalg.eigh(cov.transpose(1, 2) @ cov).eigenvectors)
            self._try(i, ("v", "o"), self._vo_candidates(bases, Xf, W_V, W_O, s), "vo")

    def _vo_candidates(self, bases, Xf, W_V, W_O, s):
        G, dv = s.n_kv_heads, s.v_head_dim
        W_Og = W_O.reshape(G, s.n_heads // G, dv, -1)
        for R, a, b in product(bases, ALPHAS[::2], BETAS[::2]):
            VR = W_V @ R  # [G, d, dv]
            OR = R.transpose(1, 2) @ W_Og  # [G, m, dv, d]
            x_rms = torch.einsum("nd,gde->gne", Xf, VR).square().mean(1).sqrt()  # [G, dv]
            side = (OR.abs().amax((1, 3)) / VR.abs().amax(1).clamp_min(1e-12)).sqrt()  # [G, dv]
            D = torch.stack([balance(x_rms[g], side[g], a, b) for g in range(G)])  # [G, dv]
            yield R * D[:, None, :]

    # ---- Q/K ---------------------------------------------------------------------------------
    def search_queries(self) -> None:
        for i in range(self.L):
            self.run(i + 1, self.L, f"Q/K of layer {i}")
            w, Xf = self.attention_inputs(i)
            s = w.spec
            G, dk = s.n_kv_heads, s.head_dim
            Wq = w.W_Q.double().reshape(G, s.n_heads // G, -1, dk)  # [G, m, d, dk]
            Wk = w.W_K.double()  # [G, d, dk]
            q_rms = torch.einsum("nd,gmdk->gmnk", Xf, Wq).square().mean((1, 2)).sqrt()  # [G, dk]
            k_rms = torch.einsum("nd,gdk->gnk", Xf, Wk).square().mean(1).sqrt()
            q_max, k_max = Wq.abs().amax((1, 2)), Wk.abs().amax(1)  # [G, dk]
            rms, ranges = _tie((k_rms / q_rms.clamp_min(1e-12)).sqrt(), s), _tie(
                (k_max / q_max.clamp_min(1e-12)).sqrt(), s)
            grid = product(ALPHAS[::2], BETAS)
            cands = (torch.diag_embed(_normalised(rms**a * ranges**b)) for a, b in grid)
            self._try(i, ("q", "k"), cands, "qk")

    # ---- MLP ---------------------------------------------------------------------------------
    def search_mlp(self) -> None:
        for i in range(self.L):
            self.run(i + 1, self.L, f"MLP scales of layer {i}")
            m = self.layer(i)
            lay = m.layout
            up, down = lay.mlps[i]
            nm = mlp_norm(lay, i)
            X = self.inputs(m, nm, self.calib[i].mlp_in)
            U = X @ m.weight(up).T.to(X.dtype)
            Hn = self.act(X @ m.weight(lay.gates[i]).T.to(X.dtype)) * U if lay.mlp == "gated" else self.act(U)
            h_rms = Hn.double().square().mean(0).sqrt()
            up_max = m.weight(up).abs().amax(1).clamp_min(1e-12)
            side = (m.weight(down).abs().amax(0) / up_max).double().sqrt()
            self._try(i, ("up", "down"), (balance(h_rms, side, a, b) for a, b in product(ALPHAS, BETAS)
                                          if a or b), "mlp")

    # ---- one layer's candidates ----------------------------------------------------------
    def _try(self, i: int, kinds: Sequence[str], cands, field_name: str) -> None:
        """Keep the best of the current part and ``cands`` (this layer's ``field_name`` part
        composed after the current one) on the terms ``kinds``."""
        cur = self.layers[i]
        best_terms = {k: self.terms[i][k] for k in kinds}
        best, keep = objective_value([best_terms]), None
        for x in cands:
            new = _compose(cur, field_name, x)
            t = self.eval(self.layer(i, new), i, kinds)
            v = objective_value([t])
            if v < best:
                best, best_terms, keep = v, t, new
        if keep is not None:
            self.layers[i] = keep
            self.terms[i] |= best_terms


def _attn_norm(m: ModelTensors, i: int) -> Norm:
    return next(n for n in m.layout.norms if n.path == m.layout.attn_norm(i))


def _normalised(c: torch.Tensor) -> torch.Tensor:
    """Each row at geometric mean 1, within ``[1/SPREAD, SPREAD]``."""
    return (c / c.log().mean(-1, keepdim=True).exp()).clamp(1 / SPREAD, SPREAD)


def _tie(t: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """``t [G, dk]`` with both dims of each RoPE plane at their mean (a plane scales as one:
    the RoPE commutant)."""
    out = t.clone()
    if spec.rope_dims:
        i1, i2 = plane_dims(spec)
        mean = 0.5 * (t[:, i1] + t[:, i2])
        out[:, i1], out[:, i2] = mean, mean
    return out


def _compose(le: LayerElement, name: str, x: torch.Tensor) -> LayerElement:
    """``le`` with its ``name`` part (``vo``, ``qk`` or ``mlp``) followed by ``x``."""
    cur = getattr(le, name)
    if cur is None:
        return replace(le, **{name: x})
    return replace(le, **{name: cur * x if name == "mlp" else cur @ x})

