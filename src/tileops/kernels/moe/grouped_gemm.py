"""Grouped GEMM: one GEMM per expert over its group of rows, in one launch, no host sync.

Rows: a [M_total, K] holds the groups' rows back to back; group e owns rows [offsets[e-1],
offsets[e]) (offsets[-1] = 0: torch._grouped_mm's `offs`, the cumulative end rows, int32).
The group sizes are data, read on the device only.

Programs (one builder each, flags for the variants):
- `grouped_gemm_programs`: out[rows of e] = a[rows] @ op(b[e]).
  - trans_b=True (the forward): b [E, N, K], each expert's weight as nn.Linear stores it.
  - trans_b=False (the input gradient, da = dy @ b[e]): b [E, K, N] read untransposed.
  - silu_mul=True (the gate-up projection of a gated MLP): b [E, 2N, K] whose first N rows
    are the gate and the last N the up projection (Hugging Face's fused `gate_up_proj`,
    `linear(x, w).chunk(2, -1)`); out [M, N] = silu(a @ gate^T) * (a @ up^T), the
    epilogue in fp32 on the two accumulators, so the [M, 2N] product never reaches HBM.
  A tile table (one small CTA: a scan over the experts) lists each expert's m tiles; a
  persistent grid walks (m tile, n tile) pairs from it, each tile stateless (its expert and
  first row re-read from the table: TileLang's warp specialization gives the producer and
  the consumers separate copies of loop-carried registers); or (`persistent=False`) a CTA
  per tile of the bound runs that same tile body once. The number of m tiles is
  bounded from shapes, ceil(M_total / block_m) + E (each group adds at most one partial
  tile), so the launch never waits for the host; tiles past the real end are skipped.
  Each tile: TMA loads of a's rows (a tile may read past its group: those rows are
  computed and never stored; past M_total TMA fills zeros) and b[e]'s rows into swizzled
  shared memory, pipelined over K with a producer warp group, wgmma into fp32, a store
  guarded by the group's end row. Rows past offsets[E-1] are not written, except by
  `zero_tail_program` (the input gradient's rows that no expert owns are zeros).
- `weight_grad_program`: db[e] = dy[rows of e]^T @ a[rows of e], [E, N, K]: a GEMM per
  (expert, n tile, k tile) whose reduction runs over the expert's rows (a trip count read
  from offsets: 0 rows gives db[e] = 0), experts with the most rows first. Whole row
  tiles come by TMA through the pipeline; the last partial one, whose box would cover
  the next expert's rows, is loaded by the consumers with guards (rows outside the group
  read as zero in both operands, since they may hold anything, NaN included). Zeroing
  those rows of the TMA tiles instead does not work in TileLang 0.1.15: its warp
  specialization gives the masking to the producer, ahead of the load it must follow.
"""

from dataclasses import dataclass
from types import SimpleNamespace

import tilelang.language as T

from ..attention.attention_fwd import sm_sharing
from ..base import Kernel
from ..selection.topk import exclusive_offsets

SMS = 132  # H200


@dataclass(frozen=True)
class GroupedGemmConfig:
    block_m: int = 128
    block_n: int = 256  # output columns per tile (silu_mul: per accumulator, 2 of them)
    block_k: int = 64
    stages: int = 3
    threads: int = 256  # consumer threads (a producer warp group is added)
    ctas: int = SMS
    # A tile wholly inside its group and N leaves through shared memory by one TMA store
    # instead of guarded row stores from registers (tiles at a group's end still store row
    # by row): short-K shapes (Qwen3-30B's experts, 12-32 K steps a tile) spend a large share
    # of each tile in the epilogue. Costs a bm x bn tile of shared memory.
    tile_store: bool = False
    # 2: two persistent CTAs share an SM (ctas = 2 x SMs), so one's epilogue runs under the
    # other's mainloop (what CUTLASS's ping-pong schedule gets from two consumer warp groups)
    ctas_per_sm: int = 1
    # False: a CTA per tile of the bound (the dense GEMM's launch: the hardware starts the
    # next tile's CTA as one finishes) instead of `ctas` persistent CTAs walking the tiles
    persistent: bool = True
    # True: each consumer warp group owns block_m / 2 whole rows (one m64 x block_n wgmma a
    # k step, what CUTLASS's cooperative kernel issues) instead of half the columns of every
    # row (two m64 x block_n / 2 wgmmas reading the a tile twice from shared memory)
    full_row: bool = False
    # > 0: tiles run in groups of this many n tiles, the m tiles (every expert's, in order)
    # swept inside a group, so the CTAs in flight share their experts' weight tiles in L2
    # (per-tile CTAs: the group is the grid's slowest dimension; the persistent grid:
    # `raster`); 0: each m tile's n tiles in turn. Only differs from 0 where N has more
    # than `n_group` tiles (Mixtral's 28672 columns: 112).
    n_group: int = 0
    # with tile_store: a tile that ends past its group's rows leaves through the same shared
    # tile too, by row-guarded 16-byte stores, instead of guarded stores from the
    # accumulator's registers (skewed routing: most experts' only tile is partial)
    staged_rows: bool = False
    # the weight gradient only: > 1, each CTA computes its output tile for this many
    # experts in turn (experts order[z], order[z + Z], ... of the rows-descending order), so
    # the producer loads the next expert's rows while the consumers store this one's tile;
    # 1: a CTA per (tile, expert), its fill, K loop and store in series
    experts_per_cta: int = 1


def tile_bound(m_total, n_experts: int, block_m: int):
    """Most m tiles the groups can need: each group adds at most one partial tile."""
    return T.ceildiv(m_total, block_m) + n_experts


def _group_start(offsets, e):
    return T.if_then_else(e == 0, 0, offsets[T.max(e - 1, 0)])


# -- the persistent grid's tiles, shared with the grouped fp8 GEMM (fp8/grouped_gemm_fp8.py)
# Tile t = step * ctas + cta walks (m tile, n tile) pairs; every quantity below is an
# expression of global loads (table, offsets), never a carried register.
def tile_count(m_tiles, n_tiles: int):
    return m_tiles * n_tiles


def tile_of(step, cta, ctas: int):
    return step * ctas + cta


def raster(linear, m_tiles, n_tiles: int, group: int, minimum=T.min):
    """The tile (m tile * n_tiles + n tile) that launch slot `linear` runs: with group > 0,
    slots walk groups of `group` n tiles, and inside a group every m tile's n tiles of the
    group in turn (a bijection on [0, m_tiles * n_tiles)); with 0, slot = tile. Built from
    expressions only (plain ints work too, with minimum=min)."""
    if group <= 0 or group >= n_tiles:
        return linear
    span = group * m_tiles
    width = minimum(group, n_tiles - linear // span * group)  # the last group may be narrow
    within = linear % span
    return within // width * n_tiles + linear // span * group + within % width


def tile_live(table, t, n_tiles: int):
    """The tile's m tile is a real one (the table's entries past the end are -1)."""
    return table[t // n_tiles] >= 0


def tile_expert(table, t, n_tiles: int):
    return table[t // n_tiles] >> 16


def tile_row0(offsets, table, t, n_tiles: int, block_m: int):
    """The tile's first row: its group's start plus its m tile's offset in the group."""
    return _group_start(offsets, tile_expert(table, t, n_tiles)) \
        + (table[t // n_tiles] & 65535) * block_m


def tile_col0(t, n_tiles: int, block_n: int):
    return t % n_tiles * block_n


@T.macro
def store_group_tile(acc, out, row0, row_end, col0, n: int, block_m: int, block_n: int):
    """out[row0 + i, col0 + j] = acc[i, j] for the rows of the group (< row_end) and the
    columns < n: a tile's rows past its group belong to the next one."""
    for i, j in T.Parallel(block_m, block_n):
        if row0 + i < row_end and col0 + j < n:
            out[row0 + i, col0 + j] = acc[i, j]


def tile_table_program(n_experts: int, block_m: int):
    """table[i] = expert << 16 | its m tile, for each group's m tiles in order; -1 after."""
    m_tiles = T.dynamic("m_tiles")
    threads = 512  # one thread per expert (E <= 384)

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
                mine[0] = T.ceildiv(T.max(offsets[tx] - _group_start(offsets, tx), 0),
                                    block_m)
            exclusive_offsets(mine, tx, threads, warp_sums, first, total)
            for i in T.serial(mine[0]):
                table[first[0] + i] = tx * 65536 + i
            for r in T.serial(T.ceildiv(m_tiles, threads)):
                if r * threads + tx < m_tiles and r * threads + tx >= total[0]:
                    table[r * threads + tx] = -1

    return tile_table


def tile_store_macro(config: GroupedGemmConfig, n: int, n_tiles: int):
    """The macro `store_tile(io, t, bufs)`: tile t's fp32 accumulator `bufs.acc` into
    io.out. With `config.tile_store` a tile wholly inside its group and N leaves through
    `bufs.out_shared` by one TMA store; other tiles store row by row, guarded by the
    group's end row (with `config.staged_rows` through `bufs.out_shared` too)."""
    bm, bn = config.block_m, config.block_n

    def whole_tile(io, t):
        return (tile_row0(io.offsets, io.table, t, n_tiles, bm) + bm
                <= io.offsets[tile_expert(io.table, t, n_tiles)]) & (
                    tile_col0(t, n_tiles, bn) + bn <= n)

    def inside(io, t, i, j):  # element (i, j) of tile t is in its group's rows and in N
        row_ok = tile_row0(io.offsets, io.table, t, n_tiles, bm) + i \
            < io.offsets[tile_expert(io.table, t, n_tiles)]
        return row_ok if n % bn == 0 else row_ok & (tile_col0(t, n_tiles, bn) + j < n)

    @T.macro
    def staged_group_rows(io, t, bufs):
        """The tile's rows inside its group, from registers through `bufs.out_shared`."""
        T.copy(bufs.acc, bufs.out_shared)
        for i, j in T.Parallel(bm, bn):
            if inside(io, t, i, j):
                io.out[tile_row0(io.offsets, io.table, t, n_tiles, bm) + i,
                       tile_col0(t, n_tiles, bn) + j] = bufs.out_shared[i, j]

    @T.macro
    def store_tile(io, t, bufs):
        if config.tile_store and whole_tile(io, t):
            T.copy(bufs.acc, bufs.out_shared)
            T.copy(bufs.out_shared, io.out[tile_row0(io.offsets, io.table, t, n_tiles, bm),
                                           tile_col0(t, n_tiles, bn)])
        elif config.tile_store and config.staged_rows:
            staged_group_rows(io, t, bufs)
        else:
            store_group_tile(bufs.acc, io.out, tile_row0(io.offsets, io.table, t, n_tiles, bm),
                             io.offsets[tile_expert(io.table, t, n_tiles)],
                             tile_col0(t, n_tiles, bn), n, bm, bn)

    return store_tile


def tile_launch(config: GroupedGemmConfig, n_tiles: int, m_tiles, one_tile,
                alloc_tile_buffers):
    """The macro `launch(io)` every grouped GEMM shares: the grid over (m tile, n tile)
    pairs that runs `one_tile(io, t, bufs)` on each live tile t, `bufs` from
    `alloc_tile_buffers()` once a CTA, `io` the kernel's tensors (io.table the tile table).
    `config.persistent`: `ctas` CTAs walk the tiles; else a CTA per tile of the bound."""
    ctas = config.ctas
    share_sm = sm_sharing(config.threads, config.ctas_per_sm)

    @T.macro
    def launch(io):
        if config.persistent:
            with T.Kernel(ctas, threads=config.threads) as cta:
                share_sm()
                bufs = alloc_tile_buffers()
                # Every index is an expression of global loads, not a register carried
                # between iterations (see the module docstring).
                for step in T.serial(T.ceildiv(tile_count(m_tiles, n_tiles), ctas)):
                    if tile_of(step, cta, ctas) < tile_count(m_tiles, n_tiles):
                        if tile_live(io.table, raster(tile_of(step, cta, ctas), m_tiles,
                                                      n_tiles, config.n_group), n_tiles):
                            one_tile(io, raster(tile_of(step, cta, ctas), m_tiles, n_tiles,
                                                config.n_group), bufs)
        else:
            # One CTA per (n tile, m tile) of the bound, the n tiles of an m tile adjacent
            # (their a rows shared in L2); the bound's dead tiles exit. With n_group the
            # grid's slowest dimension is the panel of n_group n tiles, so the launch order
            # (x, then y, then z) sweeps every m tile inside a panel: the CTAs in flight
            # share their experts' weight tiles in L2. (Without it, Mixtral's gate-up read
            # each expert's whole weight again for every m tile: 82% of HBM busy, 29% L2
            # hits, ncu.) The panel is a grid dimension, not `raster`'s division of the
            # slot by the symbolic m_tiles, whose lowering did not finish at 224 n tiles.
            width = min(config.n_group, n_tiles) if config.n_group > 0 else n_tiles
            with T.Kernel(width, m_tiles, -(-n_tiles // width),
                          threads=config.threads) as (bx, by, bz):
                share_sm()
                bufs = alloc_tile_buffers()
                # one condition (a partial last panel's spare CTAs and the bound's dead m
                # tiles exit together; nested ifs failed TileLang's ThreadSync at 12 n tiles
                # in panels of 8), its table index clamped inside the tiles
                if (bz * width + bx < n_tiles) & tile_live(
                        io.table, by * n_tiles + T.min(bz * width + bx, n_tiles - 1),
                        n_tiles):
                    one_tile(io, by * n_tiles + bz * width + bx, bufs)

    return launch


def grouped_gemm_programs(n: int, k: int, n_experts: int, dtype: str,
                          config: GroupedGemmConfig, trans_b: bool = True,
                          silu_mul: bool = False):
    """(tile table, GEMM) prim_funcs; M_total is symbolic, N, K and E are compiled in."""
    m_total, m_tiles = T.dynamic("m_total, m_tiles")
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    n_tiles = -(-n // bn)
    if silu_mul:
        b_shape = (n_experts, 2 * n, k)
    else:
        b_shape = (n_experts, n, k) if trans_b else (n_experts, k, n)
    b_tile = (bn, bk) if trans_b else (bk, bn)

    policy = T.GemmWarpPolicy.FullRow if config.full_row else T.GemmWarpPolicy.Square
    store_tile = tile_store_macro(config, n, n_tiles)

    @T.macro
    def one_tile(io, t, bufs):
        """Tile t (a live one) from its table entry: the K loop, the epilogue, the store."""
        T.clear(bufs.acc)
        if silu_mul:
            T.clear(bufs.up_acc)
        for kk in T.Pipelined(T.ceildiv(k, bk), num_stages=config.stages):
            T.copy(io.a[tile_row0(io.offsets, io.table, t, n_tiles, bm), kk * bk],
                   bufs.a_shared)
            if trans_b:
                T.copy(io.b[tile_expert(io.table, t, n_tiles), tile_col0(t, n_tiles, bn),
                            kk * bk], bufs.b_shared)
            else:
                T.copy(io.b[tile_expert(io.table, t, n_tiles), kk * bk,
                            tile_col0(t, n_tiles, bn)], bufs.b_shared)
            if silu_mul:
                T.copy(io.b[tile_expert(io.table, t, n_tiles), n + tile_col0(t, n_tiles, bn),
                            kk * bk], bufs.up_shared)
            T.gemm(bufs.a_shared, bufs.b_shared, bufs.acc, transpose_B=trans_b, policy=policy)
            if silu_mul:
                T.gemm(bufs.a_shared, bufs.up_shared, bufs.up_acc, transpose_B=True,
                       policy=policy)
        if silu_mul:
            for i, j in T.Parallel(bm, bn):
                bufs.acc[i, j] = bufs.acc[i, j] / (1.0 + T.exp(-bufs.acc[i, j])) \
                    * bufs.up_acc[i, j]
        store_tile(io, t, bufs)

    def alloc_tile_buffers():
        return SimpleNamespace(
            a_shared=T.alloc_shared((bm, bk), dtype),
            b_shared=T.alloc_shared(b_tile, dtype),
            acc=T.alloc_fragment((bm, bn), "float32"),
            up_shared=T.alloc_shared(b_tile, dtype) if silu_mul else None,
            up_acc=T.alloc_fragment((bm, bn), "float32") if silu_mul else None,
            out_shared=T.alloc_shared((bm, bn), dtype) if config.tile_store else None)

    launch = tile_launch(config, n_tiles, m_tiles, one_tile, alloc_tile_buffers)

    @T.prim_func
    def grouped_gemm(a: T.Tensor((m_total, k), dtype),
                     b: T.Tensor(b_shape, dtype),
                     offsets: T.Tensor((n_experts,), "int32"),
                     table: T.Tensor((m_tiles,), "int32"),
                     out: T.Tensor((m_total, n), dtype)):
        launch(SimpleNamespace(a=a, b=b, offsets=offsets, table=table, out=out))

    return tile_table_program(n_experts, bm), grouped_gemm


def zero_tail_program(width: int, n_experts: int, dtype: str, block_rows: int = 4,
                      threads: int = 128):
    """x[r] = 0 for the rows r >= offsets[E-1] (the rows no expert owns)."""
    m_total = T.dynamic("m_total")

    @T.prim_func
    def zero_tail(offsets: T.Tensor((n_experts,), "int32"),
                  x: T.Tensor((m_total, width), dtype)):
        with T.Kernel(T.ceildiv(m_total, block_rows), threads=threads) as bx:
            if (bx + 1) * block_rows > offsets[n_experts - 1]:
                for i, j in T.Parallel(block_rows, width):
                    if bx * block_rows + i >= offsets[n_experts - 1] \
                            and bx * block_rows + i < m_total:
                        x[bx * block_rows + i, j] = T.cast(0, dtype)

    return zero_tail


def expert_order_program(n_experts: int):
    """order[i] = the expert with the i-th most rows (ties: the lower index first)."""
    threads = 512  # one thread per expert (E <= 384)

    @T.prim_func
    def expert_order(offsets: T.Tensor((n_experts,), "int32"),
                     order: T.Tensor((n_experts,), "int32")):
        with T.Kernel(1, threads=threads) as _:
            tx = T.get_thread_binding()
            sizes_shared = T.alloc_shared((n_experts,), "int32")
            rank = T.alloc_local((1,), "int32")
            if tx < n_experts:
                sizes_shared[tx] = T.max(offsets[tx] - _group_start(offsets, tx), 0)
            T.sync_threads()
            if tx < n_experts:
                rank[0] = 0
                for j in T.serial(n_experts):
                    if sizes_shared[j] > sizes_shared[tx] or (
                            sizes_shared[j] == sizes_shared[tx] and j < tx):
                        rank[0] = rank[0] + 1
                order[rank[0]] = tx

    return expert_order


def weight_grad_program(n: int, k: int, n_experts: int, dtype: str,
                        config: GroupedGemmConfig):
    """db[e] = dy[rows of e]^T @ a[rows of e] for every expert (zeros for an empty one).

    CTAs launch expert by expert in `order` (most rows first, from `expert_order_program`),
    so under skewed routing the longest reductions start in the first wave instead of
    running on alone at the end. With `experts_per_cta` > 1 a CTA takes experts strided
    through that order (a mix of long and short reductions) one after another: TileLang's
    warp specialization keeps the producer's stage ring running across them, so one
    expert's loads overlap the previous one's store."""
    m_total = T.dynamic("m_total")
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    per_cta = config.experts_per_cta
    slots = -(-n_experts // per_cta)  # the grid's expert dimension

    @T.macro
    def partial_rows(src, offsets, e, tail, col0, width):
        """tail <- src's last (partial) row tile of expert e, columns [col0, col0 + width);
        rows past the group read as 0."""
        for i, j in T.Parallel(bk, width):
            tail[i, j] = T.if_then_else(
                offsets[e] - T.max(offsets[e] - _group_start(offsets, e), 0) % bk + i
                < offsets[e],
                src[offsets[e] - T.max(offsets[e] - _group_start(offsets, e), 0) % bk
                    + i, col0 + j], T.cast(0, dtype))

    @T.macro
    def expert_tile(dy, a, offsets, db, e, dy_shared, a_shared, dy_tail, a_tail, acc,
                    db_shared, bx, by):
        T.clear(acc)
        # whole row tiles by TMA, pipelined
        for kk in T.Pipelined(T.max(offsets[e] - _group_start(offsets, e), 0) // bk,
                              num_stages=config.stages):
            T.copy(dy[_group_start(offsets, e) + kk * bk, by * bm], dy_shared)
            T.copy(a[_group_start(offsets, e) + kk * bk, bx * bn], a_shared)
            T.gemm(dy_shared, a_shared, acc, transpose_A=True)
        # the last partial row tile by guarded loads (rows past the group read as 0)
        if T.max(offsets[e] - _group_start(offsets, e), 0) % bk > 0:
            partial_rows(dy, offsets, e, dy_tail, by * bm, bm)
            partial_rows(a, offsets, e, a_tail, bx * bn, bn)
            T.gemm(dy_tail, a_tail, acc, transpose_A=True)
        # out through shared memory by a TMA store: with few rows per expert the
        # weight gradient's cost is mostly this write
        T.copy(acc, db_shared)
        T.copy(db_shared, db[e, by * bm, bx * bn])

    @T.prim_func
    def weight_grad(dy: T.Tensor((m_total, n), dtype),
                    a: T.Tensor((m_total, k), dtype),
                    offsets: T.Tensor((n_experts,), "int32"),
                    order: T.Tensor((n_experts,), "int32"),
                    db: T.Tensor((n_experts, n, k), dtype)):
        with T.Kernel(T.ceildiv(k, bn), T.ceildiv(n, bm), slots,
                      threads=config.threads) as (bx, by, bz):
            dy_shared = T.alloc_shared((bk, bm), dtype)
            a_shared = T.alloc_shared((bk, bn), dtype)
            dy_tail = T.alloc_shared((bk, bm), dtype)
            a_tail = T.alloc_shared((bk, bn), dtype)
            acc = T.alloc_fragment((bm, bn), "float32")
            db_shared = T.alloc_shared((bm, bn), dtype)
            if per_cta == 1:
                expert_tile(dy, a, offsets, db, order[bz], dy_shared, a_shared, dy_tail,
                            a_tail, acc, db_shared, bx, by)
            else:
                for i in T.serial(per_cta):
                    if bz + i * slots < n_experts:
                        expert_tile(dy, a, offsets, db, order[bz + i * slots], dy_shared,
                                    a_shared, dy_tail, a_tail, acc, db_shared, bx, by)

    return weight_grad


class GroupedGemmKernel(Kernel):
    """key: dtype, n, k, n_experts; optional flags a plain forward's key leaves out (so its
    tuned entries keep their keys): trans_b=False (the input gradient: b read [E, K, N],
    and the rows no expert owns written as zeros), silu_mul=True (the gate-up epilogue).

    Buckets by the mean rows per expert: `decode` (<= 64, e.g. 64 tokens x top-8 over 128
    experts is 4) takes 64-row tiles, the smallest wgmma M, on one consumer warp group;
    `prefill` 128 x 256 tiles on two (silu_mul: two 128 x 128 accumulators), a CTA per tile
    with whole tiles stored by TMA (measured against the space's persistent, full_row and
    row-store configs on Qwen3-30B-A3B's gate-up; not tuned per shape).
    """

    name = "grouped_gemm"
    Config = GroupedGemmConfig

    def program(self, config: GroupedGemmConfig, bucket: str):
        key = self.key
        trans_b = key.get("trans_b", True)
        table, gemm = grouped_gemm_programs(key["n"], key["k"], key["n_experts"],
                                            key["dtype"], config, trans_b,
                                            key.get("silu_mul", False))
        if trans_b:
            return table, gemm
        return table, gemm, zero_tail_program(key["n"], key["n_experts"], key["dtype"])

    def bucket_of(self, m_total: int) -> str:
        return "decode" if m_total <= 64 * self.key["n_experts"] else "prefill"

    def pass_configs(self, config: GroupedGemmConfig, program_index: int) -> dict:
        # The persistent GEMM (program 1) reuses its pipeline's shared stages from tile to
        # tile under the pipeline's own mbarriers, whose phases carry across tiles; TileLang's
        # storage-sync pass still put a __syncthreads at the top of every tile, so the TMA
        # producer could not load the next tile while the consumers ran this one's epilogue.
        # That barrier is the only one the pass adds here (the generated CUDA differs by that
        # line alone); the TMA-stored tile (tile_store) needs the pass's consumer barriers.
        if program_index == 1 and config.persistent and not config.tile_store:
            return {"tl.disable_thread_storage_sync": True}
        return {}

    def heuristic_config(self, bucket: str, arch: str) -> GroupedGemmConfig:
        halve = 2 if self.key.get("silu_mul", False) else 1  # two accumulators
        if bucket == "decode":
            return GroupedGemmConfig(block_m=64, block_n=128 // halve, block_k=64, stages=4,
                                     threads=128)
        if not self.key.get("trans_b", True):
            # the input gradient keeps the persistent row stores: with b untransposed,
            # TileLang 0.1.15 fails to lay out the TMA-stored tile ("the original buffer
            # shape must match the layout input shape")
            return GroupedGemmConfig(block_n=256 // halve)
        # a CTA per tile, whole tiles stored by TMA: 391.0 -> 357.4 us on the H200
        # (Qwen3-30B-A3B gate-up, 4K tokens; tile_store alone on the persistent grid, or
        # per-tile CTAs alone, 396.8; full_row 389.8)
        return GroupedGemmConfig(block_n=256 // halve, tile_store=True, persistent=False,
                                 n_group=self.panel_width(256 // halve))

    def panel_width(self, block_n: int) -> int:
        """n_group for the per-tile launch: panels of 8 n tiles where few experts (<= 32)
        share the rows, so each has many m tiles, and N has more than 8 tiles. Mixtral's
        gate-up (8 experts, 112 n tiles), H200: 3664.9 -> 2758.8 us (panels of 4: 2845.3,
        16: 2851.6, 32: 3009.1; torch._grouped_mm 2631.5), DRAM busy 82% -> 36% (ncu).
        Many experts of one or two m tiles (DeepSeek-V3's 256) gain nothing from panels
        and would read each row tile once per panel: 0."""
        n_tiles = -(-self.key["n"] // block_n)
        return 8 if self.key["n_experts"] <= 32 and n_tiles > 8 else 0

    def config_space(self, bucket: str) -> list[GroupedGemmConfig]:
        halve = 2 if self.key.get("silu_mul", False) else 1
        space = list(dict.fromkeys([
            self.heuristic_config(bucket, "sm_90a"),
            GroupedGemmConfig(block_n=256 // halve),
            GroupedGemmConfig(block_m=128, block_n=128 // halve, block_k=64, stages=4,
                              threads=256),
            GroupedGemmConfig(block_m=64, block_n=128 // halve, block_k=64, stages=4,
                              threads=128),
            GroupedGemmConfig(block_m=64, block_n=256 // halve, block_k=64, stages=3,
                              threads=128),
            # whole tiles stored by TMA (see GroupedGemmConfig.tile_store)
            GroupedGemmConfig(block_n=256 // halve, tile_store=True),
            GroupedGemmConfig(block_m=128, block_n=128 // halve, block_k=64, stages=4,
                              threads=256, tile_store=True),
            # two CTAs per SM (see GroupedGemmConfig.ctas_per_sm), one consumer warp group
            # each: their launch bound caps ptxas at 128 registers a thread, which a 64 x 256
            # or 128 x 128 tile's wgmma exceeds (ptxas asks for 154)
            GroupedGemmConfig(block_m=64, block_n=128 // halve, block_k=64, stages=4,
                              threads=128, ctas=2 * SMS, ctas_per_sm=2),
            # a CTA per tile, as the dense GEMM launches (see GroupedGemmConfig.persistent)
            GroupedGemmConfig(block_n=256 // halve, persistent=False),
            GroupedGemmConfig(block_n=256 // halve, tile_store=True, persistent=False),
            # each warp group whole rows (see GroupedGemmConfig.full_row)
            GroupedGemmConfig(block_n=256 // halve, full_row=True),
            GroupedGemmConfig(block_n=256 // halve, tile_store=True, persistent=False,
                              full_row=True),
            # weight tiles shared in L2 by the CTAs in flight (see GroupedGemmConfig.n_group
            # and panel_width)
            *(GroupedGemmConfig(block_n=256 // halve, tile_store=True, persistent=False,
                                n_group=g) for g in (4, 8, 16)),
            GroupedGemmConfig(block_n=256 // halve, n_group=16),
            # partial tiles through shared memory too (see GroupedGemmConfig.staged_rows)
            GroupedGemmConfig(block_n=256 // halve, tile_store=True, persistent=False,
                              staged_rows=True)]))
        if not self.key.get("trans_b", True):  # (see heuristic_config)
            space = [c for c in space if not c.tile_store]
        return space

    def run(self, config: GroupedGemmConfig, compiled: tuple, a, b, offsets, out) -> None:
        import torch

        m_tiles = -(-a.shape[0] // config.block_m) + self.key["n_experts"]
        table = torch.empty((m_tiles,), dtype=torch.int32, device=a.device)
        compiled[0](offsets, table)
        compiled[1](a, b, offsets, table, out)
        if len(compiled) > 2:
            compiled[2](offsets, out)


class GroupedGemmWeightGradKernel(Kernel):
    """key: dtype, n, k, n_experts: db [E, N, K] from dy [M, N] and a [M, K].

    One program for every token count (the reduction length is data); 128 x 256 output
    tiles, two consumer warp groups. Not tuned."""

    name = "grouped_gemm_weight_grad"
    Config = GroupedGemmConfig

    def program(self, config: GroupedGemmConfig, bucket: str):
        key = self.key
        return (expert_order_program(key["n_experts"]),
                weight_grad_program(key["n"], key["k"], key["n_experts"], key["dtype"], config))

    def heuristic_config(self, bucket: str, arch: str) -> GroupedGemmConfig:
        return GroupedGemmConfig()

    def config_space(self, bucket: str) -> list[GroupedGemmConfig]:
        # shared memory: stages x (bm + bn) x bk, the two tails' (bm + bn) x bk and the
        # bm x bn output tile (<= 227 KB). One expert a CTA, TileLang reuses the tails' bytes
        # for the output tile; the expert loop keeps all of them live, so the 128 x 256
        # tiles drop to 2 stages there (3 would ask for 256 KB).
        return [GroupedGemmConfig(),
                GroupedGemmConfig(block_m=128, block_n=128, block_k=64, stages=4),
                GroupedGemmConfig(block_m=128, block_n=128, block_k=64, stages=6),
                *(GroupedGemmConfig(experts_per_cta=p, stages=2) for p in (2, 4, 8)),
                *(GroupedGemmConfig(block_n=128, stages=4, experts_per_cta=p) for p in (2, 4))]

    def run(self, config: GroupedGemmConfig, compiled: tuple, dy, a, offsets, db) -> None:
        import torch

        order = torch.empty_like(offsets)
        compiled[0](offsets, order)
        compiled[1](dy, a, offsets, order, db)
