"""Normalization family: RMSNorm, the fused residual add + RMSNorm, LayerNorm; forward and
backward ops, and the differentiable functional API.

Defaults are PyTorch's: eps=None means the epsilon of the fp32 math torch runs for fp16 /
bf16 inputs (torch.finfo(torch.float32).eps), not the input dtype's; LayerNorm's eps is
1e-5. The backward ops recompute the row statistics from the forward's input, so autograd
saves only tensors it holds anyway.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..errors import TileOpsValueError, op_error
from ..kernels.base import UNBOUND, Kernel
from ..kernels.normalization import (
    FusedAddRMSNormBwdKernel,
    FusedAddRMSNormKernel,
    LayerNormBwdKernel,
    LayerNormKernel,
    RMSNormBwdKernel,
    RMSNormKernel,
)
from ..manifest.spec import DTYPE_NAMES
from .base import Op
from .layout import STRIDE_ERRORS, TMA_ALIGN_BYTES, as_rows, output_rows, tma_ready

FP32_EPS = torch.finfo(torch.float32).eps  # torch's eps=None for fp16/bf16 rows


def _shape_tuple(normalized_shape: Sequence[int] | int) -> tuple[int, ...]:
    """normalized_shape as a tuple: hashable, so the functional API's per-call instance lookup
    (Op.apply_keyed) takes its fast path."""
    return (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)


class _RowNorm:
    """Shared host side of the row norm ops (a mixin: every Op subclass is bound to a
    manifest entry): rows flattened to [rows, N], contiguous, 16-byte aligned; kernels
    keyed by dtype and N (plus the op's optional tensors)."""

    eps: float | None

    @staticmethod
    def _rows(t: torch.Tensor | None, n: int) -> torch.Tensor | None:
        """`t` as a [rows, n] tensor the kernels can read (a view where possible)."""
        return as_rows(t, n)

    @staticmethod
    def _vec(t: torch.Tensor | None, n: int) -> torch.Tensor | None:
        """A weight or bias of `normalized_shape` as an [n] tensor the kernels can read."""
        if t is None:
            return None
        return tma_ready(t if t.dim() == 1 else t.reshape(n))

    def _eps(self) -> float:
        return FP32_EPS if self.eps is None else float(self.eps)

    @staticmethod
    def _kernel_key(dtype: torch.dtype, n: int, **flags: bool) -> dict[str, Any]:
        return {"dtype": DTYPE_NAMES[dtype], "n": n, **flags}


class RMSNormFwdOp(_RowNorm, Op):
    """RMSNorm over the trailing `normalized_shape` dims (torch.nn.functional.rms_norm)."""

    kernel_map = {"rms_norm": RMSNormKernel}

    def __init__(self, *, normalized_shape: Sequence[int] | int, eps: float | None = None,
                 kernel_map: Mapping[str, type[Kernel]] | None = None, tune: bool = False):
        super().__init__(normalized_shape=_shape_tuple(normalized_shape), eps=eps,
                         kernel_map=kernel_map, tune=tune)
        self.hidden = math.prod(self.normalized_shape)

    def forward(self, input: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        n = self.hidden
        x = self._rows(input, n)
        y_rows, y = output_rows(x, input)
        if x.shape[0] == 0:
            return y
        self._kernel(input, weight)(x.shape[0], x, self._vec(weight, n), y_rows, self._eps())
        return y

    def _kernel(self, input: torch.Tensor, weight: torch.Tensor | None) -> Kernel:
        has_weight = weight is not None
        return self.memo_kernel(
            ("rms_norm", input.device, input.dtype, has_weight), "rms_norm", input.device,
            lambda: self._kernel_key(input.dtype, self.hidden, has_weight=has_weight))

    def plan(self, input: torch.Tensor, weight: torch.Tensor | None = None) -> Any:
        """[rows, N] inputs, contiguous and aligned as kernels read them: one allocation
        and the launch (~2 us less host time than forward)."""
        if len(self.normalized_shape) != 1 or input.dim() != 2 or input.shape[0] == 0:
            return None
        kernel, rows, eps, forward = (self._kernel(input, weight), input.shape[0], self._eps(),
                                      self.forward)
        exe, _, current = kernel.bind(rows) or UNBOUND

        def launch(input: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
            if (input.data_ptr() | (0 if weight is None else weight.data_ptr())) % TMA_ALIGN_BYTES:
                return forward(input, weight)
            y = torch.empty_like(input)
            try:
                if not current():
                    kernel(rows, input, weight, y, eps)
                elif weight is None:
                    exe(input, y, eps)
                else:
                    exe(input, weight, y, eps)
            except STRIDE_ERRORS:  # a strided input: forward copies it
                return forward(input, weight)
            return y
        return launch

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        key = self._kernel_key(ns["input"].dtype, ns["N"], has_weight=ns["weight"] is not None)
        return [("rms_norm", key, ns["rows"])]


class RMSNormBwdOp(_RowNorm, Op):
    """(grad_input, grad_weight) of rms_norm; grad_weight is empty when there is no weight."""

    kernel_map = {"rms_norm_bwd": RMSNormBwdKernel}

    def __init__(self, *, normalized_shape: Sequence[int] | int, eps: float | None = None,
                 kernel_map: Mapping[str, type[Kernel]] | None = None, tune: bool = False):
        super().__init__(normalized_shape=_shape_tuple(normalized_shape), eps=eps,
                         kernel_map=kernel_map, tune=tune)
        self.hidden = math.prod(self.normalized_shape)

    def forward(self, grad_output: torch.Tensor, input: torch.Tensor,
                weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return _norm_backward(self, "rms_norm_bwd", self.hidden, grad_output, input, weight,
                              None, None)

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        key = self._kernel_key(ns["input"].dtype, ns["N"], has_weight=ns["weight"] is not None)
        return [("rms_norm_bwd", key, ns["rows"])]


class FusedAddRMSNormFwdOp(_RowNorm, Op):
    """h = input + residual (rounded to the input dtype, as the unfused add), then RMSNorm
    of h over the last dim: returns (rms_norm(h), h) from one pass over HBM."""

    kernel_map = {"fused_add_rms_norm": FusedAddRMSNormKernel}

    def __init__(self, *, eps: float | None = None,
                 kernel_map: Mapping[str, type[Kernel]] | None = None, tune: bool = False):
        super().__init__(eps=eps, kernel_map=kernel_map, tune=tune)

    def forward(self, input: torch.Tensor, residual: torch.Tensor,
                weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = input.shape[-1]
        x = self._rows(input, n)
        y_rows, y = output_rows(x, input)
        h_rows, h = output_rows(x, input)
        self.launch(x, self._rows(residual, n), weight, y_rows, h_rows)
        return y, h

    def launch(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
               y: torch.Tensor, h: torch.Tensor) -> None:
        """Writes rms_norm(h) into y and h = x + residual into h, all [rows, N]; y and h may
        be the inputs' own storage: each element is read before it is written."""
        if x.shape[0] == 0:
            return
        n = x.shape[1]
        self._kernel(x, n)(x.shape[0], x, residual, self._vec(weight, n), y, h, self._eps())

    def _kernel(self, x: torch.Tensor, n: int) -> Kernel:
        return self.memo_kernel(("fused_add_rms_norm", x.device, x.dtype, n),
                                "fused_add_rms_norm", x.device,
                                lambda: self._kernel_key(x.dtype, n))

    def plan(self, input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> Any:
        """As RMSNormFwdOp.plan: [rows, N] inputs as kernels read them, two allocations."""
        if input.dim() != 2 or input.shape[0] == 0 or weight.dim() != 1:
            return None
        rows, n = input.shape
        kernel, eps, forward = self._kernel(input, n), self._eps(), self.forward
        exe, _, current = kernel.bind(rows) or UNBOUND

        def launch(input: torch.Tensor, residual: torch.Tensor,
                   weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if (input.data_ptr() | residual.data_ptr() | weight.data_ptr()) % TMA_ALIGN_BYTES:
                return forward(input, residual, weight)
            y, h = torch.empty_like(input), torch.empty_like(input)
            try:
                if current():
                    exe(input, residual, weight, y, h, eps)
                else:
                    kernel(rows, input, residual, weight, y, h, eps)
            except STRIDE_ERRORS:  # a strided input: forward copies it
                return forward(input, residual, weight)
            return y, h
        return launch

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        return [("fused_add_rms_norm", self._kernel_key(ns["input"].dtype, ns["N"]), ns["rows"])]


class FusedAddRMSNormBwdOp(_RowNorm, Op):
    """Gradient of fused_add_rms_norm: grad_input (= the residual's gradient) and
    grad_weight, from the forward's residual_out and the gradients of both outputs."""

    kernel_map = {"fused_add_rms_norm_bwd": FusedAddRMSNormBwdKernel}

    def __init__(self, *, eps: float | None = None,
                 kernel_map: Mapping[str, type[Kernel]] | None = None, tune: bool = False):
        super().__init__(eps=eps, kernel_map=kernel_map, tune=tune)

    def forward(self, grad_output: torch.Tensor, grad_residual_out: torch.Tensor,
                residual_out: torch.Tensor,
                weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _norm_backward(self, "fused_add_rms_norm_bwd", residual_out.shape[-1],
                              grad_output, residual_out, weight, None, grad_residual_out)

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        return [("fused_add_rms_norm_bwd", self._kernel_key(ns["residual_out"].dtype, ns["N"]),
                 ns["rows"])]


class LayerNormFwdOp(_RowNorm, Op):
    """LayerNorm over the trailing `normalized_shape` dims (torch.nn.functional.layer_norm)."""

    kernel_map = {"layer_norm": LayerNormKernel}

    def __init__(self, *, normalized_shape: Sequence[int] | int, eps: float = 1e-5,
                 kernel_map: Mapping[str, type[Kernel]] | None = None, tune: bool = False):
        super().__init__(normalized_shape=_shape_tuple(normalized_shape), eps=float(eps),
                         kernel_map=kernel_map, tune=tune)
        self.hidden = math.prod(self.normalized_shape)

    def forward(self, input: torch.Tensor, weight: torch.Tensor | None = None,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        n = self.hidden
        x = self._rows(input, n)
        y_rows, y = output_rows(x, input)
        if x.shape[0] == 0:
            return y
        self._kernel(input, weight, bias)(x.shape[0], x, self._vec(weight, n),
                                          self._vec(bias, n), y_rows, self._eps())
        return y

    def _kernel(self, input: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None) -> Kernel:
        flags = (weight is not None, bias is not None)
        return self.memo_kernel(
            ("layer_norm", input.device, input.dtype, flags), "layer_norm", input.device,
            lambda: self._kernel_key(input.dtype, self.hidden, has_weight=flags[0],
                                     has_bias=flags[1]))

    def plan(self, input: torch.Tensor, weight: torch.Tensor | None = None,
             bias: torch.Tensor | None = None) -> Any:
        """As RMSNormFwdOp.plan."""
        if len(self.normalized_shape) != 1 or input.dim() != 2 or input.shape[0] == 0:
            return None
        kernel, rows, eps, forward = (self._kernel(input, weight, bias), input.shape[0],
                                      self._eps(), self.forward)
        # the executable directly for the common affine form (weight and bias)
        bound = kernel.bind(rows) if weight is not None and bias is not None else None
        exe, _, current = bound or UNBOUND

        def launch(input: torch.Tensor, weight: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
            if (input.data_ptr() | (0 if weight is None else weight.data_ptr())
                    | (0 if bias is None else bias.data_ptr())) % TMA_ALIGN_BYTES:
                return forward(input, weight, bias)
            y = torch.empty_like(input)
            try:
                if current():
                    exe(input, weight, bias, y, eps)
                else:
                    kernel(rows, input, weight, bias, y, eps)
            except STRIDE_ERRORS:  # a strided input: forward copies it
                return forward(input, weight, bias)
            return y
        return launch

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        key = self._kernel_key(ns["input"].dtype, ns["N"], has_weight=ns["weight"] is not None,
                               has_bias=ns["bias"] is not None)
        return [("layer_norm", key, ns["rows"])]


class LayerNormBwdOp(_RowNorm, Op):
    """(grad_input, grad_weight, grad_bias) of layer_norm; the gradient of an absent weight
    or bias is empty."""

    kernel_map = {"layer_norm_bwd": LayerNormBwdKernel}

    def __init__(self, *, normalized_shape: Sequence[int] | int, eps: float = 1e-5,
                 kernel_map: Mapping[str, type[Kernel]] | None = None, tune: bool = False):
        super().__init__(normalized_shape=_shape_tuple(normalized_shape), eps=float(eps),
                         kernel_map=kernel_map, tune=tune)
        self.hidden = math.prod(self.normalized_shape)

    def forward(self, grad_output: torch.Tensor, input: torch.Tensor,
                weight: torch.Tensor | None = None, bias: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _norm_backward(self, "layer_norm_bwd", self.hidden, grad_output, input, weight,
                              bias, None, with_bias=True)

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        key = self._kernel_key(ns["input"].dtype, ns["N"], has_weight=ns["weight"] is not None,
                               has_bias=ns["bias"] is not None)
        return [("layer_norm_bwd", key, ns["rows"])]


def _norm_backward(op: Any, dispatch_key: str, n: int, grad_output: torch.Tensor,
                   h: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                   grad_residual: torch.Tensor | None, with_bias: bool = False) -> tuple:
    """The backward ops' shared body: one pass writing dx and fp32 partial sums of dw / db
    per CTA, then a column sum of the partials (see kernels/normalization/row_norm_bwd.py)."""
    device, dtype = h.device, h.dtype
    rows = op._rows(h, n)
    dx_rows, dx = output_rows(rows, h)
    # (empty_like and new_empty: a few microseconds less host time than torch.empty)
    dw = h.new_empty(0) if weight is None else torch.empty_like(
        weight, memory_format=torch.contiguous_format)
    db = h.new_empty(0) if bias is None else torch.empty_like(
        bias, memory_format=torch.contiguous_format)
    outputs = (dx, dw, db) if with_bias else (dx, dw)
    flags = {} if dispatch_key == "fused_add_rms_norm_bwd" else {"has_weight": weight is not None}
    if with_bias:
        flags["has_bias"] = bias is not None
    dy = op._rows(grad_output, n)
    if dy.shape[0] == 0:  # no rows: zero gradients for the parameters
        dw.zero_(), db.zero_()
        return outputs
    kernel = op.memo_kernel((dispatch_key, device, dtype, n, *flags.values()), dispatch_key,
                            device, lambda: op._kernel_key(dtype, n, **flags))
    kernel(dy.shape[0], dy, rows, op._vec(weight, n), op._rows(grad_residual, n), dx_rows,
           dw.view(n) if weight is not None else None,
           db.view(n) if bias is not None else None, op._eps())
    return outputs


# -- autograd -----------------------------------------------------------------------------
def _named(cls: type[Op], inputs: Sequence[Any]) -> dict[str, Any]:
    """The custom op's arguments by name (they come in the manifest's call order)."""
    return dict(zip(cls.spec.call_order, inputs, strict=True))


def _params(args: Mapping[str, Any]) -> dict[str, Any]:
    """The call's non-tensor arguments, the only ones a ctx attribute may hold. A tensor in a
    ctx attribute lives as long as the autograd graph (the loss's grad_fn), not until its
    backward node has run as a saved tensor does: each norm's input [T, N] stayed alive
    through the optimizer step (17 x 32 MiB at Llama-3.1-8B's 8 layers and 4K tokens)."""
    return {k: v for k, v in args.items() if not isinstance(v, torch.Tensor)}


def _save_inputs(cls: type[Op], names: Sequence[str]):
    def setup_context(ctx, inputs, output):
        args = _named(cls, inputs)
        ctx.args = _params(args)
        ctx.save_for_backward(*(args[n] for n in names))
    return setup_context


def _rms_norm_backward(ctx, grad_output):
    x, weight = ctx.saved_tensors
    shape, eps = ctx.args["normalized_shape"], ctx.args["eps"]
    dx, dw = RMSNormBwdOp.through_custom_op(grad_output, x, weight,
                                            normalized_shape=list(shape), eps=eps)
    return RMSNormFwdOp.grads_in_call_order(input=dx, weight=dw if weight is not None else None)


def _fused_add_backward(ctx, grad_output, grad_residual_out):
    h, weight = ctx.saved_tensors
    dx, dw = FusedAddRMSNormBwdOp.through_custom_op(grad_output, grad_residual_out, h, weight,
                                                    eps=ctx.args["eps"])
    return FusedAddRMSNormFwdOp.grads_in_call_order(input=dx, residual=dx, weight=dw)


def _fused_add_setup(ctx, inputs, output):
    args = _named(FusedAddRMSNormFwdOp, inputs)
    ctx.args = _params(args)
    ctx.save_for_backward(output[1], args["weight"])  # h: the backward's only row input


def _layer_norm_backward(ctx, grad_output):
    x, weight, bias = ctx.saved_tensors
    dx, dw, db = LayerNormBwdOp.through_custom_op(
        grad_output, x, weight, bias, normalized_shape=list(ctx.args["normalized_shape"]),
        eps=ctx.args["eps"])
    return LayerNormFwdOp.grads_in_call_order(input=dx, weight=dw if weight is not None else None,
                                              bias=db if bias is not None else None)


RMSNormFwdOp.register_autograd(_rms_norm_backward,
                               setup_context=_save_inputs(RMSNormFwdOp, ("input", "weight")))
FusedAddRMSNormFwdOp.register_autograd(_fused_add_backward, setup_context=_fused_add_setup)
LayerNormFwdOp.register_autograd(_layer_norm_backward,
                                 setup_context=_save_inputs(LayerNormFwdOp,
                                                            ("input", "weight", "bias")))


# -- functional API -----------------------------------------------------------------------
def rms_norm(input: torch.Tensor, normalized_shape: Sequence[int] | int,
             weight: torch.Tensor | None = None, eps: float | None = None) -> torch.Tensor:
    """torch.nn.functional.rms_norm on TileOPs kernels (differentiable)."""
    shape = _shape_tuple(normalized_shape)
    return RMSNormFwdOp.apply_keyed((input, weight), (shape, eps, type(eps)),
                                    lambda: {"normalized_shape": shape, "eps": eps})


def fused_add_rms_norm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(input + residual, [N], weight, eps), input + residual) in one pass, the
    pre-norm residual step of a Llama-style layer (differentiable)."""
    return FusedAddRMSNormFwdOp.apply(input, residual, weight, eps=eps)


def fused_add_rms_norm_(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """In place, as serving engines call it: `residual` becomes input + residual and
    `input` its RMSNorm; returns (input, residual). Both must be contiguous. Under
    torch.compile or autograd it runs out of place and copies into the inputs."""
    op = FusedAddRMSNormFwdOp.cached(eps=eps)
    if torch.compiler.is_compiling() or torch.is_grad_enabled() and (
            input.requires_grad or residual.requires_grad or weight.requires_grad):
        y, h = FusedAddRMSNormFwdOp.apply(input, residual, weight, eps=eps)
        return input.copy_(y), residual.copy_(h)
    meta = op.validate((input, residual, weight))
    if meta is not None:  # a shape check: the results are the inputs themselves
        return input, residual
    for name, t in (("input", input), ("residual", residual)):
        if not t.is_contiguous():
            raise op_error(TileOpsValueError, op.spec.op_name, name,
                           "a contiguous tensor (the in-place form writes into it)",
                           f"strides {tuple(t.stride())}")
    n = input.shape[-1]
    # contiguous: views of their storage (none for 2-D tensors: a view costs ~1.3 us)
    x = input if input.dim() == 2 else input.view(-1, n)
    r = residual if residual.dim() == 2 else residual.view(-1, n)
    op.launch(op._rows(x, n), op._rows(r, n), weight, x, r)
    return input, residual


def layer_norm(input: torch.Tensor, normalized_shape: Sequence[int] | int,
               weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               eps: float = 1e-5) -> torch.Tensor:
    """torch.nn.functional.layer_norm on TileOPs kernels (differentiable)."""
    shape = _shape_tuple(normalized_shape)
    return LayerNormFwdOp.apply_keyed((input, weight, bias), (shape, eps, type(eps)),
                                      lambda: {"normalized_shape": shape, "eps": float(eps)})
