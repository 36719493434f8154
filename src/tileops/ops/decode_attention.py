"""Serving attention: decode and chunked prefill over a KV cache, and the cache write.

What an engine needs, and what these ops promise:

- The layouts engines already hold. Paged: page pools k/v [num_pages, page_size, Hkv, D]
  (FlashAttention's `page_table`, FlashInfer's NHD), `block_table` int32 [B, max_pages]
  (request b's key j lives in page block_table[b, j // page_size], row j % page_size),
  `cache_seqlens` int32 [B]; page_size 16, 32, 64, 128 or 256. Contiguous: k/v
  [B, S_max, Hkv, D] with the same `cache_seqlens`. The caches are read in place and must
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
  block_table are only read on the GPU; the launch grid and the number of KV splits come
  from shapes (batch, KV heads, max_pages * page_size or S_max, 132 SMs), and batch and
  lengths are runtime sizes of the compiled programs (per model config at most the
  one-split program and the split program with its combine). So a CUDA graph captured
  once replays correctly with new values in cache_seqlens and block_table, and a decode
  loop whose lengths grow by one each step never compiles. A block table wider than the
  longest request costs nothing but a possibly higher split count (splits divide each
  request's own length).
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
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import TileOpsValueError, op_error
from ..kernels.attention.decode import (
    DecodeAttentionKernel,
    choose_splits,
    row_blocks,
    tile_keys,
)
from ..kernels.attention.kv_cache import KVCacheAppendKernel
from ..kernels.base import Kernel
from ..manifest.spec import DTYPE_NAMES
from .base import LIBRARY, Op

_placeholders: dict[tuple, torch.Tensor] = {}


def _placeholder(device: torch.device, shape: tuple[int, ...]) -> torch.Tensor:
    """An int32 tensor a program takes and never reads (the contiguous cache's block
    table, the decode form's cu_seqlens_q), made once per device."""
    t = _placeholders.get((device, shape))
    if t is None:
        t = _placeholders[(device, shape)] = torch.zeros(shape, dtype=torch.int32,
                                                         device=device)
    return t


def _contiguous(op: str, name: str, t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise op_error(TileOpsValueError, op, name,
                       "a contiguous tensor (the cache is read in place; copying it would "
                       "cost more than the attention)", f"strides {t.stride()}")
    return t


class DecodeAttentionFwdOp(Op):
    """Attention of q [B, Sq, H, D] over a paged or contiguous KV cache; returns (o, lse).

    See the module docstring for the layouts and semantics."""

    kernel_map = {"decode_attention": DecodeAttentionKernel}
    checked = os.environ.get("TILEOPS_CHECK_INDICES", "0") == "1"

    def __init__(self, *, sm_scale: float | None = None, softcap: float = 0.0,
                 window_left: int = -1, is_causal: bool = True,
                 kernel_map: Mapping[str, type[Kernel]] | None = None, tune: bool = False):
        super().__init__(sm_scale=sm_scale, softcap=float(softcap), window_left=window_left,
                         is_causal=is_causal, kernel_map=kernel_map, tune=tune)

    @classmethod
    def index_bounds(cls, inputs: Mapping[str, Any]) -> dict[str, int]:
        k, table = inputs["k_cache"], inputs.get("block_table")
        if table is None:
            return {"cache_seqlens": k.shape[1] + 1}
        return {"cache_seqlens": table.shape[1] * k.shape[1] + 1, "block_table": k.shape[0]}

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                cache_seqlens: torch.Tensor,
                block_table: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        batch, q_len, heads, head_dim = q.shape
        o = torch.empty((batch, q_len, heads, head_dim), dtype=q.dtype, device=q.device)
        lse = torch.empty((batch, heads, q_len), dtype=torch.float32, device=q.device)
        if batch == 0:
            return o, lse
        self._launch(q.contiguous(), k_cache, v_cache, cache_seqlens, block_table, None, o, lse,
                     q_len)
        return o, lse

    def _launch(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                cache_seqlens: torch.Tensor, block_table: torch.Tensor | None,
                cu_seqlens_q: torch.Tensor | None, o: torch.Tensor, lse: torch.Tensor,
                q_len: int, max_tokens: int | None = None) -> None:
        """One attention launch (and the combine when split): q and o [rows, Sq, H, D], lse
        [rows, H, Sq]; packed queries (cu_seqlens_q given) are rows of one token, q_len 0,
        at most max_tokens per request."""
        name = self.spec.op_name
        k_cache = _contiguous(name, "k_cache", k_cache)
        v_cache = _contiguous(name, "v_cache", v_cache)
        paged = block_table is not None
        if self.checked and not torch.cuda.is_current_stream_capturing():
            self._check_indices(k_cache, cache_seqlens, block_table)
        rows, tokens, heads, head_dim = q.shape
        key = self._kernel_key(q.dtype, heads, k_cache.shape[2], head_dim, q_len,
                               k_cache.shape[1] if paged else 0)
        kernel = self.get_kernel("decode_attention", q.device, **key)
        blocks = row_blocks(heads, k_cache.shape[2], max_tokens if max_tokens else q_len)
        splits = self._splits(key, cache_seqlens.shape[0], blocks,
                              k_cache.shape[1] * (block_table.shape[1] if paged else 1))
        if splits > 1:
            o_part = torch.empty((rows, tokens, heads, splits, head_dim), dtype=torch.float32,
                                 device=q.device)
            lse_part = torch.empty((rows, tokens, heads, splits), dtype=torch.float32,
                                   device=q.device)
        else:
            o_part = lse_part = None
        table = block_table.contiguous() if paged else _placeholder(q.device, (1, 1))
        cu = cu_seqlens_q.contiguous() if cu_seqlens_q is not None else _placeholder(
            q.device, (1,))
        scale = self.sm_scale if self.sm_scale is not None else head_dim ** -0.5
        kernel(splits, q, k_cache, v_cache, table, cache_seqlens.contiguous(), cu, o, lse,
               o_part, lse_part, blocks, float(scale))

    def _kernel_key(self, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                    q_len: int, page_size: int) -> dict[str, Any]:
        # one query token sees the same keys causal or not: one program for both
        return {"dtype": DTYPE_NAMES[dtype], "heads": heads, "kv_heads": kv_heads,
                "head_dim": head_dim, "q_len": q_len, "page_size": page_size,
                "window_left": self.window_left, "softcap": self.softcap,
                "causal": self.is_causal or q_len == 1}

    @staticmethod
    def _splits(key: Mapping[str, Any], batch: int, blocks: int, max_keys: int) -> int:
        return choose_splits(batch, key["kv_heads"], blocks, max_keys,
                             tile_keys(key["head_dim"]))

    def _check_indices(self, k_cache: torch.Tensor, cache_seqlens: torch.Tensor,
                       block_table: torch.Tensor | None) -> None:
        """Lengths within the cache and used block-table entries within the pool (one
        host sync)."""
        name = self.spec.op_name
        page = k_cache.shape[1]
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
        key = self._kernel_key(ns["q"].dtype, ns["H"], ns["Hkv"], ns["D"], ns["Sq"], page)
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

    def __init__(self, *, max_seqlen_q: int, sm_scale: float | None = None,
                 softcap: float = 0.0, window_left: int = -1, is_causal: bool = True,
                 kernel_map: Mapping[str, type[Kernel]] | None = None, tune: bool = False):
        Op.__init__(self, max_seqlen_q=max_seqlen_q, sm_scale=sm_scale,
                    softcap=float(softcap), window_left=window_left, is_causal=is_causal,
                    kernel_map=kernel_map, tune=tune)

    @classmethod
    def index_bounds(cls, inputs: Mapping[str, Any]) -> dict[str, int]:
        bounds = super().index_bounds(inputs)
        bounds["cu_seqlens_q"] = inputs["q"].shape[0] + 1
        return bounds

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                cu_seqlens_q: torch.Tensor, cache_seqlens: torch.Tensor,
                block_table: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        total, heads, head_dim = q.shape
        o = torch.empty((total, heads, head_dim), dtype=q.dtype, device=q.device)
        lse = torch.empty((total, heads), dtype=torch.float32, device=q.device)
        if total == 0 or cache_seqlens.shape[0] == 0 or self.max_seqlen_q == 0:
            return o, lse
        if self.checked and not torch.cuda.is_current_stream_capturing():
            self._check_chunks(cu_seqlens_q, cache_seqlens, total)
        self._launch(q.contiguous().view(total, 1, heads, head_dim), k_cache, v_cache,
                     cache_seqlens, block_table, cu_seqlens_q, o.view(total, 1, heads, head_dim),
                     lse.view(total, heads, 1), 0, self.max_seqlen_q)
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
        key = self._kernel_key(ns["q"].dtype, ns["H"], ns["Hkv"], ns["D"], 0, page)
        max_keys = ns["S"] * (table.shape[1] if table is not None else 1)
        blocks = row_blocks(ns["H"], ns["Hkv"], self.max_seqlen_q)
        return [("decode_attention", key, self._splits(key, ns["B"], blocks, max_keys))]


class KVCacheAppendFwdOp(Op):
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

    def __init__(self, *, kernel_map: Mapping[str, type[Kernel]] | None = None,
                 tune: bool = False):
        super().__init__(kernel_map=kernel_map, tune=tune)
        self.inplace = True

    @classmethod
    def cached(cls, **params: Any) -> Op:
        op = super().cached(**params)
        op.inplace = False  # behind the pure custom op: copies
        return op

    def __call__(self, *inputs: Any) -> Any:
        if self.inplace and torch.compiler.is_compiling():
            torch.ops.tileops.kv_cache_append_inplace(*inputs)
            return inputs[2], inputs[3]
        return super().__call__(*inputs)

    @classmethod
    def index_bounds(cls, inputs: Mapping[str, Any]) -> dict[str, int]:
        pages = inputs["k_pages"]
        return {"slot_mapping": pages.shape[0] * pages.shape[1]}

    def forward(self, k_new: torch.Tensor, v_new: torch.Tensor, k_pages: torch.Tensor,
                v_pages: torch.Tensor,
                slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
        kernel = self.get_kernel("kv_cache_append", k_new.device,
                                 **self._kernel_key(k_new.dtype, slot_mapping.dtype, width))
        kernel(tokens, k_new.reshape(tokens, width).contiguous(),
               v_new.reshape(tokens, width).contiguous(), k_out.view(-1, width),
               v_out.view(-1, width), slot_mapping.contiguous())
        return k_out, v_out

    @staticmethod
    def _kernel_key(dtype: torch.dtype, slot_dtype: torch.dtype, width: int) -> dict[str, Any]:
        return {"dtype": DTYPE_NAMES[dtype], "slot_dtype": DTYPE_NAMES[slot_dtype],
                "width": width}

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        key = self._kernel_key(ns["k_new"].dtype, ns["slot_mapping"].dtype, ns["Hkv"] * ns["D"])
        return [("kv_cache_append", key, ns["T"])]


_append_inplace = KVCacheAppendFwdOp()


@torch.library.custom_op(f"{LIBRARY}::kv_cache_append_inplace",
                         mutates_args=("k_pages", "v_pages"))
def _kv_cache_append_inplace(k_new: torch.Tensor, v_new: torch.Tensor, k_pages: torch.Tensor,
                             v_pages: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    _append_inplace.run(k_new, v_new, k_pages, v_pages, slot_mapping)


@_kv_cache_append_inplace.register_fake
def _(k_new: torch.Tensor, v_new: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
      slot_mapping: torch.Tensor) -> None:
    _append_inplace.check((k_new, v_new, k_pages, v_pages, slot_mapping))


# -- functional API -----------------------------------------------------------------------
def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     cache_seqlens: torch.Tensor, block_table: torch.Tensor | None = None,
                     sm_scale: float | None = None, softcap: float | None = None,
                     window_left: int | None = None, is_causal: bool = True,
                     return_lse: bool = False) -> Any:
    """Attention of q [B, H, D] (one token per request) or [B, q_len, H, D] over a KV cache.

    k_cache/v_cache: page pools [num_pages, page_size, Hkv, D] with `block_table`
    [B, max_pages], or a contiguous cache [B, S_max, Hkv, D] (block_table None);
    cache_seqlens [B] int32 counts each request's keys, its new tokens included. Returns o
    shaped like q, and with return_lse also lse [B, H] (or [B, H, q_len]), fp32 natural log.
    See the module docstring for masks and edge cases.
    """
    single = q.dim() == 3
    o, lse = DecodeAttentionFwdOp.apply(
        q.unsqueeze(1) if single else q, k_cache, v_cache, cache_seqlens, block_table,
        sm_scale=sm_scale, softcap=0.0 if softcap is None else float(softcap),
        window_left=-1 if window_left is None else int(window_left), is_causal=is_causal)
    if single:
        o, lse = o.squeeze(1), lse.squeeze(2)
    return (o, lse) if return_lse else o


def chunked_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              cu_seqlens_q: torch.Tensor, cache_seqlens: torch.Tensor,
                              max_seqlen_q: int, block_table: torch.Tensor | None = None,
                              sm_scale: float | None = None, softcap: float | None = None,
                              window_left: int | None = None, is_causal: bool = True,
                              return_lse: bool = False) -> Any:
    """Packed new tokens q [T, H, D] (request b: rows cu_seqlens_q[b]:cu_seqlens_q[b + 1],
    at most max_seqlen_q) attending to their KV cache, their own keys already appended;
    cache layouts and options as `decode_attention`. Returns o [T, H, D], and with
    return_lse also lse [T, H] (fp32, natural log)."""
    o, lse = ChunkedPrefillAttentionFwdOp.apply(
        q, k_cache, v_cache, cu_seqlens_q, cache_seqlens, block_table,
        max_seqlen_q=max_seqlen_q, sm_scale=sm_scale,
        softcap=0.0 if softcap is None else float(softcap),
        window_left=-1 if window_left is None else int(window_left), is_causal=is_causal)
    return (o, lse) if return_lse else o


def kv_cache_append(k_new: torch.Tensor, v_new: torch.Tensor, k_pages: torch.Tensor,
                    v_pages: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Writes k_new/v_new [T, Hkv, D] into k_pages/v_pages [num_pages, page_size, Hkv, D]
    in place at slot_mapping [T] (int64 or int32; slot = page * page_size + offset, -1
    skips the token), as vLLM's reshape_and_cache. int32 slots are widened first (one
    small copy)."""
    if slot_mapping.dtype == torch.int32:
        slot_mapping = slot_mapping.long()
    if torch.compiler.is_compiling():
        torch.ops.tileops.kv_cache_append_inplace(k_new, v_new, k_pages, v_pages, slot_mapping)
    else:
        _append_inplace.run(k_new, v_new, k_pages, v_pages, slot_mapping)

