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
from types import SimpleNamespace

import tilelang.language as T

from ..moe.grouped_gemm import (
    SMS,
    GroupedGemmConfig,
    GroupedGemmKernel,
    tile_col0,
    tile_expert,
    tile_launch,
    tile_row0,
    tile_store_macro,
    tile_table_program,
)
from .gemm_fp8 import (
    FP8,
    SCALE_BLOCK,
    load_block_factors,
    load_block_scales,
    promote_block,
    promote_block_prefetched,
)

SMEM_LIMIT = 227 * 1024


@dataclass(frozen=True)
class GroupedGemmFp8Config(GroupedGemmConfig):
    block_m: int = 128
    block_n: int = SCALE_BLOCK  # one 128x128 weight block per tile and K step
    block_k: int = SCALE_BLOCK
    stages: int = 5
    threads: int = 256  # consumer threads (a producer warp group is added)
    ctas: int = SMS
    # load K block k+1's scales while block k's wgmma runs (the dense GEMM's option): the
    # plain promotion waits one global load of the scales every K block
    prefetch_scales: bool = False

    def smem_bytes(self) -> int:
        out = self.block_m * self.block_n * 2 if self.tile_store else 0
        return self.stages * (self.block_m + self.block_n) * self.block_k + out

    def valid(self) -> bool:
        return (self.smem_bytes() <= SMEM_LIMIT and self.block_n == SCALE_BLOCK == self.block_k
                and self.block_m in (64, 128) and self.threads == self.block_m * 2
                and (self.n_group == 0 or not self.persistent) and not self.full_row
                and (self.ctas_per_sm == 1 or self.threads == 128)
                # TileLang 0.1.15's ThreadSync fails to lower this one ("a divergent region
                # with 1 participating threads")
                and not (self.persistent and self.tile_store and self.prefetch_scales)
                and (self.tile_store or not self.staged_rows))


def grouped_gemm_fp8_programs(n: int, k: int, n_experts: int, out_dtype: str,
                              config: GroupedGemmFp8Config, scale_a_m_major: bool = True):
    """(tile table, GEMM) prim_funcs; M_total is symbolic."""
    assert n % SCALE_BLOCK == 0 and k % SCALE_BLOCK == 0 and config.valid(), (n, k, config)
    m_total, m_tiles = T.dynamic("m_total, m_tiles")
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    n_tiles = n // bn
    k_blocks = k // SCALE_BLOCK
    sa_shape = (k_blocks, m_total) if scale_a_m_major else (m_total, k_blocks)
    store_tile = tile_store_macro(config, n, n_tiles)

    def b_scale(io, t, kb):  # the tile's weight block scale in K block kb
        return io.scale_b[tile_expert(io.table, t, n_tiles), t % n_tiles, kb]

    @T.macro
    def one_tile(io, t, bufs):
        """Tile t (a live one): the K loop promoting block by block, then the store."""
        T.clear(bufs.acc)
        if config.prefetch_scales:  # the first K block's raw scales
            load_block_scales(bufs.factor, bufs.sb, bm, io.scale_a, scale_a_m_major, 0,
                              tile_row0(io.offsets, io.table, t, n_tiles, bm), m_total - 1,
                              b_scale(io, t, 0))
        for kk in T.Pipelined(k_blocks, num_stages=config.stages):
            T.copy(io.a[tile_row0(io.offsets, io.table, t, n_tiles, bm), kk * bk],
                   bufs.a_shared)
            T.copy(io.b[tile_expert(io.table, t, n_tiles), tile_col0(t, n_tiles, bn),
                        kk * bk], bufs.b_shared)
            if config.prefetch_scales:
                promote_block_prefetched(
                    bufs.a_shared, bufs.b_shared, bufs.part, bufs.acc, bufs.factor, bufs.sb,
                    bm, bn, io.scale_a, scale_a_m_major, T.min(kk + 1, k_blocks - 1),
                    tile_row0(io.offsets, io.table, t, n_tiles, bm), m_total - 1,
                    b_scale(io, t, T.min(kk + 1, k_blocks - 1)))
            else:
                load_block_factors(bufs.factor, bm, io.scale_a, scale_a_m_major, kk,
                                   tile_row0(io.offsets, io.table, t, n_tiles, bm),
                                   m_total - 1, b_scale(io, t, kk))
                promote_block(bufs.a_shared, bufs.b_shared, bufs.part, bufs.acc, bufs.factor,
                              bm, bn)
        store_tile(io, t, bufs)

    def alloc_tile_buffers():
        return SimpleNamespace(
            a_shared=T.alloc_shared((bm, bk), FP8),
            b_shared=T.alloc_shared((bn, bk), FP8),
            acc=T.alloc_fragment((bm, bn), "float32"),
            part=T.alloc_fragment((bm, bn), "float32"),
            factor=T.alloc_fragment((bm,), "float32"),
            sb=T.alloc_local((1,), "float32") if config.prefetch_scales else None,
            out_shared=T.alloc_shared((bm, bn), out_dtype) if config.tile_store else None)

    launch = tile_launch(config, n_tiles, m_tiles, one_tile, alloc_tile_buffers)

    # Each parameter its own annotation object (a shared one would alias the buffers).
    @T.prim_func
    def grouped_gemm_fp8(a: T.Tensor((m_total, k), FP8),
                         b: T.Tensor((n_experts, n, k), FP8),
                         scale_a: T.Tensor(sa_shape, "float32"),
                         scale_b: T.Tensor((n_experts, n_tiles, k_blocks), "float32"),
                         offsets: T.Tensor((n_experts,), "int32"),
                         table: T.Tensor((m_tiles,), "int32"),
                         out: T.Tensor((m_total, n), out_dtype)):
        launch(SimpleNamespace(a=a, b=b, scale_a=scale_a, scale_b=scale_b, offsets=offsets,
                               table=table, out=out))

    return tile_table_program(n_experts, bm), grouped_gemm_fp8


class GroupedGemmFp8Kernel(GroupedGemmKernel):
    """key: n, k, n_experts, out_dtype, scale_a_m_major. The bf16 grouped GEMM's buckets
    (mean rows per expert: `decode` <= 64 takes 64-row tiles on one consumer warp group,
    `prefill` 128-row tiles on two) and launch (tile table, then the GEMM). Two fp32
    accumulators (the promoted sum and the K tile's), so 128 x 128 tiles: what fits the
    168 registers of a warp-specialized consumer. The prefill default is the best of a
    compare of its space (see heuristic_config); the decode bucket's is not measured.
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
        # A CTA per tile, whole tiles stored by TMA, the next K block's scales loaded under
        # this block's wgmma. On the H200 (DeepSeek-V3 experts, 4K tokens x top 8, uniform;
        # compare against the old persistent walk with row stores): gate-up 2752.1 ->
        # 2567.2 us (1.58x our bf16 grouped GEMM), down 1532.2 -> 1347.1 (1.52x); the
        # per-tile store alone 2696.4 / 1340.9, the prefetch alone 2801.2 / 1664.8.
        return GroupedGemmFp8Config(block_m=128, stages=5, threads=256, persistent=False,
                                    tile_store=True, prefetch_scales=True)

    def config_space(self, bucket: str) -> list[GroupedGemmFp8Config]:
        space = [self.heuristic_config(bucket, "sm_90a")]
        for block_m, threads, stages in ((64, 128, 6), (64, 128, 8), (64, 128, 9),
                                         (128, 256, 4), (128, 256, 6)):
            space.append(GroupedGemmFp8Config(block_m=block_m, stages=stages, threads=threads))
        # the launch and epilogue options of the bf16 grouped GEMM (a CTA per tile, whole
        # tiles stored by TMA, two CTAs an SM) and the scales loaded a K block ahead
        tile = dict(block_m=128, threads=256) if bucket == "prefill" else dict(
            block_m=64, threads=128)
        for prefetch in (False, True):
            space += [
                GroupedGemmFp8Config(**tile, stages=5, prefetch_scales=prefetch),
                GroupedGemmFp8Config(**tile, stages=5, persistent=False,
                                     prefetch_scales=prefetch),
                GroupedGemmFp8Config(**tile, stages=5, persistent=False, tile_store=True,
                                     prefetch_scales=prefetch),
                GroupedGemmFp8Config(**tile, stages=5, tile_store=True,
                                     prefetch_scales=prefetch),
                GroupedGemmFp8Config(block_m=64, threads=128, stages=4, ctas=2 * SMS,
                                     ctas_per_sm=2, prefetch_scales=prefetch),
                GroupedGemmFp8Config(block_m=64, threads=128, stages=4, persistent=False,
                                     ctas_per_sm=2, prefetch_scales=prefetch),
                # n tiles in panels (GroupedGemmConfig.n_group): an expert of many m tiles
                # (skewed routing) keeps its weight tiles in L2 across them
                GroupedGemmFp8Config(**tile, stages=5, persistent=False, tile_store=True,
                                     prefetch_scales=prefetch, n_group=8),
                # partial tiles staged too (GroupedGemmConfig.staged_rows)
                GroupedGemmFp8Config(**tile, stages=5, persistent=False, tile_store=True,
                                     prefetch_scales=prefetch, staged_rows=True)]
        return [c for c in dict.fromkeys(space) if c.valid()]

    def run(self, config: GroupedGemmFp8Config, compiled: tuple, a, b, scale_a, scale_b,
            offsets, out) -> None:
        import torch

        m_tiles = -(-a.shape[0] // config.block_m) + self.key["n_experts"]
        table = torch.empty((m_tiles,), dtype=torch.int32, device=a.device)
        compiled[0](offsets, table)
        compiled[1](a, b, scale_a, scale_b, offsets, table, out)
