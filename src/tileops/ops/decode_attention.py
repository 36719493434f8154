"""Serving attention: decode and chunked prefill over a KV cache, and the cache write.

What an engine needs, and what these ops promise:

- The layouts engines already hold. Paged: page pools k/v [num_pages, page_size, Hkv, D]
  (FlashAttention's `page_table`, FlashInfer's NHD), `block_table` int32 [B, max_pages]
  (request b's key j lives in page block_table[b, j // page_size], row j % page_size),
  `cache_seqlens` int32 [B]; page_size 16, 32, 64, 128 or 256. Contiguous: k/v
  [B, S_max, Hkv, D] with the same `cache_seqlens`. `kv_layout="HND"` takes the heads-first
  forms instead: pages [num_pages, Hkv, page_size, D] (FlashInfer's HND) and contiguous
  [B, Hkv, S_max, D] (transformers' static cache). The caches are read in place and must
  be contiguous (a copy would cost more than the attention; the op refuses instead).
- Semantics of `flash_attn.flash_attn_with_kvcache` with the new tokens already written
  (`kv_cache_append`): `cache_seqlens[b]` counts request b's keys, its q_len new tokens
  included. Query i of request b sits at position cache_seqlens[b] - q_len + i; with
  `is_causal` (the default here, unlike flash-attn's False: speculative decoding and
  chunked appends want it) it sees keys up to its position, else every key of the request.
  `window_left` keeps the keys at most that many positions behind the query (Mistral's
  4096-token window is window_left=4095); `softcap` is Gemma-2's tanh cap on the scaled
  logits; `sm_scale` defaults to 1/sqrt(D).
- No host synchronization and no recompilation in the run path: cache_seqlens and
  block_table are only read on the GPU, and batch and lengths are runtime sizes of the
  compiled programs. Decode (q [B, Sq, H, D]) runs the planned programs: a small schedule
  program splits each request's key tiles in proportion to its share of the batch's keys
  (one wave of CTAs in all, four for gathered page-16 programs, see `DecodePlan`), the
  grid comes from shapes (B + those waves of slots). Chunked prefill takes one split
  count for the batch from shapes (batch, KV heads, max_pages * page_size or S_max, 132
  SMs). So a CUDA graph captured once replays correctly with new values in cache_seqlens
  and block_table, and a decode loop whose lengths grow by one each step never compiles.
  A block table wider than the longest request costs nothing.
- Edge cases: a request of length 0 gets o = 0 and lse = -inf. Block-table entries past a
  request's last page are never used for data and may hold anything (-1, stale pages). Cache
  rows past a request's length must hold finite values (stale tokens or zeros, as engines
  leave them): the kernel masks those keys, but a NaN in V would still reach 0 * NaN.
- Indices are not range-checked by default (a check would synchronize). Set
  `DecodeAttentionFwdOp.checked = True` (or TILEOPS_CHECK_INDICES=1) to check, with one
  host sync per call outside CUDA-graph capture, that lengths fit the cache and that the
  block-table entries a request uses name existing pages.
- Returns o [B, Sq, H, D] and lse [B, H, Sq] (fp32, natural log, the log-sum-exp of the
  scaled logits), which engines use to merge attention over a shared prefix with the rest
  (cascade / prefix caching).

`chunked_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, cache_seqlens, max_seqlen_q,
block_table=None, ...)` serves packed chunks q [T, H, D] (request b owns rows
cu_seqlens_q[b]:cu_seqlens_q[b + 1]; decode requests fold in as one-token chunks) with the
same layouts, semantics and kernel; it returns o [T, H, D] and lse [T, H].

`kv_cache_append(k_new, v_new, k_pages, v_pages, slot_mapping)` writes new tokens in place
with vLLM's reshape_and_cache semantics (slot = page * page_size + offset, -1 skipped).

fp8 (e4m3) caches: the same calls with k_scale/v_scale (fp32 [1] or [Hkv]) on e4m3 caches
(`DecodeAttentionFp8FwdOp`, `ChunkedPrefillAttentionFp8FwdOp`, `KVCacheAppendFp8FwdOp`):
attention over k_cache * k_scale and v_cache * v_scale, the append storing
clamp(x / scale, -448, 448) in e4m3.

`tileops.plan_decode(...)` returns a `DecodePlan`: the decode schedule and work buffers
made once per batch shape, reused by every layer and by CUDA graphs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import TileOpsValueError, op_error
from ..kernels.attention.decode import (
    GATHERED_SPLIT_WAVES,
    LONG_CHUNK,
    SMS,
    ChunkedPrefillKernel,
    DecodeAttentionKernel,
    PlannedDecodeKernel,
    choose_splits,
    row_blocks,
    slot_count,
    target_slots,
    tile_keys,
)
from ..kernels.attention.kv_cache import KVCacheAppendKernel
from ..kernels.base import Kernel, sm_count
from ..manifest.spec import DTYPE_NAMES
from .base import LIBRARY, InPlaceByDefault, Op


def _sms(device: torch.device) -> int:
    return sm_count(device, SMS)


def _unread_table(cache_seqlens: torch.Tensor) -> torch.Tensor:
    """The int32 [1, 1] block table a contiguous cache's program takes and never reads: a
    view of the call's own cache_seqlens (one op, ~1 us of host time). Not a tensor cached
    across calls: one made during the first call under torch.compile's CUDA-graph trees
    would live in their memory pool, which they refuse. (The decode form's unread
    cu_seqlens_q is cache_seqlens itself: its length is symbolic.)"""
    return cache_seqlens.as_strided((1, 1), (1, 1))


FP8 = torch.float8_e4m3fn


def _scales(op: str, k_cache: torch.Tensor, k_scale: torch.Tensor | None,
            v_scale: torch.Tensor | None, spare: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_scale, v_scale) for the programs: an fp8 cache's scales (None: 1.0), fp32 [1] or
    [Hkv] alike; a cache in q's dtype takes none and passes a view of `spare` (a contiguous
    fp32 tensor of the call; the programs never read it; see _unread_table for why not a
    cached tensor)."""
    if k_cache.dtype != FP8:
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
            if t is not None:
                raise op_error(TileOpsValueError, op, name, "None for a cache in q's dtype "
                               "(scales belong to an fp8 cache)", "a tensor")
        unread = spare.view(-1)  # any length: the scales' length is symbolic
        return unread, unread
    if k_scale is None or v_scale is None:
        one = torch.ones(1, dtype=torch.float32, device=k_cache.device)
        k_scale = k_scale if k_scale is not None else one
        v_scale = v_scale if v_scale is not None else one
    if k_scale.numel() != v_scale.numel():
        raise op_error(TileOpsValueError, op, "v_scale",
                       f"as many scales as k_scale ({k_scale.numel()})", v_scale.numel())
    return k_scale.reshape(-1).contiguous(), v_scale.reshape(-1).contiguous()


def cache_dims(k_cache: torch.Tensor, kv_layout: str) -> tuple[int, int]:
    """(rows per page or per request, KV heads) of a cache in `kv_layout`."""
    if kv_layout == "HND":
        return k_cache.shape[2], k_cache.shape[1]
    return k_cache.shape[1], k_cache.shape[2]


def _contiguous(op: str, name: str, t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise op_error(TileOpsValueError, op, name,
                       "a contiguous tensor (the cache is read in place; copying it would "
                       "cost more than the attention)", f"strides {t.stride()}")
    return t


class DecodeAttentionFwdOp(Op):
    """Attention of q [B, Sq, H, D] over a paged or contiguous KV cache; returns (o, lse).

    See the module docstring for the layouts and semantics."""

    kernel_map = {"decode_attention": DecodeAttentionKernel,
                  "decode_attention_planned": PlannedDecodeKernel}
    checked = os.environ.get("TILEOPS_CHECK_INDICES", "0") == "1"
    # q [B, Sq, H, D] runs the planned program (per-request splits from a schedule the GPU
    # computes from cache_seqlens, see `DecodePlan`); False: one split count for the whole
    # batch from shapes (`choose_splits`), the first slice's program
    planned = os.environ.get("TILEOPS_DECODE_PLANNED", "1") == "1"

    def __init__(self, *, sm_scale: float | None = None, softcap: float = 0.0,
                 window_left: int = -1, is_causal: bool = True, kv_layout: str = "NHD",
                 kernel_map: Mapping[str, type[Kernel]] | None = None, tune: bool = False):
        super().__init__(sm_scale=sm_scale, softcap=float(softcap), window_left=window_left,
                         is_causal=is_causal, kv_layout=kv_layout, kernel_map=kernel_map,
                         tune=tune)

    def _meta_outputs(self, ns: Mapping[str, Any], device: torch.device) -> Any:
        # a launch refuses a strided cache (it is read in place), so meta and traced calls
        # do too: torch.compile then fails while tracing, not at the first run
        for name in ("k_cache", "v_cache"):
            _contiguous(self.spec.op_name, name, ns[name])
        return super()._meta_outputs(ns, device)

    @classmethod
    def index_bounds(cls, inputs: Mapping[str, Any],
                     params: Mapping[str, Any] | None = None) -> dict[str, int]:
        k, table = inputs["k_cache"], inputs.get("block_table")
        rows, _ = cache_dims(k, (params or {}).get("kv_layout", "NHD"))
        if table is None:
            return {"cache_seqlens": rows + 1}
        return {"cache_seqlens": table.shape[1] * rows + 1, "block_table": k.shape[0]}

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                cache_seqlens: torch.Tensor,
                block_table: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self._decode(q, k_cache, v_cache, cache_seqlens, block_table)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                cache_seqlens: torch.Tensor, block_table: torch.Tensor | None,
                k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        batch, q_len, heads, head_dim = q.shape
        o = torch.empty((batch, q_len, heads, head_dim), dtype=q.dtype, device=q.device)
        lse = torch.empty((batch, heads, q_len), dtype=torch.float32, device=q.device)
        if batch == 0:
            return o, lse
        self._launch(q.contiguous(), k_cache, v_cache, cache_seqlens, block_table, None, o, lse,
                     q_len, None, k_scale, v_scale)
        return o, lse

    def _launch(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                cache_seqlens: torch.Tensor, block_table: torch.Tensor | None,
                cu_seqlens_q: torch.Tensor | None, o: torch.Tensor, lse: torch.Tensor,
                q_len: int, max_tokens: int | None = None,
                k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None) -> None:
        """One attention launch (and the combine when split): q and o [rows, Sq, H, D], lse
        [rows, H, Sq]; packed queries (cu_seqlens_q given) are rows of one token, q_len 0,
        at most max_tokens per request; k_scale/v_scale for an fp8 cache."""
        name = self.spec.op_name
        k_cache = _contiguous(name, "k_cache", k_cache)
        v_cache = _contiguous(name, "v_cache", v_cache)
        cache_seqlens = cache_seqlens.contiguous()
        paged = block_table is not None
        if self.checked and not torch.cuda.is_current_stream_capturing():
            self._check_indices(k_cache, cache_seqlens, block_table)
        rows, tokens, heads, head_dim = q.shape
        page_rows, kv_heads = cache_dims(k_cache, self.kv_layout)
        key = self._kernel_key(q.dtype, heads, kv_heads, head_dim, q_len,
                               page_rows if paged else 0, k_cache.dtype)
        k_scale, v_scale = _scales(name, k_cache, k_scale, v_scale, lse)
        table = block_table.contiguous() if paged else _unread_table(cache_seqlens)
        scale = self.sm_scale if self.sm_scale is not None else head_dim ** -0.5
        if cu_seqlens_q is None and self.planned:
            kernel = self.get_kernel("decode_attention_planned", q.device, **key)
            _planned_launch(kernel, True, q, k_cache, v_cache, table,
                            cache_seqlens, k_scale, v_scale, o, lse,
                            _PlanBuffers.make(rows, q_len, heads, kv_heads, head_dim,
                                              _sms(q.device), q.device, GATHERED_SPLIT_WAVES),
                            float(scale))
            return
        kernel = self.get_kernel(self._kernel_name(max_tokens), q.device, **key)
        blocks = row_blocks(heads, kv_heads, max_tokens if max_tokens else q_len)
        splits = self._splits(key, cache_seqlens.shape[0], blocks,
                              page_rows * (block_table.shape[1] if paged else 1))
        if splits > 1:
            o_part = torch.empty((rows, tokens, heads, splits, head_dim), dtype=torch.float32,
                                 device=q.device)
            lse_part = torch.empty((rows, tokens, heads, splits), dtype=torch.float32,
                                   device=q.device)
        else:
            o_part = lse_part = None
        cu = cu_seqlens_q.contiguous() if cu_seqlens_q is not None else cache_seqlens
        kernel(splits, q, k_cache, v_cache, table, cache_seqlens, cu, k_scale,
               v_scale, o, lse, o_part, lse_part, blocks, float(scale))

    @staticmethod
    def _kernel_name(max_tokens: int | None) -> str:
        """The kernel of a launch (packed chunks of at most max_tokens tokens)."""
        return "decode_attention"

    def _kernel_key(self, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                    q_len: int, page_size: int,
                    kv_dtype: torch.dtype | None = None) -> dict[str, Any]:
        # one query token sees the same keys causal or not: one program for both
        key = {"dtype": DTYPE_NAMES[dtype], "heads": heads, "kv_heads": kv_heads,
               "head_dim": head_dim, "q_len": q_len, "page_size": page_size,
               "window_left": self.window_left, "softcap": self.softcap,
               "causal": self.is_causal or q_len == 1}
        if kv_dtype == FP8:  # only then: the other programs keep their keys
            key["kv_dtype"] = "float8_e4m3fn"
        if self.kv_layout == "HND":  # likewise
            key["kv_layout"] = "HND"
        return key

    @staticmethod
    def _splits(key: Mapping[str, Any], batch: int, blocks: int, max_keys: int) -> int:
        return choose_splits(batch, key["kv_heads"], blocks, max_keys,
                             tile_keys(key["head_dim"]))

    def _check_indices(self, k_cache: torch.Tensor, cache_seqlens: torch.Tensor,
                       block_table: torch.Tensor | None) -> None:
        """Lengths within the cache and used block-table entries within the pool (one
        host sync)."""
        name = self.spec.op_name
        page, _ = cache_dims(k_cache, self.kv_layout)
        capacity = page * (block_table.shape[1] if block_table is not None else 1)
        lengths = cache_seqlens.long()
        bad_len = ((lengths < 0) | (lengths > capacity)).any()
        if block_table is None:
            if bool(bad_len):
                raise op_error(TileOpsValueError, name, "cache_seqlens",
                               f"lengths in [0, {capacity}]", cache_seqlens.tolist())
            return
        used = (torch.arange(block_table.shape[1], device=block_table.device)[None]
                < (lengths[:, None] + page - 1) // page)
        bad_page = (used & ((block_table < 0) | (block_table >= k_cache.shape[0]))).any()
        problems = torch.stack([bad_len, bad_page]).tolist()
        if problems[0]:
            raise op_error(TileOpsValueError, name, "cache_seqlens",
                           f"lengths in [0, {capacity}] (max_pages * page_size)",
                           cache_seqlens.tolist())
        if problems[1]:
            raise op_error(TileOpsValueError, name, "block_table",
                           f"page indices in [0, {k_cache.shape[0]}) for every page a request "
                           "uses", "an entry out of range")

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        table = ns.get("block_table")
        page = ns["S"] if table is not None else 0
        key = self._kernel_key(ns["q"].dtype, ns["H"], ns["Hkv"], ns["D"], ns["Sq"], page,
                               ns["k_cache"].dtype)
        if self.planned:
            return [("decode_attention_planned", key, 0)]
        max_keys = ns["S"] * (table.shape[1] if table is not None else 1)
        blocks = row_blocks(ns["H"], ns["Hkv"], ns["Sq"])
        return [("decode_attention", key, self._splits(key, ns["B"], blocks, max_keys))]


class ChunkedPrefillAttentionFwdOp(DecodeAttentionFwdOp):
    """Chunked prefill / append over a KV cache: packed new tokens q [T, H, D], request b
    owning rows cu_seqlens_q[b]:cu_seqlens_q[b + 1], attend to the request's cached keys,
    their own keys included (appended first): token i of a request with n_q new tokens and
    cache_seqlens[b] keys sits at position cache_seqlens[b] - n_q + i (bottom-right causal).
    Returns o [T, H, D] and lse [T, H] (FlashInfer's ragged layout). Decode requests fold in
    as chunks of one token. `max_seqlen_q` bounds every chunk (it sizes the grid; checked
    with `checked`, like the indices)."""

    # one split count per batch; chunks of LONG_CHUNK tokens or more take 128-row CTAs
    kernel_map = {"decode_attention": DecodeAttentionKernel,
                  "chunked_prefill_attention": ChunkedPrefillKernel}

    def __init__(self, *, max_seqlen_q: int, sm_scale: float | None = None,
                 softcap: float = 0.0, window_left: int = -1, is_causal: bool = True,
                 kv_layout: str = "NHD", kernel_map: Mapping[str, type[Kernel]] | None = None,
                 tune: bool = False):
        Op.__init__(self, max_seqlen_q=max_seqlen_q, sm_scale=sm_scale,
                    softcap=float(softcap), window_left=window_left, is_causal=is_causal,
                    kv_layout=kv_layout, kernel_map=kernel_map, tune=tune)

    @classmethod
    def index_bounds(cls, inputs: Mapping[str, Any],
                     params: Mapping[str, Any] | None = None) -> dict[str, int]:
        bounds = super().index_bounds(inputs, params)
        bounds["cu_seqlens_q"] = inputs["q"].shape[0] + 1
        return bounds

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                cu_seqlens_q: torch.Tensor, cache_seqlens: torch.Tensor,
                block_table: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self._chunks(q, k_cache, v_cache, cu_seqlens_q, cache_seqlens, block_table)

    def _chunks(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                cu_seqlens_q: torch.Tensor, cache_seqlens: torch.Tensor,
                block_table: torch.Tensor | None, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        total, heads, head_dim = q.shape
        o = torch.empty((total, heads, head_dim), dtype=q.dtype, device=q.device)
        lse = torch.empty((total, heads), dtype=torch.float32, device=q.device)
        if total == 0 or cache_seqlens.shape[0] == 0 or self.max_seqlen_q == 0:
            return o, lse
        if self.checked and not torch.cuda.is_current_stream_capturing():
            self._check_chunks(cu_seqlens_q, cache_seqlens, total)
        self._launch(q.contiguous().view(total, 1, heads, head_dim), k_cache, v_cache,
                     cache_seqlens, block_table, cu_seqlens_q, o.view(total, 1, heads, head_dim),
                     lse.view(total, heads, 1), 0, self.max_seqlen_q, k_scale, v_scale)
        return o, lse

    def _check_chunks(self, cu: torch.Tensor, cache_seqlens: torch.Tensor, total: int) -> None:
        """cu_seqlens_q from 0 to T, non-decreasing, chunks within max_seqlen_q and within
        their request's keys (one host sync)."""
        lengths = cu.diff()
        bad = torch.stack([cu[0] != 0, cu[-1] != total, (lengths < 0).any(),
                           (lengths > self.max_seqlen_q).any(),
                           (lengths > cache_seqlens).any()]).tolist()
        if any(bad):
            what = ["to start at 0", f"to end at the token count {total}",
                    "to be non-decreasing", f"chunks of at most max_seqlen_q = "
                    f"{self.max_seqlen_q}", "chunks no longer than their cache_seqlens"]
            raise op_error(TileOpsValueError, self.spec.op_name, "cu_seqlens_q",
                           " and ".join(w for w, b in zip(what, bad, strict=True) if b),
                           cu.tolist())

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        table = ns.get("block_table")
        page = ns["S"] if table is not None else 0
        key = self._kernel_key(ns["q"].dtype, ns["H"], ns["Hkv"], ns["D"], 0, page,
                               ns["k_cache"].dtype)
        max_keys = ns["S"] * (table.shape[1] if table is not None else 1)
        blocks = row_blocks(ns["H"], ns["Hkv"], self.max_seqlen_q)
        return [(self._kernel_name(self.max_seqlen_q), key,
                 self._splits(key, ns["B"], blocks, max_keys))]

    @staticmethod
    def _kernel_name(max_tokens: int | None) -> str:
        return "chunked_prefill_attention" if (max_tokens or 0) >= LONG_CHUNK \
            else "decode_attention"


class KVCacheAppendFwdOp(InPlaceByDefault, Op):
    """vLLM's reshape_and_cache: k_new/v_new [T, Hkv, D] into the page pools at
    slot_mapping [T] (page * page_size + offset; -1 skips the token). Slots past the pool
    are skipped by the kernel; slots must be distinct.

    An op object writes in place and returns the pools themselves (k_out is k_pages), as
    engines want; under torch.compile it calls the mutating custom op
    `torch.ops.tileops.kv_cache_append_inplace`. The manifest's custom op
    `torch.ops.tileops.kv_cache_append_fwd` (and `cached()` instances behind it) returns
    updated copies instead, as its pure schema promises.
    """

    kernel_map = {"kv_cache_append": KVCacheAppendKernel}

    def __init__(self, *, kv_layout: str = "NHD",
                 kernel_map: Mapping[str, type[Kernel]] | None = None, tune: bool = False):
        super().__init__(kv_layout=kv_layout, kernel_map=kernel_map, tune=tune)

    def __call__(self, *inputs: Any) -> Any:
        if self.inplace and torch.compiler.is_compiling():
            torch.ops.tileops.kv_cache_append_inplace(*inputs, self.kv_layout)
            return inputs[2], inputs[3]
        return super().__call__(*inputs)

    @classmethod
    def index_bounds(cls, inputs: Mapping[str, Any],
                     params: Mapping[str, Any] | None = None) -> dict[str, int]:
        pages = inputs["k_pages"]
        rows, _ = cache_dims(pages, (params or {}).get("kv_layout", "NHD"))
        return {"slot_mapping": pages.shape[0] * rows}

    def forward(self, k_new: torch.Tensor, v_new: torch.Tensor, k_pages: torch.Tensor,
                v_pages: torch.Tensor,
                slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._append(k_new, v_new, k_pages, v_pages, slot_mapping)

    def _append(self, k_new: torch.Tensor, v_new: torch.Tensor, k_pages: torch.Tensor,
                v_pages: torch.Tensor, slot_mapping: torch.Tensor,
                k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        name = self.spec.op_name
        if self.inplace:
            k_out = _contiguous(name, "k_pages", k_pages)
            v_out = _contiguous(name, "v_pages", v_pages)
        else:
            k_out = k_pages.clone(memory_format=torch.contiguous_format)
            v_out = v_pages.clone(memory_format=torch.contiguous_format)
        tokens, kv_heads, head_dim = k_new.shape
        if tokens == 0 or k_out.numel() == 0:
            return k_out, v_out
        width = kv_heads * head_dim
        page_size, _ = cache_dims(k_out, self.kv_layout)
        kernel = self.get_kernel("kv_cache_append", k_new.device,
                                 **self._kernel_key(k_new.dtype, slot_mapping.dtype, width,
                                                    k_out.dtype, head_dim, page_size))
        scales = () if k_scale is None else (k_scale, v_scale)
        # the kernel's view of the pools: rows of Hkv * D, or (HND) blocks of one head's page
        view = (-1, page_size, head_dim) if self.kv_layout == "HND" else (-1, width)
        kernel(tokens, k_new.reshape(tokens, width).contiguous(),
               v_new.reshape(tokens, width).contiguous(), k_out.view(view), v_out.view(view),
               slot_mapping.contiguous(), *scales)
        return k_out, v_out

    def _kernel_key(self, dtype: torch.dtype, slot_dtype: torch.dtype, width: int,
                    cache_dtype: torch.dtype | None = None, head_dim: int = 0,
                    page_size: int = 0) -> dict[str, Any]:
        key = {"dtype": DTYPE_NAMES[dtype], "slot_dtype": DTYPE_NAMES[slot_dtype],
               "width": width}
        if cache_dtype == FP8:  # the scale of element j is its KV head's, j // head_dim
            key.update(cache_dtype="float8_e4m3fn", head_dim=head_dim)
        if self.kv_layout == "HND":  # only then: the NHD programs keep their keys
            key.update(head_dim=head_dim, page_size=page_size)
        return key

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        key = self._kernel_key(ns["k_new"].dtype, ns["slot_mapping"].dtype, ns["Hkv"] * ns["D"],
                               ns["k_pages"].dtype, ns["D"], ns["S"])
        return [("kv_cache_append", key, ns["T"])]


def _appender(op_class: type[KVCacheAppendFwdOp], kv_layout: str) -> KVCacheAppendFwdOp:
    """The in-place op object of a layout, made once (the functional calls' and the
    mutating custom ops')."""
    op = _appenders.get((op_class, kv_layout))
    if op is None:
        op = _appenders[(op_class, kv_layout)] = op_class(kv_layout=kv_layout)
    return op


_appenders: dict[tuple, KVCacheAppendFwdOp] = {}


@torch.library.custom_op(f"{LIBRARY}::kv_cache_append_inplace",
                         mutates_args=("k_pages", "v_pages"))
def _kv_cache_append_inplace(k_new: torch.Tensor, v_new: torch.Tensor, k_pages: torch.Tensor,
                             v_pages: torch.Tensor, slot_mapping: torch.Tensor,
                             kv_layout: str = "NHD") -> None:
    _appender(KVCacheAppendFwdOp, kv_layout).run(k_new, v_new, k_pages, v_pages, slot_mapping)


@_kv_cache_append_inplace.register_fake
def _(k_new: torch.Tensor, v_new: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
      slot_mapping: torch.Tensor, kv_layout: str = "NHD") -> None:
    _appender(KVCacheAppendFwdOp, kv_layout).check(
        (k_new, v_new, k_pages, v_pages, slot_mapping))



# -- fp8 caches ---------------------------------------------------------------------------
class DecodeAttentionFp8FwdOp(DecodeAttentionFwdOp):
    """`DecodeAttentionFwdOp` over an fp8 (e4m3) cache with fp32 scales k_scale/v_scale [1]
    (per tensor) or [Hkv] (per KV head), None meaning 1.0: the attention of q over
    k_cache * k_scale and v_cache * v_scale. Same programs, K/V tiles widened to q's dtype
    in shared memory after the load; k_scale folds into the softmax scale and v_scale into
    the output (exact: a CTA serves one KV head)."""

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                cache_seqlens: torch.Tensor, block_table: torch.Tensor | None = None,
                k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self._decode(q, k_cache, v_cache, cache_seqlens, block_table, k_scale, v_scale)


class ChunkedPrefillAttentionFp8FwdOp(ChunkedPrefillAttentionFwdOp):
    """`ChunkedPrefillAttentionFwdOp` over an fp8 cache (scales as
    `DecodeAttentionFp8FwdOp`)."""

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                cu_seqlens_q: torch.Tensor, cache_seqlens: torch.Tensor,
                block_table: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self._chunks(q, k_cache, v_cache, cu_seqlens_q, cache_seqlens, block_table,
                            k_scale, v_scale)


class KVCacheAppendFp8FwdOp(KVCacheAppendFwdOp):
    """`KVCacheAppendFwdOp` into fp8 (e4m3) pools: each element divided by its scale
    (k_scale/v_scale fp32 [1] or [Hkv]), saturated to +-448 and rounded to e4m3, as
    vLLM's reshape_and_cache_flash with kv_cache_dtype fp8. In place for an op object and
    the functional call (`torch.ops.tileops.kv_cache_append_fp8_inplace` under
    torch.compile)."""

    kernel_map = {"kv_cache_append": KVCacheAppendKernel}

    def __call__(self, *inputs: Any) -> Any:
        if self.inplace and torch.compiler.is_compiling():
            inputs = inputs + (None,) * (7 - len(inputs))  # k_scale, v_scale default None
            torch.ops.tileops.kv_cache_append_fp8_inplace(*inputs, self.kv_layout)
            return inputs[2], inputs[3]
        return Op.__call__(self, *inputs)

    def forward(self, k_new: torch.Tensor, v_new: torch.Tensor, k_pages: torch.Tensor,
                v_pages: torch.Tensor, slot_mapping: torch.Tensor,
                k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self._append(k_new, v_new, k_pages, v_pages, slot_mapping,
                            *_scales(self.spec.op_name, k_pages, k_scale, v_scale,
                                     torch.empty(1, dtype=torch.float32,
                                                 device=k_pages.device)))


@torch.library.custom_op(f"{LIBRARY}::kv_cache_append_fp8_inplace",
                         mutates_args=("k_pages", "v_pages"))
def _kv_cache_append_fp8_inplace(k_new: torch.Tensor, v_new: torch.Tensor,
                                 k_pages: torch.Tensor, v_pages: torch.Tensor,
                                 slot_mapping: torch.Tensor, k_scale: torch.Tensor | None,
                                 v_scale: torch.Tensor | None, kv_layout: str = "NHD") -> None:
    _appender(KVCacheAppendFp8FwdOp, kv_layout).run(k_new, v_new, k_pages, v_pages,
                                                    slot_mapping, k_scale, v_scale)


@_kv_cache_append_fp8_inplace.register_fake
def _(k_new: torch.Tensor, v_new: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
      slot_mapping: torch.Tensor, k_scale: torch.Tensor | None,
      v_scale: torch.Tensor | None, kv_layout: str = "NHD") -> None:
    _appender(KVCacheAppendFp8FwdOp, kv_layout).check(
        (k_new, v_new, k_pages, v_pages, slot_mapping, k_scale, v_scale))


# -- the planned decode -------------------------------------------------------------------
class _PlanBuffers:
    """The planned program's work buffers for one batch shape: the schedule (slot_table
    [slots, 4], split_ends [B]) in one int32 allocation, the partials (o_part [slots, Sq, H,
    D], lse_part [slots, Sq, H]) in one fp32 allocation; slots = B + `waves` waves of splits
    (room for the gathered programs' schedules: `target` is one wave, the kernel scales it
    by its config's `split_waves`)."""

    def __init__(self, slot_table, split_ends, o_part, lse_part, blocks, target):
        self.slot_table, self.split_ends = slot_table, split_ends
        self.o_part, self.lse_part = o_part, lse_part
        self.blocks, self.target = blocks, target

    @classmethod
    def make(cls, batch: int, q_len: int, heads: int, kv_heads: int, head_dim: int, sms: int,
             device: torch.device, waves: int = 1) -> _PlanBuffers:
        blocks = row_blocks(heads, kv_heads, q_len)
        target = target_slots(kv_heads, blocks, sms)
        slots = slot_count(batch, kv_heads, blocks, sms, waves)
        ints = torch.empty(slots * 4 + batch, dtype=torch.int32, device=device)
        part = slots * q_len * heads
        floats = torch.empty(part * (head_dim + 1), dtype=torch.float32, device=device)
        return cls(ints[:slots * 4].view(slots, 4), ints[slots * 4:],
                   floats[:part * head_dim].view(slots, q_len, heads, head_dim),
                   floats[part * head_dim:].view(slots, q_len, heads), blocks, target)


def _planned_launch(kernel: Kernel, schedule: bool, q, k_cache, v_cache, table, cache_seqlens,
                    k_scale, v_scale, o, lse, buffers: _PlanBuffers, scale: float) -> None:
    kernel(0, schedule, q, k_cache, v_cache, table, cache_seqlens, buffers.slot_table,
           buffers.split_ends, k_scale, v_scale, o, lse, buffers.o_part, buffers.lse_part,
           buffers.blocks, buffers.target, scale)


class BatchPlan:
    """What the reusable decode plans share (`DecodePlan`, `MLADecodePlan`): the device and
    SM count, fixed work buffers (`_PlanBuffers`), whether a schedule has run, and the checks
    of their arguments, lengths and output buffers, each error naming the plan."""

    batch_size: int
    buffers: _PlanBuffers

    def _check(self, ints: Mapping[str, tuple[Any, int]], dtype: torch.dtype) -> None:
        """Checks `ints` (argument -> (value, least value)) and dtype."""
        name = type(self).__name__
        for arg, (value, low) in ints.items():
            if not isinstance(value, int) or value < low:
                raise op_error(TileOpsValueError, name, arg, f"an int >= {low}", value)
        if dtype not in (torch.float16, torch.bfloat16):
            raise op_error(TileOpsValueError, name, "dtype", "torch.float16 or torch.bfloat16",
                           dtype)

    def _place(self, device: Any, num_sms: int | None) -> None:
        """Fixes the device and its SM count (after every argument is checked: resolving
        a CUDA device needs one)."""
        self.device = torch.device(device if device is not None else "cuda")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.num_sms = num_sms if num_sms is not None else _sms(self.device)
        self._scheduled = False

    @property
    def num_slots(self) -> int:
        """CTAs per (KV head, row block): the batch plus the schedule's waves of splits."""
        return self.buffers.slot_table.shape[0]

    def _check_lengths(self, cache_seqlens: torch.Tensor) -> None:
        if (cache_seqlens.dtype != torch.int32 or tuple(cache_seqlens.shape) !=
                (self.batch_size,) or cache_seqlens.device != self.device):
            raise op_error(TileOpsValueError, f"{type(self).__name__}.schedule",
                           "cache_seqlens", f"int32 [{self.batch_size}] on {self.device}",
                           f"{cache_seqlens.dtype} {list(cache_seqlens.shape)} on "
                           f"{cache_seqlens.device}")

    def _outputs(self, out: torch.Tensor | None, lse: torch.Tensor | None,
                 like: torch.Tensor, lse_shape: tuple[int, ...]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(o, lse): the caller's buffers, checked, or new ones (o like `like`)."""
        o = out if out is not None else torch.empty_like(like)
        lse = lse if lse is not None else torch.empty(lse_shape, dtype=torch.float32,
                                                      device=like.device)
        for arg, t, shape, dtype in (("out", o, like.shape, like.dtype),
                                     ("lse", lse, lse_shape, torch.float32)):
            if tuple(t.shape) != tuple(shape) or t.dtype != dtype or not t.is_contiguous():
                raise op_error(TileOpsValueError, f"{type(self).__name__}.run", arg,
                               f"a contiguous {dtype} tensor of shape {list(shape)}",
                               f"{list(t.shape)} ({t.dtype})")
        return o, lse


class DecodePlan(BatchPlan):
    """A decode batch schedule, made once and reused by every layer's call.

    `tileops.plan_decode(batch_size, num_heads, num_kv_heads, head_dim, page_size=16, ...)`
    fixes what the programs depend on (batch size, query tokens, head config, page size,
    dtype, options, the SM count) and owns fixed work buffers: the schedule (which split of
    which request each CTA runs) and the fp32 partials. Per step:

        plan.schedule(cache_seqlens)            # once: per-request split counts, on the GPU
        for layer in layers:
            o = plan.run(q, k_cache[layer], v_cache[layer], cache_seqlens, block_table)

    Nothing on the host reads cache_seqlens or block_table, and no buffer is allocated in
    `run` but the outputs (pass `out`/`lse` to reuse yours), so a CUDA graph captured once
    replays correctly when only the values of cache_seqlens and block_table change (keep
    `plan.schedule` inside the captured region, or call it before each replay).

    The schedule splits each request's visible key tiles in proportion to its share of the
    batch's keys, one wave of CTAs in all (SMs / (KV heads x row blocks) splits; four
    waves for the gathered page-16 programs, which run several CTAs an SM) plus at
    most one per request: a batch of short requests runs one split each (no partials for
    them), a long request among them is still split. A stale schedule (lengths changed, not
    rescheduled) is still exact: the kernel cuts each request's *current* tiles into the
    scheduled number of runs; only the balance suffers. `run(..., schedule=True)` (the
    default) reschedules first, one small launch; pass schedule=False to reuse the last.

    Results and masks are those of `DecodeAttentionFwdOp` (which runs the same programs
    with a schedule per call); `run` returns o like q and lse [B, H, q_len] ([B, H] for a
    3-d q)."""

    def __init__(self, batch_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 page_size: int | None = 16, q_len: int = 1,
                 dtype: torch.dtype = torch.bfloat16, device: Any = None,
                 sm_scale: float | None = None, softcap: float = 0.0, window_left: int = -1,
                 is_causal: bool = True, num_sms: int | None = None,
                 kv_dtype: torch.dtype | None = None, kv_layout: str = "NHD"):
        name = "DecodePlan"
        self._check({"batch_size": (batch_size, 1), "num_heads": (num_heads, 1),
                     "num_kv_heads": (num_kv_heads, 1), "q_len": (q_len, 1)}, dtype)
        if num_heads % num_kv_heads:
            raise op_error(TileOpsValueError, name, "num_kv_heads", "a divisor of num_heads "
                           f"({num_heads})", num_kv_heads)
        if head_dim not in (64, 128, 256):
            raise op_error(TileOpsValueError, name, "head_dim", "64, 128 or 256", head_dim)
        if q_len > 16:
            raise op_error(TileOpsValueError, name, "q_len", "at most 16", q_len)
        if page_size is not None and page_size not in (16, 32, 64, 128, 256):
            raise op_error(TileOpsValueError, name, "page_size",
                           "16, 32, 64, 128, 256 or None (a contiguous cache)", page_size)
        kv_dtype = kv_dtype or dtype
        if kv_dtype not in (dtype, FP8):
            raise op_error(TileOpsValueError, name, "kv_dtype",
                           f"None, {dtype} or torch.float8_e4m3fn", kv_dtype)
        op_class = DecodeAttentionFp8FwdOp if kv_dtype == FP8 else DecodeAttentionFwdOp
        if kv_layout not in ("NHD", "HND"):
            raise op_error(TileOpsValueError, name, "kv_layout", "'NHD' or 'HND'", kv_layout)
        self._place(device, num_sms)
        self.op = op_class.cached(sm_scale=sm_scale, softcap=float(softcap),
                                  window_left=window_left, is_causal=is_causal,
                                  kv_layout=kv_layout)
        self.kv_dtype = kv_dtype
        self.batch_size, self.q_len, self.num_heads = batch_size, q_len, num_heads
        self.num_kv_heads, self.head_dim, self.page_size = num_kv_heads, head_dim, page_size
        self.dtype = dtype
        self.scale = float(sm_scale if sm_scale is not None else head_dim ** -0.5)
        self.key = self.op._kernel_key(dtype, num_heads, num_kv_heads, head_dim, q_len,
                                       page_size or 0, kv_dtype)
        self.buffers = _PlanBuffers.make(batch_size, q_len, num_heads, num_kv_heads, head_dim,
                                         self.num_sms, self.device, GATHERED_SPLIT_WAVES)
        self._kernel: Kernel | None = None

    @property
    def kernel(self) -> Kernel:
        if self._kernel is None:
            self._kernel = self.op.get_kernel("decode_attention_planned", self.device,
                                              **self.key)
        return self._kernel

    def schedule(self, cache_seqlens: torch.Tensor) -> None:
        """Recomputes the per-request split counts from cache_seqlens, on the GPU."""
        self._check_lengths(cache_seqlens)
        _planned_launch(self.kernel, True, None, None, None, None, cache_seqlens.contiguous(),
                        None, None, None, None, self.buffers, self.scale)
        self._scheduled = True

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            cache_seqlens: torch.Tensor, block_table: torch.Tensor | None = None, *,
            out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
            schedule: bool = True, k_scale: torch.Tensor | None = None,
            v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(o, lse) of q [B, q_len, H, D] (or [B, H, D] when q_len is 1) over the cache;
        k_scale/v_scale (fp32 [1] or [Hkv]) for an fp8 cache."""
        name = "DecodePlan.run"
        single = q.dim() == 3
        q4 = q.unsqueeze(1) if single else q
        want = (self.batch_size, self.q_len, self.num_heads, self.head_dim)
        if tuple(q4.shape) != want or q.dtype != self.dtype:
            raise op_error(TileOpsValueError, name, "q", f"shape {list(want)} ({self.dtype}) "
                           "as planned", f"{list(q.shape)} ({q.dtype})")
        paged = block_table is not None
        if paged != (self.page_size is not None) or k_cache.dim() != 4 or (
                paged and cache_dims(k_cache, self.op.kv_layout)[0] != self.page_size):
            raise op_error(TileOpsValueError, name, "k_cache",
                           f"pages of {self.page_size} keys with a block_table" if
                           self.page_size else "a contiguous cache and no block_table",
                           f"shape {list(k_cache.shape)}, block_table "
                           f"{'given' if paged else 'None'}")
        inputs = (q4, k_cache, v_cache, cache_seqlens, block_table)
        self.op.validate(inputs + (k_scale, v_scale) if self.kv_dtype == FP8 else inputs)
        if self.op.checked and not torch.cuda.is_current_stream_capturing():
            self.op._check_indices(k_cache, cache_seqlens, block_table)
        lse_shape = (self.batch_size, self.num_heads) + (() if single else (self.q_len,))
        o, lse = self._outputs(out, lse, q, lse_shape)
        k_scale, v_scale = _scales(name, k_cache, k_scale, v_scale, lse)
        table = block_table.contiguous() if paged else _unread_table(cache_seqlens)
        _planned_launch(self.kernel, schedule or not self._scheduled, q4.contiguous(),
                        _contiguous(name, "k_cache", k_cache),
                        _contiguous(name, "v_cache", v_cache), table,
                        cache_seqlens.contiguous(), k_scale, v_scale,
                        o.view(want) if single else o,
                        lse.view(self.batch_size, self.num_heads, self.q_len), self.buffers,
                        self.scale)
        self._scheduled = True
        return o, lse

    __call__ = run


def plan_decode(batch_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                page_size: int | None = 16, q_len: int = 1, dtype: torch.dtype = torch.bfloat16,
                device: Any = None, sm_scale: float | None = None, softcap: float = 0.0,
                window_left: int = -1, is_causal: bool = True,
                num_sms: int | None = None, kv_dtype: torch.dtype | None = None,
                kv_layout: str = "NHD") -> DecodePlan:
    """A reusable `DecodePlan` for a decode batch (see its docstring); page_size None means
    a contiguous cache [B, S_max, Hkv, D] ([B, Hkv, S_max, D] with kv_layout "HND");
    kv_dtype torch.float8_e4m3fn an fp8 cache."""
    return DecodePlan(batch_size, num_heads, num_kv_heads, head_dim, page_size=page_size,
                      q_len=q_len, dtype=dtype, device=device, sm_scale=sm_scale,
                      softcap=softcap, window_left=window_left, is_causal=is_causal,
                      num_sms=num_sms, kv_dtype=kv_dtype, kv_layout=kv_layout)

# -- functional API -----------------------------------------------------------------------
def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     cache_seqlens: torch.Tensor, block_table: torch.Tensor | None = None,
                     sm_scale: float | None = None, softcap: float | None = None,
                     window_left: int | None = None, is_causal: bool = True,
                     return_lse: bool = False, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None, kv_layout: str = "NHD") -> Any:
    """Attention of q [B, H, D] (one token per request) or [B, q_len, H, D] over a KV cache.

    k_cache/v_cache: page pools [num_pages, page_size, Hkv, D] with `block_table`
    [B, max_pages], or a contiguous cache [B, S_max, Hkv, D] (block_table None); with
    kv_layout "HND", [num_pages, Hkv, page_size, D] or [B, Hkv, S_max, D];
    cache_seqlens [B] int32 counts each request's keys, its new tokens included. Returns o
    shaped like q, and with return_lse also lse [B, H] (or [B, H, q_len]), fp32 natural log.
    An fp8 (e4m3) cache takes fp32 k_scale/v_scale [1] or [Hkv] (None: 1.0). See the module
    docstring for masks and edge cases.
    """
    single = q.dim() == 3
    fp8 = k_cache.dtype == FP8
    o, lse = (DecodeAttentionFp8FwdOp if fp8 else DecodeAttentionFwdOp).apply(
        q.unsqueeze(1) if single else q, k_cache, v_cache, cache_seqlens, block_table,
        *((k_scale, v_scale) if fp8 else _no_scales(k_scale, v_scale)),
        sm_scale=sm_scale, softcap=0.0 if softcap is None else float(softcap),
        window_left=-1 if window_left is None else int(window_left), is_causal=is_causal,
        kv_layout=kv_layout)
    if single:
        o, lse = o.squeeze(1), lse.squeeze(2)
    return (o, lse) if return_lse else o


def chunked_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              cu_seqlens_q: torch.Tensor, cache_seqlens: torch.Tensor,
                              max_seqlen_q: int, block_table: torch.Tensor | None = None,
                              sm_scale: float | None = None, softcap: float | None = None,
                              window_left: int | None = None, is_causal: bool = True,
                              return_lse: bool = False, k_scale: torch.Tensor | None = None,
                              v_scale: torch.Tensor | None = None,
                              kv_layout: str = "NHD") -> Any:
    """Packed new tokens q [T, H, D] (request b: rows cu_seqlens_q[b]:cu_seqlens_q[b + 1],
    at most max_seqlen_q) attending to their KV cache, their own keys already appended;
    cache layouts and options as `decode_attention`. Returns o [T, H, D], and with
    return_lse also lse [T, H] (fp32, natural log); an fp8 cache takes k_scale/v_scale."""
    fp8 = k_cache.dtype == FP8
    o, lse = (ChunkedPrefillAttentionFp8FwdOp if fp8 else ChunkedPrefillAttentionFwdOp).apply(
        q, k_cache, v_cache, cu_seqlens_q, cache_seqlens, block_table,
        *((k_scale, v_scale) if fp8 else _no_scales(k_scale, v_scale)),
        max_seqlen_q=max_seqlen_q, sm_scale=sm_scale,
        softcap=0.0 if softcap is None else float(softcap),
        window_left=-1 if window_left is None else int(window_left), is_causal=is_causal,
        kv_layout=kv_layout)
    return (o, lse) if return_lse else o


def _no_scales(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> tuple:
    if k_scale is not None or v_scale is not None:
        raise op_error(TileOpsValueError, "tileops", "k_scale",
                       "None for a cache in q's dtype (scales belong to an fp8 cache)",
                       "a tensor")
    return ()


def kv_cache_append(k_new: torch.Tensor, v_new: torch.Tensor, k_pages: torch.Tensor,
                    v_pages: torch.Tensor, slot_mapping: torch.Tensor,
                    k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None, kv_layout: str = "NHD") -> None:
    """Writes k_new/v_new [T, Hkv, D] into k_pages/v_pages [num_pages, page_size, Hkv, D]
    ([num_pages, Hkv, page_size, D] with kv_layout "HND") in place at slot_mapping [T]
    (int64 or int32; slot = page * page_size + offset, -1 skips the token), as vLLM's
    reshape_and_cache. int32 slots are widened first (one small copy). fp8 (e4m3) pools
    store each element / its scale (k_scale/v_scale fp32 [1] or [Hkv], None: 1.0),
    saturated to +-448."""
    if slot_mapping.dtype == torch.int32:
        slot_mapping = slot_mapping.long()
    if k_pages.dtype == FP8:
        if torch.compiler.is_compiling():
            torch.ops.tileops.kv_cache_append_fp8_inplace(k_new, v_new, k_pages, v_pages,
                                                          slot_mapping, k_scale, v_scale,
                                                          kv_layout)
        else:
            _appender(KVCacheAppendFp8FwdOp, kv_layout).run(
                k_new, v_new, k_pages, v_pages, slot_mapping, k_scale, v_scale)
        return
    _no_scales(k_scale, v_scale)
    if torch.compiler.is_compiling():
        torch.ops.tileops.kv_cache_append_inplace(k_new, v_new, k_pages, v_pages, slot_mapping,
                                                  kv_layout)
    else:
        _appender(KVCacheAppendFwdOp, kv_layout).run(k_new, v_new, k_pages, v_pages,
                                                     slot_mapping)

