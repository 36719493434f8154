"""MLA decode (DeepSeek-V2/V3 absorbed form) over a paged latent cache.

`tileops.mla_decode(q_nope, q_pe, kv_cache, cache_seqlens, block_table, sm_scale=None)`:
q_nope [B, H, Dc] (queries already multiplied by W_UK), q_pe [B, H, Dr], the latent cache
kv_cache [num_pages, page_size, Dc + Dr] (c, then k_pe; FlashMLA's layout with its one
"KV head" dropped), block_table int32 [B, max_pages], cache_seqlens int32 [B] (the keys of
each request, the new token's included). Returns o [B, H, Dc] = softmax(s) @ c with
s = (q_nope . c + q_pe . k_pe) * sm_scale (default (Dc + Dr) ** -0.5; DeepSeek-V3 passes
its own, mscale included), and with return_lse lse [B, H] (fp32, natural log).
DeepSeek-V3: H 128 (no tensor parallelism; 16 / 32 / 64 under TP 8 / 4 / 2 are multiples of
64 only from TP 2), Dc 512, Dr 64, pages of 64.

Split-KV per request as `DecodeAttentionFwdOp`'s planned path (a schedule computed on the
GPU from cache_seqlens, no host sync, no recompilation for new batch sizes or lengths). A
request of length 0 gets o = 0 and lse = -inf; block-table entries past a request's pages
are never used for data. Checked mode (`MLADecodeFwdOp.checked`, TILEOPS_CHECK_INDICES=1)
checks lengths and used pages with one host sync.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from ..kernels.attention.mla_decode import MLADecodeKernel
from ..kernels.base import Kernel
from ..manifest.spec import DTYPE_NAMES
from .base import Op
from .decode_attention import DecodeAttentionFwdOp, _contiguous, _PlanBuffers, _sms


class MLADecodeFwdOp(Op):
    """Absorbed MLA decode; see the module docstring."""

    kernel_map = {"mla_decode": MLADecodeKernel}
    checked = os.environ.get("TILEOPS_CHECK_INDICES", "0") == "1"

    def __init__(self, *, sm_scale: float | None = None,
                 kernel_map: Mapping[str, type[Kernel]] | None = None, tune: bool = False):
        super().__init__(sm_scale=sm_scale, kernel_map=kernel_map, tune=tune)

    @classmethod
    def index_bounds(cls, inputs: Mapping[str, Any],
                     params: Mapping[str, Any] | None = None) -> dict[str, int]:
        kv, table = inputs["kv_cache"], inputs["block_table"]
        return {"cache_seqlens": table.shape[1] * kv.shape[1] + 1, "block_table": kv.shape[0]}

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                cache_seqlens: torch.Tensor,
                block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, heads, dim = q_nope.shape
        o = torch.empty((batch, heads, dim), dtype=q_nope.dtype, device=q_nope.device)
        lse = torch.empty((batch, heads), dtype=torch.float32, device=q_nope.device)
        if batch == 0:
            return o, lse
        name = self.spec.op_name
        kv_cache = _contiguous(name, "kv_cache", kv_cache)
        if self.checked and not torch.cuda.is_current_stream_capturing():
            DecodeAttentionFwdOp._check_indices(self, kv_cache, cache_seqlens, block_table)
        key = self._kernel_key(q_nope.dtype, heads, dim, q_pe.shape[2], kv_cache.shape[1])
        kernel = self.get_kernel("mla_decode", q_nope.device, **key)
        units = _work_units(batch, heads, block_table.shape[1] * kv_cache.shape[1])
        # slots of (request, 64 heads): one wave is SMs / (H / 64) runs of key tiles
        buffers = _PlanBuffers.make(batch, 1, heads, 1, dim, _sms(q_nope.device),
                                    q_nope.device, kernel.split_waves(units))
        scale = self.sm_scale if self.sm_scale is not None else (dim + q_pe.shape[2]) ** -0.5
        kernel(units, True, q_nope.contiguous(), q_pe.contiguous(), kv_cache,
               block_table.contiguous(), cache_seqlens.contiguous(), buffers.slot_table,
               buffers.split_ends, o.view(batch, 1, heads, dim), lse.view(batch, heads, 1),
               buffers.o_part, buffers.lse_part, buffers.target, float(scale))
        return o, lse

    @staticmethod
    def _kernel_key(dtype: torch.dtype, heads: int, dim: int, rope: int,
                    page_size: int) -> dict[str, Any]:
        return {"dtype": DTYPE_NAMES[dtype], "heads": heads, "dim": dim, "rope": rope,
                "page_size": page_size}

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        key = self._kernel_key(ns["q_nope"].dtype, ns["H"], ns["Dc"], ns["Dr"], ns["S"])
        return [("mla_decode", key, _work_units(ns["B"], ns["H"], ns["P"] * ns["S"]))]


def _work_units(batch: int, heads: int, table_keys: int) -> int:
    """(request, 64 heads, 64-key tile) units the block table can hold: the kernel's bucket
    (the lengths themselves stay on the GPU)."""
    return batch * -(-heads // 64) * -(-table_keys // 64)


def mla_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
               cache_seqlens: torch.Tensor, block_table: torch.Tensor,
               sm_scale: float | None = None, return_lse: bool = False) -> Any:
    """Absorbed MLA decode over a paged latent cache; see the module docstring."""
    o, lse = MLADecodeFwdOp.apply(q_nope, q_pe, kv_cache, cache_seqlens, block_table,
                                  sm_scale=sm_scale)
    return (o, lse) if return_lse else o
