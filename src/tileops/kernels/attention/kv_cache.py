"""Cache write: new tokens' K and V rows into their slots of the page pools, in place.

vLLM's reshape_and_cache: token t goes to slot s = slot_mapping[t] = page * page_size +
offset; a slot of -1 (a padding token) is skipped. A token's row of the pool,
k_pages[page, offset], is Hkv * D contiguous elements, so the kernel sees the pools as
[num_pages * page_size, Hkv * D] and copies whole rows with 16-byte vectors. Heads-first
pools (kv_layout "HND", [num_pages, Hkv, page_size, D]) are seen as [num_pages * Hkv,
page_size, D]: a token's head h goes to block page * Hkv + h, row offset. TileLang 0.1.15
vectorizes those stores by 4 bytes only (the data-dependent block index defeats its
16-byte proof): an append into HND pools is slower than into NHD ones (not measured).
"""

from dataclasses import dataclass

import tilelang.language as T

from ..base import Kernel


@dataclass(frozen=True)
class KVCacheAppendConfig:
    block_rows: int = 4  # tokens per CTA
    threads: int = 128


FP8_MAX = 448.0  # e4m3's largest finite value


def kv_cache_append_program(width: int, dtype: str, slot_dtype: str,
                            config: KVCacheAppendConfig, cache_dtype: str | None = None,
                            head_dim: int = 0, page_size: int = 0):
    """k_new/v_new [T, width] into rows slot_mapping[t] of k_pages/v_pages [slots, width],
    or with `page_size` (heads-first pools) into the pools' rows of head_dim (see the module
    docstring).

    `cache_dtype` "float8_e4m3fn": the pools are fp8 and the program takes k_scale/v_scale
    [1] or [Hkv] (fp32); element j of a row, of KV head j // head_dim, is stored as
    clamp(x / scale, -448, 448) rounded to e4m3."""
    tokens, slots, n_scale = T.dynamic("tokens, slots, n_scale")
    block_rows = config.block_rows
    heads_first = page_size > 0
    kv_heads = width // head_dim if heads_first else 0
    # heads-first pools as [num_pages * Hkv, page_size, head_dim]
    pool_shape = (slots, page_size, head_dim) if heads_first else (slots, width)
    pool_dtype = cache_dtype or dtype

    def quantize(x, scales, head):
        return T.Cast(cache_dtype, T.clamp(
            T.Cast("float", x) / scales[T.min(head, n_scale - 1)], -FP8_MAX, FP8_MAX))

    def stored(x, scales, head):
        return x if cache_dtype is None else quantize(x, scales, head)

    def head_block(slot, h):
        """The heads-first pool's [page_size, head_dim] block of KV head h of `slot`'s page."""
        return slot // page_size * kv_heads + h

    @T.macro
    def append_heads_first(k_new, v_new, k_pages, v_pages, slot_mapping, k_scale, v_scale,
                           bx):
        # (token, head, column): the columns of one head are contiguous on both sides, so
        # they move in 16-byte vectors
        for i, h, d in T.Parallel(block_rows, kv_heads, head_dim):
            row = bx * block_rows + i
            if row < tokens:
                if slot_mapping[row] >= 0:
                    k_pages[head_block(slot_mapping[row], h), slot_mapping[row] % page_size,
                            d] = stored(k_new[row, h * head_dim + d], k_scale, h)
                    v_pages[head_block(slot_mapping[row], h), slot_mapping[row] % page_size,
                            d] = stored(v_new[row, h * head_dim + d], v_scale, h)

    if cache_dtype is not None:
        @T.prim_func
        def kv_cache_append_fp8(k_new: T.Tensor((tokens, width), dtype),
                                v_new: T.Tensor((tokens, width), dtype),
                                k_pages: T.Tensor(pool_shape, pool_dtype),
                                v_pages: T.Tensor(pool_shape, pool_dtype),
                                slot_mapping: T.Tensor((tokens,), slot_dtype),
                                k_scale: T.Tensor((n_scale,), "float"),
                                v_scale: T.Tensor((n_scale,), "float")):
            with T.Kernel(T.ceildiv(tokens, block_rows), threads=config.threads) as bx:
                if heads_first:
                    append_heads_first(k_new, v_new, k_pages, v_pages, slot_mapping, k_scale,
                                       v_scale, bx)
                else:
                    for i, j in T.Parallel(block_rows, width):
                        row = bx * block_rows + i
                        if row < tokens:
                            if slot_mapping[row] >= 0:
                                k_pages[slot_mapping[row], j] = quantize(
                                    k_new[row, j], k_scale, j // head_dim)
                                v_pages[slot_mapping[row], j] = quantize(
                                    v_new[row, j], v_scale, j // head_dim)

        return kv_cache_append_fp8

    @T.prim_func
    def kv_cache_append(k_new: T.Tensor((tokens, width), dtype),
                        v_new: T.Tensor((tokens, width), dtype),
                        k_pages: T.Tensor(pool_shape, dtype),
                        v_pages: T.Tensor(pool_shape, dtype),
                        slot_mapping: T.Tensor((tokens,), slot_dtype)):
        with T.Kernel(T.ceildiv(tokens, block_rows), threads=config.threads) as bx:
            if heads_first:
                append_heads_first(k_new, v_new, k_pages, v_pages, slot_mapping, None, None,
                                   bx)
            else:
                # the slot is re-read per vector (an L1 hit): a per-row register copy would
                # pin each row to one thread
                for i, j in T.Parallel(block_rows, width):
                    row = bx * block_rows + i
                    if row < tokens:
                        if slot_mapping[row] >= 0:
                            k_pages[slot_mapping[row], j] = k_new[row, j]
                            v_pages[slot_mapping[row], j] = v_new[row, j]

    return kv_cache_append


class KVCacheAppendKernel(Kernel):
    """key: dtype, slot_dtype, width (Hkv * D); for fp8 pools also cache_dtype and
    head_dim; for heads-first pools also head_dim and page_size (absent: NHD)."""

    name = "kv_cache_append"
    Config = KVCacheAppendConfig

    def program(self, config: KVCacheAppendConfig, bucket: str):
        k = self.key
        return kv_cache_append_program(k["width"], k["dtype"], k["slot_dtype"], config,
                                       k.get("cache_dtype"), k.get("head_dim", 0),
                                       k.get("page_size", 0))

    def heuristic_config(self, bucket: str, arch: str) -> KVCacheAppendConfig:
        # one 16-byte vector per thread per row at width 1024 (8 KV heads x 128): 4 rows per
        # CTA give each thread 8 vectors in flight (4 of K, 4 of V)
        return KVCacheAppendConfig()

    def config_space(self, bucket: str) -> list[KVCacheAppendConfig]:
        return [KVCacheAppendConfig(rows, 128) for rows in (1, 2, 4, 8)]

    def run(self, config: KVCacheAppendConfig, compiled: tuple, k_new, v_new, k_pages,
            v_pages, slot_mapping, *scales) -> None:
        compiled[0](k_new, v_new, k_pages, v_pages, slot_mapping, *scales)
