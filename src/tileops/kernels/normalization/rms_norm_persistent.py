"""RMSNorm with persistent CTAs: the weight loaded once per CTA, x tiles prefetched by TMA.

The grid is `ctas_per_sm` CTAs per SM (fewer when there are fewer row blocks), and CTA b
takes row blocks b, b + grid, b + 2 grid, ... A producer warpgroup (added by TileLang's warp
specialization of `T.Pipelined`) keeps the x tiles of the next `stages - 1` row blocks in
flight through TMA while the consumer threads copy the current tile from shared memory to
registers, free its buffer, reduce, scale and store y. The weight sits in registers from
before the loop to the end. TMA zero-fills the rows past the end of x (the row tail of the
last block); the y stores are guarded by row. Math in fp32, cast at the store, as in
`rms_norm_program`.
"""

import tilelang.language as T

VEC = 8  # 16-byte accesses of fp16/bf16
NUM_SMS = 132  # H200
SMEM_PER_SM = 227 * 1024  # usable shared memory per SM on Hopper
PRODUCER_THREADS = 128  # the warpgroup warp specialization adds to `threads`
MAX_THREADS_PER_SM = 2048
REGISTERS_PER_SM = 65536


def persistent_ok(n: int, block_rows: int, threads: int) -> bool:
    """Whether the persistent program builds for this shape: 16-byte vectors that split
    evenly over whole consumer warpgroups, each thread holding the same columns of every
    row (so its slice of the weight serves every row of a tile)."""
    return (n % VEC == 0 and threads % 128 == 0 and threads & (threads - 1) == 0
            and (n // VEC) % threads == 0 and block_rows >= 1)


def persistent_fits(n: int, itemsize: int, has_weight: bool, block_rows: int, threads: int,
                    ctas_per_sm: int, stages: int) -> bool:
    """Whether `ctas_per_sm` CTAs fit on one SM: their x stages (plus 1 KB each for the
    reduction scratch and barriers) in shared memory, their threads in the thread limit, and
    (two CTAs) their registers without spills. The register need is fitted to ptxas's counts for
    sm_90a: 56-79 with 32-56 x elements per thread, plus about 1.5 per weight element (the
    weight stays in registers); two CTAs of 640 threads get 48 registers and spilled, two
    of 256 threads with 56 weight elements each (hidden 7168) got 128 and spilled."""
    smem = stages * block_rows * n * itemsize + 1024
    cta_threads = threads + PRODUCER_THREADS
    budget = min(255, REGISTERS_PER_SM // (ctas_per_sm * cta_threads) // 8 * 8)
    need = 56 + (3 * (n // threads) // 2 if has_weight else 0)
    return (ctas_per_sm * smem <= SMEM_PER_SM
            and ctas_per_sm * cta_threads <= MAX_THREADS_PER_SM
            and (ctas_per_sm == 1 or need <= budget))  # one CTA: ptxas fits it, no spills


def rms_norm_persistent_program(n: int, dtype: str, has_weight: bool, block_rows: int,
                                threads: int, ctas_per_sm: int, stages: int):
    assert persistent_ok(n, block_rows, threads), (n, block_rows, threads)
    rows = T.dynamic("rows")

    @T.macro
    def body(x, w, y, eps):
        n_blocks = T.ceildiv(rows, block_rows)
        grid = T.min(NUM_SMS * ctas_per_sm, n_blocks)  # every CTA gets >= 1 row block
        with T.Kernel(grid, threads=threads) as bx:
            x_shared = T.alloc_shared((block_rows, n), dtype)
            x_local = T.alloc_fragment((block_rows, n), dtype)
            sq_local = T.alloc_fragment((block_rows, n), "float")
            sum_local = T.alloc_fragment((block_rows,), "float")
            y_local = T.alloc_fragment((block_rows, n), dtype)
            # Registers as ptxas needs them (no setmaxnreg split), capped so that
            # `ctas_per_sm` CTAs are resident together.
            T.disable_warp_group_reg_alloc()
            T.annotate_min_blocks_per_sm(ctas_per_sm)
            if has_weight:
                w_local = T.alloc_fragment((n,), dtype)
                T.copy(w, w_local)  # once per CTA, before the row-block loop
            for t in T.Pipelined(T.ceildiv(n_blocks - bx, grid), num_stages=stages):
                row0 = (bx + t * grid) * block_rows
                T.copy(x[row0, 0], x_shared)  # TMA; rows past the end read as zero
                T.copy(x_shared, x_local)
                for i, j in T.Parallel(block_rows, n):
                    sq_local[i, j] = (T.cast(x_local[i, j], "float")
                                      * T.cast(x_local[i, j], "float"))
                T.reduce_sum(sq_local, sum_local, dim=1)
                for i in T.Parallel(block_rows):
                    sum_local[i] = T.rsqrt(sum_local[i] / n + eps)
                for i, j in T.Parallel(block_rows, n):
                    if has_weight:
                        y_local[i, j] = T.cast(
                            T.cast(x_local[i, j], "float") * sum_local[i]
                            * T.cast(w_local[j], "float"), dtype)
                    else:
                        y_local[i, j] = T.cast(T.cast(x_local[i, j], "float") * sum_local[i],
                                               dtype)
                T.copy(y_local, y[row0, 0])  # guarded by row < rows

    if has_weight:
        @T.prim_func
        def rms_norm_persistent(x: T.Tensor((rows, n), dtype), w: T.Tensor((n,), dtype),
                                y: T.Tensor((rows, n), dtype), eps: T.float32):
            body(x, w, y, eps)
    else:
        @T.prim_func
        def rms_norm_persistent(x: T.Tensor((rows, n), dtype), y: T.Tensor((rows, n), dtype),
                                eps: T.float32):
            body(x, None, y, eps)

    return rms_norm_persistent
