"""A hand-written warp-specialized K loop for Hopper GEMM tiles, with wgmmas kept in flight.

TileLang's automatic warp specialization (`T.Pipelined`, `k_loop`) ends every K step of a
consumer warp group with `warpgroup_wait<0>`: the step's wgmmas must all finish before its
stage goes back to the producer and the next step's wgmmas are issued, so the tensor cores
drain once per K step. Here the consumers wait for the previous step instead: step k's
wgmmas are issued, then `wait_wgmma(1)` lets step k - 1's finish and its stage is released
while step k still runs (the mainloop of CUTLASS's Hopper GEMMs).

Roles: the consumer warp groups are threads [0, consumers); one producer warp group after
them issues each stage's TMA loads on the stage's full barrier once the consumers have
released it on its empty barrier. The stage buffers carry the stage as their first
dimension (`stage_shapes`); the barriers are `full` (one arrival per producer thread plus
the TMA bytes) and `empty` (one arrival per consumer thread).
"""

import tilelang.language as T

PRODUCER_THREADS = 128
# setmaxnreg budgets: 128 x 40 + 256 x 232 fits the SM's 64K registers with two consumer
# warp groups (TileLang's own split is 24 / 240; 40 leaves the producer its addressing).
PRODUCER_REGISTERS = 40
CONSUMER_REGISTERS = 232
SM_REGISTERS = 65536


def register_budgets(consumer_threads: int, ctas_per_sm: int = 1) -> tuple[int, int]:
    """(producer, consumer) setmaxnreg budgets: the defaults above for one CTA an SM; with
    several, the consumers take what the CTA's share of the register file leaves after
    the producer's 40 (multiples of 8: 216 for one consumer warp group at two an SM)."""
    if ctas_per_sm == 1:
        return PRODUCER_REGISTERS, CONSUMER_REGISTERS
    share = SM_REGISTERS // ctas_per_sm - PRODUCER_REGISTERS * PRODUCER_THREADS
    return PRODUCER_REGISTERS, min(CONSUMER_REGISTERS, share // consumer_threads // 8 * 8)


def stage_shapes(trans_a: bool, trans_b: bool, block_m: int, block_n: int, block_k: int,
                 stages: int) -> tuple[tuple, tuple]:
    """The shared buffers of A and B tiles, one per stage, in the layouts TMA writes."""
    a_tile = (block_k, block_m) if trans_a else (block_m, block_k)
    b_tile = (block_n, block_k) if trans_b else (block_k, block_n)
    return (stages, *a_tile), (stages, *b_tile)


def tma_producer(trans_a: bool, trans_b: bool, block_m: int, block_n: int, block_k: int,
                 stages: int, cluster: int = 1):
    """The producer's loop: `steps` K tiles from K tile k0 of output tile (tm, tn), the
    pipeline's steps numbered on from `base` (the steps of the CTA's earlier tiles). In a
    cluster of CTAs on the same column tile, the B tile goes to all of them in one
    multicast load (TMA's: the cluster's first CTA issues it, each CTA expects its bytes).

    `out` (an accumulating persistent GEMM, else None): (d, d_shared, out_full, out_free,
    tile), the CTA's tile-th output tile's old values loaded into d_shared once the
    consumers have freed it (out_free's phase of the tile before) and the tile's first
    stages are issued, so its read overlaps the tile's K loop."""
    multicast = (1 << cluster) - 1 if cluster > 1 else None
    load_out = old_tile_load(block_m, block_n)

    @T.macro
    def produce(a, b, a_stages, b_stages, full, empty, tm, tn, k0, steps, base, out=None):
        for ko in T.serial(steps):
            s = (base + ko) % stages
            # a fresh barrier passes a wait for the parity before its first phase
            T.mbarrier_wait_parity(empty[s], (((base + ko) // stages) & 1) ^ 1)
            kt = k0 + ko
            if trans_a:
                T.tma_copy(a[kt * block_k:(kt + 1) * block_k, tm * block_m:(tm + 1) * block_m],
                           a_stages[s, :, :], barrier=full[s])
            else:
                T.tma_copy(a[tm * block_m:(tm + 1) * block_m, kt * block_k:(kt + 1) * block_k],
                           a_stages[s, :, :], barrier=full[s])
            if trans_b:
                T.tma_copy(b[tn * block_n:(tn + 1) * block_n, kt * block_k:(kt + 1) * block_k],
                           b_stages[s, :, :], barrier=full[s], cluster_mask=multicast)
            else:
                T.tma_copy(b[kt * block_k:(kt + 1) * block_k, tn * block_n:(tn + 1) * block_n],
                           b_stages[s, :, :], barrier=full[s], cluster_mask=multicast)
            T.mbarrier_arrive(full[s])
            if out is not None:
                if ko == T.min(steps, stages) - 1:
                    load_out(tm, tn, *out)
    return produce


def old_tile_load(block_m: int, block_n: int):
    """The producer's load of output tile (tm, tn)'s old values into d_shared, on out_full
    (an accumulating GEMM's `early_out`); first, in a persistent walk, the wait for the
    consumers to have freed d_shared of the CTA's tile before (out_free; None: a CTA with
    one tile)."""

    @T.macro
    def load_out(tm, tn, d, d_shared, out_full, out_free, tile):
        if out_free is not None:
            T.mbarrier_wait_parity(out_free, (tile & 1) ^ 1)
        T.tma_copy(d[tm * block_m:(tm + 1) * block_m, tn * block_n:(tn + 1) * block_n],
                   d_shared, barrier=out_full)
        T.mbarrier_arrive(out_full)
    return load_out


def empty_arrivals(consumer_threads: int, cluster: int = 1) -> int:
    """Arrivals that free a stage: every consumer thread; in a cluster, one a consumer warp
    of every CTA (the multicast writes the stage in each of them)."""
    return consumer_threads if cluster == 1 else consumer_threads // 32 * cluster


def wgmma_consumer(trans_a: bool, trans_b: bool, stages: int, full_row: bool,
                   cluster: int = 1):
    """The consumers' loop over `steps` K tiles into acc, one K step's wgmmas in flight;
    steps numbered on from `base` as the producer numbers them. Every stage goes back to
    the producer, the last once its wgmmas are done (a persistent CTA's next tile needs it);
    in a cluster, to every CTA's producer."""
    policy = T.GemmWarpPolicy.FullRow if full_row else T.GemmWarpPolicy.Square

    @T.macro
    def release(empty, s):
        if cluster == 1:
            T.mbarrier_arrive(empty[s])
        elif T.get_thread_binding() % 32 == 0:
            for rank in T.unroll(cluster):
                T.mbarrier_arrive(empty[s], rank)

    @T.macro
    def consume(a_stages, b_stages, acc, full, empty, steps, base):
        for ko in T.serial(steps):
            step = base + ko
            s = step % stages
            T.mbarrier_wait_parity(full[s], (step // stages) & 1)
            T.wgmma_gemm(a_stages[s, :, :], b_stages[s, :, :], acc, transpose_A=trans_a,
                         transpose_B=trans_b, policy=policy)
            T.wait_wgmma(1)  # step - 1 has finished reading its stage
            if ko > 0:
                release(empty, (step + stages - 1) % stages)
        T.wait_wgmma(0)
        release(empty, (base + steps + stages - 1) % stages)
    return consume


def tile_order(tiles_n: int, raster: int, minimum=T.min):
    """Tile t of a persistent walk -> (row tile, column tile): panels of `raster` column
    tiles walked row by row (CTAs running together share their B columns and A rows in
    L2); row-major when raster is 0. (`minimum`: min on plain ints, for a test.)"""

    def tile_of(t, tiles_m):
        if raster == 0:
            return t // tiles_n, t % tiles_n
        group = raster * tiles_m
        first = t // group * raster
        width = minimum(raster, tiles_n - first)
        return t % group // width, first + t % group % width
    return tile_of
