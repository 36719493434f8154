"""GEMM family: d = op(a) @ op(b) (torch.matmul with optional transposes)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..kernels.base import Kernel
from ..kernels.gemm import GemmKernel
from ..manifest.spec import DTYPE_NAMES
from .base import Op
from .layout import tma_ready


class GemmFwdOp(Op):
    """Dense GEMM d[M, N] = op(a) @ op(b), fp32 accumulation.

    a is [M, K] ([K, M] when trans_a); b is [N, K] when trans_b (a Linear weight, the default)
    or [K, N]. A transposed view is served without a copy by flipping its trans flag.
    """

    kernel_map = {"gemm": GemmKernel}

    def __init__(self, *, trans_a: bool = False, trans_b: bool = True,
                 kernel_map: Mapping[str, type[Kernel]] | None = None, tune: bool = False):
        super().__init__(trans_a=trans_a, trans_b=trans_b, kernel_map=kernel_map, tune=tune)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a, trans_a = _as_row_major(a, self.trans_a)
        b, trans_b = _as_row_major(b, self.trans_b)
        m = a.shape[1] if trans_a else a.shape[0]
        if trans_a and m % 8:
            # The symbolic M is then a row stride, which TMA needs 16-byte aligned.
            a, trans_a = a.t().contiguous(), False
        n = b.shape[0] if trans_b else b.shape[1]
        k = b.shape[1] if trans_b else b.shape[0]
        d = torch.empty((m, n), dtype=a.dtype, device=a.device)
        if m == 0 or n == 0:
            return d
        if k == 0:
            return d.zero_()
        kernel = self.memo_kernel(("gemm", a.device, a.dtype, n, k, trans_a, trans_b), "gemm",
                                  a.device, lambda: self._kernel_key(a.dtype, n, k, trans_a,
                                                                     trans_b))
        kernel(m, tma_ready(a), tma_ready(b), d)
        return d

    @staticmethod
    def _kernel_key(dtype: torch.dtype, n: int, k: int, trans_a: bool,
                    trans_b: bool) -> dict[str, Any]:
        return {"dtype": DTYPE_NAMES[dtype], "n": n, "k": k, "trans_a": trans_a,
                "trans_b": trans_b}

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        trans_a = self.trans_a and ns["M"] % 8 == 0
        key = self._kernel_key(ns["a"].dtype, ns["N"], ns["K"], trans_a, self.trans_b)
        return [("gemm", key, ns["M"])]


def _as_row_major(t: torch.Tensor, trans: bool) -> tuple[torch.Tensor, bool]:
    """A contiguous tensor and its trans flag; a transposed view flips the flag, no copy."""
    if t.is_contiguous():
        return t, trans
    if t.t().is_contiguous():
        return t.t(), not trans
    return t.contiguous(), trans


def gemm(a: torch.Tensor, b: torch.Tensor, trans_a: bool = False,
         trans_b: bool = True) -> torch.Tensor:
    """d = op(a) @ op(b); by default a [M, K] times a Linear weight b [N, K]."""
    return GemmFwdOp.apply(a, b, trans_a=trans_a, trans_b=trans_b)
