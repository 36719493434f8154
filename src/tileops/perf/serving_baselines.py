"""Baselines of the serving-attention ops: what a torch user without a paged kernel runs,
and flash-attn's kvcache kernel when importable; for chunked prefill also TileOPs' own dense
varlen forward on pre-packed keys (the issue's yardstick), and for fp8 caches TileOPs' 16-bit
kernels on the widened cache."""

from __future__ import annotations

import itertools
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


def _as_nhd(run: Baseline) -> Baseline:
    """`run` (written for [N, S, Hkv, D] caches) on a cache of either kv_layout: a
    heads-first cache is passed as its [N, S, Hkv, D] view (no copy)."""

    def wrapped(q, k_cache, v_cache, *args, kv_layout="NHD", **params):
        if kv_layout == "HND":
            k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
        return run(q, k_cache, v_cache, *args, **params)

    return wrapped


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
    return {name: _as_nhd(run) for name, run in table.items()}


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


_packed: dict[tuple, tuple[torch.Tensor, torch.Tensor, int]] = {}


def _packed_once(cache: torch.Tensor, block_table: torch.Tensor | None,
                 cache_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(keys [sum(lengths), Hkv, D], cu_seqlens_kv, longest): each request's keys packed
    end to end, made on the first call for this cache and reused (outside the timed region
    after warm-up, as a dense prefill would find them)."""
    key = (cache.data_ptr(), tuple(cache.shape), cache_seqlens.data_ptr(),
           None if block_table is None else block_table.data_ptr())
    found = _packed.get(key)
    if found is None:
        if len(_packed) > 16:
            _packed.clear()
        lengths = cache_seqlens.tolist()
        rows = [_keys_of(cache if block_table is not None else cache[b:b + 1],
                         None if block_table is None else block_table[b:b + 1])[0, :n]
                for b, n in enumerate(lengths)]
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32,
                          device=cache.device)
        found = _packed[key] = (torch.cat(rows), cu, max(lengths))
    return found


def _tileops_dense_varlen(q, k_cache, v_cache, cu_seqlens_q, cache_seqlens, block_table=None,
                          max_seqlen_q=0, sm_scale=None, softcap=0.0, window_left=-1,
                          is_causal=True):
    """TileOPs' own dense prefill forward (the varlen kernel) on the same chunks with each
    request's keys packed contiguously beforehand: the chunked-prefill target's yardstick
    (>= 0.9x of it). Bottom-right causal in both."""
    from tileops import attention_varlen

    k, cu_k, longest = _packed_once(k_cache, block_table, cache_seqlens)
    v, _, _ = _packed_once(v_cache, block_table, cache_seqlens)
    return attention_varlen(q, k, v, cu_seqlens_q, cu_k, max_seqlen_q, longest,
                            is_causal=is_causal, scale=sm_scale,
                            window_size=(window_left, -1), softcap=softcap)


def chunked_prefill_baselines(libs: dict[str, bool]) -> dict[str, Baseline]:
    from torch.nn.attention import SDPBackend

    table = {f"sdpa-{name}-per-request": _sdpa_chunks(backend) for name, backend in (
        ("cudnn", SDPBackend.CUDNN_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION))}
    table["tileops-dense-varlen"] = _tileops_dense_varlen
    if libs["flash_attn"]:
        table["flash-attn-varlen-paged"] = _flash_attn_paged_varlen
    return {name: _as_nhd(run) for name, run in table.items()}


def _index_copy(k_new, v_new, k_pages, v_pages, slot_mapping, kv_layout="NHD"):
    """Row scatter into the flattened pools (torch has no skip for slot -1); heads-first
    pools by an indexed store into their [N, page, Hkv, D] view."""
    kv_heads, head_dim = k_new.shape[1:]
    if kv_layout == "HND":
        page = k_pages.shape[2]
        for new, pages in ((k_new, k_pages), (v_new, v_pages)):
            pages.transpose(1, 2)[slot_mapping // page, slot_mapping % page] = new
        return k_pages, v_pages
    k_pages.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k_new)
    v_pages.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v_new)
    return k_pages, v_pages


def kv_cache_append_baselines(libs: dict[str, bool]) -> dict[str, Baseline]:
    return {"torch-index-copy": _index_copy}


# -- fp8 caches ---------------------------------------------------------------------------
_widened: dict[tuple, torch.Tensor] = {}


def _widen_once(cache: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype,
                kv_layout: str = "NHD") -> torch.Tensor:
    """cache * scale in `dtype`, made on the first call for this cache and reused (outside
    the timed region after warm-up): the same attention over a 16-bit cache."""
    key = (cache.data_ptr(), tuple(cache.shape), None if scale is None else scale.data_ptr(),
           dtype)
    wide = _widened.get(key)
    if wide is None:
        if len(_widened) > 8:
            _widened.clear()
        wide = _widened[key] = _dequantize(cache, scale, dtype, kv_layout)
    return wide


def _dequantize(cache: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype,
                kv_layout: str = "NHD") -> torch.Tensor:
    """cache [..., Hkv, D] (HND: [..., Hkv, S, D]) * scale ([1] or [Hkv]) in `dtype`."""
    wide = cache.float()
    if scale is not None:
        wide = wide * scale.reshape((-1, 1) if kv_layout == "NHD" else (-1, 1, 1)).float()
    return wide.to(dtype)


def _bf16_cache(run: Baseline) -> Baseline:
    """`run` over the fp8 cache widened once: our own 16-bit kernel on the same shapes."""

    def wrapped(q, k_cache, v_cache, *args, k_scale=None, v_scale=None, **params):
        layout = params.get("kv_layout", "NHD")
        return run(q, _widen_once(k_cache, k_scale, q.dtype, layout),
                   _widen_once(v_cache, v_scale, q.dtype, layout), *args, **params)

    return wrapped


def _split_scales(run: Baseline, n_args: int) -> Baseline:
    """The fp8 op's positional inputs (..., k_scale, v_scale) as keywords for `run`."""

    def wrapped(*args, **params):
        args = list(args) + [None] * (n_args + 2 - len(args))
        return run(*args[:n_args], k_scale=args[n_args], v_scale=args[n_args + 1], **params)

    return wrapped


def _dequantized_sdpa(run: Baseline) -> Baseline:
    """`run` on the cache dequantized on every call (what a torch user writes)."""

    def wrapped(q, k_cache, v_cache, *args, k_scale=None, v_scale=None, **params):
        return run(q, _dequantize(k_cache, k_scale, q.dtype),
                   _dequantize(v_cache, v_scale, q.dtype), *args, **params)

    return wrapped


def _tileops_decode(q, k_cache, v_cache, cache_seqlens, block_table=None, sm_scale=None,
                    softcap=0.0, window_left=-1, is_causal=True, kv_layout="NHD"):
    from tileops import decode_attention

    return decode_attention(q, k_cache, v_cache, cache_seqlens, block_table, sm_scale,
                            softcap, window_left, is_causal, kv_layout=kv_layout)


def _tileops_chunks(q, k_cache, v_cache, cu_seqlens_q, cache_seqlens, block_table=None,
                    max_seqlen_q=0, sm_scale=None, softcap=0.0, window_left=-1,
                    is_causal=True, kv_layout="NHD"):
    from tileops import chunked_prefill_attention

    return chunked_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, cache_seqlens,
                                     max_seqlen_q, block_table, sm_scale, softcap, window_left,
                                     is_causal, kv_layout=kv_layout)


def decode_attention_fp8_baselines(libs: dict[str, bool]) -> dict[str, Baseline]:
    """TileOPs' 16-bit decode on the same cache widened once (the issue's fp8 target is
    >= 1.7x of it), and cuDNN SDPA on the gathered cache dequantized per call."""
    from torch.nn.attention import SDPBackend

    return {"tileops-16bit-cache": _split_scales(_bf16_cache(_tileops_decode), 5),
            "sdpa-cudnn-masked-dequantized": _split_scales(_as_nhd(
                _dequantized_sdpa(_sdpa_decode(SDPBackend.CUDNN_ATTENTION, True))), 5)}


def chunked_prefill_fp8_baselines(libs: dict[str, bool]) -> dict[str, Baseline]:
    return {"tileops-16bit-cache": _split_scales(_bf16_cache(_tileops_chunks), 6)}


def _quantize_copy(k_new, v_new, k_pages, v_pages, slot_mapping, k_scale=None, v_scale=None,
                   kv_layout="NHD"):
    """Scale, saturate and cast in torch, then the row scatter."""
    def q8(x, scale):
        if scale is not None:
            x = x.float() / scale.reshape(-1, 1).float()
        return x.float().clamp(-448.0, 448.0).to(torch.float8_e4m3fn)

    return _index_copy(q8(k_new, k_scale), q8(v_new, v_scale), k_pages, v_pages, slot_mapping,
                       kv_layout)


def kv_cache_append_fp8_baselines(libs: dict[str, bool]) -> dict[str, Baseline]:
    return {"torch-quantize-index-copy": _quantize_copy}


# -- MLA decode ---------------------------------------------------------------------------
def _sdpa_mla(backend: Any) -> Baseline:
    """SDPA over the gathered latent cache as one KV head (keys c ++ k_pe, values c), a
    per-request length mask: what a torch user without an MLA kernel runs."""

    def run(q_nope, q_pe, kv_cache, cache_seqlens, block_table, sm_scale=None):
        from torch.nn.attention import sdpa_kernel

        dim = q_nope.shape[2]
        keys = _keys_of(kv_cache[:, :, None], block_table)  # [B, S, 1, Dc + Dr]
        q = torch.cat([q_nope, q_pe], dim=-1)[:, None]  # [B, 1, H, Dc + Dr]
        mask = _visible(cache_seqlens, 1, keys.shape[1], -1, True)
        scale = sm_scale if sm_scale is not None else q.shape[-1] ** -0.5
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(
                q.transpose(1, 2), keys.transpose(1, 2), keys[..., :dim].transpose(1, 2),
                attn_mask=mask, scale=scale, enable_gqa=True).transpose(1, 2)[:, 0]

    return run


def _flash_mla(q_nope, q_pe, kv_cache, cache_seqlens, block_table, sm_scale=None):
    from flash_mla import flash_mla_with_kvcache, get_mla_metadata

    heads, dim = q_nope.shape[1], q_nope.shape[2]
    q = torch.cat([q_nope, q_pe], dim=-1)[:, None]
    metadata, splits = get_mla_metadata(cache_seqlens, heads, 1)
    scale = sm_scale if sm_scale is not None else q.shape[-1] ** -0.5
    return flash_mla_with_kvcache(q, kv_cache[:, :, None], block_table, cache_seqlens, dim,
                                  metadata, splits, softmax_scale=scale)[0][:, 0]


def mla_decode_baselines(libs: dict[str, bool]) -> dict[str, Baseline]:
    from torch.nn.attention import SDPBackend

    table = {"sdpa-efficient-masked": _sdpa_mla(SDPBackend.EFFICIENT_ATTENTION),
             "sdpa-math-masked": _sdpa_mla(SDPBackend.MATH)}
    if libs.get("flash_mla"):
        table["flash-mla"] = _flash_mla
    return table
