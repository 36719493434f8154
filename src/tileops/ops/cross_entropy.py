"""Cross-entropy over vocabulary rows: loss, gradient, and the two in one pass.

`cross_entropy(input, target, ...)` is torch.nn.functional.cross_entropy for logits
[M, V] and class indices [M], plus two options of LLM training: `softcap` (Gemma-2's final
logit soft-capping, applied first) and `lse_square_scale` (the z-loss, scale * lse^2 per
row). Math in fp32; the loss comes back in the input dtype, as torch's.

Two autograd paths:
- default: the forward reads the logits once (loss and logsumexp per row); the backward
  reads them once more and writes the gradient, scaled by the incoming gradient on the
  device (no host synchronization, CUDA-graph safe, torch.compile-able).
- `inplace_backward=True` (eager only): the forward computes the loss and writes the
  gradient over the logits in the same pass, as Liger-Kernel does, so no gradient-sized
  buffer is ever allocated; the logits are destroyed (their version counter is bumped,
  so autograd refuses any other use of them that saved them). The backward scales that
  gradient in place.

Targets outside [0, V) that are not `ignore_index`: with `check_target=True` a
TileOpsValueError (one host synchronization); otherwise the row's loss and gradient are
NaN, so a mean loss is NaN: loud, never a silently wrong number.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..errors import TileOpsUnsupportedError, TileOpsValueError, op_error
from ..kernels.base import Kernel
from ..kernels.softmax import CrossEntropyKernel
from ..manifest.spec import DTYPE_NAMES
from .base import Op
from .layout import tma_ready

_KERNELS = {"cross_entropy": CrossEntropyKernel}
_REDUCTIONS = ("mean", "sum", "none")


class _CrossEntropy:
    """Shared host side (a mixin: every Op subclass is bound to a manifest entry)."""

    kernel_map = _KERNELS
    ignore_index: int
    label_smoothing: float
    softcap: float | None
    lse_square_scale: float

    def __init__(self, *, ignore_index: int = -100, label_smoothing: float = 0.0,
                 softcap: float | None = None, lse_square_scale: float = 0.0,
                 kernel_map: Mapping[str, type[Kernel]] | None = None, tune: bool = False):
        super().__init__(ignore_index=ignore_index, label_smoothing=float(label_smoothing),
                         softcap=None if softcap is None else float(softcap),
                         lse_square_scale=float(lse_square_scale), kernel_map=kernel_map,
                         tune=tune)

    @classmethod
    def index_bounds(cls, inputs: Mapping[str, Any],
                     params: Mapping[str, Any] | None = None) -> dict[str, int]:
        return {"target": inputs["input"].shape[-1]}

    def _key(self, mode: str, dtype: torch.dtype, n: int,
             dloss_per_row: bool = False) -> dict[str, Any]:
        return {"mode": mode, "dtype": DTYPE_NAMES[dtype], "n": n,
                "softcap": self.softcap is not None, "smoothing": self.label_smoothing != 0.0,
                "dloss_per_row": dloss_per_row}

    def _scalars(self) -> tuple[int, float, float, float]:
        cap = 1.0 if self.softcap is None else self.softcap
        return self.ignore_index, cap, self.label_smoothing, self.lse_square_scale

    def _run(self, mode: str, logits: torch.Tensor, *tensors: torch.Tensor,
             dloss_per_row: bool = False) -> None:
        rows, n = logits.shape
        if rows == 0:
            return
        kernel = self.get_kernel("cross_entropy", logits.device,
                                 **self._key(mode, logits.dtype, n, dloss_per_row))
        kernel(rows, *tensors, *self._scalars())

    def launch_loss_and_grad(self, logits: torch.Tensor, target: torch.Tensor,
                             grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, lse) per row, fp32, and the unscaled gradient written into `grad` (which
        may be `logits` itself: each element is read before it is written)."""
        rows = logits.shape[0]
        loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
        lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
        self._run("loss_and_grad", logits, logits, target, loss, lse, grad)
        return loss, lse

    def _kernels(self, mode: str, ns: Mapping[str, Any],
                 dloss_per_row: bool = False) -> list[tuple[str, dict[str, Any], int]]:
        key = self._key(mode, ns["input"].dtype, ns["V"], dloss_per_row)
        return [("cross_entropy", key, ns["M"])]


class CrossEntropyFwdOp(_CrossEntropy, Op):
    """(loss, lse) per row, fp32: one pass over the logits."""

    def forward(self, input: torch.Tensor,
                target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = input.shape[0]
        loss = torch.empty(rows, dtype=torch.float32, device=input.device)
        lse = torch.empty(rows, dtype=torch.float32, device=input.device)
        self._run("loss", input, tma_ready(input), target.contiguous(), loss, lse)
        return loss, lse

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        return self._kernels("loss", ns)


class CrossEntropyWithGradFwdOp(_CrossEntropy, Op):
    """(loss, lse, grad) per row: the loss and its unscaled gradient d loss[i] / d input[i]
    in one pass (the gradient is what a 'sum' reduction's backward gets)."""

    def forward(self, input: torch.Tensor,
                target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        grad = torch.empty(input.shape, dtype=input.dtype, device=input.device)
        loss, lse = self.launch_loss_and_grad(tma_ready(input), target.contiguous(), grad)
        return loss, lse, grad

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        return self._kernels("loss_and_grad", ns)


class CrossEntropyBwdOp(_CrossEntropy, Op):
    """grad_input = grad_loss[i] * d loss[i] / d input[i], from the forward's lse; a
    one-element grad_loss applies to every row (the 'mean' and 'sum' reductions)."""

    def forward(self, grad_loss: torch.Tensor, input: torch.Tensor, target: torch.Tensor,
                lse: torch.Tensor) -> torch.Tensor:
        grad = torch.empty(input.shape, dtype=input.dtype, device=input.device)
        per_row = grad_loss.numel() != 1 or input.shape[0] == 1
        self._run("grad", input, grad_loss.contiguous(), tma_ready(input), target.contiguous(),
                  lse.contiguous(), grad, dloss_per_row=per_row)
        return grad

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        per_row = ns["grad_loss"].numel() != 1 or ns["M"] == 1
        return self._kernels("grad", ns, per_row)


# -- autograd (default path) ---------------------------------------------------------------
_PARAMS = ("ignore_index", "label_smoothing", "softcap", "lse_square_scale")


def _setup(ctx, inputs, output):
    args = dict(zip(CrossEntropyFwdOp.spec.call_order, inputs, strict=True))
    ctx.params = {p: args[p] for p in _PARAMS}
    ctx.save_for_backward(args["input"], args["target"], output[1])


def _backward(ctx, grad_loss, _grad_lse):
    x, target, lse = ctx.saved_tensors
    if grad_loss.dim() == 1 and grad_loss.shape[0] > 1 and grad_loss.stride(0) == 0:
        grad_loss = grad_loss[:1]  # a reduction's expanded scalar: the kernel broadcasts it
    grad = CrossEntropyBwdOp.through_custom_op(grad_loss, x, target, lse, **ctx.params)
    return CrossEntropyFwdOp.grads_in_call_order(input=grad)


CrossEntropyFwdOp.register_autograd(_backward, setup_context=_setup)


# -- autograd (gradient written over the logits) -------------------------------------------
class _InplaceCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, params: dict[str, Any],
                reduction: str) -> torch.Tensor:
        op = CrossEntropyWithGradFwdOp.cached(**params)
        op.validate((logits, target))
        if not logits.is_contiguous() or logits.data_ptr() % 16:
            raise op_error(TileOpsValueError, op.spec.op_name, "input",
                           "a contiguous, 16-byte aligned tensor (inplace_backward writes "
                           "the gradient into it)", f"strides {tuple(logits.stride())}")
        loss, _ = op.launch_loss_and_grad(logits, target.contiguous(), logits)
        torch.autograd.graph.increment_version(logits)  # its values are now the gradient
        ctx.reduction = reduction
        n_valid = _valid_count(target, params["ignore_index"])
        ctx.save_for_backward(logits, n_valid)
        return _reduce(loss, reduction, n_valid).to(logits.dtype)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad, n_valid = ctx.saved_tensors
        scale = grad_output.float()
        if ctx.reduction == "mean":
            scale = scale / n_valid
        scale = scale[:, None] if ctx.reduction == "none" else scale
        return grad.mul_(scale.to(grad.dtype)), None, None, None


def _valid_count(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    return (target != ignore_index).sum()


def _reduce(loss: torch.Tensor, reduction: str, n_valid: torch.Tensor) -> torch.Tensor:
    if reduction == "none":
        return loss
    total = loss.sum()
    return total / n_valid if reduction == "mean" else total


# -- functional API -----------------------------------------------------------------------
def cross_entropy(input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                  size_average: Any = None, ignore_index: int = -100, reduce: Any = None,
                  reduction: str = "mean", label_smoothing: float = 0.0, *,
                  softcap: float | None = None, lse_square_scale: float = 0.0,
                  inplace_backward: bool = False, check_target: bool = False) -> torch.Tensor:
    """torch.nn.functional.cross_entropy for logits [M, V] and class indices [M] on TileOPs
    kernels (differentiable), plus Gemma-2's `softcap` and the z-loss `lse_square_scale`.

    Class weights and the legacy `size_average` / `reduce` arguments are refused. See the
    module doc for `inplace_backward` and `check_target`.
    """
    name = CrossEntropyFwdOp.spec.op_name
    for arg, value in (("weight", weight), ("size_average", size_average), ("reduce", reduce)):
        if value is not None:
            raise op_error(TileOpsUnsupportedError, name, arg,
                           "None (class weights and the legacy reduction flags are not "
                           "supported)", type(value).__name__)
    if reduction not in _REDUCTIONS:
        raise op_error(TileOpsValueError, name, "reduction", "'mean', 'sum' or 'none'",
                       repr(reduction))
    params = {"ignore_index": ignore_index, "label_smoothing": label_smoothing,
              "softcap": softcap, "lse_square_scale": lse_square_scale}
    if check_target:
        _check_target(name, input, target, ignore_index)
    if inplace_backward and torch.is_grad_enabled() and input.requires_grad:
        if torch.compiler.is_compiling():
            raise op_error(TileOpsUnsupportedError, name, "inplace_backward",
                           "False under torch.compile (the in-place gradient is eager-only)",
                           True)
        return _InplaceCrossEntropy.apply(input, target, params, reduction)
    loss, _ = CrossEntropyFwdOp.apply(input, target, **params)
    if reduction == "none":
        return loss.to(input.dtype)
    return _reduce(loss, reduction, _valid_count(target, ignore_index)).to(input.dtype)


def _check_target(name: str, input: torch.Tensor, target: torch.Tensor,
                  ignore_index: int) -> None:
    """Raises for a class index outside [0, V) that is not ignore_index (syncs the host)."""
    if input.device.type == "meta" or input.dim() != 2:
        return  # nothing to look at, or the op's own checks will say what is wrong
    vocab = input.shape[-1]
    bad = ((target < 0) | (target >= vocab)) & (target != ignore_index)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise op_error(TileOpsValueError, name, "target",
                       f"class indices in [0, {vocab}) or ignore_index={ignore_index}",
                       f"{int(target[i])} at position {i}")
