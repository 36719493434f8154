"""Grouped fp8 GEMM: the MoE experts in e4m3 with DeepSeek-V3 block scaling.

grouped_gemm_fp8(a, b, offsets, scale_a, scale_b, out_dtype=bfloat16) -> out [M, N]:
out[rows of group e] = (a[rows] * scale_a) @ (b[e] * scale_b[e])^T, dequantized per block,
with
- a e4m3 [M, K], scale_a fp32 [M, K/128]: one scale per 1x128 group of a row (as
  quantize_fp8(a, 'group') returns it; its M-major storage, strides (1, M), is read in
  place, any other layout is copied);
- b e4m3 [E, N, K] (each expert's weight as nn.Linear stores it), scale_b fp32
  [E, N/128, K/128]: one scale per 128x128 block (DeepSeek-V3's checkpoints);
- offsets int32 [E]: the cumulative end rows, torch._grouped_mm's `offs` and
  tileops.grouped_gemm's convention. Read on the device only (no host sync, CUDA-graph
  safe), so not checked: non-decreasing, at most M. Output rows past offsets[-1] are not
  written.
K and N must be multiples of 128 (the scale blocks). Accumulation and error bound: those of
gemm_fp8's block scaling (tileops.ops.fp8): each 128-deep K block is summed by wgmma and
promoted into an fp32 accumulator, so against an fp32 GEMM of the dequantized inputs,
per output element, |out - ref| <= atol + rtol * |ref| + 4 * 2^-12 * (|a| @ |b|^T), with
(atol, rtol) the out_dtype rounding tolerance of tests/helpers.py
(tests/ops/test_grouped_gemm_fp8.py holds it). Inference only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..kernels.base import Kernel
from ..kernels.fp8 import GroupedGemmFp8Kernel
from ..manifest.spec import DTYPES
from .base import Op
from .fp8 import _dtype_name, _is_m_major
from .layout import tma_ready


class GroupedGemmFp8FwdOp(Op):
    """One block-scaled fp8 GEMM per expert over its group of rows, in one launch."""

    kernel_map = {"grouped_gemm_fp8": GroupedGemmFp8Kernel}

    def __init__(self, *, out_dtype: str = "bfloat16",
                 kernel_map: Mapping[str, type[Kernel]] | None = None, tune: bool = False):
        super().__init__(out_dtype=_dtype_name(out_dtype), kernel_map=kernel_map, tune=tune)

    def empty_outputs(self, ns: Mapping[str, Any], device: torch.device) -> list[torch.Tensor]:
        return [torch.empty((ns["M"], ns["N"]), dtype=DTYPES[self.out_dtype], device=device)]

    def forward(self, a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
                scale_a: torch.Tensor, scale_b: torch.Tensor) -> torch.Tensor:
        m = a.shape[0]
        n_experts, n, k = b.shape
        out = torch.empty((m, n), dtype=DTYPES[self.out_dtype], device=a.device)
        if m == 0:
            return out
        m_major = _is_m_major(scale_a)
        kernel = self.get_kernel("grouped_gemm_fp8", a.device,
                                 **self._kernel_key(n, k, n_experts, m_major))
        sa = scale_a.t() if m_major else scale_a.contiguous()  # [K/128, M] storage, in place
        kernel(m, tma_ready(a), tma_ready(b), sa, scale_b.contiguous(), offsets.contiguous(),
               out)
        return out

    def _kernel_key(self, n: int, k: int, n_experts: int, m_major: bool) -> dict[str, Any]:
        return {"n": n, "k": k, "n_experts": n_experts, "out_dtype": self.out_dtype,
                "scale_a_m_major": m_major}

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        if ns["M"] == 0:
            return []
        key = self._kernel_key(ns["N"], ns["K"], ns["E"], _is_m_major(ns["scale_a"]))
        return [("grouped_gemm_fp8", key, ns["M"])]


def grouped_gemm_fp8(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
                     scale_a: torch.Tensor, scale_b: torch.Tensor,
                     out_dtype: Any = torch.bfloat16) -> torch.Tensor:
    """out [M, N]: rows offsets[e-1]:offsets[e] of a times b[e]^T, dequantized by the 1x128
    scales of a and the 128x128 block scales of b; a, b float8_e4m3fn."""
    return GroupedGemmFp8FwdOp.apply(a, b, offsets, scale_a, scale_b,
                                     out_dtype=_dtype_name(out_dtype))
