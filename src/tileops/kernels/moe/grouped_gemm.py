"""Grouped GEMM forward: out[rows of group e] = a[rows of group e] @ b[e]^T.

a [M_total, K] holds the groups' rows back to back; group e owns rows [offsets[e-1],
offsets[e]) (offsets[-1] = 0: torch._grouped_mm's `offs`, the cumulative end rows, int32);
b [E, N, K] is each expert's weight as nn.Linear stores it. The group sizes are data, read
on the device: a persistent grid of `ctas` CTAs walks the (expert, m tile, n tile) tiles in
order, CTA c taking tiles c, c + ctas, ...; each CTA keeps a cursor (expert, its first
tile, its first row) that only moves forward, so finding a tile's expert costs one step
per expert over the whole walk. The number of tiles is bounded from shapes,
ceil(M_total / block_m) + E m tiles at most (each group adds at most one partial tile),
so the launch never waits for the host; tiles past the real end are skipped.

Each tile: TMA loads of a's rows (a tile may read past its group: those rows are computed
and never stored; past M_total TMA fills zeros) and b[e]'s rows into swizzled shared
memory, pipelined over K with a producer warp group, wgmma into an fp32 accumulator, and
a store guarded by the group's end row. Rows of `out` past offsets[E-1] are not written.
"""

from dataclasses import dataclass

import tilelang.language as T

from ..base import Kernel
from ..selection.topk import exclusive_offsets

SMS = 132  # H200


@dataclass(frozen=True)
class GroupedGemmConfig:
    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    stages: int = 3
    threads: int = 256  # consumer threads (a producer warp group is added)
    ctas: int = SMS


def tile_bound(m_total, n_experts: int, block_m: int):
    """Most m tiles the groups can need: each group adds at most one partial tile."""
    return T.ceildiv(m_total, block_m) + n_experts


def grouped_gemm_programs(n: int, k: int, n_experts: int, dtype: str,
                          config: GroupedGemmConfig):
    """(tile table, GEMM) prim_funcs; M_total is symbolic, N, K and E are compiled in."""
    m_total, m_tiles = T.dynamic("m_total, m_tiles")
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    n_tiles = -(-n // bn)
    ctas = config.ctas
    threads = 512  # the table's CTA: one thread per expert (E <= 384)

    def group_start(offsets, e):
        return T.if_then_else(e == 0, 0, offsets[T.max(e - 1, 0)])

    @T.prim_func
    def tile_table(offsets: T.Tensor((n_experts,), "int32"),
                   table: T.Tensor((m_tiles,), "int32")):
        with T.Kernel(1, threads=threads) as _:
            tx = T.get_thread_binding()
            warp_sums = T.alloc_shared((threads // 32,), "int32")
            mine = T.alloc_local((1,), "int32")
            first = T.alloc_local((1,), "int32")
            total = T.alloc_local((1,), "int32")
            mine[0] = 0
            if tx < n_experts:
                mine[0] = T.ceildiv(T.max(offsets[tx] - group_start(offsets, tx), 0), bm)
            exclusive_offsets(mine, tx, threads, warp_sums, first, total)
            # entry: expert << 16 | its m tile; -1 past the last group's tiles
            for i in T.serial(mine[0]):
                table[first[0] + i] = tx * 65536 + i
            for r in T.serial(T.ceildiv(m_tiles, threads)):
                if r * threads + tx < m_tiles and r * threads + tx >= total[0]:
                    table[r * threads + tx] = -1

    @T.prim_func
    def grouped_gemm(a: T.Tensor((m_total, k), dtype),
                     b: T.Tensor((n_experts, n, k), dtype),
                     offsets: T.Tensor((n_experts,), "int32"),
                     table: T.Tensor((m_tiles,), "int32"),
                     out: T.Tensor((m_total, n), dtype)):
        with T.Kernel(ctas, threads=config.threads) as cta:
            a_shared = T.alloc_shared((bm, bk), dtype)
            b_shared = T.alloc_shared((bn, bk), dtype)
            acc = T.alloc_fragment((bm, bn), "float32")
            # Every index below is an expression of global loads, not a register carried
            # between iterations: TileLang's warp specialization gives the producer and the
            # consumers separate copies of local state and does not keep such state right.
            for step in T.serial(T.ceildiv(m_tiles * n_tiles, ctas)):
                if step * ctas + cta < m_tiles * n_tiles:
                    if table[(step * ctas + cta) // n_tiles] >= 0:
                        T.clear(acc)
                        for kk in T.Pipelined(T.ceildiv(k, bk), num_stages=config.stages):
                            T.copy(a[group_start(offsets,
                                                 table[(step * ctas + cta) // n_tiles] >> 16)
                                     + (table[(step * ctas + cta) // n_tiles] & 65535) * bm,
                                     kk * bk], a_shared)
                            T.copy(b[table[(step * ctas + cta) // n_tiles] >> 16,
                                     (step * ctas + cta) % n_tiles * bn, kk * bk], b_shared)
                            T.gemm(a_shared, b_shared, acc, transpose_B=True)
                        for i, j in T.Parallel(bm, bn):
                            if group_start(offsets, table[(step * ctas + cta) // n_tiles] >> 16) \
                                    + (table[(step * ctas + cta) // n_tiles] & 65535) * bm + i \
                                    < offsets[table[(step * ctas + cta) // n_tiles] >> 16] \
                                    and (step * ctas + cta) % n_tiles * bn + j < n:
                                out[group_start(offsets,
                                                table[(step * ctas + cta) // n_tiles] >> 16)
                                    + (table[(step * ctas + cta) // n_tiles] & 65535) * bm + i,
                                    (step * ctas + cta) % n_tiles * bn + j] = acc[i, j]

    return tile_table, grouped_gemm


class GroupedGemmKernel(Kernel):
    """key: dtype, n, k, n_experts.

    Buckets by the mean rows per expert: `decode` (<= 64, e.g. 64 tokens x top-8 over 128
    experts is 4) takes 64-row tiles, the smallest wgmma M, on one consumer warp group;
    `prefill` 128 x 256 tiles on two. Not tuned: no device has run it yet.
    """

    name = "grouped_gemm"
    Config = GroupedGemmConfig

    def program(self, config: GroupedGemmConfig, bucket: str):
        key = self.key
        return grouped_gemm_programs(key["n"], key["k"], key["n_experts"], key["dtype"],
                                     config)

    def bucket_of(self, m_total: int) -> str:
        return "decode" if m_total <= 64 * self.key["n_experts"] else "prefill"

    def heuristic_config(self, bucket: str, arch: str) -> GroupedGemmConfig:
        if bucket == "decode":
            return GroupedGemmConfig(block_m=64, block_n=128, block_k=64, stages=4,
                                     threads=128)
        return GroupedGemmConfig()

    def config_space(self, bucket: str) -> list[GroupedGemmConfig]:
        return list(dict.fromkeys([
            self.heuristic_config(bucket, "sm_90a"), GroupedGemmConfig(),
            GroupedGemmConfig(block_m=128, block_n=128, block_k=64, stages=4, threads=256),
            GroupedGemmConfig(block_m=64, block_n=128, block_k=64, stages=4, threads=128),
            GroupedGemmConfig(block_m=64, block_n=256, block_k=64, stages=3, threads=128)]))

    def run(self, config: GroupedGemmConfig, compiled: tuple, a, b, offsets, out) -> None:
        import torch

        m_tiles = -(-a.shape[0] // config.block_m) + self.key["n_experts"]
        table = torch.empty((m_tiles,), dtype=torch.int32, device=a.device)
        compiled[0](offsets, table)
        compiled[1](a, b, offsets, table, out)
