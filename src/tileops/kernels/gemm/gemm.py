"""Dense GEMM on Hopper: TMA loads, wgmma, warp-specialized pipeline, optional split-K.

d[M, N] = op(a) @ op(b) with fp32 accumulation. M (tokens) is symbolic; N and K (weight
shape) are compiled in. Small M cannot fill 132 SMs with output tiles, so its buckets may
split K across CTAs: each writes an fp32 partial, and a second kernel sums them. A bucket
without a tuned entry takes the cost model's pick (select.py).
"""

import dataclasses
import functools
from dataclasses import dataclass

import tilelang.language as T
import torch

from ..base import Kernel, sm_count
from . import async_pipeline, select
from .wave_fill import SAFE_MEMORY_OFF, merge_buffers, partition, wave_fill_program

NUM_SMS_H200 = 132
SMEM_LIMIT = 227 * 1024
# a named barrier of the consumer warp groups alone (TileLang's own syncs of a warp-
# specialized consumer use 3; 0 is __syncthreads)
EPILOGUE_BARRIER = 5
# M buckets: powers of two up to 16K rows, then "large". Wave quantization makes the best
# tile differ between 4K and 16K rows for the same N, so each gets its own config.
M_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
LARGE_ROWS = 32768  # the M the cost model assumes for "large"


@dataclass(frozen=True)
class GemmConfig:
    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    stages: int = 3
    threads: int = 256  # consumer threads; warp specialization adds a 128-thread producer
    split_k: int = 1
    raster: int = 8  # panel width of the swizzled CTA order (L2 reuse); 0 = row-major
    # Stage the output tile in shared memory for a TMA store; without it the registers go
    # straight to global memory and the freed shared memory can hold another K stage.
    stage_out: bool = True
    # Whole waves of tiles, the last partial wave's tiles split over K and merged in the
    # same launch (wave_fill.py); the split is chosen per call from M, so split_k stays 1.
    wave_fill: bool = False
    # Each consumer warp group takes whole rows of the tile (one m64 x block_n wgmma a K
    # slice) instead of TileLang's default square split (a 128 x 128 tile: two m64n64
    # wgmmas per warp group, which read A twice and B at half width from shared memory).
    full_row: bool = False
    # The hand-written pipeline (async_pipeline.py): one K step's wgmmas stay in flight
    # while the next is issued, where TileLang's waits for each step's before the next.
    async_mma: bool = False
    # One CTA an SM walks the output tiles (async_mma only, no split): the producer loads a
    # tile's first stages while the consumers still store the tile before it.
    persistent: bool = False
    # CTAs of a cluster on the same column tile and adjacent row tiles (async_mma only; the
    # raster panels are of whole clusters): B tiles arrive by one TMA multicast for all of
    # them, halving the L2 -> SM traffic of the weight.
    cluster_m: int = 1
    # Decode sizes (weight_stream.py): the weight's rows on wgmma's M side (block_n of them a
    # CTA), the tokens on its N side (block_m, the whole of M), split-K CTAs reduced in a
    # cluster's shared memory. a [M, K] and b [N, K] only.
    weight_rows: bool = False
    # Accumulating GEMMs (d += a @ b; async_mma): the producer brings the old output tile
    # into the output staging buffer by TMA (first; persistent: after the tile's first
    # stages, once the tile before has left the buffer), so its read overlaps the K loop
    # and the consumers add it after; without it they read it before the loop, exposed.
    early_out: bool = False
    # async_mma: CTAs resident on an SM at once (launch bound and register budgets to
    # match): with one consumer warp group each, one CTA's epilogue runs while another's
    # wgmmas do (the grad_weight GEMM's old-tile traffic against its short K loop)
    ctas_per_sm: int = 1
    # Ping-pong (persistent, async_mma, two consumer warp groups): each consumer warp group
    # owns whole block_m x block_n tiles, the CTA's tiles dealt to them in turn, and their K
    # loops take turns on the tensor cores, so one's epilogue runs under the other's K loop
    # (a K loop of 512 is too short to hide a tile's store; CUTLASS's "pingpong" kernels).
    pingpong: bool = False

    def smem_bytes(self, elem_bytes: int = 2) -> int:
        if self.weight_rows:  # the stages, the transposed tile, the cluster's partials
            tile = self.block_m * self.block_n * 4
            return (self.stages * (self.block_m + self.block_n) * self.block_k * elem_bytes
                    + tile * (1 + (self.split_k if self.split_k > 1 else 0)))
        pipeline = self.stages * (self.block_m + self.block_n) * self.block_k * elem_bytes
        out_bytes = 4 if self.split_k > 1 else elem_bytes
        out = self.block_m * self.block_n * out_bytes if self.stage_out else 0
        out *= 2 if self.pingpong else 1  # a staging tile per consumer warp group
        # TileLang's shared-memory planner places the output staging tile over the pipeline
        # buffers of its own pipeline (the K loop is done when the epilogue writes it), not
        # over the hand-written pipeline's
        return pipeline + out if self.async_mma else max(pipeline, out)

    def wide_square(self) -> bool:
        """A 192-row tile of the hand-written pipeline: TileLang's square split gives each of
        the two consumer warp groups all 192 rows and half the columns (three m64 wgmmas a K
        slice; cuBLAS's cooperative 192 x 192 tile on K 512 GEMMs). Not a default nor in the
        tuner's space: without cuBLAS's 2-CTA multicast it ran at 0.78-0.95x the defaults on
        14 Linear shapes, K 512-14336, persistent or not (H100, 2026-12-06)."""
        return (self.block_m == 192 and self.async_mma and not self.full_row
                and self.threads == 256 and self.block_n % 32 == 0)

    def valid(self) -> bool:
        if self.weight_rows:
            from . import weight_stream as ws

            return (self.smem_bytes() <= SMEM_LIMIT and self.threads == ws.THREADS
                    and self.block_m in ws.TOKEN_TILES and self.block_n in ws.WEIGHT_TILES
                    and 1 <= self.split_k <= ws.MAX_SPLIT
                    and not (self.wave_fill or self.async_mma or self.persistent
                             or self.full_row or self.cluster_m > 1))
        warps = self.threads // 32
        return (self.smem_bytes() * self.ctas_per_sm <= SMEM_LIMIT and warps % 4 == 0
                and (self.ctas_per_sm == 1 or (self.async_mma and self.cluster_m == 1
                                                and self.ctas_per_sm == 2))
                and not (self.wave_fill and self.split_k > 1)
                and not (self.wave_fill and self.async_mma)
                and not (self.persistent and (not self.async_mma or self.split_k > 1))
                and not (self.early_out and (not self.async_mma or not self.stage_out
                                             or self.split_k > 1 or self.cluster_m > 1))
                and self.cluster_m in (1, 2)
                and not (self.pingpong and not (self.persistent and self.threads == 256
                                                and self.stage_out and self.ctas_per_sm == 1
                                                and not self.early_out))
                and not (self.cluster_m > 1 and (not self.async_mma or self.persistent))
                and self.block_m >= 64
                and (self.block_m % (16 * min(warps, self.block_m // 16)) == 0
                     or self.wide_square())
                # whole-row warp groups take any wgmma width in steps of 16
                and self.block_n % (16 if self.full_row else 64) == 0)


# The default of accumulating GEMMs (accumulates_early): the old output tile by TMA during
# the K loop. On an H100, the fused loss's grad_weight GEMM of Llama-3.1-8B (M 128256, N
# 4096, K 512; 2 GB of grad_weight read and written against 0.54 TFLOP) took 1315.7 and
# 1328.7 us against the cost model's 128 x 256 TileLang pipeline's 1393.0 and 1398.6 (two
# runs); persistent 1339.5-1362.1, 128 x 192 x 4 stages 1328.8-1355.7 (2026-12-06).
EARLY_ACCUMULATE = GemmConfig(128, 256, 64, 3, 256, 1, 8, full_row=True, async_mma=True,
                              early_out=True)
# ... and of those with K <= SHORT_ACCUMULATE_K: two CTAs an SM of 128 x 128 tiles, one
# consumer warp group each, so one CTA's old-tile traffic and store run under the other's
# wgmmas (a 512-deep K loop is too short to hide them in one CTA). The same GEMM on an H100:
# 1246.0 us against EARLY_ACCUMULATE's 1324.7 (1.063x; cuBLAS addmm 1111.8); at K 1024 it
# lost (1955.2 against 1915.8; K 2048: 3826.7 against 3455.7) (2026-12-06).
TWO_CTA_ACCUMULATE = dataclasses.replace(EARLY_ACCUMULATE, block_n=128, block_k=32, stages=4,
                                         threads=128, ctas_per_sm=2)
SHORT_ACCUMULATE_K = 512
# The default of plain GEMMs in a Linear layer's layout (a [M, K], b [N, K]) with a static
# K in PINGPONG_K past 256 rows (DeepSeek-V3's kv_b_proj, K 512): a ping-pong walk of 128 x
# 128 tiles, K 64 x 5 stages, so one tile's store runs under the next one's K loop (8 steps
# of 64, too short to hide it). On an H100 at 512 / 4096 / 16384 tokens: 37.9 / 230.0 /
# 985.9 us against the cost model's 128 x 256 TileLang pipeline's 41.2 / 283.0 / 1101.5
# (1.09-1.23x; cuBLAS 32.7 / 219.6 / 854.1). Left out: K 896-1024 (0.93-1.08x), the
# transposed-a weight gradient's layout (0.96x) and K 32 x 10 or 128 x 2 stages (0.6-0.9x)
# (2026-12-06).
SHORT_K_PINGPONG = GemmConfig(128, 128, 64, 5, 256, 1, 8, full_row=True, async_mma=True,
                              persistent=True, pingpong=True)
PINGPONG_K = (256, 512)


def k_tiles_per_split(k: int, block_k: int, split_k: int) -> int:
    k_tiles = -(-k // block_k)
    return -(-k_tiles // split_k)


def k_loop(dtype: str, trans_a: bool, trans_b: bool, block_m: int, block_n: int,
           block_k: int, stages: int, full_row: bool = False):
    """The pipelined K loop of one output tile (row tile tm, column tile tn): `steps` K tiles
    from K tile k0, accumulated into acc (TMA loads, wgmma, warp-specialized)."""
    policy = T.GemmWarpPolicy.FullRow if full_row else T.GemmWarpPolicy.Square

    @T.macro
    def loop(a, b, a_shared, b_shared, acc, tm, tn, k0, steps):
        for ko in T.Pipelined(steps, num_stages=stages):
            kt = k0 + ko
            if trans_a:
                T.copy(a[kt * block_k, tm * block_m], a_shared)
            else:
                T.copy(a[tm * block_m, kt * block_k], a_shared)
            if trans_b:
                T.copy(b[tn * block_n, kt * block_k], b_shared)
            else:
                T.copy(b[kt * block_k, tn * block_n], b_shared)
            T.gemm(a_shared, b_shared, acc, transpose_A=trans_a, transpose_B=trans_b,
                   policy=policy)
    return loop


def tile_store(n: int, block_m: int, block_n: int, has_bias: bool, stage_out: bool):
    """The epilogue: + bias[N] (column tile tn), then acc into `out` (a tile of d), through
    shared memory (TMA store) when d_shared is given."""

    @T.macro
    def store(acc, d_shared, bias, tn, out):
        if has_bias:
            for i, j in T.Parallel(block_m, block_n):
                # columns past N read a valid bias entry; they are never stored
                acc[i, j] += T.cast(bias[T.min(tn * block_n + j, n - 1)], "float")
        if stage_out:
            T.copy(acc, d_shared)
            T.copy(d_shared, out)
        else:
            T.copy(acc, out)
    return store


def gemm_program(n: int, k: int | None, dtype: str, trans_a: bool, trans_b: bool,
                 block_m: int, block_n: int, block_k: int, stages: int, threads: int,
                 split_k: int, raster: int, stage_out: bool = True, accumulate: bool = False,
                 has_bias: bool = False, full_row: bool = False, async_mma: bool = False,
                 persistent: bool = False, cluster_m: int = 1, early_out: bool = False,
                 ctas_per_sm: int = 1, pingpong: bool = False):
    """The GEMM program; with split_k > 1 it writes fp32 partials [split_k, M, N]. With
    `accumulate` it adds to d instead (d += op(a) @ op(b), one rounding per call): the
    weight gradient of a chunked loss sums into its output without a temporary. With
    `has_bias` it adds bias[N] in the epilogue (split_k 1; the split-K reduce adds it
    otherwise). k=None makes K symbolic, like M (a weight gradient reduces over tokens).
    full_row, async_mma, persistent, cluster_m, early_out, ctas_per_sm and pingpong are
    GemmConfig's."""
    m = T.dynamic("m")
    if k is None:
        k = T.dynamic("k")
        tiles = T.ceildiv(k, block_k)  # split_k is 1 (the kernel forces it)
    else:
        tiles = k_tiles_per_split(k, block_k, split_k)
    a_shape = (k, m) if trans_a else (m, k)
    b_shape = (n, k) if trans_b else (k, n)
    a_tile = (block_k, block_m) if trans_a else (block_m, block_k)
    b_tile = (block_n, block_k) if trans_b else (block_k, block_n)
    out_shape = (split_k, m, n) if split_k > 1 else (m, n)
    out_dtype = "float" if split_k > 1 else dtype
    epilogue_bias = has_bias and split_k == 1

    main_loop = k_loop(dtype, trans_a, trans_b, block_m, block_n, block_k, stages, full_row)
    produce = async_pipeline.tma_producer(trans_a, trans_b, block_m, block_n, block_k, stages,
                                          cluster_m)
    consume = async_pipeline.wgmma_consumer(trans_a, trans_b, stages, full_row, cluster_m)
    alloc_empty = T.alloc_cluster_barrier if cluster_m > 1 else T.alloc_barrier
    arrivals = async_pipeline.empty_arrivals(threads, cluster_m)
    a_stages, b_stages = async_pipeline.stage_shapes(trans_a, trans_b, block_m, block_n,
                                                     block_k, stages)
    store = tile_store(n, block_m, block_n, epilogue_bias, stage_out)
    producer = async_pipeline.PRODUCER_THREADS if async_mma else 0
    producer_regs, consumer_regs = async_pipeline.register_budgets(threads, ctas_per_sm)
    tiles_n = -(-n // block_n)
    tile_of = async_pipeline.tile_order(tiles_n, raster)

    load_old_tile = async_pipeline.old_tile_load(block_m, block_n)

    @T.macro
    def start(d, acc_local, by, bx):
        if accumulate and not early_out:
            T.copy(d[by * block_m, bx * block_n], acc_local)
        else:
            T.clear(acc_local)

    @T.macro
    def add_old_tile(acc_local, d_shared, out_full, parity):
        """early_out: the old tile, landed in d_shared, added to the K loop's sums."""
        if early_out:
            T.mbarrier_wait_parity(out_full, parity)
            for i, j in T.Parallel(block_m, block_n):
                acc_local[i, j] += T.cast(d_shared[i, j], "float")

    @T.macro
    def body(a, b, d, bias):
        # a cluster's row tiles past M load zeros and store nothing (TMA clips both)
        with T.Kernel(T.ceildiv(n, block_n), T.ceildiv(m, block_m * cluster_m) * cluster_m,
                      split_k, threads=threads + producer,
                      cluster_dims=(1, cluster_m, 1) if cluster_m > 1 else None) as (bx, by, bz):
            if ctas_per_sm > 1:
                T.annotate_min_blocks_per_sm(ctas_per_sm)
            if async_mma:
                a_shared = T.alloc_shared(a_stages, dtype)
                b_shared = T.alloc_shared(b_stages, dtype)
                full = T.alloc_barrier([producer] * stages)
                empty = alloc_empty([arrivals] * stages)
                if early_out:
                    out_full = T.alloc_barrier([producer])
            else:
                a_shared = T.alloc_shared(a_tile, dtype)
                b_shared = T.alloc_shared(b_tile, dtype)
            acc_local = T.alloc_fragment((block_m, block_n), "float")
            d_shared = T.alloc_shared((block_m, block_n), out_dtype) if stage_out else None
            tm, tn = by, bx
            if cluster_m > 1:
                # the swizzle on whole clusters: a cluster's CTAs keep one column tile
                pm, tn = tile_of(by // cluster_m * tiles_n + bx, T.ceildiv(m, block_m * cluster_m))
                tm = pm * cluster_m + by % cluster_m
            elif raster > 0:
                T.use_swizzle(raster)
            out = d[bz, tm * block_m, tn * block_n] if split_k > 1 else d[
                tm * block_m, tn * block_n]
            if async_mma:
                if T.get_thread_binding() >= threads:
                    T.set_max_nreg(producer_regs, 0)
                    if early_out:  # the CTA's one tile: before its stages
                        load_old_tile(tm, tn, d, d_shared, out_full, None, 0)
                    produce(a, b, a_shared, b_shared, full, empty, tm, tn, bz * tiles, tiles, 0)
                else:
                    T.set_max_nreg(consumer_regs, 1)
                    start(d, acc_local, tm, tn)
                    consume(a_shared, b_shared, acc_local, full, empty, tiles, 0)
                    add_old_tile(acc_local, d_shared, out_full if early_out else None, 0)
                    store(acc_local, d_shared, bias, tn, out)
                if cluster_m > 1:  # no CTA leaves while its peers may still write to it
                    T.cluster_sync()
            else:
                start(d, acc_local, by, bx)
                main_loop(a, b, a_shared, b_shared, acc_local, by, bx, bz * tiles, tiles)
                store(acc_local, d_shared, bias, bx, out)

    @T.macro
    def persistent_body(a, b, d, bias):
        tiles_m = T.ceildiv(m, block_m)
        out_tiles = tiles_m * tiles_n
        grid = T.min(out_tiles, NUM_SMS_H200 * ctas_per_sm)
        with T.Kernel(grid, threads=threads + producer) as cta:
            if ctas_per_sm > 1:
                T.annotate_min_blocks_per_sm(ctas_per_sm)
            a_shared = T.alloc_shared(a_stages, dtype)
            b_shared = T.alloc_shared(b_stages, dtype)
            full = T.alloc_barrier([producer] * stages)
            empty = T.alloc_barrier([threads] * stages)
            if early_out:  # the old output tile landed; the staging buffer free again
                out_full = T.alloc_barrier([producer])
                out_free = T.alloc_barrier([threads])
            acc_local = T.alloc_fragment((block_m, block_n), "float")
            d_shared = T.alloc_shared((block_m, block_n), out_dtype) if stage_out else None
            mine = T.ceildiv(out_tiles - cta, grid)  # tiles cta, cta + grid, ...
            if T.get_thread_binding() >= threads:
                T.set_max_nreg(producer_regs, 0)
                for i in T.serial(mine):
                    tm, tn = tile_of(cta + i * grid, tiles_m)
                    produce(a, b, a_shared, b_shared, full, empty, tm, tn, 0, tiles, i * tiles,
                            (d, d_shared, out_full, out_free, i) if early_out else None)
            else:
                T.set_max_nreg(consumer_regs, 1)
                for i in T.serial(mine):
                    tm, tn = tile_of(cta + i * grid, tiles_m)
                    start(d, acc_local, tm, tn)
                    consume(a_shared, b_shared, acc_local, full, empty, tiles, i * tiles)
                    add_old_tile(acc_local, d_shared, out_full if early_out else None, i & 1)
                    store(acc_local, d_shared, bias, tn, d[tm * block_m, tn * block_n])
                    if early_out:
                        # the store's one issuing thread has waited for its reads of the
                        # buffer: past this barrier the producer may fill it again
                        T.sync_threads(EPILOGUE_BARRIER, threads)
                        T.mbarrier_arrive(out_free)

    @T.macro
    def consume_turn(a, b, d, bias, a_shared, b_shared, full, empty, turn, acc_local, d_shared,
                     cta, grid, tiles_m, g, t):
        """Warp group g's t-th tile (the CTA's tile 2 t + g) of a ping-pong walk."""
        i = 2 * t + g
        tm, tn = tile_of(cta + i * grid, tiles_m)
        if g == 1 or t > 0:
            T.mbarrier_wait_parity(turn[g], (t - 1 + g) & 1)
        start(d, acc_local, tm, tn)
        consume(a_shared, b_shared, acc_local, full, empty, tiles, i * tiles)
        T.mbarrier_arrive(turn[1 - g])
        store(acc_local, d_shared, bias, tn, d[tm * block_m, tn * block_n])

    @T.macro
    def pingpong_body(a, b, d, bias):
        group = threads // 2  # a consumer warp group: one tile at a time
        tiles_m = T.ceildiv(m, block_m)
        out_tiles = tiles_m * tiles_n
        grid = T.min(out_tiles, NUM_SMS_H200)
        with T.Kernel(grid, threads=threads + producer) as cta:
            a_shared = T.alloc_shared(a_stages, dtype)
            b_shared = T.alloc_shared(b_stages, dtype)
            full = T.alloc_barrier([producer] * stages)
            empty = T.alloc_barrier([group] * stages)  # a stage is one warp group's
            # turn[g]: the other warp group's K loop is done, warp group g's may start (the
            # stages are dealt in tile order, and a waiter may be only one phase behind)
            turn = T.alloc_barrier([group, group])
            acc = [T.alloc_fragment((block_m, block_n), "float") for _ in range(2)]
            staged = [T.alloc_shared((block_m, block_n), out_dtype) for _ in range(2)]
            mine = T.ceildiv(out_tiles - cta, grid)  # tiles cta, cta + grid, ...
            tx = T.get_thread_binding()
            if tx >= threads:
                T.set_max_nreg(producer_regs, 0)
                for i in T.serial(mine):
                    tm, tn = tile_of(cta + i * grid, tiles_m)
                    produce(a, b, a_shared, b_shared, full, empty, tm, tn, 0, tiles, i * tiles)
            elif tx < group:
                T.set_max_nreg(consumer_regs, 1)
                for t in T.serial(T.ceildiv(mine, 2)):
                    consume_turn(a, b, d, bias, a_shared, b_shared, full, empty, turn, acc[0],
                                 staged[0], cta, grid, tiles_m, 0, t)
            else:
                T.set_max_nreg(consumer_regs, 1)
                for t in T.serial(mine // 2):
                    consume_turn(a, b, d, bias, a_shared, b_shared, full, empty, turn, acc[1],
                                 staged[1], cta, grid, tiles_m, 1, t)

    launch = pingpong_body if pingpong else persistent_body if persistent else body

    # Each parameter its own annotation object (a shared one would alias the buffers).
    if epilogue_bias:
        @T.prim_func
        def gemm_bias(a: T.Tensor(a_shape, dtype), b: T.Tensor(b_shape, dtype),
                      bias: T.Tensor((n,), dtype), d: T.Tensor(out_shape, out_dtype)):
            launch(a, b, d, bias)
        return gemm_bias

    @T.prim_func
    def gemm(a: T.Tensor(a_shape, dtype), b: T.Tensor(b_shape, dtype),
             d: T.Tensor(out_shape, out_dtype)):
        launch(a, b, d, None)
    return gemm


def split_k_reduce_program(n: int, split_k: int, dtype: str, block_m: int = 4,
                           block_n: int = 512, threads: int = 128, has_bias: bool = False,
                           unroll_splits: bool = False):
    """Sums the fp32 partials [split_k, M, N] into d[M, N] in the output dtype (+ bias).
    With `unroll_splits` the split loop is unrolled, so every split's load is in flight at
    once (the rolled loop waits one L2 round trip per split)."""
    m = T.dynamic("m")
    splits = T.unroll if unroll_splits else T.serial

    @T.macro
    def body(w, bias, d):
        with T.Kernel(T.ceildiv(n, block_n), T.ceildiv(m, block_m), threads=threads) as (bx, by):
            acc_local = T.alloc_fragment((block_m, block_n), "float")
            part_local = T.alloc_fragment((block_m, block_n), "float")
            T.clear(acc_local)
            for s in splits(split_k):
                T.copy(w[s, by * block_m, bx * block_n], part_local)
                for i, j in T.Parallel(block_m, block_n):
                    acc_local[i, j] += part_local[i, j]
            if has_bias:
                for i, j in T.Parallel(block_m, block_n):
                    acc_local[i, j] += T.cast(bias[T.min(bx * block_n + j, n - 1)], "float")
            T.copy(acc_local, d[by * block_m, bx * block_n])

    if has_bias:
        @T.prim_func
        def reduce_bias(w: T.Tensor((split_k, m, n), "float"), bias: T.Tensor((n,), dtype),
                        d: T.Tensor((m, n), dtype)):
            body(w, bias, d)
        return reduce_bias

    @T.prim_func
    def reduce(w: T.Tensor((split_k, m, n), "float"), d: T.Tensor((m, n), dtype)):
        body(w, None, d)
    return reduce


class GemmKernel(Kernel):
    """key: dtype, n, k, trans_a, trans_b; optional flags that a plain GEMM's key leaves out
    (so tuned entries keep their keys): accumulate=True (d += op(a) @ op(b)), has_bias=True
    (+ bias[N]), and k=None for a symbolic K (a weight gradient's token count). Bucketed on M.
    Launch with (a, b, d), or (a, b, bias, d) with has_bias."""

    name = "gemm"
    Config = GemmConfig
    m_buckets = M_BUCKETS
    large_rows = LARGE_ROWS
    weight_stream_stages = 8  # the most stages a weight_rows config of the space takes

    def bucket_of(self, m: int) -> str:
        for limit in self.m_buckets:
            if m <= limit:
                return f"m{limit}"
        return "large"

    def bucket_rows(self, bucket: str) -> int:
        return int(bucket[1:]) if bucket != "large" else self.large_rows

    def program(self, config: GemmConfig, bucket: str):
        k = self.key
        if config.async_mma and not self.tma_aligned():
            raise ValueError("the hand-written pipeline loads by TMA: K (and N when b is "
                             f"[K, N]) must be a multiple of 8 elements, got {k}")
        if config.early_out and not k.get("accumulate", False):
            raise ValueError("early_out loads the old output tile of an accumulating GEMM")
        if config.weight_rows:
            return (self._weight_stream_program(config, bucket),)
        if config.wave_fill:
            if not self._splittable():
                raise ValueError("an accumulating or symbolic-K GEMM cannot fill waves")
            return (wave_fill_program(
                k["n"], k["k"], k["dtype"], k["trans_a"], k["trans_b"], config.block_m,
                config.block_n, config.block_k, config.stages, config.threads,
                config.raster, config.stage_out, k.get("has_bias", False),
                functools.partial(k_loop, full_row=config.full_row), tile_store),)
        main = gemm_program(k["n"], k["k"], k["dtype"], k["trans_a"], k["trans_b"],
                            config.block_m, config.block_n, config.block_k, config.stages,
                            config.threads, config.split_k, config.raster, config.stage_out,
                            k.get("accumulate", False), k.get("has_bias", False),
                            config.full_row, config.async_mma, config.persistent,
                            config.cluster_m, config.early_out, config.ctas_per_sm,
                            config.pingpong)
        if config.split_k == 1:
            return main
        if not self._splittable():
            raise ValueError("an accumulating or symbolic-K GEMM takes split_k = 1")
        return main, split_k_reduce_program(k["n"], config.split_k, k["dtype"],
                                            has_bias=k.get("has_bias", False))

    def _streams_weight(self) -> bool:
        """Whether the weight-streaming form serves this key: 16-bit a [M, K] and b [N, K]
        (a Linear layer's layout), a static K of whole 16-byte rows (TMA), no accumulation."""
        k = self.key
        return (k.get("dtype") in ("float16", "bfloat16") and k.get("trans_a") is False
                and k.get("trans_b") is True and self._splittable() and k["k"] % 8 == 0)

    def _weight_stream_program(self, config: GemmConfig, bucket: str):
        from .weight_stream import weight_stream_program

        k = self.key
        if not self._streams_weight():
            raise ValueError("weight_rows takes 16-bit a [M, K] and b [N, K] with a static K "
                             f"(a multiple of 8) and no accumulation, got {k}")
        self._check_token_tile(config, bucket)
        return weight_stream_program(k["n"], k["k"], k["dtype"], config.block_m, config.block_n,
                                     config.block_k, config.stages, config.split_k,
                                     k.get("has_bias", False))

    def _check_token_tile(self, config: GemmConfig, bucket: str) -> None:
        """A weight_rows program holds all of M in its token tile (block_m rows)."""
        if self.bucket_rows(bucket) > config.block_m:
            raise ValueError(f"weight_rows holds M <= block_m = {config.block_m} rows; bucket "
                             f"{bucket} has up to {self.bucket_rows(bucket)}")

    def pass_configs(self, config: GemmConfig, program_index: int) -> dict:
        return dict(SAFE_MEMORY_OFF) if config.wave_fill else {}

    def tma_aligned(self) -> bool:
        """Every static row stride of a and b a multiple of 16 bytes (TMA's rule; the
        symbolic M's stride of a transposed a is the op's to check)."""
        k, n = self.key["k"], self.key["n"]
        k_strided = not self.key["trans_a"] or self.key["trans_b"]
        return ((k is None or not k_strided or k % 8 == 0)
                and (self.key["trans_b"] or n % 8 == 0))

    def _splittable(self) -> bool:
        # split-K partials would each add d; a symbolic K has no static split
        return not self.key.get("accumulate", False) and self.key["k"] is not None

    def run(self, config: GemmConfig, compiled: tuple, a, b, *rest) -> None:
        *bias, d = rest  # (d) or (bias, d)
        if config.wave_fill:
            self._run_wave_fill(config, compiled[0], a, b, bias, d)
            return
        if config.split_k == 1 or config.weight_rows:  # (weight_rows reduces in its cluster)
            compiled[0](a, b, *bias, d)
            return
        partial = d.new_empty((config.split_k, d.shape[0], d.shape[1]), dtype=torch.float32)
        compiled[0](a, b, partial)
        compiled[1](partial, *bias, d)  # the reduce adds the bias, once

    def _run_wave_fill(self, config: GemmConfig, launch, a, b, bias: list, d) -> None:
        bm, bn = config.block_m, config.block_n
        sms = sm_count(d.device)
        tiles = -(-d.shape[0] // bm) * -(-self.key["n"] // bn)
        whole, split = partition(tiles, -(-self.key["k"] // config.block_k), sms)
        slots, counts = merge_buffers(d.device, bm, bn, sms)
        launch(a, b, *bias, d, slots, counts, whole, split)

    def split_for(self, m: int, block_m: int, block_n: int, block_k: int) -> int:
        """Enough K splits for the grid to cover the SMs, each split keeping >= 4 K tiles."""
        if not self._splittable():
            return 1
        ctas = -(-self.key["n"] // block_n) * -(-m // block_m)
        k_tiles = -(-self.key["k"] // block_k)
        split = 1
        while ctas * split * 2 <= NUM_SMS_H200 * 1.5 and k_tiles // (split * 2) >= 4:
            split *= 2
        return split

    def weight_stream_space(self, bucket: str) -> list[GemmConfig]:
        """The weight-streaming tiles for the tuner, up to 64 rows (the token tile the
        bucket's rows): 64 / 128 weight rows, K tiles of 128 / 256, the most stages that fit
        (up to weight_stream_stages), splits 1-4."""
        from . import weight_stream as ws

        rows, key = self.bucket_rows(bucket), self.key
        if rows > max(ws.TOKEN_TILES) or not self._streams_weight():
            return []
        block_m = next(t for t in ws.TOKEN_TILES if t >= rows)
        space = [ws.deepest(block_m, block_n, block_k, split, self.Config,
                            self.weight_stream_stages)
                 for block_n in ws.WEIGHT_TILES for block_k in (128, 256) for split in (1, 2, 4)
                 if -(-key["k"] // block_k) // split >= 4]
        return [c for c in space if c is not None]

    def model_shape(self) -> select.Shape:
        key = self.key
        return select.Shape(m=0, n=key["n"], k=key["k"], dtype=key["dtype"],
                            splittable=self._splittable())

    def heuristic_config(self, bucket: str, arch: str) -> GemmConfig:
        """Up to 16 rows of a [M, K] x b [N, K]: the weight-streaming form (weight_stream.py);
        else the cost model's pick for this bucket (select.py), evaluated at its largest M."""
        stream = self.weight_stream_config(bucket)
        if stream is not None:
            return stream
        if self.accumulates_early(bucket):
            return (TWO_CTA_ACCUMULATE if self.key["k"] <= SHORT_ACCUMULATE_K
                    else EARLY_ACCUMULATE)
        if self.pingpong_serves(bucket):
            return SHORT_K_PINGPONG
        return select.choose(self.model_shape(), self.bucket_rows(bucket), self.gpu)

    def accumulates_early(self, bucket: str) -> bool:
        """Whether `EARLY_ACCUMULATE` (or `TWO_CTA_ACCUMULATE`) serves: an accumulating GEMM
        with a static K of whole TMA rows, past a wave of 128-row tiles (the fused loss's
        grad_weight: M = the vocabulary)."""
        return (self.key.get("accumulate", False) and self.key["k"] is not None
                and self.tma_aligned() and self.bucket_rows(bucket) > 128)

    def pingpong_serves(self, bucket: str) -> bool:
        """Whether `SHORT_K_PINGPONG` serves: a plain GEMM (no bias, no accumulation) of a
        [M, K] and b [N, K] with a static K in PINGPONG_K, past 256 rows."""
        k = self.key
        return (not k.get("accumulate", False) and not k.get("has_bias", False)
                and k["k"] is not None and PINGPONG_K[0] <= k["k"] <= PINGPONG_K[1]
                and not k["trans_a"] and k["trans_b"] and self.tma_aligned()
                and self.bucket_rows(bucket) > 256)

    def weight_stream_config(self, bucket: str) -> GemmConfig | None:
        """The weight-streaming default for a bucket of <= 16 rows where the form serves the
        key (`_streams_weight`); None elsewhere."""
        from . import weight_stream as ws

        if self.bucket_rows(bucket) > ws.ROWS or not self._streams_weight():
            return None
        block_n, block_k = ws.DEFAULT_TILE
        return ws.deepest(ws.ROWS, block_n, block_k, ws.default_split(self.key["n"],
                                                                      self.key["k"]))

    def config_space(self, bucket: str) -> list[GemmConfig]:
        rows = self.bucket_rows(bucket)
        space = [self.heuristic_config(bucket, "sm_90a")]
        space += self.weight_stream_space(bucket)
        if rows <= 128:
            block_m, threads = (64, 128) if rows <= 64 else (128, 256)
            for bn in (64, 128, 256):
                for bk, st in ((64, 6), (128, 4), (128, 6), (256, 2)):
                    split = self.split_for(rows, block_m, bn, bk)
                    for s in sorted({1, split, max(1, split // 2), split * 2}):
                        space.append(GemmConfig(block_m, bn, bk, st, threads, s, 0))
        else:
            for bm, bn, st in ((128, 256, 3), (256, 128, 3), (128, 128, 4), (128, 128, 5)):
                for raster in (0, 8, 16):
                    space.append(GemmConfig(bm, bn, 64, st, 256, 1, raster))
            for bm, bn in ((128, 256), (256, 128)):  # a 4th stage in the epilogue's space
                space.append(GemmConfig(bm, bn, 64, 4, 256, 1, 8, stage_out=False))
            if self.tma_aligned():  # the hand-written pipeline (defaults: see heuristic_config)
                space += [GemmConfig(128, bn, 64, st, 256, 1, 8, full_row=True, async_mma=True)
                          for bn, st in ((256, 3), (128, 4))]
                if not (self.key.get("accumulate", False) or self.key.get("has_bias", False)):
                    # (measured far slower accumulating; with a bias, ptxas takes minutes)
                    space += [SHORT_K_PINGPONG,
                              dataclasses.replace(SHORT_K_PINGPONG, block_n=192, stages=3)]
                if self.key.get("accumulate", False):
                    space += [dataclasses.replace(EARLY_ACCUMULATE, block_n=bn, stages=st,
                                                  persistent=p)
                              for bn, st in ((256, 3), (192, 4)) for p in (False, True)]
                    # two CTAs an SM, one consumer warp group each
                    space += [dataclasses.replace(EARLY_ACCUMULATE, block_n=128, block_k=bk,
                                                  stages=st, threads=128, ctas_per_sm=2,
                                                  persistent=p)
                              for bk, st in ((64, 2), (32, 4)) for p in (False, True)]
        # the cost model's runners-up (split-K ones among them)
        scored = select.ranked(self.model_shape(), rows, self.gpu)
        space += [c for _, c in sorted(scored, key=lambda s: s[0])[:6]]
        if not self._splittable():
            space = [c for c in space if c.split_k == 1]
        return [c for c in dict.fromkeys(space) if c.valid()]
