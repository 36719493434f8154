"""fp8 (e4m3) GEMM on Hopper: d[M, N] = (a[M, K] @ b[N, K]^T) * scales (+ bias), fp32
accumulation, TMA loads, wgmma, warp-specialized pipeline, split-K for small M.

Scalings (torch._scaled_mm's, with b given as the [N, K] weight):
- "tensor": one scale each for a and b, applied in the epilogue;
- "row": a per row of a (scale_a[M]), b per row of b (scale_b[N]), in the epilogue;
- "block": DeepSeek-V3's: a in 1x128 groups, read M-major as scale_a[K/128, M]; b in 128x128
  blocks, scale_b[ceil(N/128), K/128]. Each 128-wide K tile is accumulated by wgmma into a
  fresh fragment, then promoted into the fp32 main accumulator multiplied by
  scale_a[m, kt] * scale_b[n // 128, kt] (so the fp32 sum never sees an unscaled block).

M (tokens) is symbolic and picks a bucket (the bf16 GEMM's buckets and split-K rule); N, K
are compiled in. With split-K each split writes scaled fp32 partials and the bf16 GEMM's
reduce kernel sums them (and adds the bias).
"""

from dataclasses import dataclass

import tilelang.language as T
import torch

from ..gemm.gemm import (
    NUM_SMS_H200,
    SMEM_LIMIT,
    GemmConfig,
    GemmKernel,
    k_tiles_per_split,
    split_k_reduce_program,
)

FP8 = "float8_e4m3fn"
SCALE_BLOCK = 128  # DeepSeek-V3's quantization block (1x128 for a, 128x128 for b)
SCALINGS = ("tensor", "row", "block")
SMEM_PER_SM = 228 * 1024  # the per-SM pool that ctas_per_sm CTAs share
# Two CTAs of one consumer warpgroup an SM: producer 24 + consumer 224 registers a thread,
# x 128 threads each, x 2 CTAs = 63488 of the 64K register file.
PRODUCER_REGS_2, CONSUMER_REGS_2 = 24, 224
# Warpgroups split the tile by rows: each issues m64 x block_n wgmmas (the widest), and a
# thread's rows, hence its per-row scales, are few.
ROWS = T.GemmWarpPolicy.FullRow


# -- block scaling, shared with the grouped fp8 GEMM (grouped_gemm_fp8.py) -----------------
def a_scale_at(scale_a, m_major: bool, kb, row):
    """scale_a of `row` in K block `kb`: stored [K/128, M] (M-major) or [M, K/128]."""
    return scale_a[kb, row] if m_major else scale_a[row, kb]


@T.macro
def load_block_factors(factor, block_m: int, scale_a, m_major: bool, kb, row0, last_row,
                       b_scale):
    """factor[i] = scale_a[row0 + i, kb] * b_scale: one K tile's row factors (rows past
    `last_row` read its scale: they are computed, never stored, and stay finite). Loaded
    before the tile's wgmma so their latency hides under it."""
    for i in T.Parallel(block_m):
        factor[i] = a_scale_at(scale_a, m_major, kb, T.min(row0 + i, last_row)) * b_scale


@T.macro
def promote_block(a_shared, b_shared, part, acc, factor, block_m: int, block_n: int):
    """One 128-deep K tile by wgmma into a fresh fragment, promoted into the fp32
    accumulator times its row factors (the fp32 sum never sees an unscaled block)."""
    T.gemm(a_shared, b_shared, part, transpose_B=True, clear_accum=True, policy=ROWS)
    for i, j in T.Parallel(block_m, block_n):
        acc[i, j] += part[i, j] * factor[i]


@T.macro
def load_block_scales(sa, sb, block_m: int, scale_a, m_major: bool, kb, row0, last_row,
                      b_scale):
    """The raw scales of one K tile, not yet multiplied: sa[i] = scale_a[row0 + i, kb],
    sb[0] = b_scale (the prefetching promotion's: a product here would wait for the loads
    at once; unused until the next tile's promotion, they arrive under its wgmma)."""
    for i in T.Parallel(block_m):
        sa[i] = a_scale_at(scale_a, m_major, kb, T.min(row0 + i, last_row))
    sb[0] = b_scale


@T.macro
def add_scaled(part, acc, factor, block_m: int, block_n: int):
    """acc += part * factor[row]: the promotion of one 128-deep K block."""
    for i, j in T.Parallel(block_m, block_n):
        acc[i, j] += part[i, j] * factor[i]


@T.macro
def add_scaled_raw(part, acc, sa, sb, block_m: int, block_n: int, by_column: bool = False):
    """add_scaled with the factors as raw scale pairs (sa[i] * sb[0]); `by_column`: the
    tile is transposed, a's rows on its columns (sa[j] * sb[0])."""
    for i, j in T.Parallel(block_m, block_n):
        if by_column:
            acc[i, j] += part[i, j] * (sa[j] * sb[0])
        else:
            acc[i, j] += part[i, j] * (sa[i] * sb[0])


def scale_shapes(m, n: int, k: int, scaling: str, m_major: bool) -> tuple[tuple, tuple]:
    """The kernel's scale_a and scale_b shapes: one each ("tensor"), scale_a[M] and
    scale_b[N] ("row"), scale_a[K/128, M] (M-major) or [M, K/128] and scale_b[N/128, K/128]
    ("block")."""
    k_blocks, n_blocks = k // SCALE_BLOCK, -(-n // SCALE_BLOCK)
    sa_block = (k_blocks, m) if m_major else (m, k_blocks)
    return ({"tensor": (1,), "row": (m,), "block": sa_block}[scaling],
            {"tensor": (1,), "row": (n,), "block": (n_blocks, k_blocks)}[scaling])


@T.macro
def promote_block_prefetched(a_shared, b_shared, part, acc, sa, sb, block_m: int,
                             block_n: int, scale_a, m_major: bool, kb_next, row0, last_row,
                             b_scale_next):
    """promote_block with the scales one K block ahead: this block's raw scales (sa, sb)
    loaded during the previous block, the next block's (kb_next) loaded after this
    promotion, so their latency hides under the next block's wgmma."""
    T.gemm(a_shared, b_shared, part, transpose_B=True, clear_accum=True, policy=ROWS)
    add_scaled_raw(part, acc, sa, sb, block_m, block_n)
    load_block_scales(sa, sb, block_m, scale_a, m_major, kb_next, row0, last_row,
                      b_scale_next)


@dataclass(frozen=True)
class Fp8GemmConfig(GemmConfig):
    block_k: int = 128
    # Block scaling: load tile k+1's scales while tile k's wgmma runs (the plain promotion
    # multiplies them before its barrier wait, so every K tile waits one global load).
    prefetch_scales: bool = False
    # CTAs an SM holds (__launch_bounds__(threads + 128, n), registers split to fit): with 2,
    # one CTA's pipeline fill and epilogue run under the other's stream. Shared memory
    # must fit n times.
    ctas_per_sm: int = 1
    # split-K: the reduce program one output row a CTA with every split's load in flight
    # (the shared reduce, 4 rows a CTA, waits one L2 round trip per split)
    reduce_unrolled: bool = False

    def smem_bytes(self, elem_bytes: int = 1) -> int:
        if self.weight_rows:
            return super().smem_bytes(elem_bytes)
        pipeline = self.stages * (self.block_m + self.block_n) * self.block_k * elem_bytes
        out_bytes = 4 if self.split_k > 1 else 2
        return pipeline + (self.block_m * self.block_n * out_bytes if self.stage_out else 0)

    def valid(self) -> bool:
        if self.weight_rows:  # weight_stream_fp8.py: K tiles of whole 128-byte TMA boxes
            return (super().valid() and self.block_k in (128, 256) and not self.prefetch_scales
                    and self.ctas_per_sm == 1 and not self.reduce_unrolled)
        warps = self.threads // 32
        fits = self.smem_bytes() <= SMEM_LIMIT
        if self.ctas_per_sm != 1:
            # two CTAs of one consumer warpgroup (the register split above); the planner
            # lays the output staging tile over the pipeline (GemmConfig.smem_bytes)
            pipeline = self.stages * (self.block_m + self.block_n) * self.block_k
            out = self.block_m * self.block_n * (4 if self.split_k > 1 else 2)
            fits = (self.ctas_per_sm == 2 and self.threads == 128
                    and max(pipeline, out if self.stage_out else 0) <= SMEM_PER_SM // 2 - 1024)
        return (fits and warps % 4 == 0 and self.block_m >= 64 and not self.wave_fill
                and self.block_m % (16 * min(warps, self.block_m // 16)) == 0
                and self.block_n % 64 == 0 and self.block_k % 32 == 0)


def gemm_fp8_program(n: int, k: int, scaling: str, out_dtype: str, has_bias: bool,
                     block_m: int, block_n: int, block_k: int, stages: int, threads: int,
                     split_k: int, raster: int, stage_out: bool, scale_a_m_major: bool = True,
                     prefetch_scales: bool = False, ctas_per_sm: int = 1):
    """The main program: (a, b, scale_a, scale_b[, bias], d); with split_k > 1 d is the fp32
    partials [split_k, M, N] (scaled; the reduce adds the bias). Block scaling reads scale_a
    as [K/128, M] (M-major: a warp's rows are adjacent) or, without `scale_a_m_major`, as the
    row-major [M, K/128]."""
    m = T.dynamic("m")
    block = scaling == "block"
    if block:
        assert block_k % SCALE_BLOCK == 0 and block_n == SCALE_BLOCK and k % SCALE_BLOCK == 0
    # 128-deep K blocks a tile: a 256-deep tile (two TMA boxes of 128 bytes a row, adjacent in
    # the weight) is promoted block by block from its two halves in shared memory
    sub = block_k // SCALE_BLOCK if block else 1
    prefetch = block and prefetch_scales
    tiles = k_tiles_per_split(k, block_k, split_k)
    k_blocks = k // SCALE_BLOCK
    n_blocks = -(-n // SCALE_BLOCK)
    sa_shape, sb_shape = scale_shapes(m, n, k, scaling, scale_a_m_major)
    acc_dtype = "float"
    d_dtype = "float" if split_k > 1 else out_dtype
    d_shape = (split_k, m, n) if split_k > 1 else (m, n)
    epilogue_bias = has_bias and split_k == 1

    def row_of(by, i):  # rows and columns past the edges read valid entries, never stored
        return T.min(by * block_m + i, m - 1)

    def col_of(bx, j):
        return T.min(bx * block_n + j, n - 1)

    @T.macro
    def body(a, b, scale_a, scale_b, bias, d):
        with T.Kernel(T.ceildiv(n, block_n), T.ceildiv(m, block_m), split_k,
                      threads=threads) as (bx, by, bz):
            a_shared = T.alloc_shared((block_m, block_k), FP8)
            b_shared = T.alloc_shared((block_n, block_k), FP8)
            acc = T.alloc_fragment((block_m, block_n), acc_dtype)
            if block:
                part = T.alloc_fragment((block_m, block_n), acc_dtype)
                factor = T.alloc_fragment((block_m,), acc_dtype)
            if prefetch:
                sb = T.alloc_local((1,), acc_dtype)
            if stage_out:
                d_shared = T.alloc_shared((block_m, block_n), d_dtype)
            if ctas_per_sm > 1:
                T.annotate_min_blocks_per_sm(ctas_per_sm)
                T.annotate_producer_reg_dealloc(PRODUCER_REGS_2)
                T.annotate_consumer_reg_alloc(CONSUMER_REGS_2)
            if raster > 0:
                T.use_swizzle(raster)
            T.clear(acc)
            if prefetch:  # the first tile's scales (factor holds raw scale_a values)
                kb0 = T.min(bz * tiles * sub if sub > 1 else bz * tiles, k_blocks - 1)
                load_block_scales(factor, sb, block_m, scale_a, scale_a_m_major, kb0,
                                  by * block_m, m - 1, scale_b[T.min(bx, n_blocks - 1), kb0])
            for ko in T.Pipelined(tiles, num_stages=stages):
                kt = bz * tiles + ko
                T.copy(a[by * block_m, kt * block_k], a_shared)
                T.copy(b[bx * block_n, kt * block_k], b_shared)
                if sub > 1:
                    for h in T.serial(sub):
                        g = kt * sub + h  # the K block (past K: zeros, clamped scales)
                        # the halves sliced here: a macro argument would drop the slice
                        T.gemm(a_shared[:, h * SCALE_BLOCK:(h + 1) * SCALE_BLOCK],
                               b_shared[:, h * SCALE_BLOCK:(h + 1) * SCALE_BLOCK], part,
                               transpose_B=True, clear_accum=True, policy=ROWS)
                        if prefetch:
                            add_scaled_raw(part, acc, factor, sb, block_m, block_n)
                            kn = T.min(g + 1, k_blocks - 1)
                            load_block_scales(factor, sb, block_m, scale_a, scale_a_m_major,
                                              kn, by * block_m, m - 1,
                                              scale_b[T.min(bx, n_blocks - 1), kn])
                        else:
                            kb = T.min(g, k_blocks - 1)
                            load_block_factors(factor, block_m, scale_a, scale_a_m_major, kb,
                                               by * block_m, m - 1,
                                               scale_b[T.min(bx, n_blocks - 1), kb])
                            add_scaled(part, acc, factor, block_m, block_n)
                elif prefetch:  # the next tile's scales (clamped past K)
                    promote_block_prefetched(
                        a_shared, b_shared, part, acc, factor, sb, block_m, block_n, scale_a,
                        scale_a_m_major, T.min(kt + 1, k_blocks - 1), by * block_m, m - 1,
                        scale_b[T.min(bx, n_blocks - 1), T.min(kt + 1, k_blocks - 1)])
                elif block:
                    # the tile's columns share one 128-wide b block; a last split may run
                    # past K: its tiles load as zeros, and the clamped scale index keeps
                    # the factor a finite number
                    kb = T.min(kt, k_blocks - 1)
                    load_block_factors(factor, block_m, scale_a, scale_a_m_major, kb,
                                       by * block_m, m - 1,
                                       scale_b[T.min(bx, n_blocks - 1), kb])
                    promote_block(a_shared, b_shared, part, acc, factor, block_m, block_n)
                else:
                    T.gemm(a_shared, b_shared, acc, transpose_B=True, policy=ROWS)
            if scaling == "tensor":
                for i, j in T.Parallel(block_m, block_n):
                    acc[i, j] *= scale_a[0] * scale_b[0]
            elif scaling == "row":
                for i, j in T.Parallel(block_m, block_n):
                    acc[i, j] *= scale_a[row_of(by, i)] * scale_b[col_of(bx, j)]
            if epilogue_bias:
                for i, j in T.Parallel(block_m, block_n):
                    acc[i, j] += T.cast(bias[col_of(bx, j)], acc_dtype)
            out = d[bz, by * block_m, bx * block_n] if split_k > 1 else d[
                by * block_m, bx * block_n]
            if stage_out:
                T.copy(acc, d_shared)
                T.copy(d_shared, out)
            else:
                T.copy(acc, out)

    # Each parameter its own annotation object (a shared one would alias the buffers).
    if epilogue_bias:
        @T.prim_func
        def gemm_fp8_bias(a: T.Tensor((m, k), FP8), b: T.Tensor((n, k), FP8),
                          scale_a: T.Tensor(sa_shape, "float"),
                          scale_b: T.Tensor(sb_shape, "float"),
                          bias: T.Tensor((n,), out_dtype), d: T.Tensor(d_shape, d_dtype)):
            body(a, b, scale_a, scale_b, bias, d)
        return gemm_fp8_bias

    @T.prim_func
    def gemm_fp8(a: T.Tensor((m, k), FP8), b: T.Tensor((n, k), FP8),
                 scale_a: T.Tensor(sa_shape, "float"), scale_b: T.Tensor(sb_shape, "float"),
                 d: T.Tensor(d_shape, d_dtype)):
        body(a, b, scale_a, scale_b, None, d)
    return gemm_fp8


class Fp8GemmKernel(GemmKernel):
    """key: n, k, scaling, out_dtype, has_bias, scale_a_m_major. Buckets and the split-K
    rule are the bf16 GEMM's (on M). Launch with (a, b, scale_a, scale_b[, bias], d)."""

    name = "gemm_fp8"
    Config = Fp8GemmConfig
    # The buckets before the bf16 GEMM's went to 16K rows (its cost model is bf16's).
    m_buckets = (16, 32, 64, 128, 256, 512, 1024)
    large_rows = 4096
    weight_stream_stages = 16  # an e4m3 stage is half a 16-bit one's bytes

    def program(self, config: Fp8GemmConfig, bucket: str):
        key = self.key
        if config.weight_rows:
            self._check_token_tile(config, bucket)
            from .weight_stream_fp8 import weight_stream_fp8_program

            return (weight_stream_fp8_program(
                key["n"], key["k"], key["scaling"], key["out_dtype"], key["has_bias"],
                config.block_m, config.block_n, config.block_k, config.stages, config.split_k,
                key["scale_a_m_major"]),)
        main = gemm_fp8_program(key["n"], key["k"], key["scaling"], key["out_dtype"],
                                key["has_bias"], config.block_m, config.block_n,
                                config.block_k, config.stages, config.threads, config.split_k,
                                config.raster, config.stage_out, key["scale_a_m_major"],
                                config.prefetch_scales, config.ctas_per_sm)
        if config.split_k == 1:
            return main
        rows = {"block_m": 1, "unroll_splits": True} if config.reduce_unrolled else {}
        return main, split_k_reduce_program(key["n"], config.split_k, key["out_dtype"],
                                            has_bias=key["has_bias"], **rows)

    def run(self, config: Fp8GemmConfig, compiled: tuple, a, b, scale_a, scale_b,
            *rest) -> None:
        *bias, d = rest  # (d) or (bias, d)
        if config.split_k == 1 or config.weight_rows:  # (weight_rows reduces in its cluster)
            compiled[0](a, b, scale_a, scale_b, *bias, d)
            return
        partial = d.new_empty((config.split_k, d.shape[0], d.shape[1]), dtype=torch.float32)
        compiled[0](a, b, scale_a, scale_b, partial)
        compiled[1](partial, *bias, d)

    def _splittable(self) -> bool:
        return True

    def _streams_weight(self) -> bool:
        """The weight-streaming form (weight_stream_fp8.py) serves every key: a and b are
        [M, K] and [N, K] with K a multiple of 16 (the op's check, TMA's rows)."""
        return self.key["k"] % 16 == 0

    def split_for(self, m: int, block_m: int, block_n: int, block_k: int,
                  ctas_per_sm: int = 1) -> int:
        """Decode sizes (M <= 64) stream the weight once: the K split whose grid fills the
        SMs' waves best (a wave is ctas_per_sm CTAs an SM), discounted by the fp32 partials
        it adds (written and read back: 8 x split x M / K of the weight's bytes; at M = 64
        over K = 25600, 13 splits moved 26% more bytes than the weight and ran 1.29x slower
        than 3, measured), each split keeping >= 4 K tiles, none of them wholly past K.
        Larger M: the bf16 GEMM's rule."""
        if m > 64:
            return super().split_for(m, block_m, block_n, block_k)
        ctas = -(-self.key["n"] // block_n) * -(-m // block_m)
        k_tiles = -(-self.key["k"] // block_k)
        slots = NUM_SMS_H200 * ctas_per_sm
        best, best_score = 1, 0.0
        for split in range(1, 17):
            if k_tiles // split < 4:
                break
            per_split = -(-k_tiles // split)
            if -(-k_tiles // per_split) < split:
                continue  # fewer splits cover K at this size: the last would be past K
            fill = ctas * split / (-(-ctas * split // slots) * slots)
            score = fill / (1 + 8 * split * m / self.key["k"])
            if score > best_score + 0.02:  # a larger split only for a clearly better grid
                best, best_score = split, score
        return best

    def heuristic_config(self, bucket: str, arch: str) -> Fp8GemmConfig:
        rows = self.bucket_rows(bucket)
        block = self.key["scaling"] == "block"
        stream = self.weight_stream_default(rows)
        if stream is not None:
            return stream
        if rows <= 64:
            # block scaling loads the next tile's scales under this one's promotion, and
            # the split-K reduce keeps every split's load in flight (measured: 1.04-1.24x on
            # DeepSeek-V3 and Qwen3-32B decode rows, neutral on per-tensor)
            cfg = dict(block_m=64, block_n=128, block_k=128, stages=6, threads=128)
            split = self.split_for(rows, 64, 128, 128)
            return Fp8GemmConfig(**cfg, split_k=split, prefetch_scales=block,
                                 reduce_unrolled=split > 1)
        elif rows <= 256 or block:
            # block scaling holds two fp32 accumulators: 128x128 is what fits the registers
            cfg = dict(block_m=128, block_n=128, block_k=128, stages=5, threads=256)
        else:
            cfg = dict(block_m=128, block_n=256, block_k=128, stages=3, threads=256)
        split = self.split_for(rows, cfg["block_m"], cfg["block_n"], cfg["block_k"])
        return Fp8GemmConfig(**cfg, split_k=split)

    def weight_stream_default(self, rows: int) -> Fp8GemmConfig | None:
        """Up to 16 rows where the weight's 64-row tiles alone fill >= 80% of the SMs: the
        weight-streaming form (weight_stream_fp8.py), 64 x 256 tiles, the most stages that
        fit, no split. Measured on an H100 (2026-12-06, against the 64-row split-K tile):
        1.10x on DeepSeek-V3's b1 down_proj (112 tiles), 1.10x on Llama-3.1-70B's b1
        o_proj and 1.04x on its b16 down_proj (128 tiles); where the tiles are few the
        split-K cluster lost (b32 q_a_proj, 24 tiles: 0.77x at 4 splits, 0.38x at 8), and at
        64 tokens the one consumer warpgroup did (Qwen3-32B b64 down_proj: 0.55-0.73x)."""
        from ..gemm import weight_stream as ws

        tiles = -(-self.key["n"] // 64)
        if rows > ws.ROWS or tiles < 0.8 * NUM_SMS_H200 or not self._streams_weight():
            return None
        return ws.deepest(ws.ROWS, 64, 256, 1, Fp8GemmConfig, self.weight_stream_stages)

    def config_space(self, bucket: str) -> list[Fp8GemmConfig]:
        rows = self.bucket_rows(bucket)
        block = self.key["scaling"] == "block"
        space = [self.heuristic_config(bucket, "sm_90a")]
        if rows <= 64:
            space += self.decode_variants(rows) + self.weight_stream_space(bucket)
        if rows <= 128:
            block_m, threads = (64, 128) if rows <= 64 else (128, 256)
            for bn in (128,) if block else (64, 128, 256):  # block: one b block a tile
                for st in (4, 6, 8):
                    split = self.split_for(rows, block_m, bn, 128)
                    for s in sorted({1, split, max(1, split // 2), split * 2}):
                        space.append(Fp8GemmConfig(block_m, bn, 128, st, threads, s, 0))
        else:
            shapes = ((128, 128, 5), (128, 128, 6)) if block else (
                (128, 256, 3), (256, 128, 3), (128, 128, 5))
            for bm, bn, st in shapes:
                for raster in (0, 8, 16):
                    space.append(Fp8GemmConfig(bm, bn, 128, st, 256, 1, raster))
                space.append(Fp8GemmConfig(bm, bn, 128, st + 1, 256, 1, 8, stage_out=False))
        return [c for c in dict.fromkeys(space) if c.valid()]

    def decode_variants(self, rows: int) -> list[Fp8GemmConfig]:
        """The decode (M <= 64) programs beside the default: block scaling's scales
        prefetched a tile ahead, two CTAs an SM (4 stages each, the split filling 264
        slots), a 256-deep K tile (256 contiguous bytes of each weight row a stage, block
        scaling promoting its two 128-deep halves); each split-K one with the unrolled
        reduce."""
        block = self.key["scaling"] == "block"

        def variant(block_k: int, stages: int, ctas_per_sm: int) -> Fp8GemmConfig:
            split = self.split_for(rows, 64, 128, block_k, ctas_per_sm)
            return Fp8GemmConfig(64, 128, block_k, stages, 128, split, 0,
                                 prefetch_scales=block, ctas_per_sm=ctas_per_sm,
                                 reduce_unrolled=split > 1)

        return [variant(128, 6, 1), variant(128, 4, 2), variant(256, 3, 1)]
