"""The arbiter's working precision: a module's own function, computed in float64.

Hugging Face computes RMSNorm, softmax (some families' attention scores) and rotary tables
in float32 even inside a float64 model. That rounding (about 1e-7) hides exact symmetries:
a direction that is exactly null in the function reads as a singular value at 1e-7, above
any threshold that separates float64 rounding from real rank (docs/theory.md §12.6). The
remedy is not a looser threshold but the same function without the downcasts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

_F32 = (torch.float32, torch.float16, torch.bfloat16)


class Float64Mode(TorchFunctionMode):
    """Every cast to a lower floating precision (``.float()``, ``.to(float32)``, ``dtype=``)
    stays float64: the model's own function, computed without rounding.

    >>> with Float64Mode():
    ...     torch.ones(2, dtype=torch.float64).float().dtype
    torch.float64
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in (torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16):
            return args[0].to(torch.float64)
        if kwargs.get("dtype") in _F32:
            kwargs["dtype"] = torch.float64
        args = tuple(torch.float64 if isinstance(a, torch.dtype) and a in _F32 else a for a in args)
        return func(*args, **kwargs)


def in_float64(forward: Callable[[nn.Module, torch.Tensor], torch.Tensor]
               ) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    """``forward`` run under :class:`Float64Mode`."""

    def run(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with Float64Mode():
            return forward(module, x)

    return run
