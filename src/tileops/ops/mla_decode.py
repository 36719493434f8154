"""MLA decode (DeepSeek-V2/V3 absorbed form) over a paged latent cache.

`tileops.mla_decode(q_nope, q_pe, kv_cache, cache_seqlens, block_table, sm_scale=None)`:
q_nope [B, H, Dc] (queries already multiplied by W_UK), q_pe [B, H, Dr], the latent cache
kv_cache [num_pages, page_size, Dc + Dr] (c, then k_pe; FlashMLA's layout with its one
"KV head" dropped), block_table int32 [B, max_pages], cache_seqlens int32 [B] (the keys of
each request, the new token's included). Returns o [B, H, Dc] = softmax(s) @ c with
s = (q_nope . c + q_pe . k_pe) * sm_scale (default (Dc + Dr) ** -0.5; DeepSeek-V3 passes
its own, mscale included), and with return_lse lse [B, H] (fp32, natural log).
DeepSeek-V3: H 128 without tensor parallelism, 16 / 32 / 64 a GPU under TP 8 / 4 / 2 (any
H: a block of 64 heads past H masks its rows), Dc 512, Dr 64, pages of 64.

Split-KV per request as `DecodeAttentionFwdOp`'s planned path (a schedule computed on the
GPU from cache_seqlens, no host sync, no recompilation for new batch sizes or lengths). A
request of length 0 gets o = 0 and lse = -inf; block-table entries past a request's pages
are never used for data. Checked mode (`MLADecodeFwdOp.checked`, TILEOPS_CHECK_INDICES=1)
checks lengths and used pages with one host sync. `tileops.plan_mla_decode(batch_size,
num_heads, max_pages, ...)` schedules once a step for every layer (`MLADecodePlan`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import TileOpsValueError, op_error
from ..kernels.attention.mla_decode import MLADecodeKernel
from ..kernels.base import Kernel
from ..manifest.spec import DTYPE_NAMES
from .base import Op
from .decode_attention import BatchPlan, DecodeAttentionFwdOp, _contiguous, _PlanBuffers, _sms


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
        _launch(kernel, units, True, q_nope.contiguous(), q_pe.contiguous(), kv_cache,
                cache_seqlens.contiguous(), block_table.contiguous(), o, lse, buffers,
                float(scale))
        return o, lse

    @staticmethod
    def _kernel_key(dtype: torch.dtype, heads: int, dim: int, rope: int,
                    page_size: int) -> dict[str, Any]:
        return {"dtype": DTYPE_NAMES[dtype], "heads": heads, "dim": dim, "rope": rope,
                "page_size": page_size}

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        key = self._kernel_key(ns["q_nope"].dtype, ns["H"], ns["Dc"], ns["Dr"], ns["S"])
        return [("mla_decode", key, _work_units(ns["B"], ns["H"], ns["P"] * ns["S"]))]


def _launch(kernel: Kernel, units: int, schedule: bool, q_nope, q_pe, kv, cache_seqlens, table,
            o, lse, buffers: _PlanBuffers, scale: float) -> None:
    """The schedule (with `schedule`), attention and combine of one call, the op's or a
    plan's; q_nope None: the schedule only. o [B, H, Dc] and lse [B, H] as the programs'
    one-query-token views."""
    if o is not None:
        batch, heads, dim = o.shape
        o, lse = o.view(batch, 1, heads, dim), lse.view(batch, heads, 1)
    kernel(units, schedule, q_nope, q_pe, kv, table, cache_seqlens, buffers.slot_table,
           buffers.split_ends, o, lse, buffers.o_part, buffers.lse_part, buffers.target, scale)


def _work_units(batch: int, heads: int, table_keys: int) -> int:
    """(request, 64 heads, 64-key tile) units the block table can hold: the kernel's bucket
    (the lengths themselves stay on the GPU)."""
    return batch * -(-heads // 64) * -(-table_keys // 64)


class MLADecodePlan(BatchPlan):
    """An MLA decode schedule, made once per step and reused by every layer's call (what
    FlashMLA's get_mla_metadata gives its flash_mla_with_kvcache calls).

    `tileops.plan_mla_decode(batch_size, num_heads, max_pages, page_size=64, ...)` fixes
    what the programs depend on (batch, heads, the block table's width, page size, dtype,
    the SM count: so the bucket and config) and owns the schedule and the fp32 partials.
    Per step:

        plan.schedule(cache_seqlens)              # once: the split counts, on the GPU
        for layer in layers:
            o = plan.run(q_nope, q_pe, kv_cache[layer], cache_seqlens, block_table)

    Nothing on the host reads cache_seqlens or block_table, and `run` allocates only the
    outputs (pass `out` / `lse` to reuse yours), so a CUDA graph captured once replays
    correctly when only their values change. `run(..., schedule=True)` (the default)
    reschedules first; pass schedule=False to reuse the last one (a stale schedule is still
    exact, as `DecodePlan`'s). Results are `MLADecodeFwdOp`'s; `run` returns (o [B, H, Dc],
    lse [B, H])."""

    def __init__(self, batch_size: int, num_heads: int, max_pages: int, *,
                 page_size: int = 64, head_dim: int = 512, rope_dim: int = 64,
                 dtype: torch.dtype = torch.bfloat16, device: Any = None,
                 sm_scale: float | None = None, num_sms: int | None = None):
        name = "MLADecodePlan"
        self._check({"batch_size": (batch_size, 1), "num_heads": (num_heads, 1),
                     "max_pages": (max_pages, 1)}, dtype)
        for arg, value, allowed in (("head_dim", head_dim, (512,)), ("rope_dim", rope_dim, (64,)),
                                    ("page_size", page_size, (64, 128, 256))):
            if value not in allowed:
                raise op_error(TileOpsValueError, name, arg, " or ".join(map(str, allowed)),
                               value)
        if sm_scale is not None and not sm_scale > 0:
            raise op_error(TileOpsValueError, name, "sm_scale", "None or > 0", sm_scale)
        self._place(device, num_sms)
        self.op = MLADecodeFwdOp.cached(sm_scale=sm_scale)
        self.batch_size, self.num_heads, self.max_pages = batch_size, num_heads, max_pages
        self.head_dim, self.rope_dim, self.page_size, self.dtype = (head_dim, rope_dim,
                                                                    page_size, dtype)
        self.scale = float(sm_scale if sm_scale is not None else (head_dim + rope_dim) ** -0.5)
        self.units = _work_units(batch_size, num_heads, max_pages * page_size)
        self._kernel: Kernel | None = None
        self._buffers: _PlanBuffers | None = None
        if self.device.type == "cuda":
            self.buffers  # noqa: B018 (allocated now, not inside a graph capture later)

    @property
    def kernel(self) -> Kernel:
        if self._kernel is None:
            self._kernel = self.op.get_kernel("mla_decode", self.device, **self.op._kernel_key(
                self.dtype, self.num_heads, self.head_dim, self.rope_dim, self.page_size))
        return self._kernel

    @property
    def buffers(self) -> _PlanBuffers:
        """The schedule and partials, as many waves of slots as the kernel's config takes."""
        if self._buffers is None:
            self._buffers = _PlanBuffers.make(self.batch_size, 1, self.num_heads, 1,
                                              self.head_dim, self.num_sms, self.device,
                                              self.kernel.split_waves(self.units))
        return self._buffers

    def schedule(self, cache_seqlens: torch.Tensor) -> None:
        """Recomputes the per-request split counts from cache_seqlens, on the GPU."""
        self._check_lengths(cache_seqlens)
        _launch(self.kernel, self.units, True, None, None, None, cache_seqlens.contiguous(),
                None, None, None, self.buffers, self.scale)
        self._scheduled = True

    def run(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
            cache_seqlens: torch.Tensor, block_table: torch.Tensor, *,
            out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
            schedule: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(o [B, H, Dc], lse [B, H]) of the absorbed queries over the latent cache."""
        name = "MLADecodePlan.run"
        planned = {"q_nope": (q_nope, (self.batch_size, self.num_heads, self.head_dim)),
                   "q_pe": (q_pe, (self.batch_size, self.num_heads, self.rope_dim)),
                   "block_table": (block_table, (self.batch_size, self.max_pages))}
        for arg, (t, shape) in planned.items():
            dtype = torch.int32 if arg == "block_table" else self.dtype
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise op_error(TileOpsValueError, name, arg,
                               f"shape {list(shape)} ({dtype}) as planned",
                               f"{list(t.shape)} ({t.dtype})")
        if kv_cache.dim() != 3 or kv_cache.shape[1] != self.page_size:
            raise op_error(TileOpsValueError, name, "kv_cache",
                           f"pages of {self.page_size} latent rows, as planned",
                           f"shape {list(kv_cache.shape)}")
        inputs = (q_nope, q_pe, kv_cache, cache_seqlens, block_table)
        self.op.validate(inputs)
        kv_cache = _contiguous(name, "kv_cache", kv_cache)
        if self.op.checked and not torch.cuda.is_current_stream_capturing():
            DecodeAttentionFwdOp._check_indices(self.op, kv_cache, cache_seqlens, block_table)
        o, lse = self._outputs(out, lse, q_nope, (self.batch_size, self.num_heads))
        _launch(self.kernel, self.units, schedule or not self._scheduled, q_nope.contiguous(),
                q_pe.contiguous(), kv_cache, cache_seqlens.contiguous(),
                block_table.contiguous(), o, lse, self.buffers, self.scale)
        self._scheduled = True
        return o, lse

    __call__ = run



def plan_mla_decode(batch_size: int, num_heads: int, max_pages: int, *, page_size: int = 64,
                    head_dim: int = 512, rope_dim: int = 64,
                    dtype: torch.dtype = torch.bfloat16, device: Any = None,
                    sm_scale: float | None = None,
                    num_sms: int | None = None) -> MLADecodePlan:
    """A reusable `MLADecodePlan` for a batch of `batch_size` requests whose block tables
    are `max_pages` wide (see its docstring)."""
    return MLADecodePlan(batch_size, num_heads, max_pages, page_size=page_size,
                         head_dim=head_dim, rope_dim=rope_dim, dtype=dtype, device=device,
                         sm_scale=sm_scale, num_sms=num_sms)


def mla_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
               cache_seqlens: torch.Tensor, block_table: torch.Tensor,
               sm_scale: float | None = None, return_lse: bool = False) -> Any:
    """Absorbed MLA decode over a paged latent cache; see the module docstring."""
    o, lse = MLADecodeFwdOp.apply(q_nope, q_pe, kv_cache, cache_seqlens, block_table,
                                  sm_scale=sm_scale)
    return (o, lse) if return_lse else o
