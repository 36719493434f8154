"""Row normalization backward: RMSNorm and LayerNorm over the last dimension.

With h the forward's normalized input, xhat = (h - mean if centered) * rstd and
g = dy * w (dy where there is no weight), per row:

    dx = rstd * (g - xhat * mean(g * xhat) - (mean(g) if centered)) (+ dres)
    dw = sum over rows of dy * xhat,   db = sum over rows of dy

Two programs. The first runs a fixed grid of `ctas` CTAs that stride over the (symbolic)
rows; each reads dy and h once, recomputes the row statistics (so the forward saves
nothing), writes dx, and keeps its share of dw / db in fp32 registers, stored once per CTA
as a partial row: no atomics. The second sums the partial rows column by column and casts
to the weight's dtype. `dres` is the gradient arriving at the fused residual sum, added to
dx in the same pass.
"""

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace

import tilelang.language as T

from ..base import Kernel, launchers
from ..vectors import ELEM_BYTES, vector_width
from ..workspace import zeroed_counters
from .lane_norm_bwd import lanes_bwd_body
from .row_norm_fwd import default_lanes, lane_configs, lanes_ok
from .rows import (
    SMS,
    RowTile,
    cta_sums,
    dx_value,
    fused_sums_ok,
    row_configs,
    stageable,
    vector_map_ok,
)

FEW_ROWS = 4096  # bucket edge: up to this many rows a smaller grid leaves fewer partials


SHORT_UNALIGNED = 2048  # up to this width, rows without an even vector split go one per CTA
# (from 512: narrower ones fill too few threads alone and stay several per CTA)


@dataclass(frozen=True)
class NormBwdConfig:
    block_rows: int = 1
    threads: int = 256
    ctas: int = 2 * SMS
    prefetch: bool = True  # load the next rows during this row's reductions
    # > 0: rows staged through shared memory this deep: by a TMA pipeline (tile map), or
    # (lane map) a ring each thread fills with its own vectors by cp.async
    stages: int = 0
    from_shared: bool = False  # staged rows are read where they land, not copied to registers
    # a row's sums taken together by warp shuffles and one barrier (`cta_sums`), not one
    # TileLang all-reduce per sum; only where every thread holds a share of every row
    fused_sums: bool = False
    # the lane map (lane_norm_bwd.py): threads // block_rows threads a row, any whole number
    # of warps; its dW / dB shares in shared memory instead of registers (`acc_shared`)
    lanes: bool = False
    acc_shared: bool = False
    # the lane map's ring only: rows dealt to the CTAs as they go (an atomic counter), not
    # an equal count each; dW / dB may then differ in their last bits from run to run
    dynamic: bool = False


def norm_bwd_program(n: int, dtype: str, centered: bool, has_weight: bool, has_bias: bool,
                     has_residual_grad: bool, block_rows: int, threads: int, ctas: int,
                     prefetch: bool, stages: int = 0, from_shared: bool = False,
                     fused_sums: bool = False, lanes: bool = False, acc_shared: bool = False,
                     dynamic: bool = False):
    rows = T.dynamic("rows")
    flags = dict(centered=centered, has_weight=has_weight, has_bias=has_bias,
                 has_residual_grad=has_residual_grad)
    if lanes:
        if not lanes_ok(n, dtype, block_rows, threads) or from_shared or fused_sums:
            raise ValueError(f"the lane map needs an exact split of {n} columns into 16-byte "
                             f"vectors over {threads // block_rows} threads a row, and neither "
                             f"from_shared nor fused_sums (tile-map options)")
        body = lanes_bwd_body(rows, n, dtype, block_rows=block_rows, threads=threads,
                              ctas=ctas, prefetch=prefetch, acc_shared=acc_shared,
                              stages=stages, dynamic=dynamic, **flags)
    else:
        if acc_shared or dynamic:
            raise ValueError("acc_shared and dynamic are options of the lane map (lanes=True)")
        body = _tile_bwd_body(rows, n, dtype, block_rows=block_rows, threads=threads,
                              ctas=ctas, prefetch=prefetch, stages=stages,
                              from_shared=from_shared, fused_sums=fused_sums, **flags)
    return _bwd_signature(body, rows, n, dtype, ctas, **flags)


def _tile_bwd_body(rows, n: int, dtype: str, centered: bool, has_weight: bool,
                   has_bias: bool, has_residual_grad: bool, block_rows: int, threads: int,
                   ctas: int, prefetch: bool, stages: int, from_shared: bool,
                   fused_sums: bool):
    """The tile map's `body(dy, h, w, dres, dx, dw_part, db_part, sched, eps)` macro (its
    rows dealt statically: `sched` unused)."""
    staged = stages > 0 and stageable(n, block_rows, threads)
    tile = RowTile(n, block_rows, threads, exact=staged)
    load, store = tile.macros(rows)
    n_tile = tile.n_tile
    parts = ctas * block_rows
    f32 = "float"
    # a thread's rows reduce in one all-reduce (one set of barriers, not one per row): short
    # rows (several per CTA) were bound by the barriers of 4 reductions x block_rows rows
    batch = tile.rows_per_thread
    if fused_sums and not fused_sums_ok(n, block_rows, threads, exact=staged):
        raise ValueError(f"fused_sums needs every thread to hold a share of every row of the "
                         f"step (n={n}, block_rows={block_rows}, threads={threads})")
    if fused_sums and from_shared:
        # dx came out wrong on the H200 (16384 columns, 512 threads: most elements off)
        raise ValueError("fused_sums is not supported with from_shared (rows read where "
                         "they land)")
    n_sums = 3 if centered else 2  # after the mean: [(h - mean)^2, g (h - mean), g]; or [h^2, g h]

    def hat_of(h_local, i, j, mean, rstd):  # xhat in fp32 from the row's mean and rstd
        h = T.cast(h_local[i, j], f32)
        return (h - mean if centered else h) * rstd

    def hat(h_local, mean_local, rstd_local, i, j):
        return hat_of(h_local, i, j, mean_local[i] if centered else None, rstd_local[i])

    def dx_of(dy_local, h_local, dres_local, w_local, i, j, mean, rstd, dot, gsum):
        """dx[i, j] in fp32; dot = mean(g xhat) and gsum = mean(g) of the row."""
        return dx_value(grad(dy_local, w_local, i, j), hat_of(h_local, i, j, mean, rstd), dot,
                        gsum if centered else None, rstd,
                        T.cast(dres_local[i, j], f32) if has_residual_grad else None)

    def grad(dy_local, w_local, i, j):  # g = dy * w in fp32
        dy = T.cast(dy_local[i, j], f32)
        return dy * T.cast(w_local[i, j], f32) if has_weight else dy

    @T.macro
    def put_dx(dx, dx_local, row0, i, j, v):
        if dx_local is None:  # rows read from shared memory: dx goes straight out
            if row0 + i < rows:
                dx[row0 + i, j] = T.cast(v, dtype)
        else:
            dx_local[i, j] = T.cast(v, dtype)

    @T.macro
    def row_step(dy_local, h_local, dres_local, dx, dx_local, tmp_local, rstd_local, dot_local,
                 mean_local, gsum_local, w_local, dw_acc, db_acc, row0, eps):
        if centered:
            for i, j in T.Parallel(block_rows, n_tile):
                tmp_local[i, j] = T.cast(h_local[i, j], f32)
            T.reduce_sum(tmp_local, mean_local, dim=1, batch=batch)
            for i in T.Parallel(block_rows):
                mean_local[i] = mean_local[i] / n
            for i, j in T.Parallel(block_rows, n_tile):
                tmp_local[i, j] = T.if_then_else(
                    j < n, (T.cast(h_local[i, j], f32) - mean_local[i])
                    * (T.cast(h_local[i, j], f32) - mean_local[i]), 0.0)
        else:
            for i, j in T.Parallel(block_rows, n_tile):
                tmp_local[i, j] = T.cast(h_local[i, j], f32) * T.cast(h_local[i, j], f32)
        T.reduce_sum(tmp_local, rstd_local, dim=1, batch=batch)
        for i in T.Parallel(block_rows):
            rstd_local[i] = T.rsqrt(rstd_local[i] / n + eps)
        for i, j in T.Parallel(block_rows, n_tile):
            tmp_local[i, j] = T.if_then_else(
                j < n, grad(dy_local, w_local, i, j)
                * hat(h_local, mean_local, rstd_local, i, j), 0.0)
        T.reduce_sum(tmp_local, dot_local, dim=1, batch=batch)
        if centered:
            for i, j in T.Parallel(block_rows, n_tile):
                tmp_local[i, j] = grad(dy_local, w_local, i, j)
            T.reduce_sum(tmp_local, gsum_local, dim=1, batch=batch)
        for i, j in T.Parallel(block_rows, n_tile):
            # (statement by statement, as measured: the fused path's dx_of is one expression)
            v = grad(dy_local, w_local, i, j) - hat(h_local, mean_local, rstd_local, i, j) \
                * (dot_local[i] / n)
            if centered:
                v = v - gsum_local[i] / n
            v = v * rstd_local[i]
            if has_residual_grad:
                v = v + T.cast(dres_local[i, j], f32)
            put_dx(dx, dx_local, row0, i, j, v)
        if dx_local is not None:
            store(dx_local, dx, row0)
        # dy is zero past the last row and in the padding: nothing to mask
        if has_weight:
            for i, j in T.Parallel(block_rows, n_tile):
                dw_acc[i, j] += T.cast(dy_local[i, j], f32) * hat(
                    h_local, mean_local, rstd_local, i, j)
        if has_bias:
            for i, j in T.Parallel(block_rows, n_tile):
                db_acc[i, j] += T.cast(dy_local[i, j], f32)

    def fused_stats():
        """The fused path's per-thread statistics and its shared sums (one buffer for the
        mean, one for the other sums: no barrier between the two reductions' reuses)."""
        def local(size):
            return T.alloc_local((size,), f32)

        return SimpleNamespace(
            part=local(n_sums * block_rows),
            red=T.alloc_shared((n_sums * block_rows, threads // 32), f32),
            red_mean=T.alloc_shared((block_rows, threads // 32), f32) if centered else None,
            mean=local(block_rows) if centered else None, rstd=local(block_rows),
            dot=local(block_rows), gsum=local(block_rows) if centered else None)

    @T.macro
    def fused_row_step(dy_local, h_local, dres_local, dx, dx_local, st, w_local, dw_acc, db_acc,
                       row0, eps):
        """row_step with the sums of all the step's rows taken by `cta_sums` (a barrier
        each, LayerNorm's mean first); the statistics in per-thread registers `st`."""
        part = st.part
        if centered:
            for q in T.unroll(block_rows):
                part[q] = 0.0
            for r in T.unroll(block_rows):
                for j in T.Parallel(n_tile):  # the padding reads as zero
                    part[r] = part[r] + T.cast(h_local[r, j], f32)
            cta_sums(part, st.red_mean, block_rows, threads)
            for r in T.unroll(block_rows):
                st.mean[r] = part[r] / n
        for q in T.unroll(n_sums * block_rows):
            part[q] = 0.0
        for r in T.unroll(block_rows):
            for j in T.Parallel(n_tile):
                c = T.cast(h_local[r, j], f32)
                if centered:
                    c = T.if_then_else(j < n, c - st.mean[r], 0.0)
                g = grad(dy_local, w_local, r, j)
                part[r] = part[r] + c * c
                part[block_rows + r] = part[block_rows + r] + g * c
                if centered:
                    part[2 * block_rows + r] = part[2 * block_rows + r] + g
        cta_sums(part, st.red, n_sums * block_rows, threads)
        for r in T.unroll(block_rows):
            st.rstd[r] = T.rsqrt(part[r] / n + eps)
            # sum(g (h - mean)) rstd / n = mean(g xhat)
            st.dot[r] = part[block_rows + r] * st.rstd[r] / n
            if centered:
                st.gsum[r] = part[2 * block_rows + r] / n
        for r in T.unroll(block_rows):
            for j in T.Parallel(n_tile):
                v = dx_of(dy_local, h_local, dres_local, w_local, r, j,
                          st.mean[r] if centered else None, st.rstd[r], st.dot[r],
                          st.gsum[r] if centered else None)
                put_dx(dx, dx_local, row0, r, j, v)
        if dx_local is not None:
            store(dx_local, dx, row0)
        for r in T.unroll(block_rows):
            for j in T.Parallel(n_tile):
                if has_weight:
                    dw_acc[r, j] += T.cast(dy_local[r, j], f32) * hat_of(
                        h_local, r, j, st.mean[r] if centered else None, st.rstd[r])
                if has_bias:
                    db_acc[r, j] += T.cast(dy_local[r, j], f32)

    @T.macro
    def step_rows(dy_rows, h_rows, dres_rows, row0, cta):
        """One step's rows (`cta`: the CTA's buffers, from body)."""
        if fused_sums:
            fused_row_step(dy_rows, h_rows, dres_rows, cta.dx, cta.dx_local, cta.st, cta.w,
                           cta.dw_acc, cta.db_acc, row0, cta.eps)
        else:
            row_step(dy_rows, h_rows, dres_rows, cta.dx, cta.dx_local, cta.tmp, cta.rstd,
                     cta.dot, cta.mean, cta.gsum, cta.w, cta.dw_acc, cta.db_acc, row0, cta.eps)

    @T.macro
    def body(dy, h, w, dres, dx, dw_part, db_part, sched, eps):
        with T.Kernel(ctas, threads=threads) as bx:
            # staged rows may be read straight from shared memory (wide rows: the registers
            # of a [1, n] copy are what the producer's register cap cannot spare)
            in_shared = staged and from_shared
            dy_local = None if in_shared else T.alloc_fragment(tile.shape, dtype)
            h_local = None if in_shared else T.alloc_fragment(tile.shape, dtype)
            prefetching = prefetch and not staged
            dy_next = T.alloc_fragment(tile.shape, dtype) if prefetching else None
            h_next = T.alloc_fragment(tile.shape, dtype) if prefetching else None
            dx_local = None if in_shared else T.alloc_fragment(tile.shape, dtype)
            tmp_local = None if fused_sums else T.alloc_fragment(tile.shape, f32)
            rstd_local = None if fused_sums else T.alloc_fragment((block_rows,), f32)
            dot_local = None if fused_sums else T.alloc_fragment((block_rows,), f32)
            st = fused_stats() if fused_sums else None
            dres_local = T.alloc_fragment(tile.shape, dtype) \
                if has_residual_grad and not in_shared else None
            row_sums = centered and not fused_sums  # LayerNorm's mean and mean(g) fragments
            mean_local = T.alloc_fragment((block_rows,), f32) if row_sums else None
            gsum_local = T.alloc_fragment((block_rows,), f32) if row_sums else None
            dw_acc = T.alloc_fragment(tile.shape, f32) if has_weight else None
            db_acc = T.alloc_fragment(tile.shape, f32) if has_bias else None
            dw_row = T.alloc_fragment((n_tile,), f32) if has_weight else None
            db_row = T.alloc_fragment((n_tile,), f32) if has_bias else None
            # the weight, loaded once in the tile's own layout: in fp32, or (staged, where a
            # producer warp group caps registers) in its own dtype
            if not has_weight:
                w_local = None
            elif in_shared:
                w_local = T.alloc_shared(tile.shape, dtype)
            else:
                w_local = T.alloc_fragment(tile.shape, dtype if staged else f32)
            if has_weight:
                T.clear(dw_acc)
                for i, j in T.Parallel(block_rows, n_tile):
                    w_local[i, j] = T.cast(w[T.min(j, n - 1)], w_local.dtype)
            if has_bias:
                T.clear(db_acc)
            cta = SimpleNamespace(dx=dx, dx_local=dx_local, tmp=tmp_local, rstd=rstd_local,
                                  dot=dot_local, mean=mean_local, gsum=gsum_local, st=st,
                                  w=w_local, dw_acc=dw_acc, db_acc=db_acc, eps=eps)

            if staged:
                # A TMA pipeline `stages` rows deep through shared memory (a producer warp
                # group issues the loads): more bytes in flight than a register double
                # buffer holds, and no registers spent on them. TMA zero-fills rows past
                # the last one.
                dy_shared = T.alloc_shared(tile.shape, dtype)
                h_shared = T.alloc_shared(tile.shape, dtype)
                dres_shared = T.alloc_shared(tile.shape, dtype) if has_residual_grad else None
                for step in T.Pipelined(T.ceildiv(rows, parts), num_stages=stages):
                    row0 = (step * ctas + bx) * block_rows
                    T.copy(dy[row0, 0], dy_shared)
                    T.copy(h[row0, 0], h_shared)
                    if has_residual_grad:
                        T.copy(dres[row0, 0], dres_shared)
                    if in_shared:
                        step_rows(dy_shared, h_shared, dres_shared, row0, cta)
                    else:
                        T.copy(dy_shared, dy_local)
                        T.copy(h_shared, h_local)
                        if has_residual_grad:
                            T.copy(dres_shared, dres_local)
                        step_rows(dy_local, h_local, dres_local, row0, cta)
            else:
                # The next rows' dy and h are loaded before this row's reductions, so they are in
                # flight while the CTA waits on its barriers (a register double buffer).
                if prefetching:
                    load(dy, dy_next, bx * block_rows)
                    load(h, h_next, bx * block_rows)
                for step in T.serial(T.ceildiv(rows, parts)):
                    row0 = (step * ctas + bx) * block_rows
                    if prefetching:
                        for i, j in T.Parallel(block_rows, n_tile):
                            dy_local[i, j] = dy_next[i, j]
                            h_local[i, j] = h_next[i, j]
                        load(dy, dy_next, row0 + parts)
                        load(h, h_next, row0 + parts)
                    else:
                        load(dy, dy_local, row0)
                        load(h, h_local, row0)
                    if has_residual_grad:  # used last: in flight through the reductions
                        load(dres, dres_local, row0)
                    step_rows(dy_local, h_local, dres_local, row0, cta)
            # one partial row per CTA: its rows' shares summed across the tile first
            if has_weight:
                T.reduce_sum(dw_acc, dw_row, dim=0)
                for j in T.Parallel(n_tile):
                    if j < n:
                        dw_part[bx, j] = dw_row[j]
            if has_bias:
                T.reduce_sum(db_acc, db_row, dim=0)
                for j in T.Parallel(n_tile):
                    if j < n:
                        db_part[bx, j] = db_row[j]

    return body


def _bwd_signature(body, rows, n: int, dtype: str, ctas: int, centered: bool,
                   has_weight: bool, has_bias: bool, has_residual_grad: bool):
    """One prim_func per combination of optional tensors, all sharing `body`. Each takes
    `sched`, the dynamic deal's zeroed counters (`lanes_bwd_body`; unused by the others)."""
    f32 = "float"
    R, V, P, S = (rows, n), (n,), (ctas, n), (2,)
    if has_residual_grad:  # the fused add's backward: RMSNorm with a weight
        @T.prim_func
        def fused_add_norm_bwd(dy: T.Tensor(R, dtype), h: T.Tensor(R, dtype),
                               w: T.Tensor(V, dtype), dres: T.Tensor(R, dtype),
                               dx: T.Tensor(R, dtype), dw_part: T.Tensor(P, f32),
                               sched: T.Tensor(S, "int32"), eps: T.float32):
            body(dy, h, w, dres, dx, dw_part, None, sched, eps)
        return fused_add_norm_bwd
    if has_weight and has_bias:
        @T.prim_func
        def norm_bwd_wb(dy: T.Tensor(R, dtype), h: T.Tensor(R, dtype), w: T.Tensor(V, dtype),
                        dx: T.Tensor(R, dtype), dw_part: T.Tensor(P, f32),
                        db_part: T.Tensor(P, f32), sched: T.Tensor(S, "int32"),
                        eps: T.float32):
            body(dy, h, w, None, dx, dw_part, db_part, sched, eps)
        return norm_bwd_wb
    if has_weight:
        @T.prim_func
        def norm_bwd_w(dy: T.Tensor(R, dtype), h: T.Tensor(R, dtype), w: T.Tensor(V, dtype),
                       dx: T.Tensor(R, dtype), dw_part: T.Tensor(P, f32),
                       sched: T.Tensor(S, "int32"), eps: T.float32):
            body(dy, h, w, None, dx, dw_part, None, sched, eps)
        return norm_bwd_w
    if has_bias:
        @T.prim_func
        def norm_bwd_b(dy: T.Tensor(R, dtype), h: T.Tensor(R, dtype), dx: T.Tensor(R, dtype),
                       db_part: T.Tensor(P, f32), sched: T.Tensor(S, "int32"),
                       eps: T.float32):
            body(dy, h, None, None, dx, None, db_part, sched, eps)
        return norm_bwd_b

    @T.prim_func
    def norm_bwd(dy: T.Tensor(R, dtype), h: T.Tensor(R, dtype), dx: T.Tensor(R, dtype),
                 sched: T.Tensor(S, "int32"), eps: T.float32):
        body(dy, h, None, None, dx, None, None, sched, eps)
    return norm_bwd


def column_strip(n: int) -> int:
    """Columns a CTA of the column sum takes: the widest strip of 4-32 vectors (4 fp32
    each, or single floats where 4 does not divide n) that still gives ~2 CTAs an SM."""
    vec = 4 if n % 4 == 0 else 1
    return vec * next((v for v in (32, 16, 8, 4) if -(-n // (v * vec)) >= 2 * SMS), 4)


def column_sum_program(parts: int, n: int, out_dtype: str, threads: int = 256,
                       unroll: int = 4, sums: int = 1):
    """out[j] = sum over the `parts` partial rows of part[:, j], cast to `out_dtype`; with
    `sums=2`, (part, part_b) -> (out, out_b) in the same launch (LayerNorm's dW and dB).

    A few KB to a few MB read once, so latency-bound: CTAs of narrow column strips (enough
    of them to reach every SM), each thread a 16-byte vector of a strip on every
    `slices`-th partial row, `unroll` rows' loads issued before their adds; the slices meet
    in shared memory. (One CTA of 128 columns walking all the rows 32 at a time left
    1280-column rows with 10 CTAs of up to 33 dependent loads.) Two sums share one launch:
    each is a few microseconds of mostly launch and load latency."""
    f32 = "float"
    vec = 4 if n % 4 == 0 else 1
    strip = column_strip(n)
    strip_vecs = strip // vec
    slices, warps = threads // strip_vecs, threads // 32
    shuffles = (32 // strip_vecs).bit_length() - 1
    steps = -(-parts // (slices * unroll))

    @T.macro
    def strip_sum(part, out, bx):
        tx = T.get_thread_binding()
        v, s = tx % strip_vecs, tx // strip_vecs
        col = bx * strip + v * vec
        acc = T.alloc_local((vec,), f32)
        got = T.alloc_local((unroll, vec), f32)
        red = T.alloc_shared((warps, strip), f32)
        for j in T.unroll(vec):
            acc[j] = 0.0
        if col < n:
            for k in T.serial(steps):
                for u in T.unroll(unroll):
                    row = (k * unroll + u) * slices + s
                    if row < parts:
                        for j in T.vectorized(vec):
                            got[u, j] = part[row, col + j]
                    else:
                        for j in T.unroll(vec):
                            got[u, j] = 0.0
                for u in T.unroll(unroll):
                    for j in T.unroll(vec):
                        acc[j] = acc[j] + got[u, j]
        # the warp's slices by shuffles, then the warps' sums through shared memory
        for k in T.unroll(shuffles):
            for j in T.unroll(vec):
                acc[j] = acc[j] + T.shfl_xor(acc[j], strip_vecs << k)
        if tx % 32 < strip_vecs:
            for j in T.unroll(vec):
                red[tx // 32, v * vec + j] = acc[j]
        T.sync_threads()
        if tx < strip:
            total = T.alloc_local((1,), f32)
            total[0] = red[0, tx]
            for w in T.unroll(warps - 1):
                total[0] = total[0] + red[w + 1, tx]
            if bx * strip + tx < n:
                out[bx * strip + tx] = T.cast(total[0], out_dtype)

    P = (parts, n)
    if sums == 1:
        @T.prim_func
        def column_sum(part: T.Tensor(P, f32), out: T.Tensor((n,), out_dtype)):
            with T.Kernel(T.ceildiv(n, strip), threads=threads) as bx:
                strip_sum(part, out, bx)
    elif sums == 2:  # one grid: the first sum's strips, then the second's
        blocks = -(-n // strip)

        @T.prim_func
        def column_sum(part: T.Tensor(P, f32), part_b: T.Tensor(P, f32),
                       out: T.Tensor((n,), out_dtype), out_b: T.Tensor((n,), out_dtype)):
            with T.Kernel(2 * blocks, threads=threads) as bx:
                if bx < blocks:
                    strip_sum(part, out, bx)
                else:
                    strip_sum(part_b, out_b, bx - blocks)
    else:
        raise ValueError(f"column_sum_program: sums must be 1 or 2, got {sums}")
    return column_sum


_IDLE_COUNTERS: dict = {}


def _idle_counters(device):
    """An int32 [2] buffer for the `sched` argument of programs that never read it."""
    found = _IDLE_COUNTERS.get(device)
    if found is None:
        import torch

        found = _IDLE_COUNTERS[device] = torch.zeros(2, dtype=torch.int32, device=device)
    return found


class NormBwdKernel(Kernel):
    """Base of the backward norm kernels; subclasses fix the flags from their key (which
    always holds dtype and n). Buckets: up to FEW_ROWS rows, and more."""

    Config = NormBwdConfig

    def flags(self) -> dict[str, bool]:
        raise NotImplementedError

    def program(self, config: NormBwdConfig, bucket: str):
        flags = self.flags()
        n, dtype = self.key["n"], self.key["dtype"]
        main = norm_bwd_program(n, dtype, block_rows=config.block_rows, threads=config.threads,
                                ctas=config.ctas, prefetch=config.prefetch,
                                stages=config.stages, from_shared=config.from_shared,
                                fused_sums=config.fused_sums, lanes=config.lanes,
                                acc_shared=config.acc_shared, dynamic=config.dynamic,
                                **flags)
        count = int(flags["has_weight"]) + int(flags["has_bias"])
        sums = (column_sum_program(config.ctas, n, dtype, sums=count),) if count else ()
        return (main, *sums)

    def run(self, config: NormBwdConfig, compiled: tuple, dy, h, w, dres, dx, dw, db,
            eps: float) -> None:
        """dw / db (None when absent) receive the column sums of per-CTA fp32 partial rows,
        allocated here since their count is the config's grid."""
        import torch

        def partials(grad):
            return None if grad is None else torch.empty(
                (config.ctas, self.key["n"]), dtype=torch.float32, device=dy.device)

        if config.dynamic and torch.are_deterministic_algorithms_enabled():
            # torch's deterministic mode: the same rows in each CTA's dW / dB share on every
            # run, so the static deal of the same ring (built once, then cached)
            config = dataclasses.replace(config, dynamic=False)
            compiled = launchers(self.compile(config, self.bucket_of(dy.shape[0])))
        dw_part, db_part = partials(dw), partials(db)
        # the dynamic deal's counters; a static deal's program ignores its argument, so it
        # gets a fixed buffer (one lookup, not the stream's scratch)
        sched = zeroed_counters(dy.device, 2) if config.dynamic else _idle_counters(dy.device)
        compiled[0](*(t for t in (dy, h, w, dres, dx, dw_part, db_part) if t is not None),
                    sched, eps)
        if dw is not None or db is not None:  # one launch sums both
            compiled[1](*(t for t in (dw_part, db_part, dw, db) if t is not None))

    def bucket_of(self, size: int) -> str:
        return "few" if size <= FEW_ROWS else "many"

    def pass_configs(self, config: NormBwdConfig, program_index: int) -> dict:
        # The dynamic deal's program places every barrier it needs itself (its threads read
        # back only their own ring copies; the dealt rows and the row sums' buffers are
        # published by row_sums' barrier or the step's own). TileLang's pass would add three
        # more a step around the ring's copies and the shared row indices.
        if program_index == 0 and config.lanes and config.dynamic:
            return {"tl.disable_thread_storage_sync": True}
        return {}

    def heuristic_config(self, bucket: str, arch: str) -> NormBwdConfig:
        picked = self.ring_config(bucket)
        if picked is None:
            picked = self.staged_config(bucket)
        if picked is not None:
            return picked
        n = self.key["n"]
        # dy and h of two rows (the double buffer), the fp32 accumulators and the weight
        # live in registers: at 16 elements per thread that is ~121 registers (ptxas), so
        # 512 threads per SM fit; the persistent grid is that many CTAs per SM. Longer rows
        # (32 per thread) have no registers left for the next row's loads.
        block_rows = max(1, 4096 // n)
        exact = [t for t in (256, 512, 128, 64)
                 if vector_map_ok(n, block_rows, t) and block_rows * n // t <= 16]
        if 512 <= n <= SHORT_UNALIGNED and not exact:
            # Short rows whose 16-byte vectors split over no power-of-two thread count with
            # at most 16 elements a thread (ViT-H's 1280: 160 vectors; 1536: 192, only over
            # 64 threads at 48 each) take one row a CTA: a padded tile of two rows split
            # unevenly over threads does not lower (TileLang's batched row reduce). One
            # row per CTA of two warps keeps each row sum to two warps' shuffles and one
            # barrier, and many small CTAs keep the loads in flight without a double
            # buffer: 53.7 us on the H200 against 92.5 for 3 rows per 256 threads
            # (torch.compile 72.9), 58.2 for one warp of exact vectors per row.
            # Since the thirty-third session the lane map where it splits such rows exactly
            # (1280: four rows of a warp, five vectors a lane, shuffles only, two CTAs an
            # SM, dW / dB in registers): 43.5 us against 46.4 for that padded config
            # (both with the strip column sum; 54.0 before it), torch.compile 73.6.
            lanes = default_lanes(n, self.key["dtype"])
            if lanes is not None and lanes.threads // lanes.block_rows <= 32:
                return NormBwdConfig(lanes.block_rows, lanes.threads, 2 * SMS,
                                     prefetch=False, lanes=True)
            return NormBwdConfig(1, 64, 8 * SMS if bucket == "many" else 2 * SMS,
                                 prefetch=False)
        if exact:
            threads = exact[0]
        else:
            wide = [t for t in (512, 256) if vector_map_ok(n, block_rows, t)]
            threads = wide[0] if wide else (512 if n > 4096 else 256)  # else padded
        elems = RowTile(n, block_rows, threads).n_tile * block_rows // threads
        ctas = SMS * max(1, 512 // threads)
        return NormBwdConfig(block_rows, threads, ctas if bucket == "many" else SMS,
                             prefetch=elems <= 16)

    def ring_config(self, bucket: str) -> NormBwdConfig | None:
        """The lane map's shared ring (each thread's own 16-byte vectors by cp.async, three
        steps deep, rows dealt statically, a warp's shuffles per row sum) where it beat the
        TMA pipeline, else None: 16-bit rows of 4096-8192 columns on many rows. RMSNorm and
        LayerNorm two vectors a thread on one CTA an SM; the fused add four on two (its
        third row, dres, read straight: two vectors on one CTA measured 0.90x). On an H100,
        fifty-fifth to fifty-seventh sessions (scripts/norm_bwd_ring_rows.sh), against the
        TMA default: RMSNorm 8B 1.013x, 70B 1.006x, Qwen3-32B's 5120 1.011x, DeepSeek-V3's
        7168 0.993x (level: it keeps TMA); LayerNorm falcon's 8192 1.010x (3 steps of 256
        threads), gpt-neox's 6144 1.030x; the fused add 1.021x at 4096, 1.004x at 5120,
        0.991x at 8192 (keeps TMA)."""
        n, dtype, flags = self.key["n"], self.key["dtype"], self.flags()
        if bucket != "many" or ELEM_BYTES[dtype] != 2 or not 4096 <= n <= 8192 or n == 7168:
            return None
        vec = vector_width(n, dtype)
        if flags["has_residual_grad"]:
            if n > 5120:
                return None
            threads, per_sm = n // (4 * vec), 2
        else:
            threads, per_sm = n // (2 * vec), 1
        if not lanes_ok(n, dtype, 1, threads):
            return None
        return NormBwdConfig(1, threads, per_sm * SMS, prefetch=False, stages=3, lanes=True)

    def staged_config(self, bucket: str) -> NormBwdConfig | None:
        """The TMA-pipelined config where it applies, else None. Its producer warp group
        makes 384 threads per CTA, capped at 168 registers each: one CTA per SM of 256
        consumer threads holding at most 32 elements each (8192 columns; more spilled). On
        the H200 it beat the register double buffer by 7-8% at 4096 columns and by 21-34%
        at 6144-8192 (RMSNorm, the fused add and LayerNorm, 8K rows). Three stages where a
        thread holds at most 24 elements, else two (the shared memory of 32 per thread).
        5120 and 7168 columns (8-byte vectors per thread) gained too (Qwen3-32B 197 -> 157
        us, DeepSeek-V3 110 -> 95)."""
        n, threads = self.key["n"], 256
        block_rows = max(1, 4096 // n)
        flags = self.flags()
        if block_rows == 1 and n * 2 // threads <= 32 and stageable(n, 2, threads) \
                and not (flags["centered"] or flags["has_residual_grad"]):
            # RMSNorm: two rows a step, so one batched all-reduce serves both rows' sums
            # (TileLang's costs four barriers at 256 threads): 62.0 -> 58.3 us at 4096
            # columns, 8K rows (two runs; 3 stages 60.9, 512 threads 59.7). The fused
            # add's third staged row made it 74.4 -> 76.0: it keeps one row.
            block_rows = 2
        if not stageable(n, block_rows, threads):
            return None
        elems = block_rows * n // threads
        if elems > 32:
            # Wider rows (405B's 16384): 512 consumer threads read the two stages where
            # they land and write dx straight out, the weight in shared memory too, so the
            # 96 registers the producer's cap leaves hold only the fp32 row sums' operands
            # and the dW share (no spills; a register tile of 32 spilled). On the H200:
            # 168.6 -> 119.0 us at 405B 4K tokens, 1.21x Liger.
            # RMSNorm only: LayerNorm's second fp32 share (dB) spills, and the fused add's
            # third staged row (dres) needs 228 KB of shared memory at 16384, over the
            # H200's 227 (the launch failed): both keep the register path.
            if n > 16384 or flags["has_bias"] or flags["has_residual_grad"] \
                    or not stageable(n, 1, 512):
                return None
            return NormBwdConfig(1, 512, SMS, prefetch=False, stages=2, from_shared=True)
        # a row's sums fused (shuffles and one barrier) wherever each thread holds a share
        # of every row of the step: on the H200, 8K rows, RMSNorm 58.0 -> 57.1 us (4096),
        # 106.6 -> 105.6 (8192), 145.5 -> 127.6 (Qwen3-32B's 5120); LayerNorm 124.4 -> 108.0
        # (8192), 122.1 -> 95.5 (6144); the fused add 74.6 -> 73.6, 138.4 -> 136.5
        fused = fused_sums_ok(n, block_rows, threads, exact=True)
        return NormBwdConfig(block_rows, threads, SMS, prefetch=False,
                             stages=3 if elems <= 24 else 2, fused_sums=fused)

    def config_space(self, bucket: str) -> list[NormBwdConfig]:
        space = [self.heuristic_config(bucket, "sm_90a")]
        staged = self.staged_config(bucket)  # the TMA pick, where the lane ring replaced it
        if staged is not None:
            space.append(staged)
        for block_rows, threads in row_configs(self.key["n"], (8, 32), (128, 256, 512)):
            for ctas in (SMS, 2 * SMS):
                for prefetch in (True, False):
                    if not prefetch or block_rows * self.key["n"] // threads <= 16:
                        space.append(NormBwdConfig(block_rows, threads, ctas, prefetch))
        # TMA stages of dy and h (and dres): up to 8 deep where they fit in 200 KB, so a
        # tune can tell whether the bytes in flight bound the one CTA an SM
        row_bytes = self.key["n"] * ELEM_BYTES[self.key["dtype"]]
        staged_rows = 3 if self.flags()["has_residual_grad"] else 2
        for block_rows, threads in row_configs(self.key["n"], (4, 32), (256,)):
            for stages in (2, 3, 4, 6, 8):
                if stages * staged_rows * block_rows * row_bytes <= 200 * 1024:
                    space.append(NormBwdConfig(block_rows, threads, SMS, False, stages))
        # the staged configs again with a row's sums fused (the staged default's choice)
        space += [dataclasses.replace(c, fused_sums=True) for c in space
                  if c.stages and not c.from_shared and not c.lanes
                  and fused_sums_ok(self.key["n"], c.block_rows, c.threads, exact=True)]
        space += self.lane_space()
        return list(dict.fromkeys(space))

    def lane_space(self) -> list[NormBwdConfig]:
        """The lane map's configs: each split of a row into whole warps of 1-5 vectors a
        thread, with and without the register double buffer and the shared dW / dB, on
        grids of 1, 2 or 4 CTAs an SM (the launch bound that caps the registers); without
        the double buffer also with a shared ring of 2 or 3 steps where an SM's rings and
        dW / dB buffers fit in 220 KB. (Not `dynamic`: 0.78-0.96x its static deal on every
        row measured, fifty-sixth session; scripts/norm_dynamic_compares.sh runs it.)"""
        n, dtype = self.key["n"], self.key["dtype"]
        step_bytes = 2 * n * ELEM_BYTES[dtype]  # a row of dy and one of h
        acc_bytes = 2 * n * 4  # at most: shared fp32 dW and dB rows
        found = []
        for layout in lane_configs(n, dtype, (4, 40)):
            if n // (layout.threads // layout.block_rows) > 40:
                continue
            for per_sm in (1, 2, 4):
                # 256-1024 threads an SM: fewer leave HBM idle, more cap registers under the
                # rows' vectors
                if not 256 <= layout.threads * per_sm <= 1024:
                    continue
                for prefetch, stages in ((False, 0), (True, 0), (False, 2), (False, 3)):
                    if per_sm * layout.block_rows * (stages * step_bytes + acc_bytes) \
                            > 220 * 1024:
                        continue
                    for acc_shared in (False, True):
                        found.append(NormBwdConfig(
                            layout.block_rows, layout.threads, SMS * per_sm, prefetch,
                            stages, lanes=True, acc_shared=acc_shared))
        return found


class RMSNormBwdKernel(NormBwdKernel):
    """key: dtype, n, has_weight."""

    name = "rms_norm_bwd"

    def flags(self) -> dict[str, bool]:
        return {"centered": False, "has_weight": self.key["has_weight"], "has_bias": False,
                "has_residual_grad": False}


class FusedAddRMSNormBwdKernel(NormBwdKernel):
    """key: dtype, n. RMSNorm's backward plus the gradient of the residual sum output."""

    name = "fused_add_rms_norm_bwd"

    def flags(self) -> dict[str, bool]:
        return {"centered": False, "has_weight": True, "has_bias": False,
                "has_residual_grad": True}


class LayerNormBwdKernel(NormBwdKernel):
    """key: dtype, n, has_weight, has_bias."""

    name = "layer_norm_bwd"

    def flags(self) -> dict[str, bool]:
        return {"centered": True, "has_weight": self.key["has_weight"],
                "has_bias": self.key["has_bias"], "has_residual_grad": False}
