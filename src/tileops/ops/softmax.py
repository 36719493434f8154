"""Softmax family over the last dim: softmax, log_softmax, logsumexp; forward and backward
ops, and the differentiable functional API.

As torch: fp32 math, results in the input dtype (torch.softmax / torch.logsumexp on a
bf16 tensor return bf16). Rows of any length from 1 to the vocabulary sizes of LLMs (256K
and more) run on the row kernels of kernels/softmax; `dim` must name the last dim (the
layout of attention weights and of logits): another dim is refused, never transposed
behind the user's back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..kernels.base import UNBOUND, Kernel
from ..kernels.softmax import SoftmaxKernel
from ..manifest.spec import DTYPE_NAMES
from .base import Op
from .layout import STRIDE_ERRORS, TMA_ALIGN_BYTES, as_rows, output_rows

_KERNELS = {"softmax": SoftmaxKernel}


class _RowOp:
    """Shared host side of the family (a mixin: every Op subclass is bound to a manifest
    entry): rows flattened to [rows, N]; one kernel keyed by kind, dtype and N."""

    kind: str  # the kernel's kind (kernels/softmax/softmax.py KINDS)
    kernel_map = _KERNELS

    def _launch(self, reference: torch.Tensor, *tensors: torch.Tensor) -> None:
        n = reference.shape[-1] if reference.dim() else 1
        rows = reference.numel() // n if n else 0
        if rows == 0:
            return
        self._kernel(reference, n)(rows, *tensors)

    def _kernel(self, reference: torch.Tensor, n: int) -> Kernel:
        return self.memo_kernel(("softmax", reference.device, reference.dtype, n), "softmax",
                                reference.device, lambda: _key(self.kind, reference.dtype, n))

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        t = ns[self.spec.input_names[-1]]
        return [("softmax", _key(self.kind, t.dtype, ns["N"]), ns["rows"])]


def _key(kind: str, dtype: torch.dtype, n: int) -> dict[str, Any]:
    return {"kind": kind, "dtype": DTYPE_NAMES[dtype], "n": n}


def _rows(t: torch.Tensor) -> torch.Tensor:
    n = t.shape[-1] if t.dim() else 1
    return as_rows(t, n)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1)


class _ElementwiseRowFwd(_RowOp):
    """softmax / log_softmax: output of the input's shape."""

    def __init__(self, *, dim: int = -1, kernel_map: Mapping[str, type[Kernel]] | None = None,
                 tune: bool = False):
        super().__init__(dim=dim, kernel_map=kernel_map, tune=tune)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x = _rows(input)
        y_rows, y = output_rows(x, input)
        self._launch(input, x, y_rows)
        return y

    def plan(self, input: torch.Tensor) -> Any:
        """[rows, N] inputs as the kernels read them: the output's allocation and the
        launch, the kernel bound (host time of a decode step's sampling)."""
        if input.dim() != 2 or 0 in input.shape:
            return None
        rows = input.shape[0]
        kernel, forward = self._kernel(input, input.shape[1]), self.forward
        exe, extra, current = kernel.bind(rows) or UNBOUND

        def launch(input: torch.Tensor) -> torch.Tensor:
            if input.data_ptr() % TMA_ALIGN_BYTES:
                return forward(input)
            y = torch.empty_like(input)
            try:
                if current():
                    exe(input, y, *extra)
                else:
                    kernel(rows, input, y)
            except STRIDE_ERRORS:  # a strided input: forward copies it
                return forward(input)
            return y
        return launch


class _ElementwiseRowBwd(_RowOp):
    """dx of softmax / log_softmax from (grad_output, output)."""

    def __init__(self, *, dim: int = -1, kernel_map: Mapping[str, type[Kernel]] | None = None,
                 tune: bool = False):
        super().__init__(dim=dim, kernel_map=kernel_map, tune=tune)

    def forward(self, grad_output: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        y = _rows(output)
        dx_rows, dx = output_rows(y, output)
        self._launch(output, _rows(grad_output), y, dx_rows)
        return dx


class SoftmaxFwdOp(_ElementwiseRowFwd, Op):
    """torch.softmax(input, dim=-1)."""

    kind = "softmax"


class SoftmaxBwdOp(_ElementwiseRowBwd, Op):
    """grad_input = output * (grad_output - sum(grad_output * output, dim))."""

    kind = "softmax_bwd"


class LogSoftmaxFwdOp(_ElementwiseRowFwd, Op):
    """torch.log_softmax(input, dim=-1)."""

    kind = "log_softmax"


class LogSoftmaxBwdOp(_ElementwiseRowBwd, Op):
    """grad_input = grad_output - exp(output) * sum(grad_output, dim)."""

    kind = "log_softmax_bwd"


class LogsumexpFwdOp(_RowOp, Op):
    """torch.logsumexp(input, dim=-1, keepdim=False)."""

    kind = "logsumexp"

    def __init__(self, *, dim: int = -1, keepdim: bool = False,
                 kernel_map: Mapping[str, type[Kernel]] | None = None, tune: bool = False):
        super().__init__(dim=dim, keepdim=keepdim, kernel_map=kernel_map, tune=tune)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        shape = (*input.shape[:-1], 1) if self.keepdim else tuple(input.shape[:-1])
        out = torch.empty(shape, dtype=input.dtype, device=input.device)
        self._launch(input, _rows(input), _flat(out))
        return out


class LogsumexpBwdOp(_RowOp, Op):
    """grad_input = grad_output * exp(input - output), output = logsumexp(input)."""

    kind = "logsumexp_bwd"

    def __init__(self, *, dim: int = -1, keepdim: bool = False,
                 kernel_map: Mapping[str, type[Kernel]] | None = None, tune: bool = False):
        super().__init__(dim=dim, keepdim=keepdim, kernel_map=kernel_map, tune=tune)

    def forward(self, grad_output: torch.Tensor, input: torch.Tensor,
                output: torch.Tensor) -> torch.Tensor:
        x = _rows(input)
        dx_rows, dx = output_rows(x, input)
        self._launch(input, _flat(grad_output.contiguous()), x, _flat(output.contiguous()),
                     dx_rows)
        return dx


# -- autograd -----------------------------------------------------------------------------
def _args(cls: type[Op], inputs: Sequence[Any]) -> dict[str, Any]:
    return dict(zip(cls.spec.call_order, inputs, strict=True))


def _save_output(ctx, inputs, output):
    ctx.dim = inputs[1]
    ctx.save_for_backward(output)


def _softmax_backward(ctx, grad_output):
    (y,) = ctx.saved_tensors
    return SoftmaxBwdOp.through_custom_op(grad_output, y, dim=ctx.dim), None


def _log_softmax_backward(ctx, grad_output):
    (y,) = ctx.saved_tensors
    return LogSoftmaxBwdOp.through_custom_op(grad_output, y, dim=ctx.dim), None


def _save_lse(ctx, inputs, output):
    args = _args(LogsumexpFwdOp, inputs)
    ctx.params = {"dim": args["dim"], "keepdim": args["keepdim"]}
    ctx.save_for_backward(args["input"], output)


def _logsumexp_backward(ctx, grad_output):
    x, out = ctx.saved_tensors
    return LogsumexpBwdOp.through_custom_op(grad_output, x, out, **ctx.params), None, None


SoftmaxFwdOp.register_autograd(_softmax_backward, setup_context=_save_output)
LogSoftmaxFwdOp.register_autograd(_log_softmax_backward, setup_context=_save_output)
LogsumexpFwdOp.register_autograd(_logsumexp_backward, setup_context=_save_lse)


# -- functional API -----------------------------------------------------------------------
def softmax(input: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """torch.softmax over the last dim on TileOPs kernels (differentiable)."""
    return SoftmaxFwdOp.apply_keyed((input,), (dim, type(dim)), lambda: {"dim": dim})


def log_softmax(input: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """torch.log_softmax over the last dim on TileOPs kernels (differentiable)."""
    return LogSoftmaxFwdOp.apply_keyed((input,), (dim, type(dim)), lambda: {"dim": dim})


def logsumexp(input: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """torch.logsumexp over the last dim on TileOPs kernels (differentiable)."""
    return LogsumexpFwdOp.apply(input, dim=dim, keepdim=keepdim)
