"""Projections of one input by two or three weights in one launch:
d_g[M, N_g] = a[M, K] @ b_g[N_g, K]^T (+ bias_g[N_g]) for every g (gate / up, q / k / v).

Decode sizes (`weight_group_program`): each projection is a stream of its weight, and a
small one (a k_proj of 8 MB) is too short to reach HBM speed on its own: the launch, the
pipeline's fill and the last wave's tail are paid per weight. Here the weights' row tiles
are numbered one after the other and a CTA takes one tile of whichever weight holds it, so
one launch streams them all. The tile is weight_stream.py's (the weight's rows as wgmma's
M side, the tokens as its N side). No split-K: the fused weights give >= 3072 rows on every
model this serves (48+ CTAs of 64 rows).

Prefill sizes (`token_tile_program`): the dense GEMM's tile (token rows as M), the weights'
column tiles numbered one after the other the same way: one launch instead of a GEMM a
weight, whose small weights (k_proj, v_proj) fill a fraction of a wave each.

Both K loops are hand-written (async_pipeline.py), because the weight a CTA loads from
depends on its tile: TileLang's automatic pipeline turns a TMA copy under such a branch
into synchronous loads, while a producer warp group issues one TMA load a stage from the
weight's own descriptor.
"""

import tilelang.language as T

from ..base import Kernel
from . import async_pipeline
from . import weight_stream as ws
from .gemm import LARGE_ROWS, M_BUCKETS, GemmConfig
from .gemm import NUM_SMS_H200 as SMS

GROUPS = (2, 3)
BUCKETS = (16, 32, 64)  # the weight-streaming M buckets: the token tile is the bucket's rows


def tile_starts(ns: tuple[int, ...], width: int) -> list[int]:
    """The first tile of each weight when the weights' tiles of `width` rows are numbered
    one after the other (and the total last)."""
    starts = [0]
    for n in ns:
        starts.append(starts[-1] + -(-n // width))
    return starts


def by_tile(starts: list[int], leaf):
    """A macro pick(tile, *args) running leaf(g)(tile - starts[g], *args) for the weight g
    holding the tile: a chain of comparisons, uniform across the CTA."""
    pick = None
    for g in reversed(range(len(starts) - 1)):
        pick = _choose(starts[g], starts[g + 1], leaf(g), pick)
    return pick


def weight_loader(starts: list[int], width: int, block_k: int):
    """load(tile, bs, w_shared, s, kt, full): the TMA load of K tile kt of weight tile `tile`
    (`width` rows of whichever weight holds it) into stage s, from that weight's own
    descriptor."""
    def load(g):
        @T.macro
        def weight_tile(t, bs, w_shared, s, kt, full):
            T.tma_copy(bs[g][t * width:(t + 1) * width, kt * block_k:(kt + 1) * block_k],
                       w_shared[s, :, :], barrier=full[s])
        return weight_tile
    return by_tile(starts, load)


def group_producer(load_weight, rows: int, block_k: int, stages: int, steps: int):
    """The producer's K loop of one tile: the input's `rows` rows from row0 (rows past M
    zero-filled by TMA), then the weight tile, a stage a K step."""
    @T.macro
    def produce(a, bs, w_shared, x_shared, full, empty, tile, row0):
        for kt in T.serial(steps):
            s = kt % stages
            # a fresh barrier passes a wait for the parity before its first phase
            T.mbarrier_wait_parity(empty[s], ((kt // stages) & 1) ^ 1)
            T.tma_copy(a[row0:row0 + rows, kt * block_k:(kt + 1) * block_k], x_shared[s, :, :],
                       barrier=full[s])
            load_weight(tile, bs, w_shared, s, kt, full)
            T.mbarrier_arrive(full[s])
    return produce


def weight_group_program(ns: tuple[int, ...], k: int, dtype: str, block_m: int,
                         block_n: int, block_k: int, stages: int, has_bias: bool = False):
    """The program for a [M, K] (M <= block_m) and len(ns) weights b_g [ns[g], K]: CTA t
    takes row tile t of the weights' tiles numbered in order."""
    m = T.dynamic("m")
    starts = tile_starts(ns, block_n)
    steps = -(-k // block_k)
    consumers = ws.THREADS
    w_stages, x_stages = async_pipeline.stage_shapes(False, True, block_n, block_m, block_k,
                                                     stages)
    consume = async_pipeline.wgmma_consumer(False, True, stages, full_row=False)
    produce = group_producer(weight_loader(starts, block_n, block_k), block_m, block_k,
                             stages, steps)

    def store(g):
        @T.macro
        def tile(t, ds, biases, mine):
            col0 = t * block_n
            for j, i in T.Parallel(block_m, block_n):
                if (j < m) & (col0 + i < ns[g]):
                    if has_bias:
                        ds[g][j, col0 + i] = T.cast(
                            mine[j, i] + T.cast(biases[g][col0 + i], "float"), dtype)
                    else:
                        ds[g][j, col0 + i] = T.cast(mine[j, i], dtype)
        return tile

    store_tile = by_tile(starts, store)

    @T.macro
    def body(a, bs, biases, ds):
        with T.Kernel(starts[-1], threads=consumers + async_pipeline.PRODUCER_THREADS) as tile:
            w_shared = T.alloc_shared(w_stages, dtype)
            x_shared = T.alloc_shared(x_stages, dtype)
            full = T.alloc_barrier([async_pipeline.PRODUCER_THREADS] * stages)
            empty = T.alloc_barrier([consumers] * stages)
            acc = T.alloc_fragment((block_n, block_m), "float")
            # the tile transposed to d's order ([token, weight row]): consecutive threads
            # store consecutive columns of d
            mine = T.alloc_shared((block_m, block_n), "float")
            if T.get_thread_binding() >= consumers:
                T.set_max_nreg(async_pipeline.PRODUCER_REGISTERS, 0)
                produce(a, bs, w_shared, x_shared, full, empty, tile, 0)
            else:
                T.set_max_nreg(async_pipeline.CONSUMER_REGISTERS, 1)
                T.clear(acc)
                consume(w_shared, x_shared, acc, full, empty, steps, 0)
                for i, j in T.Parallel(block_n, block_m):
                    mine[j, i] = acc[i, j]
                store_tile(tile, ds, biases, mine)

    return group_prim_func(m, ns, k, dtype, has_bias, body)


def token_tile_program(ns: tuple[int, ...], k: int, dtype: str, config: GemmConfig,
                       has_bias: bool = False):
    """Prefill sizes: the dense GEMM's orientation (block_m token rows a tile, M symbolic,
    block_n columns of one weight), the weights' column tiles numbered one after the other,
    so one launch covers every weight's tiles: no launch, fill and last-wave tail a weight,
    and the small weights' tiles (a k_proj's 1024 columns: 4 of 256) fill the waves the big
    one leaves. The hand-written pipeline (async_pipeline.py: one K step's wgmmas in
    flight), the output tile staged in shared memory and stored by TMA (which clips the
    rows past M and the columns past the weight's N)."""
    m = T.dynamic("m")
    bm, bn, bk, stages = config.block_m, config.block_n, config.block_k, config.stages
    starts = tile_starts(ns, bn)
    steps = -(-k // bk)
    consumers = config.threads
    a_stages, w_stages = async_pipeline.stage_shapes(False, True, bm, bn, bk, stages)
    consume = async_pipeline.wgmma_consumer(False, True, stages, config.full_row)
    produce = group_producer(weight_loader(starts, bn, bk), bm, bk, stages, steps)

    def store(g):
        @T.macro
        def tile(t, row0, ds, biases, acc, d_shared):
            if has_bias:
                for i, j in T.Parallel(bm, bn):
                    # columns past the weight's N read a valid entry; they are never stored
                    acc[i, j] += T.cast(biases[g][T.min(t * bn + j, ns[g] - 1)], "float")
            T.copy(acc, d_shared)
            T.copy(d_shared, ds[g][row0, t * bn])
        return tile

    store_tile = by_tile(starts, store)

    @T.macro
    def body(a, bs, biases, ds):
        with T.Kernel(starts[-1], T.ceildiv(m, bm),
                      threads=consumers + async_pipeline.PRODUCER_THREADS) as (bx, by):
            if config.raster > 0:
                T.use_swizzle(config.raster)
            a_shared = T.alloc_shared(a_stages, dtype)
            w_shared = T.alloc_shared(w_stages, dtype)
            full = T.alloc_barrier([async_pipeline.PRODUCER_THREADS] * stages)
            empty = T.alloc_barrier([consumers] * stages)
            acc = T.alloc_fragment((bm, bn), "float")
            d_shared = T.alloc_shared((bm, bn), dtype)
            if T.get_thread_binding() >= consumers:
                T.set_max_nreg(async_pipeline.PRODUCER_REGISTERS, 0)
                produce(a, bs, w_shared, a_shared, full, empty, bx, by * bm)
            else:
                T.set_max_nreg(async_pipeline.CONSUMER_REGISTERS, 1)
                T.clear(acc)
                consume(a_shared, w_shared, acc, full, empty, steps, 0)
                store_tile(bx, by * bm, ds, biases, acc, d_shared)

    return group_prim_func(m, ns, k, dtype, has_bias, body)


def group_prim_func(m, ns: tuple[int, ...], k: int, dtype: str, has_bias: bool, body):
    """The prim_func of a group's launch, (a, b_0.., bias_0.. (has_bias), d_0..), running
    body(a, weights, biases or None, outputs); m: the symbolic token count body uses."""
    # Each parameter its own annotation object (a shared one would alias the buffers).
    n0, n1, n2 = (*ns, 0)[:3]
    if len(ns) == 2 and not has_bias:
        @T.prim_func
        def gemm_group2(a: T.Tensor((m, k), dtype), b0: T.Tensor((n0, k), dtype),
                        b1: T.Tensor((n1, k), dtype), d0: T.Tensor((m, n0), dtype),
                        d1: T.Tensor((m, n1), dtype)):
            body(a, (b0, b1), None, (d0, d1))
        return gemm_group2
    if len(ns) == 2:
        @T.prim_func
        def gemm_group2_bias(a: T.Tensor((m, k), dtype), b0: T.Tensor((n0, k), dtype),
                             b1: T.Tensor((n1, k), dtype), c0: T.Tensor((n0,), dtype),
                             c1: T.Tensor((n1,), dtype), d0: T.Tensor((m, n0), dtype),
                             d1: T.Tensor((m, n1), dtype)):
            body(a, (b0, b1), (c0, c1), (d0, d1))
        return gemm_group2_bias
    if not has_bias:
        @T.prim_func
        def gemm_group3(a: T.Tensor((m, k), dtype), b0: T.Tensor((n0, k), dtype),
                        b1: T.Tensor((n1, k), dtype), b2: T.Tensor((n2, k), dtype),
                        d0: T.Tensor((m, n0), dtype), d1: T.Tensor((m, n1), dtype),
                        d2: T.Tensor((m, n2), dtype)):
            body(a, (b0, b1, b2), None, (d0, d1, d2))
        return gemm_group3

    @T.prim_func
    def gemm_group3_bias(a: T.Tensor((m, k), dtype), b0: T.Tensor((n0, k), dtype),
                         b1: T.Tensor((n1, k), dtype), b2: T.Tensor((n2, k), dtype),
                         c0: T.Tensor((n0,), dtype), c1: T.Tensor((n1,), dtype),
                         c2: T.Tensor((n2,), dtype), d0: T.Tensor((m, n0), dtype),
                         d1: T.Tensor((m, n1), dtype), d2: T.Tensor((m, n2), dtype)):
        body(a, (b0, b1, b2), (c0, c1, c2), (d0, d1, d2))
    return gemm_group3_bias


def _choose(first: int, end: int, here, later):
    """pick(tile, *args): here(tile - first, *args) below `end`, else later(tile, *args)
    (the last weight's macro takes every tile left)."""
    if later is None:
        @T.macro
        def last(tile, *args):
            here(tile - first, *args)
        return last

    @T.macro
    def pick(tile, *args):
        if tile < end:
            here(tile - first, *args)
        else:
            later(tile, *args)
    return pick


class GemmGroupKernel(Kernel):
    """key: dtype, ns (the weights' row counts, 2 or 3), k, has_bias. Bucketed on M: 16, 32
    and 64 rows take the weight-streaming form (weight_rows configs), more rows the
    token-tile form in the dense GEMM's M buckets. Launch with (a, b_0.., bias_0..
    (has_bias), d_0..)."""

    name = "gemm_group"
    Config = GemmConfig

    def bucket_of(self, m: int) -> str:
        for rows in BUCKETS + tuple(r for r in M_BUCKETS if r > BUCKETS[-1]):
            if m <= rows:
                return f"m{rows}"
        return "large"

    @staticmethod
    def bucket_rows(bucket: str) -> int:
        return LARGE_ROWS if bucket == "large" else int(bucket[1:])

    def program(self, config: GemmConfig, bucket: str):
        key = self.key
        ns, has_bias = tuple(key["ns"]), key.get("has_bias", False)
        if len(ns) not in GROUPS or key["k"] % 8 or key["dtype"] not in (
                "float16", "bfloat16"):
            raise ValueError("gemm_group takes 2 or 3 16-bit weights [N_g, K], K a multiple "
                             f"of 8 (TMA's 16-byte rows), got {key}")
        rows = self.bucket_rows(bucket)
        if config.weight_rows:
            if config.split_k != 1 or rows > config.block_m:
                raise ValueError(f"gemm_group: a weight_rows config takes split_k 1 and "
                                 f"block_m >= the bucket's rows, got {config} for {bucket}")
            return weight_group_program(ns, key["k"], key["dtype"], config.block_m,
                                        config.block_n, config.block_k, config.stages,
                                        has_bias)
        if not (config.async_mma and config.stage_out and config.valid()) or (
                config.split_k != 1 or config.persistent or config.cluster_m != 1):
            raise ValueError(f"gemm_group: a token-tile config is async_mma and stage_out, "
                             f"one CTA a tile (no split, persistence or cluster), got {config}")
        return token_tile_program(ns, key["k"], key["dtype"], config, has_bias)

    def run(self, config: GemmConfig, compiled: tuple, *tensors) -> None:
        compiled[0](*tensors)

    def heuristic_config(self, bucket: str, arch: str) -> GemmConfig:
        """Up to 64 rows weight_stream's default tile (64 weight rows, K tiles of 128, the
        most stages that fit), the token tile the bucket's rows. More rows: 128-row tiles
        with each consumer warp group on whole rows (H100, 2026-12-06, Llama-3.1-8B q/k/v
        and gate/up at 512 and 4096 tokens: 1.00-1.26x the square split and the 128 x 128
        tiles), of the width (a multiple of 16 up to 256) that takes the fewest waves
        times columns over the SMs, the wider on a tie: a tile's time grows with its width,
        and a wave that leaves SMs idle costs as much as a full one (Llama-3.1-8B's q/k/v
        at 512 tokens: 96 tiles of 256 columns leave 36 SMs idle, 120 of 208 take one wave
        at 0.81x the width)."""
        rows = self.bucket_rows(bucket)
        if rows <= BUCKETS[-1]:
            block_n, block_k = ws.DEFAULT_TILE
            return ws.deepest(rows, block_n, block_k, 1)

        def cost(width: int) -> int:
            tiles = -(-rows // 128) * tile_starts(tuple(self.key["ns"]), width)[-1]
            return -(-tiles // SMS) * width

        return token_tile_config(min(range(256, 127, -16), key=cost), full_row=True)

    def config_space(self, bucket: str) -> list[GemmConfig]:
        rows = self.bucket_rows(bucket)
        space = [self.heuristic_config(bucket, "sm_90a")]
        if rows <= BUCKETS[-1]:
            space += [ws.deepest(rows, block_n, block_k, 1)
                      for block_n in ws.WEIGHT_TILES for block_k in (128, 256)]
        else:
            space += [token_tile_config(width, full_row) for width in (256, 128)
                      for full_row in (False, True)]
        return [c for c in dict.fromkeys(space) if c is not None]


def token_tile_config(block_n: int, full_row: bool) -> GemmConfig:
    """The token-tile form's config: 128 x block_n tiles, K tiles of 64, the most stages (up
    to 6) whose buffers and staged output fit."""
    for stages in range(6, 1, -1):
        config = GemmConfig(block_n=block_n, stages=stages, async_mma=True, full_row=full_row)
        if config.valid():
            return config
    raise AssertionError(f"no stages fit a 128 x {block_n} tile")
