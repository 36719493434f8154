"""Selection family: greedy and top-k selection over vocabulary rows, for decoding.

- `argmax(input, dim=None, keepdim=False)`: torch.argmax. dim=None (torch's default)
  takes the argmax of the flattened tensor; otherwise only the last dim is supported (-1 or
  ndim - 1; any other dim fails a shape rule: TileOpsValueError). Ties give the lowest
  index and NaN counts as the maximum (its first occurrence), as torch.
- `topk(input, k, dim=-1, largest=True, sorted=True)`: torch.topk over the last dim, k <=
  MAX_K (128). Values are sorted descending and bit-identical to torch's (they are read
  back from the input); among equal values the lower index comes first (torch leaves that
  order unspecified, so indices of tied values may differ from torch's). NaN counts as the
  largest value. largest=False is refused (TileOpsUnsupportedError); sorted=False returns
  the same sorted result, which torch allows.

fp16, bf16 and fp32 inputs; the batch (leading dims) is a runtime size, the row length and
(for topk) the k bucket are compiled in. Inputs that are not contiguous are copied first.
No autograd (the indices are not differentiable; torch.topk's values are, but sampling
never needs it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..errors import TileOpsUnsupportedError, op_error
from ..kernels.base import UNBOUND, Kernel
from ..kernels.selection import MAX_K, ArgmaxKernel, TopkKernel, k_cap_of
from ..manifest.spec import DTYPE_NAMES
from .base import Op
from .layout import STRIDE_ERRORS, TMA_ALIGN_BYTES, tma_ready

_MAX_ROW = (1 << 31) - 1  # row positions are int32 in the kernels


def _rows(x: torch.Tensor, flatten: bool) -> torch.Tensor:
    """x as a contiguous, aligned [rows, n] tensor (a copy only when it is not one)."""
    x = tma_ready(x)
    if flatten:
        return x.view(1, -1)
    return x if x.dim() == 2 else x.view(-1, x.shape[-1])  # (a view costs ~1.3 us of host)


def _check_row(op: Op, n: int) -> None:
    if n > _MAX_ROW:
        raise op_error(TileOpsUnsupportedError, op.spec.op_name, "input",
                       f"rows of at most {_MAX_ROW} elements", n)


class ArgmaxFwdOp(Op):
    """Index of the largest element of each row (torch.argmax over the last dim, or over the
    flattened tensor for dim=None)."""

    kernel_map = {"argmax": ArgmaxKernel}

    def __init__(self, *, dim: int | None = None, keepdim: bool = False,
                 kernel_map: Mapping[str, type[Kernel]] | None = None, tune: bool = False):
        super().__init__(dim=dim, keepdim=keepdim, kernel_map=kernel_map, tune=tune)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.dim is None:
            shape = (1,) * input.dim() if self.keepdim else ()
        else:
            shape = (*input.shape[:-1], 1) if self.keepdim else tuple(input.shape[:-1])
        out = torch.empty(shape, dtype=torch.int64, device=input.device)
        if out.numel() == 0:
            return out
        x = _rows(input, self.dim is None)
        rows, n = x.shape
        _check_row(self, n)
        self._kernel(x)(rows, x, out if out.dim() == 1 else out.view(rows))
        return out

    def _kernel(self, x: torch.Tensor) -> Kernel:
        """The kernel for rows of x [rows, vocab] (memoized by the op)."""
        n = x.shape[1]
        return self.memo_kernel(("argmax", x.device, x.dtype, n), "argmax", x.device,
                                lambda: {"dtype": DTYPE_NAMES[x.dtype], "vocab": n})

    def plan(self, input: torch.Tensor) -> Any:
        """[rows, vocab] logits over the last dim, without keepdim (the decoding call): the
        kernel and sizes bound, per call only the layout check, the output and the launch."""
        if self.dim is None or self.keepdim or input.dim() != 2 or 0 in input.shape \
                or input.shape[1] > _MAX_ROW:
            return None
        rows = input.shape[0]
        kernel, forward, empty_like = self._kernel(input), self.forward, torch.empty_like
        exe, _, current = kernel.bind(rows) or UNBOUND
        # the output as empty_like of this: ~1 us under torch.empty(rows, dtype=, device=)
        like = torch.empty(rows, dtype=torch.int64, device=input.device)

        def launch(input: torch.Tensor) -> torch.Tensor:
            if input.data_ptr() % TMA_ALIGN_BYTES:
                return forward(input)
            out = empty_like(like)
            try:
                if current():
                    exe(input, out)
                else:
                    kernel(rows, input, out)
            except STRIDE_ERRORS:  # a strided input: forward copies it
                return forward(input)
            return out
        return launch

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        key = {"dtype": DTYPE_NAMES[ns["input"].dtype], "vocab": ns["V"]}
        return [("argmax", key, ns["rows"])]


class TopkFwdOp(Op):
    """The k largest elements of each row, sorted descending, and their int64 indices
    (torch.topk over the last dim, k <= 128)."""

    kernel_map = {"topk": TopkKernel}

    def __init__(self, *, k: int, dim: int = -1, largest: bool = True, sorted: bool = True,
                 kernel_map: Mapping[str, type[Kernel]] | None = None, tune: bool = False):
        super().__init__(k=k, dim=dim, largest=largest, sorted=sorted, kernel_map=kernel_map,
                         tune=tune)
        if k > MAX_K:
            raise op_error(TileOpsUnsupportedError, self.spec.op_name, "k",
                           f"k <= {MAX_K} (the top-k for sampling)", k)
        if not largest:
            raise op_error(TileOpsUnsupportedError, self.spec.op_name, "largest",
                           "True (the smallest k are not supported)", largest)

    def forward(self, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (*input.shape[:-1], self.k)
        values = torch.empty(shape, dtype=input.dtype, device=input.device)
        indices = torch.empty(shape, dtype=torch.int64, device=input.device)
        if self.k == 0 or values.numel() == 0:
            return values, indices
        x = _rows(input, False)
        rows, n = x.shape
        _check_row(self, n)
        kernel = self.memo_kernel(("topk", input.device, x.dtype, n), "topk", input.device,
                                  lambda: {"dtype": DTYPE_NAMES[x.dtype], "vocab": n,
                                           "k_cap": k_cap_of(self.k)})
        if values.dim() != 2:
            values, indices = values.view(rows, self.k), indices.view(rows, self.k)
        kernel(rows, x, values, indices)
        return values, indices

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        if ns["k"] == 0 or ns["rows"] == 0:
            return []
        key = {"dtype": DTYPE_NAMES[ns["input"].dtype], "vocab": ns["V"],
               "k_cap": k_cap_of(ns["k"])}
        return [("topk", key, ns["rows"])]


def argmax(input: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """torch.argmax(input, dim, keepdim) for dim None or the last dim."""
    return ArgmaxFwdOp.apply_keyed((input,), (dim, type(dim), keepdim, type(keepdim)),
                                   lambda: {"dim": dim, "keepdim": keepdim})


def topk(input: torch.Tensor, k: int, dim: int = -1, largest: bool = True,
         sorted: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) = torch.topk(input, k, dim, largest, sorted) over the last dim."""
    return TopkFwdOp.apply(input, k=k, dim=dim, largest=largest, sorted=sorted)

