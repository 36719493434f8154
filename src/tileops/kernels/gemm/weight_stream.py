"""Decode-size GEMMs with the weight as wgmma's M side: d[M, N] = a[M, K] @ b[N, K]^T for
M up to a few dozen tokens (GemmConfig.weight_rows).

At decode sizes the GEMM is a stream of the weight: every byte of b is read once and used
by M <= 64 rows of a. The plain tile puts the tokens on wgmma's M side, whose minimum is 64
rows, so a 16-token call fills a quarter of every A tile (TMA zero-fills the rest) and the
output tile is N-narrow. Here the roles swap: a CTA takes `block_n` weight rows as the
wgmma's M side (64 or 128) and the tokens as its N side (`block_m`: 16, 32 or 64 columns,
the rows of a past M zero-filled by TMA), accumulating d's transposed tile
[block_n, block_m] in fp32 registers.

Split-K without a second kernel: the `split_k` CTAs that share a weight tile (its K range
cut in `split_k` pieces) form one thread-block cluster; each pushes its fp32 partial tile
into the first CTA's shared memory (DSMEM), and that CTA sums them and writes d. So a
small N still fills the GPU (N / block_n x split_k CTAs), with no fp32 workspace round trip
and no reduce launch (the plain kernel's split-K costs both).
"""

import tilelang.language as T

from .gemm import GemmConfig, k_loop, k_tiles_per_split

ROWS = 16  # the M bucket served by default (GemmKernel.weight_stream_config)
THREADS = 128  # one consumer warp group (TileLang adds the TMA producer's)
TOKEN_TILES = (16, 32, 64)  # wgmma N widths: multiples of 16 (n8 shapes are unreliable)
WEIGHT_TILES = (64, 128)    # the consumer warp group's wgmma M side: one or two m64 blocks
MAX_SPLIT = 8               # the portable cluster size
# The default's tile: 64 weight rows x 128 K columns, 8 stages (160 KB in flight a CTA);
# split-K only where the weight tiles alone leave the GPU starved (< MIN_CTAS CTAs), at
# most 4 a cluster. Measured on an H100 (2026-12-05, Llama-3.1-8B's seven decode Linear
# shapes at 1 and 8 tokens, the project's timing protocol): 0.99-1.10x cuBLAS (through
# tileops.linear), where the plain 64-row tiles ran 0.83-1.06x; a split of 2 on 64 tiles
# cost 7% (the cluster's barriers and the DSMEM sum), a split of 8 on 16 tiles 2x (two
# waves of 8-CTA clusters).
DEFAULT_TILE = (64, 128)  # block_n, block_k (8 stages fit)
MIN_CTAS = 64
DEFAULT_MAX_SPLIT = 4


def deepest(block_m: int, block_n: int, block_k: int, split: int, config_class=GemmConfig,
            max_stages: int = 8) -> GemmConfig | None:
    """The weight_rows config (of config_class: gemm_fp8's takes it too) of this tile and
    split with the most stages (up to max_stages) that fit in shared memory; None if not
    even 2 do."""
    for stages in range(max_stages, 1, -1):
        config = config_class(block_m, block_n, block_k, stages, THREADS, split, 0,
                              stage_out=False, weight_rows=True)
        if config.valid():
            return config
    return None


def default_split(n: int, k: int, block_n: int = DEFAULT_TILE[0],
                  block_k: int = DEFAULT_TILE[1]) -> int:
    """The fewest K pieces (1, 2, 4) giving MIN_CTAS CTAs, each piece >= 4 K tiles."""
    tiles, k_tiles = -(-n // block_n), -(-k // block_k)
    split = 1
    while (tiles * split < MIN_CTAS and split * 2 <= DEFAULT_MAX_SPLIT
           and k_tiles // (split * 2) >= 4):
        split *= 2
    return split


def weight_stream_body(m, n: int, k: int, in_dtype: str, out_dtype: str, block_m: int,
                       block_n: int, block_k: int, stages: int, split_k: int, main_loop=None,
                       scale=None):
    """The kernel shared by the 16-bit and the fp8 forms: body(a, b, scale_a, scale_b, bias,
    d). `main_loop(a, b, scale_a, scale_b, w_shared, x_shared, acc, tn, k0)` accumulates
    the transposed tile acc[block_n, block_m] over this CTA's K tiles from k0 (None: the
    plain pipelined K loop); `scale(scale_a, scale_b, row, token)` (None: no scaling)
    multiplies the summed tile on its way to d, after the cluster's reduction."""
    steps = k_tiles_per_split(k, block_k, split_k)
    tiles_n = -(-n // block_n)
    if main_loop is None:
        # the weight tile as the loop's A operand (block_n rows), the tokens as its B operand
        loop = k_loop(in_dtype, False, True, block_n, block_m, block_k, stages)

        @T.macro
        def main_loop(a, b, scale_a, scale_b, w_shared, x_shared, acc, tn, k0):
            loop(b, a, w_shared, x_shared, acc, tn, 0, k0, steps)

    @T.macro
    def write(value, bias, scale_a, scale_b, col0, j, i, d):
        """d[j, col0 + i] <- value (x its scales) (+ bias), inside d's M rows and N columns."""
        if (j < m) & (col0 + i < n):
            if scale is not None:
                value = value * scale(scale_a, scale_b, col0 + i, j)
            if bias is not None:
                d[j, col0 + i] = T.cast(value + T.cast(bias[col0 + i], "float"), out_dtype)
            else:
                d[j, col0 + i] = T.cast(value, out_dtype)

    @T.macro
    def body(a, b, scale_a, scale_b, bias, d):
        with T.Kernel(tiles_n * split_k, threads=THREADS,
                      cluster_dims=(split_k, 1, 1) if split_k > 1 else None) as bx:
            w_shared = T.alloc_shared((block_n, block_k), in_dtype)
            x_shared = T.alloc_shared((block_m, block_k), in_dtype)
            acc = T.alloc_fragment((block_n, block_m), "float")
            # the tile transposed to d's order ([token, weight row]), so that the stores
            # of consecutive threads go to consecutive columns of d
            mine = T.alloc_shared((block_m, block_n), "float")
            tn, rank = bx // split_k, bx % split_k
            col0 = tn * block_n
            if split_k > 1:
                parts = T.alloc_shared((split_k, block_m, block_n), "float")
                # `parts` receives the peers' writes, which the shared-memory planner does
                # not see: touched before the K loop, it stays live (no pipeline buffer
                # shares its bytes), and the cluster barrier orders every peer's write
                # after the touch
                tx = T.get_thread_binding()
                if tx < split_k:
                    parts[tx, 0, 0] = 0.0
                T.cluster_sync()
            T.clear(acc)
            main_loop(a, b, scale_a, scale_b, w_shared, x_shared, acc, tn, rank * steps)
            for i, j in T.Parallel(block_n, block_m):
                mine[j, i] = acc[i, j]
            if split_k > 1:
                T.copy_cluster(mine, parts[rank, :, :], dst_block=0)
                T.cluster_sync()  # every partial has landed in the first CTA
                if rank == 0:
                    for j, i in T.Parallel(block_m, block_n):
                        total = T.alloc_var("float")
                        total = parts[0, j, i]
                        for r in T.unroll(split_k - 1):
                            total += parts[r + 1, j, i]
                        write(total, bias, scale_a, scale_b, col0, j, i, d)
            else:
                for j, i in T.Parallel(block_m, block_n):
                    write(mine[j, i], bias, scale_a, scale_b, col0, j, i, d)
    return body


def weight_stream_program(n: int, k: int, dtype: str, block_m: int, block_n: int,
                          block_k: int, stages: int, split_k: int, has_bias: bool = False):
    """The program for a [M, K] (M <= block_m), b [N, K]: CTA bx takes weight tile
    bx // split_k and K piece bx % split_k (its cluster rank)."""
    m = T.dynamic("m")
    body = weight_stream_body(m, n, k, dtype, dtype, block_m, block_n, block_k, stages,
                              split_k)

    if has_bias:
        @T.prim_func
        def gemm_weight_rows_bias(a: T.Tensor((m, k), dtype), b: T.Tensor((n, k), dtype),
                                  bias: T.Tensor((n,), dtype), d: T.Tensor((m, n), dtype)):
            body(a, b, None, None, bias, d)
        return gemm_weight_rows_bias

    @T.prim_func
    def gemm_weight_rows(a: T.Tensor((m, k), dtype), b: T.Tensor((n, k), dtype),
                         d: T.Tensor((m, n), dtype)):
        body(a, b, None, None, None, d)
    return gemm_weight_rows
