"""Baselines of the serving-attention ops: what a torch user without a paged kernel runs,
and flash-attn's kvcache kernel when importable. Independent of TileOPs' kernels."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .baselines import Baseline


def _keys_of(cache: torch.Tensor, block_table: torch.Tensor | None) -> torch.Tensor:
    """[B, S, Hkv, D]: the contiguous cache itself, or each request's pages gathered (one
    indexing copy of every page the table names)."""
    if block_table is None:
        return cache
    batch, max_pages = block_table.shape
    _, page, kv_heads, head_dim = cache.shape
    return cache[block_table.long()].reshape(batch, max_pages * page, kv_heads, head_dim)


def _visible(cache_seqlens: torch.Tensor, seq_q: int, seq_kv: int, window_left: int,
             is_causal: bool) -> torch.Tensor:
    """[B, 1, Sq, Skv] bool: the keys each query token sees (bottom-right, per length)."""
    lengths = cache_seqlens.long()[:, None, None]
    keys = torch.arange(seq_kv, device=cache_seqlens.device)[None, None, :]
    position = lengths - seq_q + torch.arange(seq_q, device=cache_seqlens.device)[None, :, None]
    seen = keys < lengths
    if is_causal:
        seen = seen & (keys <= position)
    if window_left >= 0:
        seen = seen & (keys >= position - window_left)
    return seen[:, None]


def _sdpa_decode(backend: Any, masked: bool) -> Baseline:
    """SDPA over the (gathered) cache. `masked`: a per-request length (and window) mask, as a
    batch of mixed lengths needs; unmasked: every key of the cache, right only when every
    request fills it (the uniform contiguous workloads)."""

    def run(q, k_cache, v_cache, cache_seqlens, block_table=None, sm_scale=None, softcap=0.0,
            window_left=-1, is_causal=True):
        from torch.nn.attention import sdpa_kernel

        if softcap:
            raise NotImplementedError("SDPA has no logit softcap")
        if not masked and (block_table is not None or window_left >= 0 or q.shape[1] > 1):
            raise NotImplementedError("the unmasked baseline is for full contiguous caches")
        k, v = _keys_of(k_cache, block_table), _keys_of(v_cache, block_table)
        mask = (_visible(cache_seqlens, q.shape[1], k.shape[1], window_left, is_causal)
                if masked else None)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                scale=sm_scale, enable_gqa=True).transpose(1, 2)

    return run


def _flash_attn_kvcache(q, k_cache, v_cache, cache_seqlens, block_table=None, sm_scale=None,
                        softcap=0.0, window_left=-1, is_causal=True):
    from flash_attn import flash_attn_with_kvcache

    return flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                                   block_table=block_table, softmax_scale=sm_scale,
                                   causal=is_causal, window_size=(window_left, -1),
                                   softcap=softcap)


def decode_attention_baselines(libs: dict[str, bool]) -> dict[str, Baseline]:
    from torch.nn.attention import SDPBackend

    backends = (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                ("efficient", SDPBackend.EFFICIENT_ATTENTION))
    table = {f"sdpa-{name}-masked": _sdpa_decode(backend, True) for name, backend in backends}
    table.update({f"sdpa-{name}-full-cache": _sdpa_decode(backend, False)
                  for name, backend in backends})
    if libs["flash_attn"]:
        table["flash-attn-kvcache"] = _flash_attn_kvcache
    return table


def _sdpa_chunks(backend: Any) -> Baseline:
    """SDPA request by request on each request's gathered keys with its bottom-right mask
    (what a torch user without a ragged paged kernel writes; reads the offsets on the
    host)."""

    def run(q, k_cache, v_cache, cu_seqlens_q, cache_seqlens, block_table=None,
            max_seqlen_q=0, sm_scale=None, softcap=0.0, window_left=-1, is_causal=True):
        from torch.nn.attention import sdpa_kernel

        if softcap:
            raise NotImplementedError("SDPA has no logit softcap")
        cu, lengths = cu_seqlens_q.tolist(), cache_seqlens.tolist()
        out = torch.empty_like(q)
        for b, n in enumerate(lengths):
            start, end = cu[b], cu[b + 1]
            if end == start:
                continue
            table = None if block_table is None else block_table[b:b + 1]
            k = _keys_of(k_cache if table is not None else k_cache[b:b + 1], table)[:, :n]
            v = _keys_of(v_cache if table is not None else v_cache[b:b + 1], table)[:, :n]
            mask = _visible(cache_seqlens[b:b + 1], end - start, n, window_left, is_causal)
            with sdpa_kernel(backend):
                out[start:end] = F.scaled_dot_product_attention(
                    q[None, start:end].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                    attn_mask=mask, scale=sm_scale, enable_gqa=True).transpose(1, 2)[0]
        return out

    return run


def _flash_attn_paged_varlen(q, k_cache, v_cache, cu_seqlens_q, cache_seqlens,
                             block_table=None, max_seqlen_q=0, sm_scale=None, softcap=0.0,
                             window_left=-1, is_causal=True):
    from flash_attn import flash_attn_varlen_func

    cu_k = F.pad(cache_seqlens.cumsum(0, dtype=torch.int32), (1, 0))
    return flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q, cu_k, max_seqlen_q,
                                  int(cache_seqlens.max()), softmax_scale=sm_scale,
                                  causal=is_causal, window_size=(window_left, -1),
                                  softcap=softcap, block_table=block_table)


def chunked_prefill_baselines(libs: dict[str, bool]) -> dict[str, Baseline]:
    from torch.nn.attention import SDPBackend

    table = {f"sdpa-{name}-per-request": _sdpa_chunks(backend) for name, backend in (
        ("cudnn", SDPBackend.CUDNN_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION))}
    if libs["flash_attn"]:
        table["flash-attn-varlen-paged"] = _flash_attn_paged_varlen
    return table


def _index_copy(k_new, v_new, k_pages, v_pages, slot_mapping):
    """Row scatter into the flattened pools (torch has no skip for slot -1)."""
    kv_heads, head_dim = k_new.shape[1:]
    k_pages.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k_new)
    v_pages.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v_new)
    return k_pages, v_pages


def kv_cache_append_baselines(libs: dict[str, bool]) -> dict[str, Baseline]:
    return {"torch-index-copy": _index_copy}
