"""Optimizer family: the AdamW parameter update (`tileops.optim.AdamW` runs it).

`AdamwStepFwdOp(lr=..., step=...)(param, grad, exp_avg, exp_avg_sq)` updates the three
state tensors in place and returns them, as torch's optimizers do; the custom op
`torch.ops.tileops.adamw_step_fwd` (and the `cached()` instances behind it) returns updated
copies instead, as its pure schema promises. `update_` is the optimizer's path: the same
in-place update with this step's learning rate and step count given per call, so one op
object serves a param group for the whole run.

Every tensor must be contiguous (the update walks the storage as one flat vector); the
vector width follows the four tensors' addresses (16 bytes when all are 16-byte aligned).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import TileOpsValueError, op_error
from ..kernels.base import Kernel
from ..kernels.optimizer import AdamWKernel
from ..manifest.spec import DTYPE_NAMES
from .base import InPlaceByDefault, Op

_KERNELS = {"adamw": AdamWKernel}
# elements a launch: the kernel's int32 indices stay below 2^31 (larger tensors take slices)
LAUNCH_ELEMENTS = 1 << 30
_NAMES = ("param", "grad", "exp_avg", "exp_avg_sq")


def _vector_width(tensors: tuple[torch.Tensor, ...]) -> int:
    """Elements a vector access: 16 bytes, halved until every tensor's address allows it."""
    size = tensors[0].element_size()
    vec = 16 // size
    while vec > 1 and any(t.data_ptr() % (vec * size) for t in tensors):
        vec //= 2
    return vec


class AdamwStepFwdOp(InPlaceByDefault, Op):
    """One AdamW update of one parameter tensor (torch.optim.AdamW's math, no amsgrad)."""

    kernel_map = _KERNELS

    def __init__(self, *, lr: float = 1e-3, beta1: float = 0.9, beta2: float = 0.999,
                 eps: float = 1e-8, weight_decay: float = 1e-2, step: int = 1,
                 maximize: bool = False,
                 kernel_map: Mapping[str, type[Kernel]] | None = None, tune: bool = False):
        super().__init__(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                         step=step, maximize=maximize, kernel_map=kernel_map, tune=tune)

    def forward(self, param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self.inplace:
            param, exp_avg, exp_avg_sq = (t.clone(memory_format=torch.contiguous_format)
                                          for t in (param, exp_avg, exp_avg_sq))
        self._launch(param, grad, exp_avg, exp_avg_sq, self.lr, self.step)
        return param, exp_avg, exp_avg_sq

    def update_(self, param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor, lr: float, step: int) -> None:
        """The update in place with this call's `lr` and `step` (the op's own are unused)."""
        if self.validate((param, grad, exp_avg, exp_avg_sq)) is not None:
            return  # meta tensors: checked, nothing to update (CUDA: cached per signature)
        if not lr >= 0.0:
            raise op_error(TileOpsValueError, self.spec.op_name, "lr", "a value >= 0", lr)
        if step < 1:
            raise op_error(TileOpsValueError, self.spec.op_name, "step", "a count >= 1", step)
        self._launch(param, grad, exp_avg, exp_avg_sq, lr, step)

    def _launch(self, param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor, lr: float, step: int) -> None:
        tensors = (param, grad, exp_avg, exp_avg_sq)
        for name, t in zip(_NAMES, tensors, strict=True):
            if not t.is_contiguous():
                raise op_error(TileOpsValueError, self.spec.op_name, name,
                               "a contiguous tensor", f"strides {tuple(t.stride())} for shape "
                               f"{tuple(t.shape)}")
        n = param.numel()
        if n == 0:
            return
        vec = _vector_width(tensors)
        dtype = param.dtype
        kernel = self.memo_kernel(("adamw", param.device, dtype, vec), "adamw", param.device,
                                  lambda: {"dtype": DTYPE_NAMES[dtype], "vec": vec})
        scalars = (-1.0 if self.maximize else 1.0, 1.0 - lr * self.weight_decay, self.beta1,
                   self.beta2, self.eps, lr / (1.0 - self.beta1 ** step),
                   1.0 / math.sqrt(1.0 - self.beta2 ** step))
        flat = [t.view(-1) for t in tensors]
        if n <= LAUNCH_ELEMENTS:
            kernel(n, *flat, *scalars)
            return
        for start in range(0, n, LAUNCH_ELEMENTS):  # slices start at multiples of 16 bytes
            pieces = [t[start:start + LAUNCH_ELEMENTS] for t in flat]
            kernel(pieces[0].numel(), *pieces, *scalars)

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        # 16-byte vectors: what fresh allocations (param, grad and the zero-initialized
        # state) always allow
        dtype = ns["param"].dtype
        key = {"dtype": DTYPE_NAMES[dtype], "vec": 16 // ns["param"].element_size()}
        return [("adamw", key, min(ns["n"], LAUNCH_ELEMENTS))]
