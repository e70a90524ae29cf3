"""The refinement of `attnid.whole.align.refine` with neither model held whole (docs/theory.md
§13.24): what `attnid align / merge / barrier --refine` run on checkpoints.

The objective and its gradient are the whole model's (`refine.PathLoss` through transformers'
own forward), computed one unit at a time over A's and B's units as they are read. Per step
and path point ``t`` (the weights ``(1 - t) A + t g(B)``, mixed in the compute dtype, float64
as `PathLoss` mixes them or float32 for bfloat16 and float16 checkpoints, then rounded to the
model's dtype):

1. **Forward**, without a graph: transformers' forward of the model built without its decoder
   layers (`attnid.whole.layerwise.LayerwiseLM`, its own tables and head freed: each forward
   is handed them), each slot running its layer there and then on that layer's weights at
   ``t``, every layer's input kept (``[b, T, d]``, as activation checkpointing keeps it),
   stopped after the last layer.
2. **The head's part**, which gives the loss: the forward again with the final norm and head
   at ``t`` (the forward's) as leaves, every slot handing back the last layer's output as a
   leaf; its backward gives the head's weight gradient and the last layer's output gradient.
3. **The layers**, last to first: each run again on its kept input with its weights at ``t``
   as leaves, its output's gradient pushed back to its input and its weights.
4. **The tables' part.** A forward with the tables at ``t`` as leaves that stops at the first
   slot, whose input takes the first layer's input gradient.

Every part runs ``MICRO_TOKENS`` tokens of the batch (whole sequences) at a time (the forward
on each layer's weights made once for all), the gradients of parts 2-4 summed over them (the
loss is a mean over tokens): a part's logits, graph and a layer's intermediates are held, not
the batch's. Each weight gradient is then pulled back to ``g`` (`UnitPathLoss._pull`): B's tensors moved by
``g`` again with a graph, a group of `coupled` tensors at a time, tables, heads and plain MLPs
``BLOCK`` rows at a time, so that one group's or block's graph is held, not a unit's. The
gradients reach ``g``'s tensors (the stream rotation, each layer's maps, the gains) held as
leaves, and from them the refinement's parameters in one more backward, with the element made
again with its graph (the passes use it without one). Each step reads every layer unit three
times per point (forward, the weights at ``t``, the pull), B's tables three times and head
twice (a tied table once more: each part of its gradient is pulled as it comes), A's tables
twice and head once;
what is held at once is one unit's weights at ``t`` and their gradient (in the model's dtype),
one group's graph (in the compute dtype), A read a tensor at a time, the head at ``t`` through
the forward and the head's part (an untied model's tables are let go after layer 0's input),
and the kept states.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from attnid.errors import AttnidError
from attnid.progress import Progress
from attnid.whole.align.refine import BATCH, Parameters, Refined, choose_parts, descend
from attnid.whole.fit.fitter import compute_dtype
from attnid.whole.layerwise import LayerwiseLM, inline
from attnid.whole.transforms.element import GroupElement, apply_element
from attnid.whole.transforms.state import ModelTensors

Tensors = dict[str, torch.Tensor]
MICRO_TOKENS = 1024  # tokens a part of a step after its forward runs at once (`UnitPathLoss._point`)
BLOCK = 4096  # rows (tokens, neurons) of one piece of a split group (`UnitPathLoss._blocks`)


def skeleton(src: Any) -> ModelTensors:
    """B's tensors as meta tensors of their shapes (what `Parameters` and `refinable_parts`
    read), the final norm's gain real (a tied head's rotation depends on its values)."""
    lay = src.layout
    out = {n: torch.empty(src.shape(n), dtype=torch.float64, device="meta") for n in src.unit_of}
    if lay.final is not None and (name := f"{lay.final.path}.weight") in out:
        out[name] = src.tensor(name).to(torch.float64)
    return ModelTensors(lay, out, src.config)


def coupled(shape: ModelTensors) -> dict[str, int]:
    """Each tensor's group: tensors a transform of `apply_element` changes together (a norm with
    its readers, a layer's attention, an MLP with its gate) share one; the rest are each their
    own. A group is moved alone as it would be with its unit. A tied head is its table, not a
    tensor of its own (a stored copy of it joins the table); the tied final norm moves only its
    own bias."""
    lay, names = shape.layout, list(shape.tensors)
    parent = {n: n for n in names}

    def root(n: str) -> str:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    def join(group: list[str]) -> None:
        for n in group[1:]:
            parent[root(n)] = root(group[0])

    def of(paths: set[str]) -> list[str]:
        return [n for n in names if n.rsplit(".", 1)[0] in paths]

    for nm in (*lay.norms, *(() if lay.final is None else (lay.final,))):
        join(of({nm.path, *(r.path for r in nm.readers), *(() if nm.absorb is None else (nm.absorb.path,))}))
    for i in range(len(lay.layers)):
        join([n for n in shape.attention_names(i) if n in parent])
        gate = lay.gates[i] if i < len(lay.gates) else None
        join(of({x.path for x in (*lay.mlps[i], *(() if gate is None else (gate,)))}))
    if lay.tied and lay.unembed is not None and lay.tables:
        join(of({lay.unembed.path, lay.tables[0]}))
    ids: dict[str, int] = {}
    return {n: ids.setdefault(root(n), len(ids)) for n in names}


def _keyed(g: GroupElement) -> dict[tuple, torch.Tensor]:
    """``g``'s tensors by where they sit (the rotation, each gain, each layer's maps)."""
    out: dict[tuple, torch.Tensor] = {} if g.rotation is None else {("rotation",): g.rotation}
    out |= {("gain", p): s for p, s in g.gains.items()}
    for i, le in enumerate(g.layers):
        out |= {(f, i): x for f in ("qk", "vo", "mlp") if (x := getattr(le, f)) is not None}
    return out


def _leaves(g: GroupElement) -> tuple[GroupElement, dict[tuple, torch.Tensor]]:
    """``g`` with each tensor a fresh leaf (its gradient kept; in its own dtype: the transforms
    check the maps in float64 and cast them to each weight's dtype), and the leaves by
    `_keyed`'s keys."""
    leaves = {k: t.detach().clone().requires_grad_() for k, t in _keyed(g).items()}
    layers = tuple(replace(le, **{f: leaves[(f, i)] for f in ("qk", "vo", "mlp") if (f, i) in leaves})
                   for i, le in enumerate(g.layers))
    gains = {p: leaves[("gain", p)] for p in g.gains}
    return GroupElement(rotation=leaves.get(("rotation",)), gains=gains, layers=layers), leaves


class _Stop(Exception):  # noqa: N818  (not an error: the forward's work is done at a slot)
    """Ends a forward at a slot, handing back what it was given there (the first slot's input,
    the last layer's output)."""

    def __init__(self, x: Any) -> None:
        self.x = x


def _per_sequence(two: Any, three: Any) -> Any:
    """Which of a layer's arguments run per sequence, from layer 0's arguments on batches of 2
    and 3 sequences (`UnitPathLoss._sequences`): a tree like theirs with True for each tensor
    whose first dimension follows the batch (hidden states, masks, positions per sequence),
    the shape of one that does not change (a position shared by the batch, ``[1, T, ...]``),
    and None for anything else (not a tensor, or the two trees differ there: the probe says
    nothing, and `_rows` judges a tensor found there by its shape). A tensor that changes
    otherwise (``[b H, ...]``) cannot be cut by sequences: refused."""
    if isinstance(two, torch.Tensor) and isinstance(three, torch.Tensor):
        if two.shape == three.shape:
            return two.shape
        if two.dim() >= 1 and (two.shape[0], three.shape[0]) == (2, 3) and two.shape[1:] == three.shape[1:]:
            return True
        raise AttnidError(f"internal: a layer's argument is {list(two.shape)} on 2 sequences and "
                          f"{list(three.shape)} on 3: not cut by sequences")
    if isinstance(two, (tuple, list)) and isinstance(three, (tuple, list)) and len(two) == len(three):
        return tuple(_per_sequence(x, y) for x, y in zip(two, three, strict=True))
    if isinstance(two, dict) and isinstance(three, dict) and two.keys() == three.keys():
        return {k: _per_sequence(v, three[k]) for k, v in two.items()}
    return None


def _rows(tree: Any, part: slice, rows: Any, b: int) -> Any:
    """``tree`` (a layer's arguments on a batch of ``b`` sequences: tensors, tuples, lists,
    dicts) with the sequences ``part`` of every tensor `_per_sequence` marks in ``rows``, the
    rest as it is (a shared tensor, where it has the shape marked). Where ``rows`` says
    nothing (None, another shape, or a tree shaped otherwise: a later layer may get a mask
    where layer 0 gets none, as a sliding-window layer does), a tensor of two or more
    dimensions whose first is the batch is cut."""
    if isinstance(tree, torch.Tensor):
        if rows is True or (isinstance(rows, torch.Size) and tree.shape == rows):
            cut = rows is True
        else:
            cut = tree.dim() >= 2 and tree.shape[0] == b
        if cut and tree.shape[0] != b:
            raise AttnidError(f"internal: a layer's argument {list(tree.shape)} runs per sequence but "
                              f"its first dimension is not the batch's {b}")
        return tree[part] if cut else tree
    if isinstance(tree, (tuple, list)):
        marks = rows if isinstance(rows, tuple) and len(rows) == len(tree) else (None,) * len(tree)
        out = [_rows(x, part, r, b) for x, r in zip(tree, marks, strict=True)]
        return tuple(out) if isinstance(tree, tuple) else out
    if isinstance(tree, dict):
        marks = rows if isinstance(rows, dict) else {}
        return {k: _rows(v, part, marks.get(k), b) for k, v in tree.items()}
    return tree


def _hidden(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def _with_hidden(args: tuple, kwargs: dict, x: torch.Tensor) -> tuple[tuple, dict]:
    if args:
        return (x, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": x}


def _stop(i: int, args: tuple, kwargs: dict) -> Any:
    """A slot's work that ends the forward at the first layer, handing back its input."""
    raise _Stop(_hidden(args, kwargs))


def _arguments(i: int, args: tuple, kwargs: dict) -> Any:
    """A slot's work that ends the forward at the first layer, handing back all it was given."""
    raise _Stop((args, kwargs))


def _hollow(w: torch.Tensor) -> torch.Tensor:
    """A tensor of ``w``'s shape and dtype holding no memory (zeros, every stride 0): a table
    the forward must be given but whose rows no slot reads."""
    return w.new_zeros(()).expand(w.shape)


def _first(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out[0]


def _joined(outs: list[Any]) -> Any:
    """A layer's outputs on parts of the batch (whole sequences, in order) as its output on the
    batch: every tensor (the hidden states, attention weights if any) joined along the batch."""
    if isinstance(outs[0], torch.Tensor):
        return torch.cat(outs)
    parts = zip(*outs, strict=True)
    return tuple(torch.cat(xs) if isinstance(xs[0], torch.Tensor) else xs[0] for xs in parts)


def _like(out: Any, x: torch.Tensor) -> Any:
    """``out`` (a layer's output: a tensor or a tuple starting with one) with ``x`` for its
    hidden states."""
    return x if isinstance(out, torch.Tensor) else (x, *out[1:])


class UnitPathLoss:
    """`refine.PathLoss` over sources read a unit at a time (`attnid.checkpoint.units.Units`, or
    `attnid.whole.fit.source.SplitSource` for a model in memory): A's, and B's moved by ``g``."""

    def __init__(self, lm: LayerwiseLM, a: Any, b: Any, alphas: Sequence[float],
                 dtype: torch.dtype = torch.float64) -> None:
        self.lm, self.a, self.b, self.alphas, self.dtype = lm, a, b, tuple(alphas), dtype
        self.L = lm.L
        shape = skeleton(b)  # reads B's final gain
        self.shapes = {n: tuple(t.shape) for n, t in shape.tensors.items()}
        self.group = coupled(shape)
        self.members: dict[int, list[str]] = {}  # each group's names
        for n, k in self.group.items():
            self.members.setdefault(k, []).append(n)

    def _moved(self, names: Sequence[str], g: GroupElement) -> Iterator[tuple[list[str], Tensors]]:
        """B's tensors ``names`` moved by ``g`` (in the compute dtype), a group of `coupled`
        tensors at a time (only its tensors read): each group's names among ``names`` with its
        moved tensors. A graph is made when the caller has gradients on."""
        for k in sorted({self.group[n] for n in names}):
            moved = dict(apply_element(self._load(self.members[k]), g).tensors)  # let go before the next
            yield [n for n in names if self.group[n] == k], moved
            del moved

    def _at(self, names: Sequence[str], g: GroupElement, t: float) -> Tensors:
        """The weights ``names`` at ``t`` (in the model's dtype), mixed in the compute dtype
        from A (read a tensor at a time, widened in the sum rather than copied) and B moved by
        ``g`` (a group at a time; mixed in `_blocks`' pieces instead, the peak at 7B widths
        rose: 3.95 -> 4.15 GiB, one run)."""
        out: Tensors = {}
        for group, moved in self._moved(names, g):
            for n in group:
                w = moved.pop(n)
                x = self.a.tensor(n)  # as stored: widened element by element in the sum, not copied
                x = x if torch.promote_types(x.dtype, w.dtype) == w.dtype else x.to(w.dtype)
                out[n] = (w * t).add_(x, alpha=1 - t).to(self.lm.dtype)
                del w, x
        return out

    def _pull(self, g: GroupElement, t: float, cot: Tensors) -> None:
        """The gradient of the weights at ``t`` (``cot``, by name; emptied) pushed into ``g``'s
        leaves: B's tensors moved by ``g`` again, a group at a time with a graph, and the
        vector-Jacobian product taken (d/d moved of ``(1 - t) A + t moved`` is ``t``). A group
        that `_blocks` splits is moved ``BLOCK`` rows (tokens, neurons) at a time: its graph,
        several copies of what it moves, is then that of a block. The group with the largest
        gradient goes first, so that a group moved whole (a layer's attention) is moved with
        the least of the others' gradients still held (at 7B widths its MLP's, 0.5 GiB)."""
        size: dict[int, int] = {}
        for n, d in cot.items():
            size[self.group[n]] = size.get(self.group[n], 0) + d.numel()
        for k in sorted(size, key=lambda k: (-size[k], k)):
            self._pull_group(self.members[k], g, t, cot)
            for n in self.members[k]:
                cot.pop(n, None)

    def _pull_group(self, members: Sequence[str], g: GroupElement, t: float, cot: Tensors) -> None:
        """`_pull` of one group (what it reads let go on return)."""
        with torch.enable_grad():
            for names, m, gb, cut in self._blocks(members, self._load(members), g):
                moved = apply_element(m, gb).tensors
                outs = [(moved[n], cot[n] if n not in cut else cot[n].narrow(*cut[n]))
                        for n in names if n in cot]
                outs = [(w, d) for w, d in outs if w.requires_grad]
                if outs:
                    torch.autograd.backward([w for w, _ in outs], [t * d.to(w.dtype) for w, d in outs])
                del moved, outs, m

    def _load(self, members: Sequence[str]) -> ModelTensors:
        """B's tensors ``members`` (nothing else of their units), in the compute dtype. A tied
        head's table, a unit's extra for other work, is not read: no move of a group needs it."""
        here: Tensors = {}
        for unit in sorted({self.b.unit_of[n] for n in members}):
            m = self.b.load(unit, self.dtype, only=members)
            here |= m.tensors
        return replace(m, tensors=here)

    def _blocks(self, members: Sequence[str], m: ModelTensors, g: GroupElement
                ) -> Iterator[tuple[list[str], ModelTensors, GroupElement, dict[str, tuple[int, int, int]]]]:
        """A group as pieces that `apply_element` moves independently: (the names whose moved
        values a piece gives, the piece, ``g`` for it, each cut tensor's ``narrow`` arguments).
        An embedding table or the unembedding (with its norm) splits by rows, as the stream's
        transforms act on columns; a plain MLP with its norm by neurons (rows of its up and
        gate, columns of its down, the scales' entries), when ``g`` permutes none. Any other
        group is one piece."""
        lay = m.layout
        wide = [n for n in members if len(self.shapes[n]) == 2]
        rows = {f"{x}.weight" for x in (*lay.tables, *(() if lay.unembed is None else (lay.unembed.path,)))}
        dims: dict[str, int] = {}
        layer = None
        if wide and all(n in rows for n in wide) and len({self.shapes[n][0] for n in wide}) == 1:
            dims = {n: 0 for n in wide}
        for i, (up, down) in enumerate(lay.mlps):
            gate = lay.gates[i] if i < len(lay.gates) else None
            lins = [x for x in (up, gate) if x is not None]
            le = g.layers[i] if i < len(g.layers) else None
            if (f"{down.path}.weight" in members and not any(x.rows or x.conv1d for x in (*lins, down))
                    and (le is None or le.neurons is None)):
                dims = {n: 0 for x in lins for p in ("weight", "bias") if (n := f"{x.path}.{p}") in members}
                dims[f"{down.path}.weight"] = 1
                layer = i if wide and set(wide) <= set(dims) else None
                dims = dims if layer is not None else {}
        if not dims:
            yield list(members), m, g, {}
            return
        size = {self.shapes[n][d] for n, d in dims.items()}
        if len(size) != 1:
            yield list(members), m, g, {}
            return
        total = size.pop()
        for start in range(0, total, BLOCK):
            n = min(BLOCK, total - start)
            cut = {x: (d, start, n) for x, d in dims.items()}
            piece = {x: w.narrow(*cut[x]) if x in cut else w for x, w in m.tensors.items()}
            gb = g
            if layer is not None and layer < len(g.layers) and g.layers[layer].mlp is not None:
                le = g.layers[layer]
                gb = replace(g, layers=tuple(replace(le, mlp=le.mlp[start:start + n]) if j == layer else x
                                             for j, x in enumerate(g.layers)))
            # a tensor the blocks do not cut (a norm, the down bias) is pulled with the first
            names = [x for x in members if x in cut or start == 0]
            yield names, replace(m, tensors=piece), gb, cut

    def _rest(self, g: GroupElement, t: float, units: Sequence[int] | None = None) -> Tensors:
        """The tables, final norm and head at ``t`` (those of ``units``; None: all)."""
        return self._at([n for n in self.lm.rest if units is None or self.a.unit_of[n] in units], g, t)

    def _layer(self, i: int, g: GroupElement, t: float) -> Tensors:
        """Layer ``i``'s weights at ``t``, by their names in the layer."""
        prefix = self.lm.prefixes[i]
        names = [prefix + n for n, _ in self.lm.layers[i].named_parameters()]
        missing = [n for n in names if n not in self.a.unit_of]
        if missing:
            raise AttnidError(f"internal: no tensor {missing[0]} for layer {i}")
        return {n[len(prefix):]: w for n, w in self._at(names, g, t).items()}

    def _forward(self, rest: Tensors, ids: torch.Tensor, run: Callable[[int, tuple, dict], Any]
                 ) -> torch.Tensor:
        """The loss of transformers' forward with the tables and head ``rest`` and each slot's
        work ``run(layer, args, kwargs)``."""
        with inline(run):
            logits = torch.func.functional_call(self.lm.model, rest, (),
                                                {"input_ids": ids, "use_cache": False}).logits
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).double(),
                                           ids[:, 1:].reshape(-1)) / len(self.alphas)

    def _point(self, g: GroupElement, t: float, ids: torch.Tensor, grad: bool) -> torch.Tensor:
        """The loss at ``t`` on ``ids``; with ``grad``, its gradient pushed into ``g``'s leaves:
        the forward without a graph, keeping each layer's input, stopped after the last layer
        (an untied model's tables give layer 0's input first and are let go: 0.5 GiB of
        float32 at 7B widths not held through the layers);
        the head's part (the forward again, every slot handing back the last layer's output),
        which gives the loss; each layer's, last to first; the tables', through a forward that
        stops at the first slot. Every layer runs ``MICRO_TOKENS`` tokens of ``ids`` at a time
        (whole sequences; in the forward on the weights made once), the weights' gradients of
        each part after the forward summed over them."""
        lm, L = self.lm, self.L
        kept: list[tuple[tuple, dict]] = []
        ran = [0]
        start: torch.Tensor | None = None
        b = ids.shape[0]
        m = self.micro(ids)
        parts = [slice(j, j + m) for j in range(0, b, m)]

        def run(i: int, args: tuple, kwargs: dict) -> Any:
            x = start if i == 0 and start is not None else _hidden(args, kwargs).detach()
            a, kw = _with_hidden(args, kwargs, x)
            w = self._layer(i, g, t)  # made once, run on each part (a 7B layer's MLP on 4,096 tokens
            outs = [torch.func.functional_call(lm.layers[i], w, *_rows((a, kw), p, rows, b))  # is 0.7 GB)
                    for p in parts]
            out = outs[0] if len(outs) == 1 else _joined(outs)
            del w, outs
            ran[0] += 1
            if grad:  # what each layer's part starts from
                kept.append((a, kw))
            if i == L - 1:
                raise _Stop(out)
            return out

        with torch.no_grad():
            if self.a.layout.tied:
                rest = self._rest(g, t)
            else:  # the tables only give layer 0's input: let go before the head is mixed
                tables = self._rest(g, t, [0])
                start = self._start(tables, ids)
                rest = {n: _hollow(w) for n, w in tables.items()}
                del tables
                rest |= self._rest(g, t, sorted({self.a.unit_of[n] for n in self.lm.rest} - {0}))
            rows = self._sequences(rest, ids) if len(parts) > 1 else None
            try:
                self._forward(rest, ids, run)
            except _Stop as s:
                last = s.x
            else:
                raise AttnidError("internal: the forward did not reach the last layer")
        if ran[0] != L:
            raise AttnidError(f"internal: the forward ran {ran[0]} of {L} layers")
        units = {self.a.unit_of[n] for n in rest}
        tail = units - {0} if not self.a.layout.tied else units  # the head reads a tied table
        if grad:
            for n in rest:  # the final norm and head (and a tied table): the head's part's leaves
                if self.a.unit_of[n] in tail:
                    rest[n].requires_grad_()
        loss = torch.zeros((), dtype=torch.float64)
        ups = []
        for p in parts:
            top = _first(last)[p].detach().requires_grad_(grad)
            with torch.set_grad_enabled(grad):
                here = self._forward(rest, ids[p], lambda i, _a, _kw, top=top, last=last: _like(last, top))
                here = here * (len(ids[p]) / b)  # equal lengths: the mean over all tokens
                if grad:
                    here.backward()
            loss = loss + here.detach()
            ups.append(top.grad)
            del here  # its graph's ends hold the leaves, and through them their gradients
        if not grad:
            return loss
        up = torch.cat(ups)
        # a tied table's part of it pulled now and its part through layer 0's input later (the
        # pull is linear in the gradient: the table moved twice instead of [V, d] held)
        cot = {n: w.grad for n, w in rest.items() if w.grad is not None}
        rest.clear()
        del last, top, ups
        self._pull(g, t, cot)
        for i in reversed(range(L)):
            a, kw = kept[i]
            with torch.no_grad():
                w = self._layer(i, g, t)
            for v in w.values():
                v.requires_grad_()
            ups = []
            for p in parts:
                ap, kwp = _rows((a, kw), p, rows, b)
                x = _hidden(ap, kwp).detach().requires_grad_()
                ap, kwp = _with_hidden(ap, kwp, x)
                with torch.enable_grad():
                    out = torch.func.functional_call(lm.layers[i], w, ap, kwp)
                    torch.autograd.backward(_first(out), up[p])
                ups.append(x.grad)
                del out
            up = torch.cat(ups)
            kept[i] = ((), {})
            prefix = lm.prefixes[i]
            cot = {prefix + n: v.grad for n, v in w.items() if v.grad is not None}
            del w, a, kw, ap, kwp, x, ups  # the layer's input (views of it) let go before the pull
            self._pull(g, t, cot)

        with torch.no_grad():
            tables = self._rest(g, t, sorted(units - {L + 1}))
        for w in tables.values():
            w.requires_grad_()
        for p in parts:
            with torch.enable_grad():
                try:
                    self._forward(tables, ids[p], _stop)
                except _Stop as s:
                    if s.x.requires_grad:
                        s.x.backward(up[p])
                else:
                    raise AttnidError("internal: the forward did not reach the first layer")
        cot = {n: w.grad for n, w in tables.items() if w.grad is not None}
        tables.clear()
        self._pull(g, t, cot)
        return loss

    def _start(self, tables: Tensors, ids: torch.Tensor, work: Callable[[int, tuple, dict], Any] = _stop
               ) -> Any:
        """Layer 0's input on ``ids`` from the weights ``tables`` (a forward stopped at the first
        slot); with ``work`` `_arguments`, all its arguments."""
        try:
            self._forward(tables, ids, work)
        except _Stop as s:
            return s.x
        raise AttnidError("internal: the forward did not reach the first layer")

    def _sequences(self, rest: Tensors, ids: torch.Tensor) -> Any:
        """`_per_sequence` of layer 0's arguments (hidden states first) on ``ids``' first
        sequence repeated 2 and 3 times (forwards stopped at the first slot): which arguments
        a part of the batch cuts, read from transformers' own forward rather than guessed from
        shapes (a shared ``[T, ...]`` tensor would look per-sequence where ``T`` is the batch).
        Layer 0's: another layer's arguments of the same place are marked alike (every layer
        is handed the model's masks and positions; `_rows` judges the rest by shape)."""
        return _per_sequence(*(self._start(rest, ids[:1].expand(n, -1), _arguments) for n in (2, 3)))

    def micro(self, ids: torch.Tensor) -> int:
        """Sequences of ``ids`` per part after the forward (`MICRO_TOKENS` tokens, at least one)."""
        return max(1, MICRO_TOKENS // max(1, ids.shape[1]))

    def value(self, g: GroupElement, ids: torch.Tensor) -> torch.Tensor:
        """The objective on ``ids`` (no gradient)."""
        with torch.no_grad():
            return torch.stack([self._point(g, t, ids, grad=False) for t in self.alphas]).sum()

    def backward(self, make: Callable[[], GroupElement], ids: torch.Tensor) -> float:
        """The objective on ``ids``, its gradient added to the parameters ``make()`` makes the
        element from. The element's own graph (a Cayley solve of ``[d, d]``, several
        ``[d, d]`` float64 tensors) is made only for the last backward, after the units'."""
        with torch.no_grad():
            leafy, leaves = _leaves(make())
        total = sum(float(self._point(leafy, t, ids, grad=True)) for t in self.alphas)
        grads = {k: x.grad for k, x in leaves.items() if x.grad is not None}
        del leafy, leaves
        made = [(t, grads[k]) for k, t in _keyed(make()).items() if k in grads and t.requires_grad]
        if made:
            torch.autograd.backward([t for t, _ in made], [d for _, d in made])
        return total

    def full(self, g: GroupElement, ids: torch.Tensor, batch: int = BATCH) -> float:
        """The objective over every chunk of ``ids``, weighted by chunk (as `PathLoss.full`)."""
        parts = [float(self.value(g, ids[i:i + batch])) * len(ids[i:i + batch])
                 for i in range(0, len(ids), batch)]
        return sum(parts) / len(ids)


def refine_units(a: Any, b: Any, lm: LayerwiseLM, calibration: torch.Tensor, steps: int, *,
                 subgroup: str = "full", permuted_stream: bool = False, parts: Sequence[str] | None = None,
                 alphas: Sequence[float] = (0.5,), lr: float = 1e-2, batch: int = BATCH, seed: int = 0,
                 progress: Progress | None = None) -> Refined:
    """`refine.refine` of the aligned B (``b``'s units) against A (``a``'s), through ``lm`` (A's
    model run a layer at a time; its own tables and head are freed), with neither held whole:
    the same steps, objective and element (``Refined.model`` is None: write B moved by
    ``Refined.element`` a unit at a time). Each unit is moved in float64, or in float32 for
    bfloat16 and float16 checkpoints (`attnid.whole.fit.fitter.compute_dtype`), the gradient's
    graph with it."""
    shape = skeleton(b)
    chosen = choose_parts(shape, subgroup, permuted_stream, parts, steps)
    theta = Parameters(shape, chosen, gl=subgroup == "full")
    lm.drop_rest()  # every forward is handed its tables and head
    loss = UnitPathLoss(lm, a, b, alphas, compute_dtype(b.dtype()))
    return descend(theta, chosen, steps, calibration, alphas=alphas, lr=lr, batch=batch, seed=seed,
                   progress=progress, step=loss.backward,
                   full=lambda g: loss.full(GroupElement() if g is None else g, calibration, batch),
                   moved=lambda g: None)
