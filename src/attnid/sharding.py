"""One parameter, whole or split across processes: find it, read it whole, write it back.

Sharded training keeps one slice of every parameter on each process. attnid measures and
corrects whole attention layers, so it needs, one layer at a time, the whole of each tensor
and a way to store a new value back into each process's slice. A :class:`Placement` says how
for one parameter:

* :class:`Whole`: the tensor is all here (one process, DDP, DeepSpeed ZeRO-1/2, whose
  optimizer's float32 copy is written too).
* :class:`DTensorShards`: a ``DTensor`` (FSDP2 ``fully_shard``, tensor parallelism):
  ``full_tensor()`` to gather, `torch.distributed.tensor.distribute_tensor` without
  communication (every process holds the same whole) to find this process's slice.
* :class:`FlatShards`: FSDP1 with ``use_orig_params=True``: each process holds a contiguous
  run of the flattened tensor (possibly empty), in rank order.
* :class:`ZeroShards`: DeepSpeed ZeRO-3: each process holds one equal, zero-padded run of the
  flattened tensor (``ds_tensor``); the optimizer's float32 copy is written too.

Gathering is a collective: every process must ask for the same tensors in the same order
(the Monitor, the Corrector and the Trainer callback run on every rank and do).
:func:`resolve` finds a parameter again by its path from the model, through wrappers that
forward attribute access (FSDP1, ``torch.compile``, activation checkpointing), so a tensor
replaced since the layer was found (``fully_shard``, ``to_empty``, ``load_state_dict(assign=True)``)
is the one read.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping

import torch
from torch import nn

from attnid.errors import AttnidError

# path parts that wrappers insert and forward through: dropped from the names attnid keeps
WRAPPER_PARTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")


def clean_name(name: str) -> str:
    """A parameter name without the parts wrappers insert (``model.layers.0.self_attn...``)."""
    return ".".join(p for p in name.split(".") if p not in WRAPPER_PARTS)


def resolve(root: nn.Module, path: str) -> tuple[torch.Tensor, nn.Module | None]:
    """The parameter at ``path`` (a :func:`clean_name`) in ``root`` now, and the innermost
    FSDP1 unit on the way to it (None when there is none)."""
    FSDP = _fsdp1_class()
    *mods, leaf = path.split(".")
    mod, unit = root, root if isinstance(root, FSDP) else None
    for part in mods:
        nxt = getattr(mod, part, None)
        if not isinstance(nxt, nn.Module):
            raise AttnidError(f"the model no longer has a module {path.rpartition('.')[0]!r} "
                              f"(its attention layers were replaced since they were found)")
        mod = nxt
        if isinstance(mod, FSDP):
            unit = mod
    p = getattr(mod, leaf, None)
    if isinstance(p, torch.Tensor) and not isinstance(p, nn.Parameter):
        # a parameter turned plain tensor: a view FSDP1 (without use_orig_params) or a
        # parametrization computes; writing to it would not reach what trains
        raise AttnidError(f"{path!r} is no longer a parameter but a tensor computed from one, "
                          f"which attnid cannot write to (a parametrization?); {HIDDEN}")
    if not isinstance(p, torch.Tensor):
        raise AttnidError(f"the model no longer has a parameter {path!r}")
    return p, unit


HIDDEN = ("FSDP without use_orig_params=True hides the attention layers' parameters in flat "
          "buffers attnid cannot read: wrap with use_orig_params=True, or shard with FSDP2's "
          "fully_shard")


def hidden_by_fsdp(model: nn.Module) -> bool:
    """Whether ``model`` holds FSDP1 flat parameters (FSDP without ``use_orig_params``)."""
    return any(n.rpartition(".")[2] == "_flat_param" for n, _ in model.named_parameters())


class Placement:
    """How one parameter lies across processes (base class: it is all here)."""

    sharded = False

    def __init__(self, param: torch.Tensor, shape: tuple[int, ...]) -> None:
        self.param, self.shape = param, tuple(shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.param.dtype

    def piece(self) -> torch.Tensor:
        """This process's part of the current values (a view: no copy, no communication)."""
        return self.param.detach()

    def full(self, piece: torch.Tensor | None = None) -> torch.Tensor:
        """The whole tensor from every process's ``piece`` (default: the current one);
        collective when sharded."""
        return self.piece() if piece is None else piece

    def write_(self, full: torch.Tensor) -> None:
        """Store this process's part of ``full`` (the same on every process) in the parameter,
        and in the optimizer's float32 copy when DeepSpeed ZeRO-1/2 keeps one (else its next
        step would start from the old value)."""
        with torch.no_grad():
            self.piece().copy_(full)
        if getattr(self.param, "_hp_mapping", None) is not None:
            from deepspeed.utils import safe_set_full_fp32_param

            safe_set_full_fp32_param(self.param, full.float())

    def grad(self) -> torch.Tensor | None:
        """The whole gradient (None when there is none); collective when sharded."""
        return self.param.grad


class Whole(Placement):
    """The whole tensor is on this process."""


class DTensorShards(Placement):
    """A ``DTensor`` parameter (FSDP2, tensor parallelism)."""

    sharded = True

    def piece(self) -> torch.Tensor:
        return self.param.to_local().detach()

    def full(self, piece: torch.Tensor | None = None) -> torch.Tensor:
        if piece is None:
            return self.param.detach().full_tensor()
        return self._dtensor(piece).full_tensor()

    def _dtensor(self, local: torch.Tensor):
        from torch.distributed.tensor import DTensor

        p = self.param
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                  shape=p.shape, stride=p.stride())

    def write_(self, full: torch.Tensor) -> None:
        from torch.distributed.tensor import distribute_tensor

        p = self.param
        # every process holds the same ``full``: each cuts its own slice, nothing is sent
        mine = distribute_tensor(full.to(p.dtype), p.device_mesh, p.placements, src_data_rank=None)
        with torch.no_grad():
            self.piece().copy_(mine.to_local())

    def grad(self) -> torch.Tensor | None:
        g = self.param.grad
        return None if g is None else g.full_tensor()


def _all_gather(piece: torch.Tensor | None, process_group, sizes: list[int], like: torch.Tensor
                ) -> torch.Tensor | None:
    """Every process's ``piece`` (of the given sizes, in rank order) concatenated; a process
    without one (None) takes part with zeros, and None comes back when no process had one."""
    import torch.distributed as dist

    width = max(sizes)
    buf = torch.zeros(width + 1, dtype=like.dtype, device=like.device)  # last entry: "present"
    if piece is not None:
        buf[: piece.numel()] = piece.reshape(-1)
        buf[-1] = 1
    out = [torch.empty_like(buf) for _ in sizes]
    dist.all_gather(out, buf, group=process_group)
    if not any(bool(t[-1]) for t in out):
        return None
    return torch.cat([t[:n] for t, n in zip(out, sizes, strict=True)])


class FlatShards(Placement):
    """FSDP1 with ``use_orig_params=True``: a contiguous run of the flattened tensor here.

    ``sizes``: every process's run length, in rank order (:func:`placements` gathers them
    once per layer)."""

    sharded = True

    def __init__(self, param: torch.Tensor, shape: tuple[int, ...], process_group, sizes: list[int],
                 rank: int) -> None:
        super().__init__(param, shape)
        self.process_group, self.sizes, self.rank = process_group, sizes, rank

    def full(self, piece: torch.Tensor | None = None) -> torch.Tensor:
        piece = self.piece() if piece is None else piece
        return _all_gather(piece, self.process_group, self.sizes, piece).view(self.shape)

    def write_(self, full: torch.Tensor) -> None:
        start = sum(self.sizes[: self.rank])
        with torch.no_grad():
            self.piece().copy_(full.reshape(-1)[start: start + self.sizes[self.rank]])

    def grad(self) -> torch.Tensor | None:
        # a process whose run is empty may hold no gradient: it takes part all the same
        g = _all_gather(self.param.grad, self.process_group, self.sizes, self.param)
        return None if g is None else g.view(self.shape)


class ZeroShards(Placement):
    """DeepSpeed ZeRO-3: an equal, zero-padded run of the flattened tensor on every process."""

    sharded = True

    @property
    def dtype(self) -> torch.dtype:
        return self.param.ds_tensor.dtype

    def piece(self) -> torch.Tensor:
        return self.param.ds_tensor.detach()

    def full(self, piece: torch.Tensor | None = None) -> torch.Tensor:
        import torch.distributed as dist

        piece = self.piece() if piece is None else piece
        process_group = self.param.ds_process_group
        out = torch.empty(piece.numel() * dist.get_world_size(process_group), dtype=piece.dtype,
                          device=piece.device)
        dist.all_gather_into_tensor(out, piece.reshape(-1), group=process_group)
        return out[: math.prod(self.shape)].view(self.shape)

    def write_(self, full: torch.Tensor) -> None:
        import torch.distributed as dist

        local = self.param.ds_tensor
        n = local.numel()
        start = n * dist.get_rank(self.param.ds_process_group)
        flat = full.reshape(-1)
        mine = torch.zeros(n, dtype=full.dtype, device=local.device)
        mine[: max(0, min(n, flat.numel() - start))] = flat[start: start + n]
        with torch.no_grad():
            local.copy_(mine)
            if self.param.numel() == flat.numel():  # also present whole: a persistent (small)
                self.param.data.copy_(full.view(self.param.shape))  # or gathered parameter
        if getattr(self.param, "_z3_optimizer", None) is not None:  # the optimizer's float32 copy
            from deepspeed.utils import safe_set_local_fp32_param

            safe_set_local_fp32_param(self.param, mine.float())

    def grad(self) -> torch.Tensor | None:
        from deepspeed.utils import safe_get_full_grad

        g = safe_get_full_grad(self.param)
        return None if g is None else g.reshape(self.shape)


def placements(params: Mapping[str, tuple[torch.Tensor, nn.Module | None]],
               shapes: Mapping[str, tuple[int, ...]], paths: Mapping[str, str]) -> dict[str, Placement]:
    """How each of one layer's parameters lies (``params``: name -> (tensor, FSDP1 unit) from
    :func:`resolve`; ``shapes``: the whole shapes; ``paths``: where each lives, for errors).
    Collective for FSDP1 (one exchange of run lengths per layer); an unknown layout raises
    `attnid.errors.AttnidError`."""
    out: dict[str, Placement] = {}
    flat: dict[str, tuple[torch.Tensor, nn.Module]] = {}
    for n, (p, unit) in params.items():
        shape = tuple(shapes[n])
        if _is_dtensor(p):
            out[n] = DTensorShards(p, shape)
            found = tuple(p.shape)
        elif hasattr(p, "ds_id") and hasattr(p, "ds_tensor"):
            out[n] = ZeroShards(p, shape)
            found = tuple(p.ds_shape)
        elif getattr(p, "_fsdp_flattened", False) and unit is not None and _fsdp_sharded(unit):
            flat[n] = (p, unit)
            continue
        else:
            out[n] = Whole(p, shape)
            found = tuple(p.shape)
        if found != shape:
            raise AttnidError(_changed(paths[n], p, found, shape))
    if flat:
        out.update(_flat_placements(flat, shapes, paths))
    return {n: out[n] for n in params}


def _flat_placements(flat: dict[str, tuple[torch.Tensor, nn.Module]], shapes: Mapping[str, tuple[int, ...]],
                     paths: Mapping[str, str]) -> dict[str, FlatShards]:
    import torch.distributed as dist

    process_groups = {id(u.process_group): u.process_group for _, u in flat.values()}
    if len(process_groups) != 1:
        raise AttnidError("one attention layer spread over several FSDP process groups")
    process_group = next(iter(process_groups.values()))
    mine = torch.tensor([p.numel() for p, _ in flat.values()], dtype=torch.int64)
    world = dist.get_world_size(process_group)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=process_group)
    rank = dist.get_rank(process_group)
    out = {}
    for k, (n, (p, _)) in enumerate(flat.items()):
        sizes = [int(e[k]) for e in every]
        shape = tuple(shapes[n])
        if sum(sizes) != math.prod(shape):
            raise AttnidError(_changed(paths[n], p, (sum(sizes),), shape))
        out[n] = FlatShards(p, shape, process_group, sizes, rank)
    return out


def _fsdp1_class() -> type | tuple:
    """FSDP1's wrapper class, or ``()`` (matches nothing) when nothing has imported it: no
    model can be wrapped by it then, and attnid need not import torch.distributed."""
    mod = sys.modules.get("torch.distributed.fsdp")
    return getattr(mod, "FullyShardedDataParallel", ()) if mod is not None else ()


def _is_dtensor(p: torch.Tensor) -> bool:
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(p, mod.DTensor)


def _fsdp_sharded(unit: nn.Module) -> bool:
    """Whether an FSDP1 unit splits its parameters (NO_SHARD keeps them whole)."""
    from torch.distributed.fsdp import ShardingStrategy

    return getattr(unit, "sharding_strategy", None) != ShardingStrategy.NO_SHARD


def _changed(name: str, p: torch.Tensor, found: tuple[int, ...], shape: tuple[int, ...]) -> str:
    return (f"parameter {name} has shape {list(found)} ({type(p).__name__}), but its layer needs "
            f"{list(shape)}: the model was changed in a way attnid cannot follow (a sharding "
            f"wrapper attnid does not know?); attnid reads plain tensors, DTensors (FSDP2), "
            f"FSDP1 with use_orig_params=True and DeepSpeed ZeRO-3 parameters")
