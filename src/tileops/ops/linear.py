"""`tileops.linear(input, weight, bias=None)`: torch.nn.functional.linear on the GEMM kernels,
differentiable, so nn.Linear layers can train on TileOPs.

- forward: y = x @ W^T (+ b), the bias added in the GEMM's epilogue (or in the split-K
  reduce for decode sizes); leading dims of x are flattened into the token dim.
- backward: dX = dY @ W (a GEMM with W untransposed), dW = dY^T @ X (a GEMM whose reduction
  runs over the tokens: K is symbolic there, so no token count compiles a new program),
  db = the column sums of dY (torch, fp32 accumulation).
The weight gradient reads dY transposed through TMA, which needs 16-byte rows: the backward
refuses out-features or in-features that are not multiples of 8 (every LLM layer's are).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..kernels.base import Kernel
from ..kernels.gemm import GemmKernel
from ..manifest.spec import DTYPE_NAMES
from .base import Op
from .layout import as_rows, is_tma_ready, tma_ready


def _gemm_key(dtype: torch.dtype, n: int, k: int | None, trans_a: bool, trans_b: bool,
              has_bias: bool = False) -> dict[str, Any]:
    key = {"dtype": DTYPE_NAMES[dtype], "n": n, "k": k, "trans_a": trans_a, "trans_b": trans_b}
    if has_bias:
        key["has_bias"] = True
    return key


class LinearFwdOp(Op):
    """y = input @ weight^T (+ bias) (torch.nn.functional.linear)."""

    kernel_map = {"gemm": GemmKernel}

    def __init__(self, *, kernel_map: Mapping[str, type[Kernel]] | None = None,
                 tune: bool = False):
        super().__init__(kernel_map=kernel_map, tune=tune)

    def forward(self, input: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        n, k = weight.shape
        x = as_rows(input, k)
        y = torch.empty((x.shape[0], n), dtype=input.dtype, device=input.device)
        if x.shape[0] and n:
            if k == 0:
                y.copy_(bias.expand_as(y)) if bias is not None else y.zero_()
            else:
                extra = () if bias is None else (tma_ready(bias),)
                self._kernel(input, n, k, bias)(x.shape[0], x, tma_ready(weight), *extra, y)
        return y if input.dim() == 2 else y.view(*input.shape[:-1], n)

    def _kernel(self, input: torch.Tensor, n: int, k: int, bias: torch.Tensor | None) -> Kernel:
        has_bias = bias is not None
        return self.memo_kernel(("gemm", input.device, input.dtype, n, k, has_bias), "gemm",
                                input.device,
                                lambda: _gemm_key(input.dtype, n, k, False, True, has_bias))

    def plan(self, input: torch.Tensor, weight: torch.Tensor,
             bias: torch.Tensor | None = None) -> Any:
        """2-D input, contiguous and 16-byte aligned like weight and bias, no empty
        dimension: the allocation and the launch, sizes and kernel bound."""
        if input.dim() != 2:
            return None
        (n, k), m = weight.shape, input.shape[0]
        if m == 0 or n == 0 or k == 0:
            return None
        kernel, forward = self._kernel(input, n, k, bias), self.forward
        shape, dtype, device = (m, n), input.dtype, input.device

        def launch(input: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
            if not (is_tma_ready(input) and is_tma_ready(weight)
                    and (bias is None or is_tma_ready(bias))):
                return forward(input, weight, bias)
            y = torch.empty(shape, dtype=dtype, device=device)
            if bias is None:
                kernel(m, input, weight, y)
            else:
                kernel(m, input, weight, bias, y)
            return y
        return launch

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        key = _gemm_key(ns["input"].dtype, ns["N"], ns["K"], False, True,
                        ns["bias"] is not None)
        return [("gemm", key, ns["rows"])]


class LinearBwdOp(Op):
    """(grad_input, grad_weight, grad_bias) of linear; grad_bias is empty without a bias."""

    kernel_map = {"gemm": GemmKernel}

    def __init__(self, *, has_bias: bool = False,
                 kernel_map: Mapping[str, type[Kernel]] | None = None, tune: bool = False):
        super().__init__(has_bias=has_bias, kernel_map=kernel_map, tune=tune)

    def forward(self, grad_output: torch.Tensor, input: torch.Tensor,
                weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n, k = weight.shape
        dtype, device = input.dtype, input.device
        dy, x = as_rows(grad_output, n), as_rows(input, k)
        rows = x.shape[0]
        dx = torch.empty((rows, k), dtype=dtype, device=device)
        dw = torch.empty((n, k), dtype=dtype, device=device)
        db = torch.empty(n if self.has_bias else 0, dtype=dtype, device=device)
        if rows == 0 or n == 0 or k == 0:
            dx.zero_(), dw.zero_(), db.zero_()
        else:
            w = tma_ready(weight)
            # dX[rows, k] = dY[rows, n] @ W[n, k]
            self.get_kernel("gemm", device, **_gemm_key(dtype, k, n, False, False))(
                rows, dy, w, dx)
            # dW[n, k] = dY^T @ X: M = n (out-features), K = tokens (symbolic)
            self.get_kernel("gemm", device, **_gemm_key(dtype, k, None, True, False))(
                n, dy, x, dw)
            if self.has_bias:
                db.copy_(dy.sum(0, dtype=torch.float32))
        shape = input.shape
        return (dx if input.dim() == 2 else dx.view(*shape[:-1], k)), dw, db

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        dtype, n, k = ns["input"].dtype, ns["N"], ns["K"]
        return [("gemm", _gemm_key(dtype, k, n, False, False), ns["rows"]),
                ("gemm", _gemm_key(dtype, k, None, True, False), n)]


# -- autograd -----------------------------------------------------------------------------
def _setup(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.has_bias = bias is not None
    ctx.save_for_backward(x, weight)


def _backward(ctx, grad_output):
    x, weight = ctx.saved_tensors
    dx, dw, db = LinearBwdOp.through_custom_op(grad_output, x, weight, has_bias=ctx.has_bias)
    return LinearFwdOp.grads_in_call_order(input=dx, weight=dw,
                                           bias=db if ctx.has_bias else None)


LinearFwdOp.register_autograd(_backward, setup_context=_setup)


def linear(input: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """torch.nn.functional.linear on TileOPs GEMMs (differentiable)."""
    return LinearFwdOp.apply(input, weight, bias)
