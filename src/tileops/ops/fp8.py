"""FP8 (e4m3) family: `tileops.quantize_fp8` and `tileops.gemm_fp8`.

quantize_fp8(x, granularity, group_size, scale) -> (x_fp8, scales): torch's recipe
(scale = amax / 448, x_fp8 = clamp(x / scale, -448, 448).to(float8_e4m3fn)), bit for bit,
except that a NaN stays in its own element (torch's amax would spread it over the group) and
an all-zero group gets the floor scale 1e-12 / 448 instead of 0 (no 0 / 0). Group scales are
returned M-major (strides (1, rows)): what torch._scaled_mm's blockwise path and gemm_fp8
take without a copy.

gemm_fp8(a, b, scale_a, scale_b, out_dtype, bias) = (a @ b^T) * scales + bias, as
torch._scaled_mm(a, b.t(), scale_a, scale_b^T, bias, out_dtype=out_dtype) where the two
overlap. Accumulation: Hopper's fp8 wgmma adds into its accumulator with 13 mantissa bits
(an "fp22"; DeepSeek-V3 report sec. 3.3.2, SageAttention2). Block scaling promotes every 128-wide K
block into a true fp32 accumulator (DeepSeek's remedy); per-tensor and per-row scaling keep
the wgmma accumulator over all of K, like torch._scaled_mm(..., use_fast_accum=True) and
vLLM's CUTLASS fp8 kernels. Error bound, against an fp32 GEMM of the dequantized inputs,
per output element, with |a| @ |b|^T the sum of the magnitudes of its terms:
    |d - ref| <= atol + rtol * |ref| + s * 2^-12 * (|a| @ |b|^T)
where (atol, rtol) is the out_dtype rounding tolerance of tests/helpers.py and s the number
of 32-deep wgmma steps summed without promotion: 4 for block scaling, K / 32 otherwise.
tests/ops/test_fp8.py holds this bound (and a relative L2 error under 1e-2 for block
scaling, 3e-2 otherwise).

Inputs must be contiguous with K a multiple of 16 (TMA's 16-byte rows); other strides are
copied. Block scaling needs K % 128 == 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..errors import TileOpsTypeError, TileOpsValueError, op_error
from ..kernels.base import Kernel
from ..kernels.fp8.gemm_fp8 import SCALE_BLOCK, Fp8GemmKernel
from ..kernels.fp8.quantize import AMAX_FLOOR, INV_E4M3_MAX, QuantizeFp8Kernel
from ..manifest.spec import DTYPE_NAMES, DTYPES
from .base import Op
from .layout import as_rows, tma_ready

K_ALIGN = 16  # TMA: 16-byte rows of e4m3
GRANULARITIES = ("tensor", "row", "group")


def _rows_and_k(x: torch.Tensor) -> tuple[int, int]:
    k = x.shape[-1]
    return (x.numel() // k if k else 0), k


class QuantizeFp8FwdOp(Op):
    """(x_fp8, scales) of x, per tensor, per row or per 1 x group_size group."""

    kernel_map = {"quantize": QuantizeFp8Kernel}

    def __init__(self, *, granularity: str = "tensor", group_size: int = 128,
                 kernel_map: Mapping[str, type[Kernel]] | None = None, tune: bool = False):
        super().__init__(granularity=granularity, group_size=group_size,
                         kernel_map=kernel_map, tune=tune)
        name = self.spec.op_name
        if granularity not in GRANULARITIES:
            raise op_error(TileOpsValueError, name, "granularity", f"one of {GRANULARITIES}",
                           repr(granularity))
        if granularity == "group" and (group_size <= 0 or group_size % K_ALIGN):
            raise op_error(TileOpsValueError, name, "group_size",
                           f"a positive multiple of {K_ALIGN}", group_size)

    def check(self, inputs: Sequence[Any], require_cuda: bool = False) -> dict[str, Any]:
        ns = super().check(inputs, require_cuda)
        name, x, scale = self.spec.op_name, ns["x"], ns["scale"]
        k = ns["K"]
        if k == 0 or k % K_ALIGN:
            raise op_error(TileOpsValueError, name, "x", f"a last dimension that is a positive "
                           f"multiple of {K_ALIGN} (16-byte fp8 rows)", tuple(x.shape))
        if self.granularity == "group" and k % self.group_size:
            raise op_error(TileOpsValueError, name, "x", f"a last dimension that is a multiple "
                           f"of group_size={self.group_size}", tuple(x.shape))
        if scale is not None:
            want = self._scale_shape(x)
            ok = (scale.numel() == 1 if self.granularity == "tensor"
                  else tuple(scale.shape) == want)
            if not ok:
                raise op_error(TileOpsValueError, name, "scale",
                               f"shape {want} ({self.granularity} granularity)",
                               tuple(scale.shape))
        return ns

    def _scale_shape(self, x: torch.Tensor) -> tuple[int, ...]:
        if self.granularity == "tensor":
            return ()
        k = x.shape[-1]
        return (*x.shape[:-1], 1 if self.granularity == "row" else k // self.group_size)

    def empty_outputs(self, ns: Mapping[str, Any], device: torch.device) -> list[torch.Tensor]:
        x = ns["x"]
        y = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=device)
        if self.granularity != "group":
            return [y, torch.empty(self._scale_shape(x), dtype=torch.float32, device=device)]
        # M-major: stored [K / group, *lead], seen as [*lead, K / group]
        lead = tuple(x.shape[:-1])
        store = torch.empty((x.shape[-1] // self.group_size, *lead), dtype=torch.float32,
                            device=device)
        return [y, store.permute(*range(1, len(lead) + 1), 0)]

    def forward(self, x: torch.Tensor,
                scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        y, scales = self.empty_outputs({"x": x}, x.device)
        rows, k = _rows_and_k(x)
        if rows == 0:
            if self.granularity == "tensor":
                scales.copy_(scale.reshape(()) if scale is not None
                             else torch.tensor(AMAX_FLOOR * INV_E4M3_MAX))
            return y, scales
        kernel = self.get_kernel("quantize", x.device, **self._kernel_key(x.dtype, k,
                                                                          scale is None))
        src = None if scale is None else self._scale_in(scale, rows)
        kernel(rows, as_rows(x, k), src, y.view(rows, k), self._scale_out(scales, rows))
        return y, scales

    def _scale_in(self, scale: torch.Tensor, rows: int) -> torch.Tensor:
        """A given scale as the kernel reads it: [1], or [K / group or 1, rows] M-major."""
        if self.granularity == "tensor":
            return scale.reshape(1)
        return scale.reshape(rows, -1).t().contiguous()

    def _scale_out(self, scales: torch.Tensor, rows: int) -> torch.Tensor:
        if self.granularity == "tensor":
            return scales.view(1)
        if self.granularity == "row":
            return scales.view(1, rows)
        return scales.permute(-1, *range(scales.dim() - 1)).view(-1, rows)

    def _kernel_key(self, dtype: torch.dtype, k: int, dynamic: bool) -> dict[str, Any]:
        group = self.group_size if self.granularity == "group" else 0
        return {"dtype": DTYPE_NAMES[dtype], "k": k, "granularity": self.granularity,
                "group": group, "dynamic": dynamic}

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        key = self._kernel_key(ns["x"].dtype, ns["K"], ns["scale"] is None)
        return [("quantize", key, ns["rows"])]


class GemmFp8FwdOp(Op):
    """d = (a @ b^T) * scales (+ bias) with a, b in e4m3; the scaling from the scale shapes."""

    kernel_map = {"gemm_fp8": Fp8GemmKernel}

    def __init__(self, *, out_dtype: str = "bfloat16",
                 kernel_map: Mapping[str, type[Kernel]] | None = None, tune: bool = False):
        super().__init__(out_dtype=_dtype_name(out_dtype), kernel_map=kernel_map, tune=tune)

    def check(self, inputs: Sequence[Any], require_cuda: bool = False) -> dict[str, Any]:
        ns = super().check(inputs, require_cuda)
        name = self.spec.op_name
        m, n, k = ns["M"], ns["N"], ns["K"]
        if k % K_ALIGN:
            raise op_error(TileOpsValueError, name, "a", f"K (a.shape[1]) a multiple of "
                           f"{K_ALIGN} (16-byte fp8 rows for TMA)", k)
        ns["scaling"] = scaling_of(name, ns["scale_a"], ns["scale_b"], m, n, k)
        bias = ns["bias"]
        if bias is not None and DTYPE_NAMES[bias.dtype] != self.out_dtype:
            raise op_error(TileOpsTypeError, name, "bias",
                           f"dtype {self.out_dtype} (out_dtype)", bias.dtype)
        return ns

    def empty_outputs(self, ns: Mapping[str, Any], device: torch.device) -> list[torch.Tensor]:
        return [torch.empty((ns["M"], ns["N"]), dtype=DTYPES[self.out_dtype], device=device)]

    def forward(self, a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                scale_b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        m, k = a.shape
        n = b.shape[0]
        d = torch.empty((m, n), dtype=DTYPES[self.out_dtype], device=a.device)
        if m == 0 or n == 0:
            return d
        if k == 0:
            return d.copy_(bias.expand_as(d)) if bias is not None else d.zero_()
        scaling = scaling_of(self.spec.op_name, scale_a, scale_b, m, n, k)
        m_major = scaling == "block" and _is_m_major(scale_a)
        kernel = self.get_kernel("gemm_fp8", a.device,
                                 **self._kernel_key(n, k, scaling, bias is not None, m_major))
        sa, sb = _kernel_scales(scaling, scale_a, scale_b, m_major)
        extra = () if bias is None else (tma_ready(bias),)
        kernel(m, tma_ready(a), tma_ready(b), sa, sb, *extra, d)
        return d

    def _kernel_key(self, n: int, k: int, scaling: str, has_bias: bool,
                    m_major: bool) -> dict[str, Any]:
        return {"n": n, "k": k, "scaling": scaling, "out_dtype": self.out_dtype,
                "has_bias": has_bias, "scale_a_m_major": m_major}

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        scaling = ns.get("scaling") or scaling_of(self.spec.op_name, ns["scale_a"],
                                                  ns["scale_b"], ns["M"], ns["N"], ns["K"])
        m_major = scaling == "block" and _is_m_major(ns["scale_a"])
        key = self._kernel_key(ns["N"], ns["K"], scaling, ns["bias"] is not None, m_major)
        return [("gemm_fp8", key, ns["M"])]


def scaling_of(op: str, scale_a: Any, scale_b: Any, m: int, n: int, k: int) -> str:
    """'tensor', 'row' or 'block' from the scale shapes, or an error saying what fits."""
    sa, sb = tuple(scale_a.shape), tuple(scale_b.shape)
    kb, nb = -(-k // SCALE_BLOCK), -(-n // SCALE_BLOCK)
    if scale_a.numel() == 1 and scale_b.numel() == 1 and len(sa) <= 2 and len(sb) <= 2:
        return "tensor"
    if sa == (m, 1) and sb == (n, 1):
        return "row"
    if sa == (m, kb) and sb == (nb, kb):
        if k % SCALE_BLOCK:
            raise op_error(TileOpsValueError, op, "a", f"K (a.shape[1]) a multiple of "
                           f"{SCALE_BLOCK} for block scaling", k)
        return "block"
    expected = (f"per tensor: scale_a and scale_b of one element; per row: scale_a ({m}, 1) "
                f"and scale_b ({n}, 1); block: scale_a ({m}, {kb}) and scale_b ({nb}, {kb})")
    arg = "scale_b" if sa in ((m, 1), (m, kb)) or scale_a.numel() == 1 else "scale_a"
    raise op_error(TileOpsValueError, op, arg, expected,
                   f"scale_a {sa} and scale_b {sb}")


def _is_m_major(scale_a: torch.Tensor) -> bool:
    """scale_a [M, K/128] stored M-major (strides (1, M)), as quantize_fp8 returns it."""
    m, kb = scale_a.shape
    return kb > 1 and m > 1 and scale_a.stride() == (1, m)


def _kernel_scales(scaling: str, scale_a: torch.Tensor, scale_b: torch.Tensor,
                   m_major: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The scales as the kernel declares them (views where the layout allows, else copies)."""
    if scaling == "tensor":
        return scale_a.reshape(1), scale_b.reshape(1)
    if scaling == "row":
        return scale_a.reshape(-1).contiguous(), scale_b.reshape(-1).contiguous()
    if m_major:
        return scale_a.t(), scale_b.contiguous()  # the [K/128, M] storage itself
    return scale_a.contiguous(), scale_b.contiguous()


def _dtype_name(dtype: Any) -> Any:
    """out_dtype as the manifest names it ('bfloat16'); torch dtypes are accepted too."""
    return DTYPE_NAMES.get(dtype, dtype) if isinstance(dtype, torch.dtype) else dtype


def quantize_fp8(x: torch.Tensor, granularity: str = "tensor", group_size: int = 128,
                 scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_fp8 in float8_e4m3fn, fp32 scales) per tensor, row (token) or 1 x group_size group;
    dynamic when `scale` is None, else static (the given scale)."""
    return QuantizeFp8FwdOp.apply(x, scale, granularity=granularity, group_size=group_size)


def gemm_fp8(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
             out_dtype: Any = torch.bfloat16, bias: torch.Tensor | None = None) -> torch.Tensor:
    """(a[M, K] @ b[N, K]^T) * scales (+ bias) in out_dtype; a, b float8_e4m3fn."""
    return GemmFp8FwdOp.apply(a, b, scale_a, scale_b, bias, out_dtype=_dtype_name(out_dtype))
