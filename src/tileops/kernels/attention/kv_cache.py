"""Cache write: new tokens' K and V rows into their slots of the page pools, in place.

vLLM's reshape_and_cache: token t goes to slot s = slot_mapping[t] = page * page_size +
offset; a slot of -1 (a padding token) is skipped. A token's row of the pool,
k_pages[page, offset], is Hkv * D contiguous elements, so the kernel sees the pools as
[num_pages * page_size, Hkv * D] and copies whole rows with 16-byte vectors.
"""

from dataclasses import dataclass

import tilelang.language as T

from ..base import Kernel


@dataclass(frozen=True)
class KVCacheAppendConfig:
    block_rows: int = 4  # tokens per CTA
    threads: int = 128


def kv_cache_append_program(width: int, dtype: str, slot_dtype: str,
                            config: KVCacheAppendConfig):
    """k_new/v_new [T, width] into rows slot_mapping[t] of k_pages/v_pages [slots, width]."""
    tokens, slots = T.dynamic("tokens, slots")
    block_rows = config.block_rows

    @T.prim_func
    def kv_cache_append(k_new: T.Tensor((tokens, width), dtype),
                        v_new: T.Tensor((tokens, width), dtype),
                        k_pages: T.Tensor((slots, width), dtype),
                        v_pages: T.Tensor((slots, width), dtype),
                        slot_mapping: T.Tensor((tokens,), slot_dtype)):
        with T.Kernel(T.ceildiv(tokens, block_rows), threads=config.threads) as bx:
            # the slot is re-read per vector (an L1 hit): a per-row register copy would pin
            # each row to one thread
            for i, j in T.Parallel(block_rows, width):
                row = bx * block_rows + i
                if row < tokens:
                    if slot_mapping[row] >= 0:
                        k_pages[slot_mapping[row], j] = k_new[row, j]
                        v_pages[slot_mapping[row], j] = v_new[row, j]

    return kv_cache_append


class KVCacheAppendKernel(Kernel):
    """key: dtype, slot_dtype, width (Hkv * D)."""

    name = "kv_cache_append"
    Config = KVCacheAppendConfig

    def program(self, config: KVCacheAppendConfig, bucket: str):
        k = self.key
        return kv_cache_append_program(k["width"], k["dtype"], k["slot_dtype"], config)

    def heuristic_config(self, bucket: str, arch: str) -> KVCacheAppendConfig:
        # one 16-byte vector per thread per row at width 1024 (8 KV heads x 128): 4 rows per
        # CTA give each thread 8 vectors in flight (4 of K, 4 of V)
        return KVCacheAppendConfig()

    def config_space(self, bucket: str) -> list[KVCacheAppendConfig]:
        return [KVCacheAppendConfig(rows, 128) for rows in (1, 2, 4, 8)]

    def run(self, config: KVCacheAppendConfig, compiled: tuple, k_new, v_new, k_pages,
            v_pages, slot_mapping) -> None:
        compiled[0](k_new, v_new, k_pages, v_pages, slot_mapping)
