"""Row normalization forward: RMSNorm and LayerNorm over the last dimension, optionally
after adding a residual (the pre-norm residual stream of a Llama-style layer).

    h = x (+ residual, rounded to the input dtype, which is also written out)
    y = (h - mean(h) if centered) * rsqrt(mean((h - mean)^2) + eps) (* w) (+ b)

Memory-bound: every CTA owns `block_rows` whole rows, held in registers between the row
sums and the scaling, so each input is read from HBM once and each output written once.
The row count is symbolic; the hidden size is compiled in (it decides the vector width and
the thread map). Math in fp32, cast at the store. The backward recomputes the row
statistics from h, so the forward saves nothing.

Two thread maps. The tile map (`RowTile`) lets TileLang lay a [block_rows, n] fragment over
the threads and reduce it with its all-reduce, which needs a power-of-two thread count: at
hidden sizes such as 2560, 5120, 6144, 7168 or 13824 that means many elements per thread
(40-64) or the padded scalar path. The lane map (`lanes`, the softmax family's `RowMap`)
gives each row any whole number of warps, each thread a fixed few 16-byte vectors of it
(2560 = 160 threads x 2 vectors of 8), and reduces by warp shuffles then shared memory.
"""

import dataclasses
from dataclasses import dataclass

import tilelang.language as T

from ..base import Kernel
from ..softmax.row_map import RowMap
from ..vectors import ELEM_BYTES, vector_width
from .rows import (
    SMS,
    RowTile,
    cta_moments,
    cta_sums,
    fused_sums_ok,
    lane_ring_macros,
    lane_row_macros,
    row_configs,
    vector_map_ok,
)

FEW_ROWS = 1024


@dataclass(frozen=True)
class NormConfig:
    """block_rows rows per CTA of `threads` threads. `lanes`: the lane map (threads //
    block_rows threads per row, any whole number of warps) instead of the tile map."""

    block_rows: int = 1
    threads: int = 256
    lanes: bool = False
    ctas_per_sm: int = 0  # lane map: a launch bound for that many resident CTAs (0: none)
    # the weight and bias loaded with the rows (in flight during the row sums) instead of
    # read after them; lane map: ~8 more registers (7 instead of 8 CTAs an SM at 2560
    # columns); tile map: a fragment of a thread's columns, shared by its rows
    prefetch: bool = False
    # lane map: a persistent grid of at most `ctas` CTAs (0: a CTA per group of block_rows
    # rows), each loading its next group's rows while it normalizes the current ones
    ctas: int = 0
    # persistent lane map: the next stages - 1 groups' rows in flight into a shared ring
    # (each thread's own vectors by cp.async) instead of the next one in registers
    stages: int = 0
    # tile map: a row's sums by warp shuffles and one barrier (`cta_sums`; LayerNorm's
    # mean and variance as merged moments, `cta_moments`) instead of TileLang's all-reduce
    # (two barriers per level above a warp); needs every thread to hold a share of every
    # row of the CTA. Lane map (LayerNorm only): the merged moments in one exchange.
    fused_sums: bool = False


def lanes_ok(n: int, dtype: str, block_rows: int, threads: int) -> bool:
    """Whether the lane map splits a [block_rows, n] tile exactly: 16-byte vectors, whole
    rows per thread group, the same number of vectors per thread, whole warps (or a power
    of two below a warp) per row."""
    vec = vector_width(n, dtype)
    if vec * ELEM_BYTES[dtype] < 16 or threads % block_rows or threads > 1024:
        return False
    row_threads = threads // block_rows
    if row_threads % 32 if row_threads >= 32 else row_threads & (row_threads - 1):
        return False
    return (n // vec) % row_threads == 0


def lane_configs(n: int, dtype: str, elems_per_thread: tuple[int, int]) -> list[NormConfig]:
    """Lane-map configs whose threads hold a number of elements within `elems_per_thread`:
    one row per CTA, or rows of fewer than 128 threads stacked up to 256 (whole warps, at
    least two)."""
    lo, hi = elems_per_thread
    vec = vector_width(n, dtype)
    found = []
    for vecs in range(max(1, lo // vec), hi // vec + 1):
        if n % (vec * vecs):
            continue
        row_threads = n // vec // vecs
        for block_rows in (1, 2, 4, 8, 16):
            threads = block_rows * row_threads
            if lanes_ok(n, dtype, block_rows, threads) and threads % 32 == 0 \
                    and threads >= 64 and (block_rows == 1 or
                                           (row_threads < 128 and threads <= 256)):
                found.append(NormConfig(block_rows, threads, lanes=True))
    return found


def default_lanes(n: int, dtype: str) -> NormConfig | None:
    """The lane map with three, four or five 16-byte vectors a thread (then two, one, six),
    one row per CTA of at most 576 threads, or None where no such split exists. On the H200
    (bf16) three vectors beat two by 17% at 6144 columns (256 threads: 52.2 us, 384: 61.0),
    five beat one by 14% at 1280 (ViT-H, 2026-12-04: four rows of 32 threads 21.8 us, one
    of 160 25.3) and were level with two at 2560 (23.0-23.4 us): more bytes in flight a
    thread, while small shares still leave registers for several rows per SM. ~55
    registers a thread: 576 threads still fit two CTAs per SM (13824 columns), 864 would fit
    one. A short row (8 threads or more) shares its CTA with others, up to ~128
    threads; shorter rows keep the tile map."""
    vec = vector_width(n, dtype)
    if vec * ELEM_BYTES[dtype] < 16 or n % vec:
        return None
    for vecs in (3, 4, 5, 2, 1, 6):
        if (n // vec) % vecs:
            continue
        row_threads = n // vec // vecs
        block_rows = max(1, 128 // row_threads)
        if 8 <= row_threads <= 576 and lanes_ok(n, dtype, block_rows,
                                                block_rows * row_threads):
            return NormConfig(block_rows, block_rows * row_threads, lanes=True)
    return None


def norm_fwd_program(n: int, dtype: str, centered: bool, has_weight: bool, has_bias: bool,
                     has_residual: bool, block_rows: int, threads: int, lanes: bool = False,
                     ctas_per_sm: int = 0, prefetch: bool = False, fused_sums: bool = False,
                     ctas: int = 0, stages: int = 0):
    rows = T.dynamic("rows")
    if ctas and not lanes:
        raise ValueError(f"a persistent grid (ctas={ctas}) needs the lane map")
    if stages and (not ctas or stages < 2):
        raise ValueError(f"a shared ring (stages={stages}) needs the persistent lane map "
                         f"(ctas={ctas}) and 2 or more stages")
    if fused_sums and lanes and not centered:
        raise ValueError("fused_sums on the lane map merges LayerNorm's mean and variance "
                         "into one exchange; an uncentered norm has one sum")
    if fused_sums and not lanes and not fused_sums_ok(n, block_rows, threads):
        raise ValueError(f"fused_sums needs the tile map with every thread holding a share "
                         f"of every row (n={n}, block_rows={block_rows}, threads={threads}, "
                         f"lanes={lanes})")
    if lanes:
        body = _lanes_body(rows, n, dtype, centered, has_weight, has_bias, has_residual,
                           block_rows, threads, ctas_per_sm, prefetch, ctas, fused_sums,
                           stages)
    else:
        body = _tile_body(rows, n, dtype, centered, has_weight, has_bias, has_residual,
                          block_rows, threads, fused_sums, prefetch)
    return _signature(body, rows, n, dtype, has_weight, has_bias, has_residual)


def _tile_body(rows, n: int, dtype: str, centered: bool, has_weight: bool, has_bias: bool,
               has_residual: bool, block_rows: int, threads: int, fused_sums: bool,
               prefetch: bool = False):
    tile = RowTile(n, block_rows, threads)
    load, store = tile.macros(rows)
    n_tile = tile.n_tile
    f32 = "float"

    def value(x_local, mean_local, i, j):  # h in fp32, centered for LayerNorm
        h = T.cast(x_local[i, j], f32)
        return h - mean_local[i] if centered else h

    def scaled(x_local, mean_local, rstd_local, w, b, i, j):  # y in the output dtype
        col = T.min(j, n - 1)  # padded columns read a valid weight, never stored
        v = value(x_local, mean_local, i, j) * rstd_local[i]
        if has_weight:
            v = v * T.cast(w[j] if prefetch else w[col], f32)
        if has_bias:
            v = v + T.cast(b[j] if prefetch else b[col], f32)
        return T.cast(v, dtype)

    @T.macro
    def load_params(w, b, w_tile, b_tile):
        """`prefetch`: the weight and bias into register fragments of a row's columns (each
        thread's columns of the tile, shared by its rows), issued with the rows' loads so
        that their latency overlaps the rows' (else each is read from L2 after the row
        sums: one more round trip on every CTA's path, from HBM on a decode step)."""
        for j in T.Parallel(n_tile):
            if has_weight:
                w_tile[j] = w[T.min(j, n - 1)]
            if has_bias:
                b_tile[j] = b[T.min(j, n - 1)]

    @T.macro
    def tile_stats(x_local, sq_local, mean_local, rstd_local, eps):
        """mean_local / rstd_local [block_rows] <- each row's mean and rsqrt(var + eps) by
        TileLang's all-reduce over the fp32 tile sq_local."""
        if centered:
            for i, j in T.Parallel(block_rows, n_tile):
                sq_local[i, j] = T.cast(x_local[i, j], f32)
            T.reduce_sum(sq_local, mean_local, dim=1)
            for i in T.Parallel(block_rows):
                mean_local[i] = mean_local[i] / n
        for i, j in T.Parallel(block_rows, n_tile):
            # centered padding is -mean: it must stay out of the variance
            sq_local[i, j] = T.if_then_else(
                j < n, value(x_local, mean_local, i, j) * value(x_local, mean_local, i, j),
                0.0)
        T.reduce_sum(sq_local, rstd_local, dim=1)
        for i in T.Parallel(block_rows):
            rstd_local[i] = T.rsqrt(rstd_local[i] / n + eps)

    @T.macro
    def fused_stats(x_local, mean_local, rstd_local, cnt_local, red, eps):
        """The same statistics in per-thread registers: RMSNorm's sum of squares by
        `cta_sums`; LayerNorm's mean and squared deviations about it per thread (two
        passes over its registers), merged across the CTA by `cta_moments`: one barrier
        either way."""
        for r in T.unroll(block_rows):
            rstd_local[r] = 0.0
            if centered:
                mean_local[r] = 0.0
                cnt_local[r] = 0.0
                for j in T.Parallel(n_tile):  # the padding reads as zero, counts nothing
                    mean_local[r] = mean_local[r] + T.cast(x_local[r, j], f32)
                    cnt_local[r] = cnt_local[r] + T.if_then_else(j < n, 1.0, 0.0)
                mean_local[r] = mean_local[r] / T.max(cnt_local[r], 1.0)
            for j in T.Parallel(n_tile):
                c = T.if_then_else(j < n, value(x_local, mean_local, r, j), 0.0)
                rstd_local[r] = rstd_local[r] + c * c
        if centered:
            cta_moments(cnt_local, mean_local, rstd_local, red, block_rows, threads)
        else:
            cta_sums(rstd_local, red, block_rows, threads)
        for r in T.unroll(block_rows):
            rstd_local[r] = T.rsqrt(rstd_local[r] / n + eps)

    @T.macro
    def body(x, residual, w, b, y, residual_out, eps):
        with T.Kernel(T.ceildiv(rows, block_rows), threads=threads) as bx:
            row0 = bx * block_rows
            x_local = T.alloc_fragment(tile.shape, dtype)
            if fused_sums:  # per-thread statistics
                mean_local = T.alloc_local((block_rows,), f32) if centered else None
                cnt_local = T.alloc_local((block_rows,), f32) if centered else None
                rstd_local = T.alloc_local((block_rows,), f32)
                warps = threads // 32
                red = T.alloc_shared((3, block_rows, warps) if centered else (block_rows, warps),
                                     f32)
            else:
                sq_local = T.alloc_fragment(tile.shape, f32)
                mean_local = T.alloc_fragment((block_rows,), f32) if centered else None
                rstd_local = T.alloc_fragment((block_rows,), f32)
            y_local = T.alloc_fragment(tile.shape, dtype)
            load(x, x_local, row0)
            if prefetch:
                w_tile = T.alloc_fragment((n_tile,), dtype) if has_weight else None
                b_tile = T.alloc_fragment((n_tile,), dtype) if has_bias else None
                load_params(w, b, w_tile, b_tile)
                w, b = w_tile, b_tile
            if has_residual:
                r_local = T.alloc_fragment(tile.shape, dtype)
                load(residual, r_local, row0)
                for i, j in T.Parallel(block_rows, n_tile):
                    x_local[i, j] = x_local[i, j] + r_local[i, j]  # rounded, as torch's add
                store(x_local, residual_out, row0)
            if fused_sums:
                fused_stats(x_local, mean_local, rstd_local, cnt_local, red, eps)
            else:
                tile_stats(x_local, sq_local, mean_local, rstd_local, eps)
            if fused_sums:  # per-thread statistics: a row at a time
                for i in T.unroll(block_rows):
                    for j in T.Parallel(n_tile):
                        y_local[i, j] = scaled(x_local, mean_local, rstd_local, w, b, i, j)
            else:
                for i, j in T.Parallel(block_rows, n_tile):
                    y_local[i, j] = scaled(x_local, mean_local, rstd_local, w, b, i, j)
            store(y_local, y, row0)

    return body


def _lanes_body(rows, n: int, dtype: str, centered: bool, has_weight: bool, has_bias: bool,
                has_residual: bool, block_rows: int, threads: int, ctas_per_sm: int,
                prefetch: bool, ctas: int, moments: bool = False, stages: int = 0):
    row_threads = threads // block_rows
    vec = vector_width(n, dtype)
    rm = RowMap(n, dtype, threads, row_threads, n // vec // row_threads, ctas=1)
    load, store, reduce_sum, _, _ = rm.macros(rows)
    vecs, warps = rm.vecs, max(rm.row_warps, 1)
    f32 = "float"
    groups = T.ceildiv(rows, block_rows)

    _, load_row, load_vector = lane_row_macros(row_threads, vec, vecs)
    ring_issue, ring_read = lane_ring_macros(row_threads, vec, vecs)

    def local():  # a thread's share of a row, in the input dtype (half fp32's registers)
        return T.alloc_local((vecs, vec), dtype)

    per_thread = vecs * vec
    shuffles = (min(row_threads, 32)).bit_length() - 1

    @T.macro
    def row_moments(mean, m2, other, red, r_mean, r_m2, lane):
        """mean[0] / m2[0] <- the row's mean and sum of squared deviations, from each
        thread's own over its `per_thread` elements: pairwise merges of equal counts
        (Chan et al.: the deviation of two means, never a difference of two large sums)
        by shuffles, then the warps' through rows r_mean / r_m2 of `red`: one barrier
        where a row spans warps, against two for the mean and then the squares."""
        for k in T.unroll(shuffles):
            other[0] = T.shfl_xor(mean[0], 1 << k)
            other[1] = T.shfl_xor(m2[0], 1 << k)
            d = other[0] - mean[0]  # both halves hold per_thread << k elements
            m2[0] = m2[0] + other[1] + d * d * T.cast(per_thread << k, f32) * 0.5
            mean[0] = (mean[0] + other[0]) * 0.5
        if warps > 1:
            if lane % 32 == 0:
                red[r_mean, lane // 32] = mean[0]
                red[r_m2, lane // 32] = m2[0]
            T.sync_threads()
            mean[0] = red[r_mean, 0]
            m2[0] = red[r_m2, 0]
            for w in T.unroll(warps - 1):  # w + 1 warps so far, one more: (w + 2) in all
                d = red[r_mean, w + 1] - mean[0]
                m2[0] = m2[0] + red[r_m2, w + 1] + d * d * T.cast(
                    per_thread * 32 * (w + 1), f32) / T.cast(w + 2, f32)
                mean[0] = mean[0] + d / T.cast(w + 2, f32)

    @T.macro
    def load_inputs(x, residual, h_local, r_local, row, lane):
        load_row(x, h_local, row, lane)
        if has_residual:
            load_row(residual, r_local, row, lane)

    @T.macro
    def load_params(w, b, w_local, b_local, lane):
        if has_weight:
            load_vector(w, w_local, lane)
        if has_bias:
            load_vector(b, b_local, lane)

    @T.macro
    def normalize(h_local, r_local, w, b, w_local, b_local, y, residual_out, total, mean,
                  other, red, base, row_in, row, r, lane, eps):
        """One row of the CTA's group: h (= x + residual, written out) normalized into y.
        Its two sums use rows base + [0, block_rows) (the mean) and base + [block_rows,
        2 block_rows) (the squares) of `red`: no barrier after the first one's reads."""
        if has_residual:
            for i in T.unroll(vecs):
                for j in T.unroll(vec):  # rounded, as torch's add
                    h_local[i, j] = T.cast(T.cast(h_local[i, j], f32)
                                           + T.cast(r_local[i, j], f32), dtype)
            if row_in < rows:
                store(h_local, residual_out, row, 0, lane)
        mean[0] = 0.0
        if centered:
            total[0] = 0.0
            for i in T.unroll(vecs):
                for j in T.unroll(vec):
                    total[0] = total[0] + T.cast(h_local[i, j], f32)
            if moments:  # the thread's own mean; the row's comes with the squares
                mean[0] = total[0] * (1.0 / per_thread)
            else:
                reduce_sum(total, red, base + r, lane)
                mean[0] = total[0] / n
        total[0] = 0.0
        for i in T.unroll(vecs):
            for j in T.unroll(vec):
                d = T.cast(h_local[i, j], f32) - mean[0]
                total[0] = total[0] + d * d
        if moments:
            row_moments(mean, total, other, red, base + r, base + block_rows + r, lane)
        else:
            reduce_sum(total, red, base + block_rows + r, lane)
        total[0] = T.rsqrt(total[0] / n + eps)
        if not (prefetch or ctas):  # from L2 after the sums: fewer registers live across them
            load_params(w, b, w_local, b_local, lane)
        for i in T.unroll(vecs):
            for j in T.unroll(vec):
                v = (T.cast(h_local[i, j], f32) - mean[0]) * total[0]
                if has_weight:
                    v = v * T.cast(w_local[i, j], f32)
                if has_bias:
                    v = v + T.cast(b_local[i, j], f32)
                h_local[i, j] = T.cast(v, dtype)
        if row_in < rows:
            store(h_local, y, row, 0, lane)

    @T.macro
    def ring_fill(x, residual, x_ring, r_ring, slot, g, r, lane):
        """Group g's rows (past the last: the last row) into the ring's `slot`, committed
        as one cp.async group."""
        row = T.min(g * block_rows + r, rows - 1)
        ring_issue(x, x_ring, slot, row, r, lane)
        if has_residual:
            ring_issue(residual, r_ring, slot, row, r, lane)
        T.ptx_commit_group()

    @T.macro
    def ring_walk(x, residual, w, b, y, residual_out, h_local, r_local, w_local, b_local,
                  total, mean, other, red, grid, bx, r, lane, eps):
        """The persistent walk with groups g + grid, ..., g + (stages - 1) grid in flight
        into a shared ring while group g is normalized (past the last group: the last
        row, unused)."""
        x_ring = T.alloc_shared((stages, block_rows, n), dtype)
        r_ring = T.alloc_shared((stages, block_rows, n), dtype) if has_residual else None

        for p in T.unroll(stages - 1):
            ring_fill(x, residual, x_ring, r_ring, p, bx + p * grid, r, lane)
        load_params(w, b, w_local, b_local, lane)
        for step in T.serial(T.ceildiv(groups - bx, grid)):
            g = bx + step * grid
            ring_fill(x, residual, x_ring, r_ring, (step + stages - 1) % stages,
                      g + (stages - 1) * grid, r, lane)
            T.ptx_wait_group(stages - 1)
            ring_read(x_ring, h_local, step % stages, r, lane)
            if has_residual:
                ring_read(r_ring, r_local, step % stages, r, lane)
            row_in = g * block_rows + r
            normalize(h_local, r_local, w, b, w_local, b_local, y, residual_out, total, mean,
                      other, red, (step % 2) * 2 * block_rows, row_in, T.min(row_in, rows - 1),
                      r, lane, eps)
        T.ptx_wait_group(0)

    @T.macro
    def register_walk(x, residual, w, b, y, residual_out, h_local, r_local, w_local, b_local,
                      total, mean, other, red, grid, bx, r, lane, eps):
        """The persistent walk with the next group's rows in flight in registers."""
        h_next = local()
        r_next = local() if has_residual else None
        load_inputs(x, residual, h_local, r_local, T.min(bx * block_rows + r, rows - 1), lane)
        load_params(w, b, w_local, b_local, lane)
        for step in T.serial(T.ceildiv(groups - bx, grid)):
            g = bx + step * grid
            load_inputs(x, residual, h_next, r_next,
                        T.min((g + grid) * block_rows + r, rows - 1), lane)
            row_in = g * block_rows + r
            normalize(h_local, r_local, w, b, w_local, b_local, y, residual_out,
                      total, mean, other, red, (step % 2) * 2 * block_rows, row_in,
                      T.min(row_in, rows - 1), r, lane, eps)
            for i in T.unroll(vecs):
                for j in T.unroll(vec):
                    h_local[i, j] = h_next[i, j]
                    if has_residual:
                        r_local[i, j] = r_next[i, j]

    @T.macro
    def body(x, residual, w, b, y, residual_out, eps):
        with T.Kernel(T.min(groups, ctas) if ctas else groups, threads=threads) as bx:
            if ctas_per_sm:
                T.annotate_min_blocks_per_sm(ctas_per_sm)
            tx = T.get_thread_binding()
            r, lane = tx // row_threads, tx % row_threads
            h_local, w_local, b_local = local(), local(), local()
            r_local = local() if has_residual else None
            total = T.alloc_local((1,), f32)
            mean = T.alloc_local((1,), f32)
            other = T.alloc_local((2,), f32) if moments else None  # a partner's moments
            # per row: the mean's partials, then the squares'; twice over when persistent
            # (consecutive groups alternate, so a group's writes never meet the reads of
            # the group before)
            red = T.alloc_shared(((4 if ctas else 2) * block_rows, warps), f32)
            if not ctas:
                row_in = bx * block_rows + r
                # a last CTA's spare rows re-read the last row, so that every thread meets
                # the barriers of the row sums; only their stores are skipped
                row = T.min(row_in, rows - 1)
                load_inputs(x, residual, h_local, r_local, row, lane)
                if prefetch:  # the weight and bias in flight during the row sums
                    load_params(w, b, w_local, b_local, lane)
                normalize(h_local, r_local, w, b, w_local, b_local, y, residual_out, total, mean,
                          other, red, 0, row_in, row, r, lane, eps)
            else:
                # persistent: groups bx, bx + grid, ...; the next group's inputs load while
                # this one's are normalized (past the last group: the last row, unused)
                grid = T.min(groups, ctas)
                if stages:
                    ring_walk(x, residual, w, b, y, residual_out, h_local, r_local, w_local,
                              b_local, total, mean, other, red, grid, bx, r, lane, eps)
                else:
                    register_walk(x, residual, w, b, y, residual_out, h_local, r_local,
                                  w_local, b_local, total, mean, other, red, grid, bx, r, lane,
                                  eps)

    return body


def _signature(body, rows, n: int, dtype: str, has_weight: bool, has_bias: bool,
               has_residual: bool):
    # One prim_func signature per combination of optional tensors (TileLang binds every
    # declared tensor), all sharing `body`. Each parameter needs its own annotation object:
    # TileLang makes one buffer per object, so a shared one would alias x and y.
    R, V = (rows, n), (n,)
    if has_residual:
        @T.prim_func
        def fused_add_norm(x: T.Tensor(R, dtype), residual: T.Tensor(R, dtype),
                           w: T.Tensor(V, dtype), y: T.Tensor(R, dtype),
                           residual_out: T.Tensor(R, dtype), eps: T.float32):
            body(x, residual, w, None, y, residual_out, eps)
        return fused_add_norm
    if has_weight and has_bias:
        @T.prim_func
        def norm_wb(x: T.Tensor(R, dtype), w: T.Tensor(V, dtype), b: T.Tensor(V, dtype),
                    y: T.Tensor(R, dtype), eps: T.float32):
            body(x, None, w, b, y, None, eps)
        return norm_wb
    if has_weight:
        @T.prim_func
        def rms_norm(x: T.Tensor(R, dtype), w: T.Tensor(V, dtype), y: T.Tensor(R, dtype),
                     eps: T.float32):
            body(x, None, w, None, y, None, eps)
        return rms_norm
    if has_bias:
        @T.prim_func
        def norm_b(x: T.Tensor(R, dtype), b: T.Tensor(V, dtype), y: T.Tensor(R, dtype),
                   eps: T.float32):
            body(x, None, None, b, y, None, eps)
        return norm_b

    @T.prim_func
    def norm(x: T.Tensor(R, dtype), y: T.Tensor(R, dtype), eps: T.float32):
        body(x, None, None, None, y, None, eps)
    return norm


class NormFwdKernel(Kernel):
    """Base of the forward norm kernels. Subclasses fix the program's flags (`flags`) from
    their key; the key always holds dtype and n. Buckets: up to FEW_ROWS rows ("few",
    decode batches), and more ("all")."""

    Config = NormConfig

    def flags(self) -> dict[str, bool]:
        raise NotImplementedError

    def program(self, config: NormConfig, bucket: str):
        return norm_fwd_program(self.key["n"], self.key["dtype"], block_rows=config.block_rows,
                                threads=config.threads, lanes=config.lanes,
                                ctas_per_sm=config.ctas_per_sm, prefetch=config.prefetch,
                                fused_sums=config.fused_sums, ctas=config.ctas,
                                stages=config.stages, **self.flags())

    def run(self, config: NormConfig, compiled: tuple, *tensors) -> None:
        compiled[0](*[t for t in tensors if t is not None])

    def direct_args(self, config: NormConfig) -> tuple:
        return ()

    def bucket_of(self, size: int) -> str:
        return "few" if size <= FEW_ROWS else "all"

    def heuristic_config(self, bucket: str, arch: str) -> NormConfig:
        n = self.key["n"]
        if n & (n - 1):  # 2560, 5120, 6144, 7168, 13824 ...: threads need not be a power of 2
            lanes = default_lanes(n, self.key["dtype"])
            if lanes is not None:
                if lanes.block_rows == 2 and bucket != "few" and not self.flags()["has_residual"]:
                    # Rows of two warps stacked two a CTA (1536, 2560 in 16 bits): the
                    # persistent form, four CTAs an SM, the next two groups' rows in a shared
                    # ring. On an H100, LayerNorm phi-2 (2560, 8K rows): 30.5 against 31.3-31.5
                    # us, 1.026x and 1.033x in two sessions (fifty-fifth, fifty-seventh), 90%
                    # of the triad. ViT-H's four stacked rows of one warp gained 0.8% (2
                    # steps): not taken.
                    return dataclasses.replace(lanes, ctas=4 * SMS, stages=3)
                return lanes
        # ~16K elements per CTA keeps several 16-byte loads in flight per thread (8 vectors
        # at 256 threads); a decode batch spreads its few rows over more CTAs instead (~2K
        # elements each). At most 64 elements per thread: more would spill. (The H200's
        # tuned winners at 4096 / 8192 / 16384 hold 2-4 vectors a thread; on an H100 one
        # row of 4096 a CTA ran 1.012x this rule's four, fifty-ninth session: a lead for a
        # width-general rule, measured at one width only.)
        target = max(1, (2048 if bucket == "few" else 16384) // n)
        for block_rows in sorted({target, *(r for r in (1, 2, 4, 8, 16, 32) if r < target)},
                                 reverse=True):
            for threads in (256, 128, 64):
                if vector_map_ok(n, block_rows, threads) and block_rows * n <= 64 * threads:
                    return NormConfig(block_rows, threads)
        return NormConfig(block_rows=1, threads=128 if n <= 4096 else 256)  # padded path

    def config_space(self, bucket: str) -> list[NormConfig]:
        # 1024 threads left out: a tuning run on the H200 stalled in this space once, and
        # 1024-thread reductions are the untested corner.
        n, dtype = self.key["n"], self.key["dtype"]
        space = [self.heuristic_config(bucket, "sm_90a")]
        space += [NormConfig(r, t) for r, t in row_configs(n, (8, 64))]
        # the tile map's configs again with a row's sums fused where every thread holds a
        # share of every row
        space += [dataclasses.replace(c, fused_sums=True) for c in space
                  if not c.lanes and fused_sums_ok(n, c.block_rows, c.threads)]
        # the tile map's default with the weight and bias loaded with the rows (level with
        # it on an H100, fifty-ninth session: for the tuner, not a default)
        if not space[0].lanes:
            space.append(dataclasses.replace(space[0], prefetch=True))
        if n & (n - 1):  # the tile map serves powers of two exactly (and was tuned there)
            space += [c for c in lane_configs(n, dtype, (8, 40)) if c.threads <= 896]
            # the lane default's variants, from its plain (non-persistent) form
            base = dataclasses.replace(space[0], ctas=0, stages=0)
            if base.lanes:
                space += [base, dataclasses.replace(base, prefetch=True)]
                # the persistent forms: 2, 4 or 8 CTAs an SM
                space += [dataclasses.replace(base, ctas=k * SMS) for k in (2, 4, 8)
                          if k * base.threads <= 2048]
                # and with a shared ring of 2 or 3 groups where an SM's rings fit in 192 KB
                ring_bytes = base.block_rows * n * ELEM_BYTES[dtype] * (
                    2 if self.flags()["has_residual"] else 1)
                space += [dataclasses.replace(base, ctas=k * SMS, stages=st)
                          for k in (2, 4) for st in (2, 3)
                          if k * base.threads <= 2048 and k * st * ring_bytes <= 192 * 1024]
                # LayerNorm's mean and variance in one exchange, where a row spans warps
                if self.flags()["centered"] and base.threads // base.block_rows > 32:
                    space.append(dataclasses.replace(base, fused_sums=True))
        return list(dict.fromkeys(space))


class RMSNormKernel(NormFwdKernel):
    """key: dtype, n (normalized size), has_weight."""

    name = "rms_norm"

    def flags(self) -> dict[str, bool]:
        return {"centered": False, "has_weight": self.key["has_weight"], "has_bias": False,
                "has_residual": False}


class FusedAddRMSNormKernel(NormFwdKernel):
    """key: dtype, n. h = x + residual is written out and normalized (weight required)."""

    name = "fused_add_rms_norm"

    def flags(self) -> dict[str, bool]:
        return {"centered": False, "has_weight": True, "has_bias": False, "has_residual": True}


class LayerNormKernel(NormFwdKernel):
    """key: dtype, n, has_weight, has_bias."""

    name = "layer_norm"

    def flags(self) -> dict[str, bool]:
        return {"centered": True, "has_weight": self.key["has_weight"],
                "has_bias": self.key["has_bias"], "has_residual": False}
