"""Decode-size fp8 GEMMs with the weight as wgmma's M side (Fp8GemmConfig.weight_rows).

The 16-bit weight-streaming form (gemm/weight_stream.py) on e4m3 tiles: a CTA takes
`block_n` weight rows as the wgmma's M side and the M <= 64 tokens as its N side, and the
split-K CTAs of one weight tile sum their fp32 partials in the first one's shared memory
(a cluster), so there is no fp32 workspace, no reduce launch, and a 16-token call does not
fill three quarters of a 64-row A tile with zeros (gemm_fp8's decode tile does).

Scalings, in the transposed tile acc[weight row, token]:
- "tensor" and "row": applied once, to the cluster's sum on its way to d;
- "block": every 128-deep K block is accumulated into a fresh fragment and promoted into
  acc times scale_a[token, kb] * scale_b[row // 128, kb]. The scales are read one block
  ahead (loaded after this block's promotion, used at the next one), so their latency
  hides under the next stage's wait and wgmma. A weight tile of 64 or 128 rows lies inside
  one 128-row block of scale_b.
"""

import tilelang.language as T

from ..gemm.gemm import k_tiles_per_split
from ..gemm.weight_stream import weight_stream_body
from .gemm_fp8 import (
    FP8,
    ROWS,
    SCALE_BLOCK,
    add_scaled_raw,
    load_block_scales,
    scale_shapes,
)


def tensor_scale(scale_a, scale_b, row, token):
    return scale_a[0] * scale_b[0]


def row_scale(scale_a, scale_b, row, token):
    return scale_a[token] * scale_b[row]


def block_scaled_loop(m, k: int, block_m: int, block_n: int, block_k: int, stages: int,
                      steps: int, m_major: bool):
    """The K loop of block scaling: each 128-deep block of a stage by wgmma into a fresh
    fragment, promoted with the scales loaded during the block before."""
    k_blocks = k // SCALE_BLOCK
    sub = block_k // SCALE_BLOCK  # a 256-deep stage is two TMA boxes, promoted by halves

    @T.macro
    def main_loop(a, b, scale_a, scale_b, w_shared, x_shared, acc, tn, k0):
        part = T.alloc_fragment((block_n, block_m), "float")
        sa = T.alloc_fragment((block_m,), "float")  # this block's raw scale_a, by token
        sb = T.alloc_local((1,), "float")
        row_block = tn * block_n // SCALE_BLOCK
        first = T.min(k0 * sub, k_blocks - 1)
        load_block_scales(sa, sb, block_m, scale_a, m_major, first, 0, m - 1,
                          scale_b[row_block, first])
        for ko in T.Pipelined(steps, num_stages=stages):
            kt = k0 + ko
            T.copy(b[tn * block_n, kt * block_k], w_shared)
            T.copy(a[0, kt * block_k], x_shared)
            for h in T.unroll(sub):
                # the halves sliced here: a macro argument would drop the slice; K blocks
                # past K (a last split's) load zeros and read clamped, finite scales
                T.gemm(w_shared[:, h * SCALE_BLOCK:(h + 1) * SCALE_BLOCK],
                       x_shared[:, h * SCALE_BLOCK:(h + 1) * SCALE_BLOCK], part,
                       transpose_B=True, clear_accum=True, policy=ROWS)
                add_scaled_raw(part, acc, sa, sb, block_n, block_m, True)
                following = T.min(kt * sub + h + 1, k_blocks - 1)
                load_block_scales(sa, sb, block_m, scale_a, m_major, following, 0, m - 1,
                                  scale_b[row_block, following])
    return main_loop


def weight_stream_fp8_program(n: int, k: int, scaling: str, out_dtype: str, has_bias: bool,
                              block_m: int, block_n: int, block_k: int, stages: int,
                              split_k: int, scale_a_m_major: bool = True):
    """(a, b, scale_a, scale_b[, bias], d) for a [M, K] (M <= block_m) e4m3, b [N, K] e4m3,
    the scales in gemm_fp8's kernel layouts; d [M, N] in out_dtype."""
    m = T.dynamic("m")
    main_loop, scale = None, {"tensor": tensor_scale, "row": row_scale}.get(scaling)
    if scaling == "block":  # promoted in the loop, not scaled on the way out
        assert k % SCALE_BLOCK == 0 and block_k % SCALE_BLOCK == 0
        assert SCALE_BLOCK % block_n == 0  # a weight tile inside one block of scale_b
        main_loop = block_scaled_loop(m, k, block_m, block_n, block_k, stages,
                                      k_tiles_per_split(k, block_k, split_k), scale_a_m_major)
    body = weight_stream_body(m, n, k, FP8, out_dtype, block_m, block_n, block_k, stages,
                              split_k, main_loop, scale)
    sa_shape, sb_shape = scale_shapes(m, n, k, scaling, scale_a_m_major)

    # Each parameter its own annotation object (a shared one would alias the buffers).
    if has_bias:
        @T.prim_func
        def gemm_fp8_weight_rows_bias(
                a: T.Tensor((m, k), FP8), b: T.Tensor((n, k), FP8),
                scale_a: T.Tensor(sa_shape, "float"), scale_b: T.Tensor(sb_shape, "float"),
                bias: T.Tensor((n,), out_dtype), d: T.Tensor((m, n), out_dtype)):
            body(a, b, scale_a, scale_b, bias, d)
        return gemm_fp8_weight_rows_bias

    @T.prim_func
    def gemm_fp8_weight_rows(a: T.Tensor((m, k), FP8), b: T.Tensor((n, k), FP8),
                             scale_a: T.Tensor(sa_shape, "float"),
                             scale_b: T.Tensor(sb_shape, "float"),
                             d: T.Tensor((m, n), out_dtype)):
        body(a, b, scale_a, scale_b, None, d)
    return gemm_fp8_weight_rows
