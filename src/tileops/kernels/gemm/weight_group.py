"""Decode-size projections of one input by two or three weights in one launch:
d_g[M, N_g] = a[M, K] @ b_g[N_g, K]^T (+ bias_g[N_g]) for every g (gate / up, q / k / v).

At decode sizes each projection is a stream of its weight, and a small one (a k_proj of
8 MB) is too short to reach HBM speed on its own: the launch, the pipeline's fill and the
last wave's tail are paid per weight. Here the weights' row tiles are numbered one after
the other and a CTA takes one tile of whichever weight holds it, so one launch streams them
all. The tile is weight_stream.py's (the weight's rows as wgmma's M side, the tokens as its
N side); the K loop is hand-written (async_pipeline.py), because the weight a CTA loads
from depends on its tile: TileLang's automatic pipeline turns a TMA copy under such a
branch into synchronous loads, while a producer warp group issues one TMA load a stage
from the weight's own descriptor. No split-K: the fused weights give >= 3072 rows on every
model this serves (48+ CTAs of 64 rows).
"""

import tilelang.language as T

from ..base import Kernel
from . import async_pipeline
from . import weight_stream as ws
from .gemm import GemmConfig

GROUPS = (2, 3)
BUCKETS = (16, 32, 64)  # M buckets: the token tile is the bucket's rows


def weight_group_program(ns: tuple[int, ...], k: int, dtype: str, block_m: int,
                         block_n: int, block_k: int, stages: int, has_bias: bool = False):
    """The program for a [M, K] (M <= block_m) and len(ns) weights b_g [ns[g], K]: CTA t
    takes row tile t of the weights' tiles numbered in order."""
    m = T.dynamic("m")
    starts = [0]
    for n in ns:
        starts.append(starts[-1] + -(-n // block_n))
    steps = -(-k // block_k)
    consumers = ws.THREADS
    w_stages, x_stages = async_pipeline.stage_shapes(False, True, block_n, block_m, block_k,
                                                     stages)
    consume = async_pipeline.wgmma_consumer(False, True, stages, full_row=False)

    def by_tile(leaf):
        """A macro pick(tile, *args) running leaf(g)(tile - starts[g], *args) for the weight
        g holding the tile: a chain of comparisons, uniform across the CTA."""
        pick = None
        for g in reversed(range(len(ns))):
            pick = _choose(starts[g], starts[g + 1], leaf(g), pick)
        return pick

    def load(g):
        @T.macro
        def weight_tile(t, bs, w_shared, s, kt, full):
            T.tma_copy(bs[g][t * block_n:(t + 1) * block_n, kt * block_k:(kt + 1) * block_k],
                       w_shared[s, :, :], barrier=full[s])
        return weight_tile

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

    load_weight, store_tile = by_tile(load), by_tile(store)

    @T.macro
    def produce(a, bs, w_shared, x_shared, full, empty, tile):
        for kt in T.serial(steps):
            s = kt % stages
            # a fresh barrier passes a wait for the parity before its first phase
            T.mbarrier_wait_parity(empty[s], ((kt // stages) & 1) ^ 1)
            # the tokens (rows past M zero-filled by TMA), then the weight's tile
            T.tma_copy(a[0:block_m, kt * block_k:(kt + 1) * block_k], x_shared[s, :, :],
                       barrier=full[s])
            load_weight(tile, bs, w_shared, s, kt, full)
            T.mbarrier_arrive(full[s])

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
                produce(a, bs, w_shared, x_shared, full, empty, tile)
            else:
                T.set_max_nreg(async_pipeline.CONSUMER_REGISTERS, 1)
                T.clear(acc)
                consume(w_shared, x_shared, acc, full, empty, steps, 0)
                for i, j in T.Parallel(block_n, block_m):
                    mine[j, i] = acc[i, j]
                store_tile(tile, ds, biases, mine)

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
    """key: dtype, ns (the weights' row counts, 2 or 3), k, has_bias. Bucketed on M (16, 32,
    64 rows). Launch with (a, b_0.., bias_0.. (has_bias), d_0..)."""

    name = "gemm_group"
    Config = GemmConfig

    def bucket_of(self, m: int) -> str:
        for rows in BUCKETS:
            if m <= rows:
                return f"m{rows}"
        raise ValueError(f"gemm_group: {m} rows, at most {BUCKETS[-1]}")

    def program(self, config: GemmConfig, bucket: str):
        key = self.key
        if len(key["ns"]) not in GROUPS or key["k"] % 8 or key["dtype"] not in (
                "float16", "bfloat16"):
            raise ValueError("gemm_group takes 2 or 3 16-bit weights [N_g, K], K a multiple "
                             f"of 8 (TMA's 16-byte rows), got {key}")
        if not config.weight_rows or config.split_k != 1 or int(bucket[1:]) > config.block_m:
            raise ValueError(f"gemm_group: the config must be weight_rows with split_k 1 and "
                             f"block_m >= the bucket's rows, got {config} for {bucket}")
        return weight_group_program(tuple(key["ns"]), key["k"], key["dtype"], config.block_m,
                                    config.block_n, config.block_k, config.stages,
                                    key.get("has_bias", False))

    def run(self, config: GemmConfig, compiled: tuple, *tensors) -> None:
        compiled[0](*tensors)

    def heuristic_config(self, bucket: str, arch: str) -> GemmConfig:
        """weight_stream's default tile (64 weight rows, K tiles of 128, the most stages that
        fit), the token tile the bucket's rows."""
        block_n, block_k = ws.DEFAULT_TILE
        return ws.deepest(int(bucket[1:]), block_n, block_k, 1)

    def config_space(self, bucket: str) -> list[GemmConfig]:
        space = [self.heuristic_config(bucket, "sm_90a")]
        space += [ws.deepest(int(bucket[1:]), block_n, block_k, 1)
                  for block_n in ws.WEIGHT_TILES for block_k in (128, 256)]
        return [c for c in dict.fromkeys(space) if c is not None]
