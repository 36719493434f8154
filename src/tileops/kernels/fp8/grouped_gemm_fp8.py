"""Grouped fp8 (e4m3) GEMM with DeepSeek-V3 block scaling: the MoE experts in fp8.

out[rows of e] = (a[rows] @ b[e]^T) dequantized, for each expert e, in one launch:
- a [M_total, K] e4m3, its 1x128 group scales read as [K/128, M_total] (M-major, as
  quantize_fp8(granularity='group') stores them) or [M_total, K/128];
- b [E, N, K] e4m3, its 128x128 block scales [E, N/128, K/128];
- offsets int32 [E]: the cumulative end rows (the bf16 grouped GEMM's convention).

The two halves are shared, not copied:
- scheduling (moe/grouped_gemm.py): the device-built tile table, the persistent grid over
  (m tile, n tile) pairs with every index re-read from the table, the store guarded by
  the group's end row, the tile bound ceil(M_total / block_m) + E (no host sync);
- numerics (fp8/gemm_fp8.py): each 128-deep K tile is accumulated by wgmma into a fresh
  fragment and promoted into the fp32 accumulator times scale_a[row, kt] *
  scale_b[e, n tile, kt] (`load_block_factors`, `promote_block`), exactly as the dense
  block-scaled GEMM does; so block_n = block_k = 128 (one b block per tile).

M_total is symbolic; N, K, E are compiled in (N and K multiples of 128).
"""

from dataclasses import dataclass

import tilelang.language as T

from ..moe.grouped_gemm import (
    SMS,
    GroupedGemmConfig,
    GroupedGemmKernel,
    store_group_tile,
    tile_col0,
    tile_count,
    tile_expert,
    tile_live,
    tile_of,
    tile_row0,
    tile_table_program,
)
from .gemm_fp8 import FP8, SCALE_BLOCK, load_block_factors, promote_block

SMEM_LIMIT = 227 * 1024


@dataclass(frozen=True)
class GroupedGemmFp8Config(GroupedGemmConfig):
    block_m: int = 128
    block_n: int = SCALE_BLOCK  # one 128x128 weight block per tile and K step
    block_k: int = SCALE_BLOCK
    stages: int = 5
    threads: int = 256  # consumer threads (a producer warp group is added)
    ctas: int = SMS

    def valid(self) -> bool:
        smem = self.stages * (self.block_m + self.block_n) * self.block_k
        return (smem <= SMEM_LIMIT and self.block_n == SCALE_BLOCK == self.block_k
                and self.block_m in (64, 128) and self.threads == self.block_m * 2)


def grouped_gemm_fp8_programs(n: int, k: int, n_experts: int, out_dtype: str,
                              config: GroupedGemmFp8Config, scale_a_m_major: bool = True):
    """(tile table, GEMM) prim_funcs; M_total is symbolic."""
    assert n % SCALE_BLOCK == 0 and k % SCALE_BLOCK == 0 and config.valid(), (n, k, config)
    m_total, m_tiles = T.dynamic("m_total, m_tiles")
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    n_tiles = n // bn
    k_blocks = k // SCALE_BLOCK
    ctas = config.ctas
    sa_shape = (k_blocks, m_total) if scale_a_m_major else (m_total, k_blocks)

    @T.macro
    def body(a, b, scale_a, scale_b, offsets, table, out):
        with T.Kernel(ctas, threads=config.threads) as cta:
            a_shared = T.alloc_shared((bm, bk), FP8)
            b_shared = T.alloc_shared((bn, bk), FP8)
            acc = T.alloc_fragment((bm, bn), "float32")
            part = T.alloc_fragment((bm, bn), "float32")
            factor = T.alloc_fragment((bm,), "float32")
            for step in T.serial(T.ceildiv(tile_count(m_tiles, n_tiles), ctas)):
                if tile_of(step, cta, ctas) < tile_count(m_tiles, n_tiles):
                    if tile_live(table, tile_of(step, cta, ctas), n_tiles):
                        T.clear(acc)
                        for kk in T.Pipelined(k_blocks, num_stages=config.stages):
                            T.copy(a[tile_row0(offsets, table, tile_of(step, cta, ctas),
                                               n_tiles, bm), kk * bk], a_shared)
                            T.copy(b[tile_expert(table, tile_of(step, cta, ctas), n_tiles),
                                     tile_col0(tile_of(step, cta, ctas), n_tiles, bn),
                                     kk * bk], b_shared)
                            load_block_factors(
                                factor, bm, scale_a, scale_a_m_major, kk,
                                tile_row0(offsets, table, tile_of(step, cta, ctas), n_tiles,
                                          bm),
                                m_total - 1,
                                scale_b[tile_expert(table, tile_of(step, cta, ctas), n_tiles),
                                        tile_of(step, cta, ctas) % n_tiles, kk])
                            promote_block(a_shared, b_shared, part, acc, factor, bm, bn)
                        store_group_tile(
                            acc, out,
                            tile_row0(offsets, table, tile_of(step, cta, ctas), n_tiles, bm),
                            offsets[tile_expert(table, tile_of(step, cta, ctas), n_tiles)],
                            tile_col0(tile_of(step, cta, ctas), n_tiles, bn), n, bm, bn)

    # Each parameter its own annotation object (a shared one would alias the buffers).
    @T.prim_func
    def grouped_gemm_fp8(a: T.Tensor((m_total, k), FP8),
                         b: T.Tensor((n_experts, n, k), FP8),
                         scale_a: T.Tensor(sa_shape, "float32"),
                         scale_b: T.Tensor((n_experts, n_tiles, k_blocks), "float32"),
                         offsets: T.Tensor((n_experts,), "int32"),
                         table: T.Tensor((m_tiles,), "int32"),
                         out: T.Tensor((m_total, n), out_dtype)):
        body(a, b, scale_a, scale_b, offsets, table, out)

    return tile_table_program(n_experts, bm), grouped_gemm_fp8


class GroupedGemmFp8Kernel(GroupedGemmKernel):
    """key: n, k, n_experts, out_dtype, scale_a_m_major. The bf16 grouped GEMM's buckets
    (mean rows per expert: `decode` <= 64 takes 64-row tiles on one consumer warp group,
    `prefill` 128-row tiles on two) and launch (tile table, then the GEMM). Two fp32
    accumulators (the promoted sum and the K tile's), so 128 x 128 tiles: what fits the
    168 registers of a warp-specialized consumer. Not tuned: no device has run it yet.
    Launch with (a, b, scale_a, scale_b, offsets, out)."""

    name = "grouped_gemm_fp8"
    Config = GroupedGemmFp8Config

    def program(self, config: GroupedGemmFp8Config, bucket: str):
        key = self.key
        return grouped_gemm_fp8_programs(key["n"], key["k"], key["n_experts"],
                                         key["out_dtype"], config, key["scale_a_m_major"])

    def heuristic_config(self, bucket: str, arch: str) -> GroupedGemmFp8Config:
        if bucket == "decode":
            return GroupedGemmFp8Config(block_m=64, stages=8, threads=128)
        return GroupedGemmFp8Config(block_m=128, stages=5, threads=256)

    def config_space(self, bucket: str) -> list[GroupedGemmFp8Config]:
        space = [self.heuristic_config(bucket, "sm_90a")]
        for block_m, threads, stages in ((64, 128, 6), (64, 128, 8), (64, 128, 9),
                                         (128, 256, 4), (128, 256, 6)):
            space.append(GroupedGemmFp8Config(block_m=block_m, stages=stages, threads=threads))
        return [c for c in dict.fromkeys(space) if c.valid()]

    def run(self, config: GroupedGemmFp8Config, compiled: tuple, a, b, scale_a, scale_b,
            offsets, out) -> None:
        import torch

        m_tiles = -(-a.shape[0] // config.block_m) + self.key["n_experts"]
        table = torch.empty((m_tiles,), dtype=torch.int32, device=a.device)
        compiled[0](offsets, table)
        compiled[1](a, b, scale_a, scale_b, offsets, table, out)
