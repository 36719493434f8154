"""Normalization family: RMSNorm (torch.nn.functional.rms_norm)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..kernels.base import Kernel
from ..kernels.normalization import RMSNormKernel
from .base import Op
from .layout import tma_ready

_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


class RMSNormFwdOp(Op):
    """RMSNorm over the trailing `normalized_shape` dims; eps=None means finfo(dtype).eps."""

    kernel_map = {"rms_norm": RMSNormKernel}

    def __init__(self, *, normalized_shape: Sequence[int], eps: float | None = None,
                 kernel_map: Mapping[str, type[Kernel]] | None = None, tune: bool = False):
        if isinstance(normalized_shape, int):
            normalized_shape = [normalized_shape]
        super().__init__(normalized_shape=list(normalized_shape), eps=eps,
                         kernel_map=kernel_map, tune=tune)

    def forward(self, input: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        n = self.hidden
        # The kernel takes [rows, n]; views cost host time, so 2-D input skips them.
        flat = input.dim() == 2 and len(self.normalized_shape) == 1
        x = input if flat else input.reshape(-1, n)
        y = torch.empty(x.shape, dtype=input.dtype, device=input.device)
        if x.shape[0] == 0:
            return y.view(input.shape)
        eps = torch.finfo(input.dtype).eps if self.eps is None else float(self.eps)
        if weight is not None and weight.dim() != 1:
            weight = weight.reshape(n)
        kernel = self.get_kernel("rms_norm", input.device,
                                 **self._kernel_key(input.dtype, n, weight is not None))
        kernel(x.shape[0], tma_ready(x), None if weight is None else tma_ready(weight), y, eps)
        return y if flat else y.view(input.shape)

    @property
    def hidden(self) -> int:
        """Elements per normalized row: the product of normalized_shape."""
        return math.prod(self.normalized_shape)

    @staticmethod
    def _kernel_key(dtype: torch.dtype, n: int, has_weight: bool) -> dict[str, Any]:
        return {"dtype": _DTYPE_NAMES[dtype], "n": n, "has_weight": has_weight}

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        key = self._kernel_key(ns["input"].dtype, ns["N"], ns["weight"] is not None)
        return [("rms_norm", key, ns["rows"])]


def rms_norm(input: torch.Tensor, normalized_shape: Sequence[int] | int,
             weight: torch.Tensor | None = None, eps: float | None = None) -> torch.Tensor:
    """torch.nn.functional.rms_norm on TileOPs kernels."""
    if isinstance(normalized_shape, int):
        normalized_shape = [normalized_shape]
    return RMSNormFwdOp.apply(input, weight, normalized_shape=list(normalized_shape), eps=eps)
