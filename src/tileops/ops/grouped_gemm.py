"""Grouped GEMM (the expert MLPs of a mixture of experts), forward, backward and the gate-up
projection with its SiLU-and-mul epilogue, in torch._grouped_mm's layouts.

- `grouped_gemm(a, b, offsets)` -> out [M, N]: out[rows of group e] = a[rows] @ b[e]^T,
  a [M, K], b [E, N, K] (expert weights as nn.Linear stores them), offsets int32 [E] the
  cumulative end rows (torch._grouped_mm's `offs`: the same result as
  `torch._grouped_mm(a, b.transpose(-2, -1), offs=offsets)`). Differentiable in a and b.
- `GroupedGemmBwdOp`: (grad_a [M, K], grad_b [E, N, K]) of the above: grad_a = dy @ b[e]
  per group's rows (rows past offsets[-1] are zeros) and grad_b[e] = dy_e^T @ a_e (zeros
  for an expert with no rows). No host synchronization: the group sizes stay on the
  device, the weight gradient's reduction length is read there.
- `grouped_gemm_silu_and_mul(a, w_gate_up, offsets)` -> [M, F]: silu(a @ gate^T) *
  (a @ up^T) per group, w_gate_up [E, 2F, K] whose first F rows of each expert are the
  gate and the last F the up projection (Hugging Face's fused `gate_up_proj` of
  Mixtral / Qwen3-MoE, `linear(x, w).chunk(2, -1)`; vLLM's w13). One pass; the epilogue
  works on the fp32 accumulators, so it rounds once where grouped_gemm + silu_and_mul
  round the [M, 2F] product first. Inference only (training takes the two-step form,
  whose [M, 2F] product the backward needs).

Offsets are read on the device only, so they are not checked: they must be non-decreasing
and at most M; output rows past offsets[-1] are not written by the forwards. fp32
accumulation; K and N multiples of 8 (TMA's 16-byte rows).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..kernels.base import Kernel
from ..kernels.moe import GroupedGemmKernel, GroupedGemmWeightGradKernel
from ..manifest.spec import DTYPE_NAMES
from .base import Op
from .layout import tma_ready


def _key(dtype: Any, n: int, k: int, n_experts: int, **flags: bool) -> dict[str, Any]:
    return {"dtype": DTYPE_NAMES[dtype], "n": n, "k": k, "n_experts": n_experts, **flags}


class GroupedGemmFwdOp(Op):
    """One GEMM per expert over its group of rows, in one launch (no host sync)."""

    kernel_map = {"grouped_gemm": GroupedGemmKernel}

    def __init__(self, *, kernel_map: Mapping[str, type[Kernel]] | None = None,
                 tune: bool = False):
        super().__init__(kernel_map=kernel_map, tune=tune)

    def forward(self, a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        out = torch.empty((a.shape[0], b.shape[1]), dtype=a.dtype, device=a.device)
        if a.shape[0] == 0:
            return out
        kernel = self.get_kernel("grouped_gemm", a.device,
                                 **_key(a.dtype, b.shape[1], b.shape[2], b.shape[0]))
        kernel(a.shape[0], tma_ready(a), tma_ready(b), offsets.contiguous(), out)
        return out

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        if ns["M"] == 0:
            return []
        return [("grouped_gemm", _key(ns["a"].dtype, ns["N"], ns["K"], ns["E"]), ns["M"])]


class GroupedGemmBwdOp(Op):
    """(grad_a, grad_b) of grouped_gemm: an input-gradient grouped GEMM (b untransposed)
    and a per-expert weight-gradient GEMM reducing over each expert's rows."""

    kernel_map = {"grouped_gemm": GroupedGemmKernel,
                  "grouped_gemm_weight_grad": GroupedGemmWeightGradKernel}

    def __init__(self, *, kernel_map: Mapping[str, type[Kernel]] | None = None,
                 tune: bool = False):
        super().__init__(kernel_map=kernel_map, tune=tune)

    def forward(self, grad_output: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m, k = a.shape
        n_experts, n, _ = b.shape
        grad_a = torch.empty((m, k), dtype=a.dtype, device=a.device)
        grad_b = torch.empty((n_experts, n, k), dtype=a.dtype, device=a.device)
        if m == 0:
            return grad_a, grad_b.zero_()
        dy, offsets = tma_ready(grad_output), offsets.contiguous()
        self.get_kernel("grouped_gemm", a.device, **_key(a.dtype, k, n, n_experts,
                                                          trans_b=False))(
            m, dy, tma_ready(b), offsets, grad_a)
        self.get_kernel("grouped_gemm_weight_grad", a.device,
                        **_key(a.dtype, n, k, n_experts))(m, dy, tma_ready(a), offsets, grad_b)
        return grad_a, grad_b

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        if ns["M"] == 0:
            return []
        dtype = ns["a"].dtype
        return [("grouped_gemm", _key(dtype, ns["K"], ns["N"], ns["E"], trans_b=False),
                 ns["M"]),
                ("grouped_gemm_weight_grad", _key(dtype, ns["N"], ns["K"], ns["E"]), ns["M"])]


class GroupedGemmSiluAndMulFwdOp(Op):
    """The gate-up projection of the experts with silu(gate) * up fused in its epilogue."""

    kernel_map = {"grouped_gemm": GroupedGemmKernel}

    def __init__(self, *, kernel_map: Mapping[str, type[Kernel]] | None = None,
                 tune: bool = False):
        super().__init__(kernel_map=kernel_map, tune=tune)

    def forward(self, a: torch.Tensor, w_gate_up: torch.Tensor,
                offsets: torch.Tensor) -> torch.Tensor:
        n_experts, two_f, k = w_gate_up.shape
        out = torch.empty((a.shape[0], two_f // 2), dtype=a.dtype, device=a.device)
        if a.shape[0] == 0:
            return out
        kernel = self.get_kernel("grouped_gemm", a.device,
                                 **_key(a.dtype, two_f // 2, k, n_experts, silu_mul=True))
        kernel(a.shape[0], tma_ready(a), tma_ready(w_gate_up), offsets.contiguous(), out)
        return out

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        if ns["M"] == 0:
            return []
        return [("grouped_gemm", _key(ns["a"].dtype, ns["F"], ns["K"], ns["E"],
                                      silu_mul=True), ns["M"])]


# -- autograd -----------------------------------------------------------------------------
def _setup(ctx: Any, inputs: tuple, output: Any) -> None:
    a, b, offsets = inputs
    ctx.save_for_backward(a, b, offsets)


def _backward(ctx: Any, grad_output: torch.Tensor) -> tuple:
    a, b, offsets = ctx.saved_tensors
    grad_a, grad_b = GroupedGemmBwdOp.through_custom_op(grad_output, a, b, offsets)
    return GroupedGemmFwdOp.grads_in_call_order(a=grad_a, b=grad_b)


GroupedGemmFwdOp.register_autograd(_backward, setup_context=_setup)


def grouped_gemm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """out [M, N]: rows offsets[e-1]:offsets[e] of a times b[e]^T, for each expert e."""
    return GroupedGemmFwdOp.apply(a, b, offsets)


def grouped_gemm_silu_and_mul(a: torch.Tensor, w_gate_up: torch.Tensor,
                              offsets: torch.Tensor) -> torch.Tensor:
    """[M, F]: silu(a @ gate_e^T) * (a @ up_e^T) per group, w_gate_up [E, 2F, K]."""
    return GroupedGemmSiluAndMulFwdOp.apply(a, w_gate_up, offsets)
