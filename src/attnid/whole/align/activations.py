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

Both models run, and their activations are kept, in the arithmetic of the checkpoints' own gauge fits
(`keep_dtype`: float32 for bfloat16 and float16 checkpoints, float64 under `Float64Mode`
otherwise). They run together, a layer of each at a time (`collect_pair`), and each layer is
reduced as soon as both models' rows of it are in: the stream to its ``[d, d]`` cross product
and column sums (all its two fits read: `StreamSums`), the neurons to their matching (no pass
changes a neuron's activation, so every pass would match them the same), the heads' outputs to
their cross product and Gram matrices when those are smaller (`HeadSums`). Only the heads'
outputs, or their sums, are kept through the passes: their writes move with the stream (a
checkpoint's sums in temporary files, a layer's read back when it is matched: `Spilled`).
`collect` and `pair` are the same for one model at a time (the reference the tests hold
`collect_pair` to). docs/theory.md §13.20 derives the reductions.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from attnid.errors import AttnidError
from attnid.whole import layerwise
from attnid.whole.check import Float64Mode
from attnid.whole.fit.fitter import compute_dtype
from attnid.whole.fit.match import assign_heads, assignment, blocked_assignment
from attnid.whole.fit.rotation import procrustes_cross
from attnid.whole.fit.source import TensorSource
from attnid.whole.layerwise import LayerwiseLM, Segment, point
from attnid.whole.transforms.state import ModelTensors

Model = Any  # a ModelTensors, or what `attnid.whole.layerwise` reads (a checkpoint's units, a TensorSource)


@dataclass(frozen=True)
class Activations:
    """One model's activations on the calibration tokens (``N`` token positions)."""

    stream: torch.Tensor  # [N (L), d]: every layer's input, stacked
    values: list[torch.Tensor]  # per layer [H, N, dv]: each head's output (the output projection's input)
    neurons: list[torch.Tensor]  # per layer [N, f], each neuron's column standardised (mean 0, norm 1)


VARIANCE_FLOOR = 1e-12  # float64 sums of n products cancel in q - s^2 / n to about sqrt(n) eps q


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

    def add_(self, other: StreamSums) -> StreamSums:
        """The sums over both sets of rows (another layer's states, stacked under these), summed
        into these tensors (no second ``[d, d]`` float64 made: 134 MB at 7B widths)."""
        for mine, theirs in ((self.cross, other.cross), (self.sum_a, other.sum_a), (self.sum_b, other.sum_b),
                             (self.sq_a, other.sq_a), (self.sq_b, other.sq_b)):
            mine += theirs
        return replace(self, n=self.n + other.n, equal=self.equal and other.equal)

    def rotation(self, layer_norm: bool) -> torch.Tensor:
        """``Q`` minimising ``||S_B Q - S_A||`` (rows centred under LayerNorm, which ignores
        all-ones: ``(S_B P)^T (S_A P) = P S_B^T S_A P`` for the centring projection ``P``, which
        `procrustes_cross` applies itself: it fits on ``U^T M U`` with ``U^T P = U^T``)."""
        if self.equal:
            return torch.eye(self.cross.shape[0], dtype=torch.float64)
        return procrustes_cross(self.cross, layer_norm)

    def permutation(self) -> torch.Tensor:
        """``perm [d]``: A's stream coordinate ``i`` is B's ``perm[i]``, by linear assignment on
        the correlations of the columns (``(S_A^T S_B - n mu_A mu_B^T) / (sigma_A sigma_B^T)``).
        A column whose variance is within the sums' cancellation of 0 (``VARIANCE_FLOOR`` of its
        mean square: a constant one) correlates with nothing, as a centred column of zeros."""
        n = max(self.n, 1)
        cov = self.cross.T - torch.outer(self.sum_a, self.sum_b) / n  # [d_A, d_B]

        def sigma(s: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
            var = q - s**2 / n
            return torch.where(var > VARIANCE_FLOOR * q, var.clamp_min(0).sqrt(), torch.inf)

        corr = cov / sigma(self.sum_a, self.sq_a)[:, None] / sigma(self.sum_b, self.sq_b)[None, :]
        return assignment(-corr.clamp(-1.0, 1.0))


@dataclass(eq=False)
class Pair:
    """Both models' activations as the alignment reads them (`pair`): the stream's sums (read
    once, by the stream's fit, which then lets them go: ``None``), per layer both models' head
    outputs ``[H, N, dv]`` (A's, B's; a head's write moves with the stream, so it is matched
    again in each pass) or their `HeadSums` (in memory, or `Spilled` to a file of ``folder``,
    which goes with the pair), and per layer B's neurons matched to A's."""

    stream: StreamSums | None
    values: tuple[Held, ...]  # per layer: the outputs, their sums, or their sums in a file
    neurons: tuple[torch.Tensor, ...]  # per layer perm [f]: A's neuron j is B's perm[j]
    folder: tempfile.TemporaryDirectory | None = field(default=None, repr=False)  # the `Spilled` files


ACTIVATION_BYTES = 8 * 1024**3  # both models' activations, as kept, at most this


def _source(m: Model) -> Any:
    return TensorSource(m) if isinstance(m, ModelTensors) else m


def _spec(src: Any, layer: int) -> Any:
    return ModelTensors(src.layout, {}, src.config).spec(layer)


def keep_dtype(m: Model) -> torch.dtype:
    """The dtype the activations are kept in: the checkpoint's compute dtype (float32 for
    bfloat16 and float16, float64 otherwise; a model in memory is float64)."""
    return compute_dtype(_source(m).dtype())


def _widths(m: Model) -> list[tuple[int, int, int, int]]:
    """Per layer ``(d, H, dv, f)``: a token's stream, heads and their width, neurons."""
    src = _source(m)
    out = []
    for i in range(len(src.layout.layers)):
        down = src.layout.mlps[i][1]
        shape = src.shape(f"{down.path}.weight")  # stored: [out = d, in = f], Conv1D [f, d]
        d, f = shape[::-1] if down.conv1d else shape
        s = _spec(src, i)
        out.append((d, s.n_heads, s.v_head_dim, f))
    return out


def kept_bytes(m: Model, ids: torch.Tensor, spill: bool = False) -> int:
    """What :func:`collect_pair` keeps at most for both models on the chunks ``ids [n, T]``, in
    `keep_dtype` (not a forward's own intermediates, which grow with `pair_batch`): the
    runner's hidden states of every chunk (one group), every layer's head outputs or their
    `HeadSums` (the smaller), and one layer's rows (stream, head outputs, neurons) before
    they are reduced. ``spill`` (`collect_pair`'s): of the `HeadSums`, the largest layer's
    only."""
    widths = _widths(m)
    n, T = int(ids.shape[0]), int(ids.shape[1])
    N, dtype = n * T, keep_dtype(m)
    rows = [2 * N * (d + H * dv + f) for d, H, dv, f in widths]
    hidden = 2 * 3 * n * T * widths[0][0]  # the runner's states: 3 a chunk and model
    heads = spilled = 0
    for _, H, dv, _ in widths:
        if not HeadSums.smaller(N, H, dv):
            heads += 2 * N * H * dv  # the outputs
        elif spill:
            spilled = max(spilled, HeadSums.numbers(H, dv))  # one layer's sums read back
        else:
            heads += HeadSums.numbers(H, dv)
    heads += spilled
    return dtype.itemsize * (hidden + heads + max(rows, default=0))


def check_memory(m: Model, ids: torch.Tensor, spill: bool = False) -> None:
    """Refuse (one line, before any work) a calibration whose activations would not fit."""
    tokens = int(ids.numel())
    need = kept_bytes(m, ids, spill=spill)
    if need > ACTIVATION_BYTES:
        fit = max(1, tokens * ACTIVATION_BYTES // need)
        raise AttnidError(f"--calibration: matching on {tokens} tokens keeps {need / 1024**3:.1f} GiB of "
                          f"activations of the two models (at most {ACTIVATION_BYTES / 1024**3:.0f} GiB): "
                          f"give a file of at most about {fit} tokens, or match on the weights")


def spilled_bytes(m: Model, ids: torch.Tensor) -> int:
    """The files `collect_pair`'s ``spill`` writes on the chunks ``ids``: every layer's
    `HeadSums` where they are kept instead of the outputs, in `keep_dtype`."""
    N = int(ids.numel())
    return keep_dtype(m).itemsize * sum(HeadSums.numbers(H, dv) for _, H, dv, _ in _widths(m)
                                        if HeadSums.smaller(N, H, dv))


def check_disk(m: Model, ids: torch.Tensor) -> None:
    """Refuse (one line, before any work) spilled head sums the temporary folder has no room for."""
    need = spilled_bytes(m, ids)
    where = tempfile.gettempdir()
    free = shutil.disk_usage(where).free
    if need > free:
        raise AttnidError(f"--calibration: matching on {int(ids.numel())} tokens keeps {need / 1e9:.1f} GB "
                          f"of the heads' sums in temporary files, and {where} has {free / 1e9:.1f} GB free: "
                          "set TMPDIR to a folder with room, or give a shorter file")


KINDS = ("stream", "values", "neurons")  # what is kept of a forward (see `_hooked`)


def _hooked(lm: LayerwiseLM, lay: Any, keep: Callable[[str, int, torch.Tensor], None]) -> None:
    """Hooks on ``lm``'s layers handing ``keep(kind, layer, rows [n, width])`` each layer's input
    (``stream``), each head's output (``values``: the output projection's input) and each neuron
    (``neurons``: the down projection's input)."""
    flat = lambda x: x.reshape(-1, x.shape[-1])  # noqa: E731
    for i, layer in enumerate(lm.layers):
        o_proj, down = (layer.get_submodule(lin.path[len(lay.layers[i]):])
                        for lin in (lay.writers[i][0], lay.mlps[i][1]))
        o_proj.register_forward_pre_hook(lambda _, x, i=i: keep("values", i, flat(x[0])))
        down.register_forward_pre_hook(lambda _, x, i=i: keep("neurons", i, flat(x[0])))
        layer.register_forward_pre_hook(lambda _, a, kw, i=i: keep("stream", i, flat(
            a[0] if a else kw["hidden_states"])), with_kwargs=True)


def _runner(dtype: torch.dtype) -> Callable[[Any, torch.Tensor], None]:
    def run(model: Any, x: torch.Tensor) -> None:
        with Float64Mode() if dtype == torch.float64 else nullcontext():  # norms and softmax too
            model.base_model(input_ids=x, use_cache=False)

    return run


def _split_heads(z: torch.Tensor, heads: int) -> torch.Tensor:
    """A layer's head outputs ``[N, H dv]`` as ``[H, N, dv]``."""
    return z.reshape(z.shape[0], heads, -1).transpose(0, 1).contiguous()


def collect(m: Model, ids: torch.Tensor, batch: int = 8, dtype: torch.dtype = torch.float64) -> Activations:
    """Run ``m`` on token chunks ``ids [n, T]`` (in ``dtype``: float64 under `Float64Mode`, so
    that transformers' float32 casts stay float64; eager attention; one decoder layer at a
    time) and keep what the matching reads."""
    src = _source(m)
    lay = src.layout
    lm = LayerwiseLM(src, dtype, eager=True, head=False)  # no head; the table as stored
    L = len(lay.layers)
    seen: dict[str, list[list[torch.Tensor]]] = {k: [[] for _ in range(L)] for k in KINDS}
    _hooked(lm, lay, lambda kind, i, x: seen[kind][i].append(x))
    lm.run(Segment(src, src), [0.0], ids, batch, _runner(dtype))
    del lm  # its tables
    rows = [torch.cat(x) for x in seen["stream"]]  # per layer [N, d], the chunks in order
    step = batch * int(ids.shape[1])  # a batch's rows: stacked batch by batch, each batch layer by layer
    states = torch.cat([r[k:k + step] for k in range(0, int(ids.numel()), step) for r in rows])
    values = [_split_heads(torch.cat(seen["values"][i]), _spec(src, i).n_heads) for i in range(L)]
    neurons = []
    for i in range(L):  # standardised as they are kept: the matching reads nothing else of them
        neurons.append(_standardise_(torch.cat(seen["neurons"][i])))
        seen["neurons"][i].clear()
    return Activations(states, values, neurons)


ONE_GROUP = 2**62  # the hidden states collect_pair's runner may hold: no bound (`pair_batch`)


def pair_batch(n: int, batch: int) -> int:
    """Chunks a forward of `collect_pair` runs: ``batch``, or more when ``n`` chunks would
    need more forwards than `layerwise.MAX_GATES` holds in flight (16 a model), so that every
    chunk is in one group. A layer is complete only once every chunk has passed it; in several
    groups every layer's rows would be held until the last (docs/theory.md §13.20)."""
    return max(batch, -(-n // layerwise.forwards_per_point(2)))  # A and B: two points


def collect_pair(A: Model, B: Model, ids: torch.Tensor, batch: int = 8, dtype: torch.dtype = torch.float64,
                 signed: bool = True, spill: bool = False) -> Pair:
    """Both models run together on ``ids [n, T]`` (the two ends of one `Segment`, each decoder
    layer of A then of B: `attnid.whole.layerwise`, in ``dtype`` as :func:`collect`), each
    layer's activations reduced once both models' are complete (`pair`'s reductions: the
    stream's sums, the neurons matched, ``signed`` as `neuron_matching`), so that one layer's
    stream and neurons are held at a time, and every layer's head outputs or their sums. Every
    chunk runs in one group: no bound on the hidden states, and forwards of `pair_batch`
    chunks (``batch`` up to 128 chunks). ``spill``: each layer's `HeadSums` written to a
    temporary file as made and read back when its layer is matched (`Spilled`: one layer's sums
    in memory at a time instead of every layer's, 71 MB a 7B layer)."""
    sa, sb = _source(A), _source(B)
    lay = sb.layout
    L, N = len(lay.layers), int(ids.numel())
    lm = LayerwiseLM(sa, dtype, eager=True, head=False)
    seen: dict[str, list[tuple[list[torch.Tensor], list[torch.Tensor]]]] = {
        k: [([], []) for _ in range(L)] for k in KINDS}
    count = {k: [[0, 0] for _ in range(L)] for k in KINDS}
    neurons: list[torch.Tensor | None] = [None] * L
    sums: list[StreamSums] = []  # one running total (a [d, d] float64 a layer: 134 MB each at 7B)
    layered: dict[int, Held] = {}
    folder = None
    if spill:  # the files go with the Pair
        folder = tempfile.TemporaryDirectory(prefix="attnid-heads-", ignore_cleanup_errors=True)

    def keep(kind: str, i: int, x: torch.Tensor) -> None:
        k = point()
        seen[kind][i][k].append(x)
        count[kind][i][k] += x.shape[0]
        if count[kind][i][k] > N:
            raise AttnidError(f"internal: layer {i}'s {kind} was seen for more than the {N} tokens")
        if min(count[kind][i]) < N:
            return
        xa, xb = (torch.cat(p) for p in seen[kind][i])
        seen[kind][i][0].clear()
        seen[kind][i][1].clear()
        if kind == "stream":
            here = StreamSums.of(xa, xb)
            sums[:] = [here if not sums else sums[0].add_(here)]
        elif kind == "values":
            held: Held = _kept_heads(xa, xb, _spec(sa, i).n_heads)
            if folder is not None and isinstance(held, HeadSums):
                held = Spilled.of(held, folder, i)
            layered[i] = held
        else:
            neurons[i] = _match_neurons(_standardise_(xa), _standardise_(xb), signed)

    try:
        _hooked(lm, lay, keep)
        lm.run(Segment(sa, sb), [0.0, 1.0], ids, pair_batch(int(ids.shape[0]), batch), _runner(dtype),
               budget=ONE_GROUP)
        del lm
        if any(c != [N, N] for rows in count.values() for c in rows):
            raise AttnidError("internal: a layer's activations were not complete")
    except BaseException:
        if folder is not None:  # now, not when the traceback lets the folder go
            folder.cleanup()
        raise
    return Pair(sums[0], tuple(layered[i] for i in range(L)), tuple(p for p in neurons if p is not None),
                folder)


def _standardise_(X: torch.Tensor) -> torch.Tensor:
    """``X [N, n]`` with each column centred and at unit norm, in place (no second ``[N, f]``:
    0.43 GB a 7B layer on 4,864 tokens)."""
    X -= X.mean(0, keepdim=True)
    return X.div_(X.norm(dim=0, keepdim=True).clamp_min_(1e-300))


def _kept_heads(ZA: torch.Tensor, ZB: torch.Tensor, heads: int
                ) -> HeadSums | tuple[torch.Tensor, torch.Tensor]:
    """A layer's head outputs of both models, side by side ``Z [N, H dv]``: their `HeadSums`
    when smaller, else each as ``[H, N, dv]``."""
    N, width = ZA.shape
    if HeadSums.smaller(N, heads, width // heads):
        return HeadSums.of(ZA, ZB, heads)
    return _split_heads(ZA, heads), _split_heads(ZB, heads)


def pair(a: Activations, b: Activations, signed: bool) -> Pair:
    """Both models' activations reduced to what the passes read (`Pair`), as `collect_pair`
    reduces them: the stream's sums, every layer's neurons matched (``signed``:
    `neuron_matching`'s), its head outputs or their sums; each layer's neuron activations let go
    of once matched (``a`` and ``b`` give them up: their lists are emptied)."""
    stream = StreamSums.of(a.stream, b.stream)
    neurons = []
    for i in range(len(a.neurons)):
        neurons.append(neuron_matching(a, b, i, signed))
        a.neurons[i] = b.neurons[i] = a.neurons[i].new_empty(0)
    a.neurons.clear()
    b.neurons.clear()
    return Pair(stream, tuple(_kept_split(za, zb) for za, zb in zip(a.values, b.values, strict=True)),
                tuple(neurons))


def _kept_split(za: torch.Tensor, zb: torch.Tensor) -> HeadSums | tuple[torch.Tensor, torch.Tensor]:
    """`_kept_heads` of outputs already split ``[H, N, dv]`` (kept as they are when not summed)."""
    H, N, dv = za.shape
    if not HeadSums.smaller(N, H, dv):
        return za, zb
    return HeadSums.of(*(z.transpose(0, 1).reshape(N, -1) for z in (za, zb)), H)


WRITE_BLOCK = 2**24  # elements of one block of heads' writes [H, n, d] (128 MiB in float64)


@dataclass(frozen=True)
class HeadSums:
    """What the heads' matching reads of both models' head outputs ``z [H, N, dv]``: the cross
    product ``Z_A^T Z_B [H dv, H dv]`` of the outputs side by side (``Z [N, H dv]``) and each
    head's Gram matrix ``z_h^T z_h [H, dv, dv]`` per model, in the outputs' dtype (summed in
    float64). Kept instead of the outputs when smaller (`smaller`: more tokens than about half
    the heads' width), since ``<z_h W_h, z_k W_k> = <z_h^T z_k, W_h W_k^T>``."""

    cross: torch.Tensor
    gram_a: torch.Tensor
    gram_b: torch.Tensor

    @staticmethod
    def numbers(heads: int, dv: int) -> int:
        """How many numbers the sums hold: the cross product and both models' Gram matrices."""
        return (heads * dv) ** 2 + 2 * heads * dv * dv

    @staticmethod
    def smaller(tokens: int, heads: int, dv: int) -> bool:
        """Whether the sums hold fewer numbers than both models' outputs."""
        return HeadSums.numbers(heads, dv) < 2 * tokens * heads * dv

    @classmethod
    def of(cls, ZA: torch.Tensor, ZB: torch.Tensor, heads: int, block: int = 1024) -> HeadSums:
        """From both models' outputs side by side ``Z [N, H dv]`` (as the output projection reads
        them), ``block`` tokens at a time."""
        N, width = ZA.shape
        dv = width // heads
        f64 = torch.float64
        cross = torch.zeros(width, width, dtype=f64)
        ga, gb = torch.zeros(heads, dv, dv, dtype=f64), torch.zeros(heads, dv, dv, dtype=f64)
        for k in range(0, N, block):
            xa, xb = ZA[k:k + block].to(f64), ZB[k:k + block].to(f64)  # [n, H dv]
            cross += xa.T @ xb
            ha, hb = (x.reshape(-1, heads, dv) for x in (xa, xb))  # [n, H, dv]
            ga += torch.einsum("nhv,nhw->hvw", ha, ha)
            gb += torch.einsum("nhv,nhw->hvw", hb, hb)
        return cls(cross.to(ZA.dtype), ga.to(ZA.dtype), gb.to(ZA.dtype))

    def inner(self, WA: torch.Tensor, WB: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(<z_h W_A^h, z_k W_B^k> [H, H], ||z_h W_A^h||^2 [H], ||z_k W_B^k||^2 [H])`` for the
        output projections per head ``W [H, dv, d]``."""
        H, dv, _ = WA.shape
        WBf = WB.reshape(H * dv, -1)
        inner = torch.empty(H, H, dtype=self.cross.dtype)
        step = max(1, H // 8)  # a block of A's heads at a time: no [H dv, H dv] product held (67 MB at 7B)
        for h in range(0, H, step):
            P = WA[h:h + step].reshape(-1, WA.shape[-1]) @ WBf.T  # [s dv, H dv]: W_A^h W_B^k^T
            inner[h:h + step] = (self.cross[h * dv:(h + step) * dv] * P).reshape(-1, dv, H, dv).sum((1, 3))
        na = (self.gram_a * (WA @ WA.mT)).sum((1, 2))
        nb = (self.gram_b * (WB @ WB.mT)).sum((1, 2))
        return inner, na, nb


@dataclass(frozen=True)
class Spilled:
    """A layer's `HeadSums` in a file (`collect_pair`'s ``spill``), read back when matched."""

    path: Path

    @classmethod
    def of(cls, sums: HeadSums, folder: tempfile.TemporaryDirectory, layer: int) -> Spilled:
        path = Path(folder.name) / f"heads-{layer}.pt"
        try:
            torch.save(vars(sums), path)  # the fields by name, as `load` gives them back
        except (OSError, RuntimeError) as e:  # a full disk (torch reports a failed write as a RuntimeError)
            size = sum(t.numel() * t.element_size() for t in vars(sums).values())
            why = e.strerror if isinstance(e, OSError) and e.strerror else "the write failed"
            raise AttnidError(f"--calibration: could not write layer {layer}'s head sums "
                              f"({size / 1e6:.3g} MB a layer) into {folder.name}: {why}; "
                              "set TMPDIR to a folder with room") from None
        return cls(path)

    def load(self) -> HeadSums:
        return HeadSums(**torch.load(self.path, weights_only=True))


Held = HeadSums | Spilled | tuple[torch.Tensor, torch.Tensor]  # a layer's head outputs as kept


def head_matching(acts: Pair, layer: int, n_kv_heads: int, WA: torch.Tensor, WB: torch.Tensor
                  ) -> torch.Tensor:
    """``perm [H]`` of B's heads, matched on the cosine of each head's write into the stream
    ``z_h W_O^h [N, d]``, from the heads' outputs (or their `HeadSums`) and each model's output
    projection per head ``W [H, dv, d]`` (B's in A's stream coordinates: moved by the stream's
    rotation or permutation), made a block of tokens at a time."""
    held = acts.values[layer]
    held = held.load() if isinstance(held, Spilled) else held
    if isinstance(held, HeadSums):
        inner, na, nb = held.inner(WA.to(held.cross.dtype), WB.to(held.cross.dtype))
    else:
        inner, na, nb = _writes(*held, WA, WB)
    cos = inner / (na.sqrt().clamp_min(1e-300)[:, None] * nb.sqrt().clamp_min(1e-300)[None, :])
    return assign_heads(1 - cos, n_kv_heads)


def _writes(za: torch.Tensor, zb: torch.Tensor, WA: torch.Tensor, WB: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`HeadSums.inner` from the outputs ``z [H, N, dv]``: the writes made a block of tokens at
    a time."""
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
    return inner, na, nb


def neuron_matching(a: Activations, b: Activations, layer: int, signed: bool) -> torch.Tensor:
    """``perm [f]`` of B's neurons (correlation; ``signed=False``: its absolute value), the
    ``[f, f]`` correlations made a block of rows at a time (`blocked_assignment`) from the
    standardised activations as kept (`Activations.neurons`: no copy of them made)."""
    return _match_neurons(a.neurons[layer], b.neurons[layer], signed)


def _match_neurons(SA: torch.Tensor, SB: torch.Tensor, signed: bool) -> torch.Tensor:
    """`neuron_matching` on standardised activations ``[N, f]``."""

    def cost(X: torch.Tensor, Y: torch.Tensor) -> Callable[[slice], torch.Tensor]:
        return lambda s: (X[:, s].T @ Y).neg_() if signed else (X[:, s].T @ Y).abs_().neg_()

    return blocked_assignment(cost(SA, SB), cost(SB, SA), SA.shape[1])
