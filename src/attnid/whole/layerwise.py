"""A Hugging Face model run one decoder layer at a time over tensors streamed from a checkpoint
(or a model in memory), at one or many points of the straight path between two of them: what
`attnid barrier` measures its losses with and `attnid align --calibration` collects its
activations with, holding one layer's weights (and the hidden states of the chunks in flight),
never a whole model.

The transformers model is built without its decoder layers (its embeddings, final norm, head
and position buffers real), and each layer's place in it is taken by a *slot*. Each (point,
batch) pair runs a *work* function (the model's own ``forward``, and what is kept of it) in a
thread of its own, which stops at every slot until the driver has put that layer's weights, at
that point of the path, into the one real layer module; only one thread runs at a time. So
the driver streams the tensors layer by layer (the outer loop) while every forward is
transformers' own code: masks, positions and each layer's inputs are whatever the model passes,
for any family. The weights at a point are ``(1 - t) A + t B`` in the model's dtype, rounded
as `attnid.checkpoint.align.interpolate` rounds them (exact at both ends).

The hidden states of all points and chunks of a *group* of chunks are held together; groups
are sized so they stay under :data:`HIDDEN_BUDGET` bytes (but hold at least one chunk), in
whole batches when they hold more than one, with at most :data:`MAX_GATES` forwards (threads)
in flight, and each group streams the layers once (a 7B model's 256-token chunks at 11 points
in float32: 3 chunks a group). A group smaller than a batch runs smaller forwards, which in
float32 can round differently from the whole model's batches.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import torch
from torch import nn

from attnid.errors import AttnidError
from attnid.whole.transforms.layout import Layout

HIDDEN_BUDGET = 2**29  # bytes of hidden states (3 per chunk and point: embeddings, stream, a layer's output)
MAX_GATES = 32  # forwards in flight (threads) at most, unless the points alone are more

STEP = 2**24  # elements of B converted at a time while interpolating

R = TypeVar("R")
Work = Callable[[nn.Module, torch.Tensor], R]  # (the model, token chunks [b, T]) -> what is kept
_here = threading.local()  # the point each forward's thread runs at


def point() -> int:
    """The index (into ``ts`` of `LayerwiseLM.run`) of the point whose forward is running, for a
    hook on the layers that keeps each point's activations apart."""
    return int(_here.point)


def forwards_per_point(points: int) -> int:
    """Forwards (threads) in flight at each of ``points`` points: `MAX_GATES` shared, one at least."""
    return max(1, MAX_GATES // points)


def group_size(T: int, width: int, dtype: torch.dtype, points: int, batch: int, budget: int | None = None
               ) -> int:
    """Chunks of ``T`` tokens a group holds (see the module): every point's hidden states under
    ``budget`` bytes (None: `HIDDEN_BUDGET`), at most `MAX_GATES` forwards, whole batches when
    more than one."""
    per_chunk = 3 * T * width * torch.finfo(dtype).bits // 8 * points
    group = max(1, (HIDDEN_BUDGET if budget is None else budget) // per_chunk)
    group = min(group, batch * forwards_per_point(points))  # threads: one per point and batch
    if group > batch:
        group -= group % batch  # whole batches: the same forwards as a run without groups
    return group


class _Gate(Generic[R]):
    """One (point, batch) forward, run in its own thread and stopped at every slot."""

    def __init__(self, run: Callable[[], R]) -> None:
        self.go, self.parked = threading.Semaphore(0), threading.Semaphore(0)
        self.layer: nn.Module | None = None
        self.at = -1  # the slot it waits at; -1: not started; None once finished
        self.result: R | None = None
        self.error: BaseException | None = None
        self.cancelled = False
        self.thread = threading.Thread(target=self._body, args=(run,), daemon=True)
        self.thread.start()

    def _body(self, run: Callable[[], R]) -> None:
        self.go.acquire()
        _CURRENT.gate = self
        try:
            if self.cancelled:
                return
            with torch.no_grad():
                self.result = run()
        except _CancelledError:
            pass
        except BaseException as e:  # handed to the driver, which raises it
            self.error = e
        finally:
            self.at = None  # type: ignore[assignment]
            self.parked.release()

    def resume(self, layer: nn.Module | None) -> None:
        """Run until the next slot (or the end), with ``layer`` for the slot it waits at."""
        self.layer = layer
        self.go.release()
        self.parked.acquire()
        if self.error is not None:
            raise self.error

    def wait_at(self, index: int) -> nn.Module:
        """Called in the gate's thread: park at slot ``index`` until the driver resumes it."""
        self.at = index
        self.parked.release()
        self.go.acquire()
        if self.cancelled or self.layer is None:
            raise _CancelledError
        return self.layer

    def cancel(self) -> None:
        """Let a thread that has not finished end (a failed run: none left waiting)."""
        if self.at is not None:
            self.cancelled = True
            self.go.release()


_CURRENT = threading.local()


class _Inline:
    """Stands where a forward's gate stands: each slot runs ``run(index, args, kwargs)`` at once."""

    def __init__(self, run: Callable[[int, tuple, dict], Any]) -> None:
        self.run = run

    def wait_at(self, index: int) -> Callable[..., Any]:
        return lambda *args, **kwargs: self.run(index, args, kwargs)


@contextmanager
def inline(run: Callable[[int, tuple, dict], Any]) -> Iterator[None]:
    """Within it, a forward of this thread through a `LayerwiseLM`'s model runs
    ``run(index, args, kwargs)`` at each slot, there and then (one forward, no threads:
    `attnid.whole.align.refine_units` runs each layer with a graph or without)."""
    before = getattr(_CURRENT, "gate", None)
    _CURRENT.gate = _Inline(run)
    try:
        yield
    finally:
        _CURRENT.gate = before


class _CancelledError(Exception):
    """Ends a forward whose run failed elsewhere."""


class _Slot(nn.Module):
    """A decoder layer's place in the model: a forward through it waits for the driver, then
    runs the real layer the driver hands over on the same inputs. Attributes it lacks are the
    layer's (a model's forward may read one, as Qwen2's ``attention_type`` in some releases);
    the layer is not a submodule, so it is never part of the model's own weights."""

    def __init__(self, index: int, layer: nn.Module) -> None:
        super().__init__()
        self.index = index
        self.__dict__["_layer"] = layer

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_layer"], name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _CURRENT.gate.wait_at(self.index)(*args, **kwargs)


class Source(Protocol):
    """What the layers are read from: a checkpoint's units (`attnid.checkpoint.units.Units`) or a
    model in memory (`attnid.whole.fit.source.TensorSource`)."""

    layout: Layout
    config: dict[str, Any]
    unit_of: Mapping[str, int]  # state_dict name -> unit (0 tables, 1..L layer, L + 1 the rest)

    def tensor(self, name: str, *, check: bool = True) -> torch.Tensor: ...


@dataclass(frozen=True)
class Segment:
    """The straight path from ``a`` to ``b`` (one architecture, `attnid.checkpoint.align.open_pair`)."""

    a: Source
    b: Source

    def put(self, into: dict[str, torch.Tensor], t: float) -> None:
        """Copy ``(1 - t) A + t B`` of each tensor named in ``into`` into it (in its dtype,
        rounded as `attnid.checkpoint.align.interpolate` rounds for sources stored in that dtype
        or a narrower one; exact at both ends), one tensor read at a time. NaN or Inf is
        refused as the sources refuse it, but checked on the result (no float32 copy of a
        bfloat16 table just for the check)."""
        for n, p in into.items():
            if t == 0.0 or t == 1.0:
                p.copy_((self.a if t == 0.0 else self.b).tensor(n, check=False))
            else:
                p.copy_(self.a.tensor(n, check=False)).mul_(1.0 - t)
                y, flat = self.b.tensor(n, check=False).reshape(-1), p.view(-1)
                for s in range(0, y.numel(), STEP):  # t B a block at a time: no float32 copy of B's table
                    flat[s:s + STEP].add_(y[s:s + STEP].to(p.dtype) * t)
            self.check(n, p, t)

    def check(self, n: str, p: torch.Tensor, t: float) -> None:
        """Refuse tensor ``n`` at point ``t``, ``p``, if it holds NaN or Inf (as the sources refuse
        it, naming the file)."""
        if not (torch.isfinite(p.sum()) or torch.isfinite(p).all()):  # a sum overflows only rarely
            for src in (self.a, self.b):
                src.tensor(n)  # the source's own refusal, naming its file
            raise AttnidError(f"tensor {n} is not finite at alpha {t}")


class LayerwiseLM:
    """``units``' model with its head (its config; ``dtype``; transformers' default attention,
    or ``eager``) with its decoder layers run one at a time (see the module).

    ``head=False`` is for work that reads the layers only (``model.base_model``, at the ends of a
    path): the output projection is not kept (an untied one's weights go back to the meta device;
    the rest of a head, BERT's transform, stays) and a plain ``nn.Embedding`` table is held as
    the source gives it, its rows converted to ``dtype`` as they are looked up, which is the
    same as converting the table first. At 7B widths in float64 that holds 0.26 GB (bfloat16)
    of the 2.1 GB the table and head take."""

    def __init__(self, units: Source, dtype: torch.dtype = torch.float32, *, eager: bool = False,
                 head: bool = True) -> None:
        from attnid.adapters.base import build_from, hf_config, hf_model_class

        lay = units.layout
        self.L, self.dtype = len(lay.layers), dtype
        self.prefixes = lay.layers
        conf = hf_config(units.config)
        if eager:
            conf._attn_implementation = "eager"
        self.width = int(conf.hidden_size)
        cls = hf_model_class(units.config)

        def build() -> nn.Module:
            return build_from(cls, conf, units.config).eval()  # no dropout

        with torch.device("meta"):  # the layers, without memory until each is run
            full = build()
        self.layers = [full.get_submodule(p.rstrip(".")) for p in lay.layers]
        for layer in self.layers:
            if any(True for _ in layer.buffers()):
                import transformers

                raise AttnidError(f"transformers {transformers.__version__}'s {type(layer).__name__} keeps "
                                  "buffers in its layers: running it a layer at a time needs a release that "
                                  "keeps them in the model (transformers 5)")
        kept = conf.num_hidden_layers
        conf.num_hidden_layers = 0  # the rest of the model built for real: embeddings, head, positions
        try:  # (everything else of the config as it is: Qwen2 reads layer_types at init)
            self.model = build().to(dtype)
        finally:
            conf.num_hidden_layers = kept
        container = self.model.get_submodule(lay.layers[0].rstrip(".").rsplit(".", 1)[0])
        if not isinstance(container, nn.ModuleList) or len(container):
            raise AttnidError(f"internal: {type(self.model).__name__}'s layers are not an empty ModuleList "
                              "when built without them")
        container.extend(_Slot(i, layer) for i, layer in enumerate(self.layers))
        params = dict(self.model.named_parameters())  # a tied head once, as its table
        rest = {n for n in units.unit_of if not n.startswith(self.prefixes)}  # BERT's embedding
        # LayerNorm among them: unit 1's, but outside the layer
        self.rest = {n: p.data for n, p in params.items() if n in rest}  # what the checkpoint gives
        given = {p.data_ptr() for p in self.rest.values()}
        missing = [n for n, p in params.items() if p.data_ptr() not in given]  # nor tied to what it gives
        if missing:
            raise AttnidError(f"internal: no tensor for {missing[0]} in the checkpoint's tables and head")
        self.dropped = False  # drop_rest: each forward is handed the tables and head
        self.table: tuple[str, nn.Embedding] | None = None  # held as the source gives it (head=False)
        if not head:
            self._narrow()

    def drop_rest(self) -> None:
        """Free the tables, final norm and head this model holds, for work that hands them to
        every forward itself (`torch.func.functional_call`; `rest` keeps their names): 1 GB at 7B
        widths in float32."""
        for p in self.model.parameters():
            p.data = p.data.new_empty(0)
        self.rest = {n: t.new_empty(0) for n, t in self.rest.items()}
        self.dropped = True

    def _narrow(self) -> None:
        """Drop an untied head and hold a plain embedding table as the source stores it."""
        by_ptr = {p.data_ptr(): n for n, p in self.rest.items()}
        inp, out = self.model.get_input_embeddings(), self.model.get_output_embeddings()
        if isinstance(out, nn.Module) and out.weight.data_ptr() != inp.weight.data_ptr():
            for p in out.parameters():
                self.rest.pop(by_ptr.get(p.data_ptr(), ""), None)
            out.to(device="meta")
        name = by_ptr.get(inp.weight.data_ptr())
        if type(inp) is nn.Embedding and name is not None:  # a subclass may scale in its dtype (Gemma 3)
            del self.rest[name]
            dtype = self.dtype
            inp.register_forward_hook(lambda _, __, y: y.to(dtype))
            inp.weight.data = inp.weight.data.new_empty(0)  # the source's, at each group's start
            self.table = (name, inp)

    def _set_rest(self, path: Segment, t: float, table: bool = True) -> None:
        """The tables, final norm and head at point ``t`` (a table held as stored only with
        ``table``: only the embeddings read it, and the head is not run then)."""
        if self.dropped:
            raise AttnidError("internal: this model's tables and head were dropped (drop_rest)")
        if self.table is not None and t not in (0.0, 1.0):
            raise AttnidError("internal: a table held as stored is only an end of the path")
        path.put(self.rest, t)
        if self.table is not None and table:
            name, emb = self.table
            w = (path.a if t == 0.0 else path.b).tensor(name, check=False)
            path.check(name, w, t)
            emb.weight.data = w

    def _set_layer(self, path: Segment, i: int, t: float) -> None:
        prefix = self.prefixes[i]
        own = {prefix + n: p.data for n, p in self.layers[i].named_parameters()}
        if set(own) != {n for n in path.a.unit_of if n.startswith(prefix)}:
            raise AttnidError(f"internal: layer {i}'s checkpoint tensors are not its parameters")
        path.put(own, t)

    def run(self, path: Segment, ts: Sequence[float], ids: torch.Tensor, batch: int, work: Work[R],
            progress: Callable[[str], None] | None = None, budget: int | None = None) -> list[list[R]]:
        """``work(model, chunks)`` at each point ``ts`` of ``path`` on the token chunks ``ids
        [n, T]``, ``batch`` chunks at a time (fewer when a group holds fewer): per point, the
        results in the chunks' order. ``work`` sees transformers' model, but its layers are
        slots: outputs transformers records with hooks on its layer classes
        (``output_hidden_states``, ``output_attentions``) come back empty; hook the layers
        (`layers`) instead, as `attnid.whole.align.activations.collect` does. ``budget``: bytes of
        hidden states a group may hold (None: `HIDDEN_BUDGET`)."""
        n, T = int(ids.shape[0]), int(ids.shape[1])
        group = group_size(T, self.width, self.dtype, len(ts), batch, budget)
        out: list[list[R]] = [[] for _ in ts]
        for g in range(0, n, group):
            chunks = ids[g:g + group]
            if progress is not None and n > group:
                progress(f"chunks {g + 1}-{g + len(chunks)} of {n}")
            batches = [chunks[s:s + batch] for s in range(0, len(chunks), batch)]
            for k, part in enumerate(self._group(path, ts, batches, work, progress)):
                out[k].extend(part)
        return out

    def _at(self, k: int, work: Work[R], x: torch.Tensor) -> R:
        """``work`` on ``x`` in its forward's own thread, which `point` then says is at ``k``."""
        _here.point = k
        return work(self.model, x)

    def _group(self, path: Segment, ts: Sequence[float], chunks: list[torch.Tensor], work: Work[R],
               progress: Callable[[str], None] | None) -> list[list[R]]:
        gates: list[list[_Gate[R]]] = []
        try:
            for k, t in enumerate(ts):
                self._set_rest(path, t)
                gates.append([])
                for x in chunks:  # each gate kept as soon as its thread runs: cancelled on failure
                    gates[-1].append(_Gate(lambda x=x, k=k: self._at(k, work, x)))
                for gate in gates[-1]:
                    gate.resume(None)  # embeddings, then parked at slot 0
            for i, layer in enumerate(self.layers):
                layer.to_empty(device="cpu")
                layer.to(self.dtype)
                try:
                    for k, t in enumerate(ts):
                        self._set_layer(path, i, t)
                        if i == self.L - 1:
                            self._set_rest(path, t, table=False)  # the forwards run on to the head
                        for gate in gates[k]:
                            if gate.at != i:
                                raise AttnidError(f"internal: a forward skipped layer {i}")
                            gate.resume(layer)
                finally:
                    layer.to(device="meta")
                if progress is not None:
                    progress(f"layer {i + 1}/{self.L} at {len(ts)} points")
            if any(g.at is not None for row in gates for g in row):
                raise AttnidError("internal: a forward did not reach its end")
            return [[g.result for g in row] for row in gates]  # type: ignore[misc]
        finally:
            for row in gates:  # a failed run: no thread left waiting
                for g in row:
                    g.cancel()
