"""GEMM family: d = op(a) @ op(b) (torch.matmul with optional transposes)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..kernels.base import Kernel
from ..kernels.gemm import GemmKernel
from ..manifest.spec import DTYPE_NAMES
from .base import Op
from .layout import is_tma_ready, tma_ready


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
        self._kernel(a, n, k, trans_a, trans_b)(m, tma_ready(a), tma_ready(b), d)
        return d

    def _kernel(self, a: torch.Tensor, n: int, k: int, trans_a: bool, trans_b: bool) -> Kernel:
        return self.memo_kernel(("gemm", a.device, a.dtype, n, k, trans_a, trans_b), "gemm",
                                a.device, lambda: self._kernel_key(a.dtype, n, k, trans_a,
                                                                   trans_b))

    def plan(self, a: torch.Tensor, b: torch.Tensor) -> Any:
        """a and b contiguous (their trans flags the op's) and 16-byte aligned, no empty
        dimension: the allocation and the launch, sizes and kernel bound."""
        if not (a.is_contiguous() and b.is_contiguous()):
            return None
        m = a.shape[1] if self.trans_a else a.shape[0]
        n = b.shape[0] if self.trans_b else b.shape[1]
        k = b.shape[1] if self.trans_b else b.shape[0]
        if m == 0 or n == 0 or k == 0 or self.trans_a and m % 8:
            return None
        kernel, forward = self._kernel(a, n, k, self.trans_a, self.trans_b), self.forward
        shape, dtype, device = (m, n), a.dtype, a.device

        def launch(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            if not (is_tma_ready(a) and is_tma_ready(b)):
                return forward(a, b)
            d = torch.empty(shape, dtype=dtype, device=device)
            kernel(m, a, b, d)
            return d
        return launch

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
