"""Roofline formulas that need more than one manifest expression (masks, varlen)."""

from __future__ import annotations

from typing import Any


def visible_pairs(seq_q: int, seq_kv: int, window_left: int, window_right: int) -> int:
    """(query, key) pairs a bottom-right aligned window lets through; -1 = unbounded side.

    Query i sees key j when j - i - (seq_kv - seq_q) lies in [-window_left, window_right].
    """
    offset = seq_kv - seq_q
    total = 0
    for i in range(seq_q):
        lo = max(0, i + offset - window_left) if window_left >= 0 else 0
        hi = min(seq_kv - 1, i + offset + window_right) if window_right >= 0 else seq_kv - 1
        total += max(0, hi - lo + 1)
    return total


def effective_window(is_causal: bool, window_size: Any) -> tuple[int, int]:
    """(left, right) after folding `is_causal` in: causal caps the right side at 0."""
    left, right = int(window_size[0]), int(window_size[1])
    if is_causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


def attention_fwd(q: Any, k: Any, v: Any, is_causal: bool, window_size: Any,
                  elem_bytes: int, **_: Any) -> tuple[int, int]:
    """FLOPs of QK^T and PV over the visible pairs; bytes of q, k, v, o and the fp32 lse.
    V (and O) may be narrower than Q and K (MLA prefill: 192 and 128)."""
    batch, seq_q, heads, head_dim = q.shape
    seq_kv, dim_v = k.shape[1], v.shape[-1]
    left, right = effective_window(is_causal, window_size)
    pairs = visible_pairs(seq_q, seq_kv, left, right)
    flops = 2 * batch * heads * (head_dim + dim_v) * pairs
    n_qo = batch * seq_q * heads * (head_dim + dim_v)
    n_kv = k.numel() + v.numel()
    nbytes = (n_qo + n_kv) * elem_bytes + batch * heads * seq_q * 4
    return flops, nbytes


def attention_varlen_fwd(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_kv: Any,
                         is_causal: bool, window_size: Any, elem_bytes: int,
                         **_: Any) -> tuple[int, int]:
    """As `attention_fwd`, summed over the packed sequences.

    On meta tensors (no values) the sequences are taken as equally long.
    """
    total_q, heads, head_dim = q.shape
    left, right = effective_window(is_causal, window_size)
    n_seq = cu_seqlens_q.shape[0] - 1
    if cu_seqlens_q.device.type == "meta" or cu_seqlens_kv.device.type == "meta":
        lens = [(total_q // max(n_seq, 1), k.shape[0] // max(n_seq, 1))] * n_seq
    else:
        cq, ckv = cu_seqlens_q.tolist(), cu_seqlens_kv.tolist()
        lens = [(cq[i + 1] - cq[i], ckv[i + 1] - ckv[i]) for i in range(n_seq)]
    pairs = sum(visible_pairs(sq, skv, left, right) for sq, skv in lens)
    dim_v = v.shape[-1]
    flops = 2 * heads * (head_dim + dim_v) * pairs
    nbytes = ((q.numel() + total_q * heads * dim_v + k.numel() + v.numel()) * elem_bytes
              + heads * total_q * 4 + 2 * (n_seq + 1) * 4)
    return flops, nbytes


def attention_bwd(do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, is_causal: bool,
                  window_size: Any, elem_bytes: int, **_: Any) -> tuple[int, int]:
    """2.5x the forward's FLOPs (S, dP, dV, dK, dQ products); reads do, q, k, v, o, lse,
    writes dq, dk, dv."""
    flops, _bytes = attention_fwd(q, k, v, is_causal, window_size, elem_bytes)
    nbytes = ((do.numel() + 2 * q.numel() + o.numel() + 2 * (k.numel() + v.numel()))
              * elem_bytes + lse.numel() * 4)
    return flops * 5 // 2, nbytes


def decode_attention(q: Any, cache_seqlens: Any, block_table: Any, S: int, Hkv: int,
                     window_left: int, elem_bytes: int, kv_bytes: int | None = None,
                     **_: Any) -> tuple[int, int]:
    """Decode over a KV cache: the K/V rows each request's queries can see are read once
    (the window's span when one is set), q read and o written once, the lse, the lengths
    and the block-table entries of the pages read. Lengths come from cache_seqlens' values;
    on meta tensors every request is taken as full (the cache's capacity per request).
    S: rows per page (or per request), Hkv: KV heads, whatever the cache's layout."""
    batch, seq_q, heads, head_dim = q.shape
    kv_heads = Hkv
    if cache_seqlens.device.type == "meta":
        capacity = block_table.shape[1] * S if block_table is not None else S
        lengths = [capacity] * batch
    else:
        lengths = [int(n) for n in cache_seqlens.tolist()]
    keys = [min(n, window_left + seq_q) if window_left >= 0 else n for n in lengths]
    pairs = sum(visible_pairs(seq_q, n, window_left, 0) for n in lengths)
    flops = 4 * heads * head_dim * pairs
    nbytes = (2 * sum(keys) * kv_heads * head_dim * (kv_bytes or elem_bytes)
              + 2 * q.numel() * elem_bytes)
    nbytes += q.numel() // head_dim * 4 + batch * 4
    if block_table is not None:
        nbytes += sum(-(-n // S) for n in keys) * 4
    return flops, nbytes


def chunked_prefill_attention(q: Any, cu_seqlens_q: Any, cache_seqlens: Any,
                              block_table: Any, S: int, Hkv: int, window_left: int,
                              is_causal: bool, elem_bytes: int, kv_bytes: int | None = None,
                              **_: Any) -> tuple[int, int]:
    """Packed chunks over a KV cache: each request's visible (query, key) pairs; the K/V
    rows its chunk can see read once, q read and o written once, the lse, the lengths and
    the block-table entries of the pages read. On meta tensors (no values) the chunks are
    taken as equal and every request's cache as full."""
    total_q, heads, head_dim = q.shape
    kv_heads = Hkv
    batch = cache_seqlens.shape[0]
    if cache_seqlens.device.type == "meta" or cu_seqlens_q.device.type == "meta":
        capacity = block_table.shape[1] * S if block_table is not None else S
        chunks = [(total_q // max(batch, 1), capacity)] * batch
    else:
        cu = [int(n) for n in cu_seqlens_q.tolist()]
        chunks = list(zip([b - a for a, b in zip(cu[:-1], cu[1:], strict=True)],
                          [int(n) for n in cache_seqlens.tolist()], strict=True))
    right = 0 if is_causal else -1
    pairs = sum(visible_pairs(n_q, n, window_left, right) for n_q, n in chunks)
    keys = [min(n, window_left + n_q) if window_left >= 0 else n for n_q, n in chunks]
    nbytes = (2 * sum(keys) * kv_heads * head_dim * (kv_bytes or elem_bytes)
              + 2 * q.numel() * elem_bytes)
    nbytes += total_q * heads * 4 + (2 * batch + 1) * 4
    if block_table is not None:
        nbytes += sum(-(-n // S) for n in keys) * 4
    return 4 * heads * head_dim * pairs, nbytes


def _scale_bytes(k_scale: Any, v_scale: Any) -> int:
    return sum(4 * t.numel() for t in (k_scale, v_scale) if t is not None)


def decode_attention_fp8(k_scale: Any = None, v_scale: Any = None, **ns: Any) -> tuple[int, int]:
    """`decode_attention` over an fp8 cache: a byte per K/V element, and the scales."""
    flops, nbytes = decode_attention(**ns, kv_bytes=1)
    return flops, nbytes + _scale_bytes(k_scale, v_scale)


def chunked_prefill_attention_fp8(k_scale: Any = None, v_scale: Any = None,
                                  **ns: Any) -> tuple[int, int]:
    """`chunked_prefill_attention` over an fp8 cache."""
    flops, nbytes = chunked_prefill_attention(**ns, kv_bytes=1)
    return flops, nbytes + _scale_bytes(k_scale, v_scale)


def mla_decode(q_nope: Any, q_pe: Any, kv_cache: Any, cache_seqlens: Any, block_table: Any,
               elem_bytes: int, **_: Any) -> tuple[int, int]:
    """Absorbed MLA decode: per request of n keys, H heads x n keys x (2 (Dc + Dr) for the
    scores + 2 Dc for P V) flops; the n latent rows (Dc + Dr) read once for all heads, q
    read and o written once, the lse, the lengths and the table entries of the pages. On
    meta tensors every request is taken as full."""
    batch, heads, dim = q_nope.shape
    rope = q_pe.shape[2]
    page = kv_cache.shape[1]
    if cache_seqlens.device.type == "meta":
        lengths = [block_table.shape[1] * page] * batch
    else:
        lengths = [int(n) for n in cache_seqlens.tolist()]
    keys = sum(lengths)
    flops = 2 * heads * (2 * dim + rope) * keys
    nbytes = (keys * (dim + rope) + q_nope.numel() + q_pe.numel() + batch * heads * dim) \
        * elem_bytes
    nbytes += batch * heads * 4 + batch * 4 + sum(-(-n // page) for n in lengths) * 4
    return flops, nbytes
