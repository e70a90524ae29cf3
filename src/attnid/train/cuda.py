"""What the training loop does differently on a GPU, so that it never waits for the GPU
between two logged steps.

Every read of a GPU value on the CPU (``float(loss)``, ``.item()``, a plain ``.to(device)`` of a
batch) waits until the GPU has done everything queued before it. Alone on a GPU that costs the
launch queue; with several runs sharing one GPU (each its own process, the GPU time-sliced
between them) every wait also lasts until the other runs' turns are over. So on a GPU the
loop copies its batches without waiting, reads the loss only at a logged step, and the Monitor
measures a CPU copy of the attention layers (:class:`HostMirror`: one read back before and
one after a logged update, the metrics in float64 on the CPU). :class:`GraphedLoss` replays
the forward and backward pass as one captured CUDA graph, which spares the launch of each of
their few hundred kernels.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from attnid.train.model import GPT


class HostMirror:
    """A CPU copy of every attention layer of ``model`` (``mirror.layers``, for a `Monitor`),
    brought up to date by :meth:`pull` with one read back."""

    def __init__(self, model: GPT) -> None:
        self.sources = [b.attn for b in model.blocks]
        self.layers = nn.ModuleList(copy.deepcopy(a).to("cpu") for a in self.sources)
        self._params = [(p, q) for a, b in zip(self.sources, self.layers, strict=True)
                        for p, q in zip(a.parameters(), b.parameters(), strict=True)]

    @torch.no_grad()
    def pull(self, *, grads: bool = False) -> None:
        """Copy the weights (and, with ``grads``, their gradients) into the mirror."""
        tensors = [p for p, _ in self._params]
        if grads:
            tensors += [p.grad if p.grad is not None else torch.zeros_like(p) for p, _ in self._params]
        flat = torch.cat([t.detach().reshape(-1) for t in tensors]).to("cpu")  # the one wait
        pieces = iter(flat.split([t.numel() for t in tensors]))
        for _, q in self._params:
            q.copy_(next(pieces).view_as(q))
        if grads:
            for _, q in self._params:
                q.grad = next(pieces).view_as(q).clone()


class GraphedLoss:
    """The training loss's forward and backward pass on a fixed-shape batch, captured once as a
    CUDA graph (after three warm-up passes on a side stream, as PyTorch's documentation asks)
    and replayed by each call: the gradients land in the parameters' ``.grad`` (which the loop
    must not reset between calls) and the loss in :attr:`loss`, overwritten by the next call.
    Dropout draws fresh masks at each replay."""

    def __init__(self, model: nn.Module, batch_size: int, block_size: int, device: str) -> None:
        self.x = torch.zeros(batch_size, block_size, dtype=torch.long, device=device)
        self.y = torch.zeros_like(self.x)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                model.zero_grad(set_to_none=True)
                model(self.x, self.y)[1].backward()
        torch.cuda.current_stream().wait_stream(side)
        model.zero_grad(set_to_none=True)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.loss = model(self.x, self.y)[1]
            self.loss.backward()

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.x.copy_(x, non_blocking=True)
        self.y.copy_(y, non_blocking=True)
        self.graph.replay()
        return self.loss
