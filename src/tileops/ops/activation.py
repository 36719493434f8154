"""Activation family: gated MLP activations act(gate) * up, forward and backward.

- `silu_and_mul(x)` / `gelu_and_mul(x, approximate)`: the fused layout of vLLM's
  SiluAndMul / GeluAndMul and FlashInfer's silu_and_mul: x [..., 2N] -> act(x[..., :N]) *
  x[..., N:], [..., N].
- `swiglu(gate, up)`: silu(gate) * up on two tensors (the Hugging Face MLP form), and
  `geglu(gate, up, approximate)`: gelu(gate) * up (Gemma's MLP, approximate='tanh'). When
  gate and up are the two halves of one [..., 2N] tensor (`x.chunk(2, -1)`), the fused
  kernel reads them in place instead of copying them contiguous.

fp16, bf16 and fp32; math in fp32, results in the input dtype, so they can differ from
torch eager's fp16/bf16 result, which rounds act(gate) before the product, by one rounding.
Each forward is a torch custom op whose autograd runs the matching backward op; the
backward saves only the inputs and recomputes the activation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..errors import TileOpsUnsupportedError, TileOpsValueError, op_error
from ..kernels.activation import GatedActivationKernel
from ..kernels.activation.gated_activation import MAX_VECTORS, vector_width
from ..kernels.base import Kernel
from ..manifest.spec import DTYPE_NAMES
from .base import Op
from .layout import is_tma_ready, tma_ready

_GELU = {"none": "gelu", "tanh": "gelu_tanh"}  # approximate -> kernel activation
_KERNELS = {"gated_activation": GatedActivationKernel}
_SAFE_ELEMENTS = 1 << 30  # below this many elements the int32 vector indices cannot overflow


def _kernel_key(dtype: torch.dtype, n: int, activation: str, backward: bool,
                fused: bool) -> dict[str, Any]:
    return {"dtype": DTYPE_NAMES[dtype], "n": n, "activation": activation,
            "backward": backward, "fused": fused}


def _launch(op: Op, activation: str, backward: bool, fused: bool, rows: int, n: int,
            *tensors: torch.Tensor) -> None:
    """Runs the kernel on [rows, n] / [rows, 2n] tensors (contiguous, 16-byte aligned)."""
    dtype = tensors[0].dtype
    if rows * n >= _SAFE_ELEMENTS and rows * (n // vector_width(n, DTYPE_NAMES[dtype])) \
            > MAX_VECTORS - 4096:
        raise op_error(TileOpsUnsupportedError, op.spec.op_name, "shapes",
                       f"fewer than 2^31 vectors of {vector_width(n, DTYPE_NAMES[dtype])} "
                       "elements per tensor (split the tokens into chunks)",
                       f"{rows} rows of {n}")
    device = tensors[0].device
    kernel = op.memo_kernel(("gated_activation", device, dtype, n, activation, backward, fused),
                            "gated_activation", device,
                            lambda: _kernel_key(dtype, n, activation, backward, fused))
    kernel(rows, *tensors)


def _rows(shape: torch.Size, n: int) -> int:
    return shape.numel() // n if n else 0


def _as_rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """t as a contiguous, aligned [rows, width] tensor (a copy only when it is not one)."""
    t = tma_ready(t)
    return t if t.dim() == 2 else t.view(-1, width)


def _halves_of_one_tensor(gate: torch.Tensor, up: torch.Tensor, rows: int,
                          n: int) -> torch.Tensor | None:
    """The [rows, 2n] tensor whose left and right halves gate and up are, else None."""
    if gate.stride() != up.stride() or gate.stride(-1) != 1 or \
            up.data_ptr() != gate.data_ptr() + n * gate.element_size() or \
            gate.data_ptr() % 16:
        return None
    pitch = 2 * n
    for size, stride in zip(reversed(gate.shape[:-1]), reversed(gate.stride()[:-1]),
                            strict=True):
        if size != 1 and stride != pitch:
            return None
        pitch *= size
    return gate.as_strided((rows, 2 * n), (2 * n, 1))


def _fused_forward(op: Op, activation: str, x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    rows = _rows(out.shape, n)
    if rows:
        _launch(op, activation, False, True, rows, n, _as_rows(x, 2 * n),
                out if out.dim() == 2 else out.view(rows, n))
    return out


def _fused_backward(op: Op, activation: str, grad_out: torch.Tensor,
                    x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1] // 2
    grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = _rows(grad_out.shape, n)
    if rows:
        _launch(op, activation, True, True, rows, n, _as_rows(grad_out, n),
                _as_rows(x, 2 * n), grad_x if grad_x.dim() == 2 else grad_x.view(rows, 2 * n))
    return grad_x


def _fused_kernels(activation: str, backward: bool,
                   ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
    key = _kernel_key(ns["x"].dtype, ns["N"], activation, backward, True)
    return [("gated_activation", key, ns["rows"])]


class _GeluGated:
    """Mixed into the GeLU-gated ops (before Op; every Op subclass is a manifest op): their
    shared param `approximate`, 'none' or 'tanh' as F.gelu."""

    kernel_map = _KERNELS

    def __init__(self, *, approximate: str = "none",
                 kernel_map: Mapping[str, type[Kernel]] | None = None, tune: bool = False):
        super().__init__(approximate=approximate, kernel_map=kernel_map, tune=tune)
        if approximate not in _GELU:
            raise op_error(TileOpsValueError, self.spec.op_name, "approximate",
                           "'none' or 'tanh' (as torch.nn.functional.gelu)",
                           repr(approximate))


class SiluAndMulFwdOp(Op):
    """silu(x[..., :N]) * x[..., N:] for x [..., 2N] (vLLM SiluAndMul)."""

    kernel_map = _KERNELS

    def __init__(self, *, kernel_map: Mapping[str, type[Kernel]] | None = None,
                 tune: bool = False):
        super().__init__(kernel_map=kernel_map, tune=tune)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _fused_forward(self, "silu", x)

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        return _fused_kernels("silu", False, ns)


class SiluAndMulBwdOp(Op):
    """grad_x [..., 2N] of silu_and_mul from grad_out [..., N] and x (recomputes silu)."""

    kernel_map = _KERNELS

    def __init__(self, *, kernel_map: Mapping[str, type[Kernel]] | None = None,
                 tune: bool = False):
        super().__init__(kernel_map=kernel_map, tune=tune)

    def forward(self, grad_out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return _fused_backward(self, "silu", grad_out, x)

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        return _fused_kernels("silu", True, ns)


class GeluAndMulFwdOp(_GeluGated, Op):
    """gelu(x[..., :N], approximate) * x[..., N:] for x [..., 2N] (vLLM GeluAndMul)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _fused_forward(self, _GELU[self.approximate], x)

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        return _fused_kernels(_GELU[self.approximate], False, ns)


class GeluAndMulBwdOp(_GeluGated, Op):
    """grad_x [..., 2N] of gelu_and_mul from grad_out [..., N] and x (recomputes gelu)."""

    def forward(self, grad_out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return _fused_backward(self, _GELU[self.approximate], grad_out, x)

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        return _fused_kernels(_GELU[self.approximate], True, ns)


def _split_forward(op: Op, activation: str, gate: torch.Tensor,
                   up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up on two [..., N] tensors; the two halves of one [..., 2N] tensor run
    the fused layout in place."""
    n = gate.shape[-1]
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    rows = _rows(gate.shape, n)
    if not rows:
        return out
    out2 = out if out.dim() == 2 else out.view(rows, n)
    x = None if gate.is_contiguous() else _halves_of_one_tensor(gate, up, rows, n)
    if x is not None:
        _launch(op, activation, False, True, rows, n, x, out2)
    else:
        _launch(op, activation, False, False, rows, n, _as_rows(gate, n), _as_rows(up, n),
                out2)
    return out


def _split_backward(op: Op, activation: str, grad_out: torch.Tensor, gate: torch.Tensor,
                    up: torch.Tensor,
                    into_inputs: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_gate, grad_up); with `into_inputs`, written over gate and up themselves where
    the kernel reads them in place (contiguous, aligned: see `_MlpActivation`)."""
    n = gate.shape[-1]
    if into_inputs and is_tma_ready(gate) and is_tma_ready(up):
        grad_gate, grad_up = gate, up
    else:
        grad_gate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        grad_up = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    rows = _rows(gate.shape, n)
    if rows:
        _launch(op, activation, True, False, rows, n, _as_rows(grad_out, n),
                _as_rows(gate, n), _as_rows(up, n), grad_gate.view(rows, n),
                grad_up.view(rows, n))
    return grad_gate, grad_up


def _split_kernels(activation: str, backward: bool,
                   ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
    key = _kernel_key(ns["gate"].dtype, ns["N"], activation, backward, False)
    return [("gated_activation", key, ns["rows"])]


class SwigluFwdOp(Op):
    """silu(gate) * up for gate, up [..., N] (the Hugging Face gated MLP)."""

    kernel_map = _KERNELS

    def __init__(self, *, kernel_map: Mapping[str, type[Kernel]] | None = None,
                 tune: bool = False):
        super().__init__(kernel_map=kernel_map, tune=tune)

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return _split_forward(self, "silu", gate, up)

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        return _split_kernels("silu", False, ns)


class SwigluBwdOp(Op):
    """grad_gate, grad_up of swiglu from grad_out, gate and up (recomputes silu)."""

    kernel_map = _KERNELS

    def __init__(self, *, kernel_map: Mapping[str, type[Kernel]] | None = None,
                 tune: bool = False):
        super().__init__(kernel_map=kernel_map, tune=tune)

    def forward(self, grad_out: torch.Tensor, gate: torch.Tensor,
                up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _split_backward(self, "silu", grad_out, gate, up)

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        return _split_kernels("silu", True, ns)


class GegluFwdOp(_GeluGated, Op):
    """gelu(gate, approximate) * up for gate, up [..., N] (the Hugging Face Gemma MLP:
    gelu_pytorch_tanh is approximate='tanh')."""

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return _split_forward(self, _GELU[self.approximate], gate, up)

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        return _split_kernels(_GELU[self.approximate], False, ns)


class GegluBwdOp(_GeluGated, Op):
    """grad_gate, grad_up of geglu from grad_out, gate and up (recomputes gelu)."""

    def forward(self, grad_out: torch.Tensor, gate: torch.Tensor,
                up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _split_backward(self, _GELU[self.approximate], grad_out, gate, up)

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        return _split_kernels(_GELU[self.approximate], True, ns)


# -- autograd: each forward custom op runs its backward op -------------------------------
def _save_inputs(ctx: Any, inputs: tuple, output: Any) -> None:
    n_tensors = sum(isinstance(t, torch.Tensor) for t in inputs)
    ctx.save_for_backward(*inputs[:n_tensors])
    ctx.params = inputs[n_tensors:]


def _silu_and_mul_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    (x,) = ctx.saved_tensors
    return (SiluAndMulBwdOp.torch_op(grad, x),)


def _gelu_and_mul_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    (x,) = ctx.saved_tensors
    return GeluAndMulBwdOp.torch_op(grad, x, *ctx.params), None


def _swiglu_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    gate, up = ctx.saved_tensors
    return tuple(SwigluBwdOp.torch_op(grad, gate, up))


def _geglu_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    gate, up = ctx.saved_tensors
    return (*GegluBwdOp.torch_op(grad, gate, up, *ctx.params), None)


for _fwd, _bwd in ((SiluAndMulFwdOp, _silu_and_mul_backward),
                   (GeluAndMulFwdOp, _gelu_and_mul_backward),
                   (SwigluFwdOp, _swiglu_backward),
                   (GegluFwdOp, _geglu_backward)):
    _fwd.register_autograd(_bwd, setup_context=_save_inputs)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :N]) * x[..., N:] for x [..., 2N]; returns [..., N]."""
    return SiluAndMulFwdOp.apply(x)


def gelu_and_mul(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """gelu(x[..., :N], approximate=approximate) * x[..., N:] for x [..., 2N]."""
    return GeluAndMulFwdOp.apply(x, approximate=approximate)


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, reuse_inputs: bool = False) -> torch.Tensor:
    """silu(gate) * up. `reuse_inputs=True`: the backward writes the gradients over gate and
    up, for intermediates no one else holds (a gated MLP's two projections): two tensors of
    their size never allocated (see `_reusing_inputs`)."""
    if reuse_inputs:
        return _reusing_inputs(gate, up, "silu")
    return SwigluFwdOp.apply(gate, up)


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "none", *,
          reuse_inputs: bool = False) -> torch.Tensor:
    """gelu(gate, approximate=approximate) * up (Gemma's MLP: approximate='tanh');
    `reuse_inputs` as in `swiglu`."""
    if reuse_inputs and approximate in _GELU:
        return _reusing_inputs(gate, up, _GELU[approximate])
    return GegluFwdOp.apply(gate, up, approximate=approximate)


# -- reuse_inputs: the backward over an MLP's own intermediates ---------------------------
_MLP_OPS = {"silu": (SwigluFwdOp, SwigluBwdOp, {}),
            "gelu": (GegluFwdOp, GegluBwdOp, {"approximate": "none"}),
            "gelu_tanh": (GegluFwdOp, GegluBwdOp, {"approximate": "tanh"})}


class _MlpActivation(torch.autograd.Function):
    """act(gate) * up whose backward writes grad_gate and grad_up over gate and up (each
    element is read before it is written, by the same thread): at the backward of a
    Llama-3.1-8B layer's MLP, 224 MiB (4K tokens) that are not allocated."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
        fwd, _, params = _MLP_OPS[activation]
        ctx.activation = activation
        ctx.save_for_backward(gate, up)
        return fwd.cached(**params)(gate, up)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        gate, up = ctx.saved_tensors
        _, bwd, params = _MLP_OPS[ctx.activation]
        op = bwd.cached(**params)
        if gate.device.type == "meta" or not (is_tma_ready(gate) and is_tma_ready(up)):
            return (*op(grad, gate, up), None)  # (meta: checked and recorded, no launch)
        op.validate((grad, gate, up))
        _split_backward(op, ctx.activation, grad, gate, up, into_inputs=True)
        # a second backward through a retained graph must fail loudly, not read gradients
        torch.autograd.graph.increment_version(gate)
        torch.autograd.graph.increment_version(up)
        return gate.detach(), up.detach(), None


def _reusing_inputs(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up (activation 'silu', 'gelu' or 'gelu_tanh') whose backward overwrites
    gate and up with their gradients: eager calls that will need a gradient only (under
    torch.compile, or with none wanted, the op that never writes its inputs)."""
    fwd, _, params = _MLP_OPS[activation]
    if torch.compiler.is_compiling() or not (torch.is_grad_enabled() and (
            gate.requires_grad or up.requires_grad)):
        return fwd.apply(gate, up, **params)
    return _MlpActivation.apply(gate, up, activation)
