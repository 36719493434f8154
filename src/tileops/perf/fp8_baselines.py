"""Baselines of the fp8 ops: torch._scaled_mm (cuBLAS / CUTLASS inside torch) in the scaling
the workload's scale shapes name, and torch's quantization recipe eager and compiled."""

from __future__ import annotations

import functools
from typing import Any

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def _quantize_eager(x, scale=None, granularity="tensor", group_size=128):
    """torch's recipe: scale = amax / 448, x_fp8 = clamp(x / scale) in e4m3."""
    xf = x.float()
    if scale is None:
        if granularity == "tensor":
            amax = xf.abs().amax()
        elif granularity == "row":
            amax = xf.abs().amax(-1, keepdim=True)
        else:
            amax = xf.unflatten(-1, (-1, group_size)).abs().amax(-1)
        scale = amax.clamp(min=1e-12) / E4M3_MAX
    s = scale.repeat_interleave(group_size, -1) if granularity == "group" else scale
    return (xf / s).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


@functools.cache
def _quantize_compiled():
    return torch.compile(_quantize_eager, dynamic=False)


class _ScaledMm:
    """torch._scaled_mm(a, b.t(), ...) with the scales in the layouts it takes, converted
    once per scale tensor (outside the timed calls that follow). torch 2.11 has no
    1x128 x 128x128 pairing: DeepSeek's 128x128 weight blocks are given to it as the
    1x128 x 1x128 pairing with each block's scale repeated over its 128 columns (the same
    numbers). `fast_accum` is torch's use_fast_accum (no promotion of wgmma's accumulator;
    what gemm_fp8 does for per-tensor and per-row scaling)."""

    def __init__(self, fast_accum: bool = False):
        self.fast_accum = fast_accum
        self.converted: dict[tuple, tuple] = {}

    def __call__(self, a, b, scale_a, scale_b, bias=None, out_dtype="bfloat16"):
        key = (scale_a.data_ptr(), scale_b.data_ptr(), a.shape[0])
        scales = self.converted.get(key)
        if scales is None:
            scales = self.converted[key] = self._scales(a, b, scale_a, scale_b, bias,
                                                        out_dtype)
        return self._call(a, b, scales, bias, out_dtype)

    def _call(self, a, b, scales, bias, out_dtype):
        return torch._scaled_mm(a, b.t(), *scales, bias=bias,
                                out_dtype=getattr(torch, out_dtype),
                                use_fast_accum=self.fast_accum)

    def _scales(self, a, b, scale_a, scale_b, bias, out_dtype) -> tuple:
        if scale_a.numel() == 1 and scale_b.numel() == 1:
            return scale_a.reshape(()), scale_b.reshape(())
        if scale_a.shape[1] == 1:  # per row: scale_b as (1, N)
            return scale_a.contiguous(), scale_b.reshape(1, -1).contiguous()
        if self.fast_accum:
            raise NotImplementedError("block scaling always promotes; see torch-scaled-mm")
        n = b.shape[0]
        sa = scale_a.t().contiguous().t()  # (M, K/128), M-major
        sb_cols = scale_b.repeat_interleave(128, 0)[:n]  # (N, K/128)
        last = None
        for sb in (sb_cols.t().contiguous(), sb_cols.contiguous().t()):  # (K/128, N)
            try:
                self._call(a, b, (sa, sb), bias, out_dtype)
                return sa, sb
            except RuntimeError as e:  # the other layout of the scale tensor
                last = e
        raise last


def fp8_baselines(op_name: str) -> dict[str, Any]:
    if op_name == "GemmFp8FwdOp":
        return {"torch-scaled-mm": _ScaledMm(),
                "torch-scaled-mm-fast-accum": _ScaledMm(fast_accum=True)}
    return {"torch-eager": _quantize_eager,
            "torch-compile": lambda *a, **k: _quantize_compiled()(*a, **k)}
