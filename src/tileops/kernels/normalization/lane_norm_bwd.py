"""The row-norm backward on the lane map: each row held by a fixed group of whole warps (or a
power of two of lanes below a warp), each thread `vecs` 16-byte vectors of it.

The tile map (row_norm_bwd.py) needs a power-of-two thread count to split a row exactly;
at 1280 (ViT-H), 2560, 6144 or 13824 columns it either holds many elements a thread or
moves a padded tile by scalar accesses. Here a row of 1280 is one warp of five vectors a
lane and its sums are warp shuffles alone; 6144 is 256 threads of three.

Per step a CTA takes `block_rows` rows (one per thread group) of a persistent walk, with
the next step's dy and h optionally in flight in registers during this one's sums
(`prefetch`), or the next `stages - 1` steps' in flight into a ring of shared memory
(`stages`): each thread copies its own vectors there by cp.async and reads back only
those, so the ring costs no registers and its steps need no producer warps.

A row's sums ([h^2, g h] for RMSNorm; the mean first, then [(h - mean)^2,
g (h - mean), g] for LayerNorm) are taken together: shuffles, then one barrier through
shared memory when the row spans several warps. The dW / dB shares of the CTA's rows
accumulate in fp32, in registers or (`acc_shared`, fewer registers: more CTAs an SM) in
shared memory, and leave as one partial row per CTA, summed by row_norm_bwd's column sum.

With the ring the rows may also be dealt out as the CTAs go (`dynamic`): past the first
`stages + 1` steps (dealt statically), thread 0 takes the next `block_rows` rows from a
counter in global memory (an atomic add) `stages + 1` steps before they are used, and a
step later (the atomic's round trip hidden) leaves their first index in shared memory,
published by that step's barrier. A static deal gives every CTA the same count of rows,
so the CTAs that HBM serves more slowly set the kernel's end: on an H100 (RMSNorm
backward, 8K x 4096) its SMs were busy only 90% of the kernel's time. The counters are
the stream's zeroed scratch: the last CTA to leave sets them back to zero. Which rows a
CTA sums into its dW / dB share then changes from run to run, so the sums may differ in
their last bits (the static deal is the deterministic one).
"""

import functools
import operator

import tilelang.language as T

from ..vectors import vector_width
from .rows import SMS, dx_value, lane_ring_macros, lane_row_macros


def lanes_bwd_body(rows, n: int, dtype: str, centered: bool, has_weight: bool,
                   has_bias: bool, has_residual_grad: bool, block_rows: int, threads: int,
                   ctas: int, prefetch: bool, acc_shared: bool, stages: int = 0,
                   dynamic: bool = False):
    """The `body(dy, h, w, dres, dx, dw_part, db_part, sched, eps)` macro of the lane map;
    sched: int32 [2] (rows dealt, CTAs done), zero before and after a `dynamic` launch."""
    if stages and (prefetch or stages < 2):
        raise ValueError(f"the lane map's shared ring needs 2 or more stages and no register "
                         f"double buffer (stages={stages}, prefetch={prefetch})")
    if dynamic and not stages:
        raise ValueError("the lane map deals rows as it goes (dynamic) only with its shared "
                         "ring (stages >= 2)")
    f32 = "float"
    row_threads = threads // block_rows
    vec = vector_width(n, dtype)
    vecs = n // vec // row_threads
    warps = max(row_threads // 32, 1)
    shuffles = min(row_threads, 32).bit_length() - 1
    n_sums = 3 if centered else 2
    parts = ctas * block_rows
    has_acc = has_weight or has_bias
    # the CTA's row groups meet in shared memory at the end (or accumulate there)
    combine = has_acc and (acc_shared or block_rows > 1)
    slots = stages + 1  # dynamic: first rows of steps step .. step + stages in shared memory

    col, load_row, _ = lane_row_macros(row_threads, vec, vecs)

    ring_issue, ring_read = lane_ring_macros(row_threads, vec, vecs)

    def step_row(step, bx, r):  # group r's row at `step`; past the last rows: the last
        return T.min((step * ctas + bx) * block_rows + r, rows - 1)

    def column_total(acc_sh, c):  # the row groups' shares of column c, summed
        return functools.reduce(operator.add, [acc_sh[q, c] for q in range(block_rows)])

    @T.macro
    def row_sums(part, count: int, red, parity, r, lane):
        """part[0:count] <- each summed over the row's threads (all of them get the sums);
        red[parity]: shared [count, block_rows, warps], not reused before the next
        barrier."""
        for q in T.unroll(count):
            for k in T.unroll(shuffles):
                part[q] = part[q] + T.shfl_xor(part[q], 1 << k)
        if warps > 1:
            if lane % 32 == 0:
                for q in T.unroll(count):
                    red[parity, q, r, lane // 32] = part[q]
            T.sync_threads()
            for q in T.unroll(count):
                part[q] = red[parity, q, r, 0]
                for w_ in T.unroll(warps - 1):
                    part[q] = part[q] + red[parity, q, r, w_ + 1]

    @T.macro
    def accumulate(acc_local, acc_sh, r, lane, i, j, v):
        if acc_shared:
            acc_sh[r, col(i, j, lane)] = acc_sh[r, col(i, j, lane)] + v
        else:
            acc_local[i, j] = acc_local[i, j] + v

    @T.macro
    def write_partial(acc_local, acc_sh, part_out, bx, r, lane):
        """The CTA's partial row of one accumulator: its row groups summed."""
        if combine:
            if not acc_shared:
                for i in T.unroll(vecs):
                    for j in T.unroll(vec):
                        acc_sh[r, col(i, j, lane)] = acc_local[i, j]
            T.sync_threads()
            for c in T.Parallel(n):
                part_out[bx, c] = column_total(acc_sh, c)
            T.sync_threads()  # acc_sh is the next accumulator's too
        else:
            for i in T.unroll(vecs):
                for j in T.vectorized(vec):
                    part_out[bx, col(i, j, lane)] = acc_local[i, j]

    @T.macro
    def deal(sched, firsts, pending, step, tx):
        """Thread 0 publishes the first row of step + stages (taken a step ago, so the
        atomic's round trip overlapped that step) and takes step + stages + 1's from the
        counter, which counts on from the statically dealt first stages + 1 steps."""
        if tx == 0:
            firsts[(step + stages) % slots] = pending[0]
            pending[0] = T.atomic_add(sched[0], block_rows, return_prev=True) \
                + (stages + 1) * parts

    @T.macro
    def leave(sched, tx):
        """The last CTA out sets the counters back to zero for the next launch."""
        if tx == 0:
            done = T.alloc_local((1,), "int32")
            # release: this CTA's deals are in before it counts itself out; acquire: the last
            # one out sees every CTA's
            done[0] = T.atomic_add(sched[1], 1, memory_order="acq_rel", return_prev=True)
            if done[0] == ctas - 1:
                sched[0] = 0
                sched[1] = 0

    def ring_row(first, r):  # group r's row of a step whose first row is `first`
        return T.min(first + r, rows - 1)

    @T.macro
    def body(dy, h, w, dres, dx, dw_part, db_part, sched, eps):
        with T.Kernel(ctas, threads=threads) as bx:
            if ctas >= 2 * SMS:
                # the grid is one wave of ctas / SMS CTAs an SM: registers capped to fit it
                # (else ptxas keeps the rows' fp32 widenings live, up to 255 a thread)
                T.annotate_min_blocks_per_sm(ctas // SMS)
            tx = T.get_thread_binding()
            r, lane = tx // row_threads, tx % row_threads
            dy_local = T.alloc_local((vecs, vec), dtype)
            h_local = T.alloc_local((vecs, vec), dtype)
            dy_next = T.alloc_local((vecs, vec), dtype) if prefetch else None
            h_next = T.alloc_local((vecs, vec), dtype) if prefetch else None
            dres_local = T.alloc_local((vecs, vec), dtype) if has_residual_grad else None
            w_local = T.alloc_local((vecs, vec), dtype) if has_weight else None
            in_regs = has_acc and not acc_shared
            dw_local = T.alloc_local((vecs, vec), f32) if in_regs and has_weight else None
            db_local = T.alloc_local((vecs, vec), f32) if in_regs and has_bias else None
            dw_shared = T.alloc_shared((block_rows, n), f32) \
                if combine and has_weight else None
            db_shared = None
            if combine and has_bias:  # registers combine one accumulator after the other
                db_shared = dw_shared if dw_shared is not None and not acc_shared \
                    else T.alloc_shared((block_rows, n), f32)
            part = T.alloc_local((n_sums,), f32)
            mean = T.alloc_local((1,), f32) if centered else None
            stat = T.alloc_local((3,), f32)  # rstd, mean(g xhat), mean(g)
            # one buffer for the mean and one for the other sums (each used once a step:
            # the barrier of the other keeps a fast warp from overwriting one still read);
            # RMSNorm's single sum alternates two buffers by step for the same reason
            red = T.alloc_shared((2, n_sums, block_rows, warps), f32) if warps > 1 else None
            red_mean = T.alloc_shared((1, 1, block_rows, warps), f32) \
                if warps > 1 and centered else None
            dy_ring = T.alloc_shared((stages, block_rows, n), dtype) if stages else None
            h_ring = T.alloc_shared((stages, block_rows, n), dtype) if stages else None
            firsts = T.alloc_shared((slots,), "int32") if dynamic else None
            dealt = T.alloc_local((1,), "int32") if dynamic else None  # this step's first row
            pending = T.alloc_local((1,), "int32") if dynamic else None

            if has_weight:
                for i in T.unroll(vecs):
                    for j in T.vectorized(vec):
                        w_local[i, j] = w[col(i, j, lane)]
            for i in T.unroll(vecs):
                for j in T.unroll(vec):
                    if in_regs and has_weight:
                        dw_local[i, j] = 0.0
                    if in_regs and has_bias:
                        db_local[i, j] = 0.0
                    if acc_shared and has_weight:
                        dw_shared[r, col(i, j, lane)] = 0.0
                    if acc_shared and has_bias:
                        db_shared[r, col(i, j, lane)] = 0.0
            if prefetch:
                first = T.min(bx * block_rows + r, rows - 1)
                load_row(dy, dy_next, first, lane)
                load_row(h, h_next, first, lane)
            if dynamic:
                # the first stages steps as the static deal has them: no atomic's round trip
                # before the first loads
                if tx == 0:
                    for p in T.unroll(stages):
                        firsts[p] = (p * ctas + bx) * block_rows
                    pending[0] = (stages * ctas + bx) * block_rows
                T.sync_threads()
                for p in T.unroll(stages - 1):  # the ring's first steps
                    if firsts[p] < rows:
                        ring_issue(dy, dy_ring, p, ring_row(firsts[p], r), r, lane)
                        ring_issue(h, h_ring, p, ring_row(firsts[p], r), r, lane)
                    T.ptx_commit_group()
            elif stages:
                for p in T.unroll(stages - 1):  # the ring's first steps
                    ring_issue(dy, dy_ring, p, step_row(p, bx, r), r, lane)
                    ring_issue(h, h_ring, p, step_row(p, bx, r), r, lane)
                    T.ptx_commit_group()
            # dynamic: at most every row to one CTA; the rows run out first (a break)
            for step in T.serial(T.ceildiv(rows, block_rows) if dynamic
                                 else T.ceildiv(rows, parts)):
                if dynamic:
                    dealt[0] = firsts[step % slots]
                    if dealt[0] >= rows:  # the same value in every thread: all leave
                        T.loop_break()
                    row_in = dealt[0] + r
                else:
                    row_in = (step * ctas + bx) * block_rows + r
                # rows past the last re-read it, so every thread meets the barriers; only
                # their stores and dW / dB shares are skipped
                row = T.min(row_in, rows - 1)
                if dynamic:
                    # step + stages - 1 into the slot this thread read a step ago (dealt two
                    # barriers ago), this step's copies waited for, the next rows dealt
                    ahead = firsts[(step + stages - 1) % slots]
                    if ahead < rows:
                        ring_issue(dy, dy_ring, (step + stages - 1) % stages,
                                   ring_row(ahead, r), r, lane)
                        ring_issue(h, h_ring, (step + stages - 1) % stages,
                                   ring_row(ahead, r), r, lane)
                    T.ptx_commit_group()
                    deal(sched, firsts, pending, step, tx)
                    T.ptx_wait_group(stages - 1)
                    ring_read(dy_ring, dy_local, step % stages, r, lane)
                    ring_read(h_ring, h_local, step % stages, r, lane)
                elif prefetch:
                    for i in T.unroll(vecs):
                        for j in T.unroll(vec):
                            dy_local[i, j] = dy_next[i, j]
                            h_local[i, j] = h_next[i, j]
                    ahead = T.min(row_in + parts, rows - 1)
                    load_row(dy, dy_next, ahead, lane)
                    load_row(h, h_next, ahead, lane)
                elif stages:
                    # step + stages - 1 into the slot this thread read a step ago, then this
                    # step's copies (all but the newest stages - 1 groups) waited for
                    ahead = (step + stages - 1) % stages
                    later = step_row(step + stages - 1, bx, r)
                    ring_issue(dy, dy_ring, ahead, later, r, lane)
                    ring_issue(h, h_ring, ahead, later, r, lane)
                    T.ptx_commit_group()
                    T.ptx_wait_group(stages - 1)
                    ring_read(dy_ring, dy_local, step % stages, r, lane)
                    ring_read(h_ring, h_local, step % stages, r, lane)
                else:
                    load_row(dy, dy_local, row, lane)
                    load_row(h, h_local, row, lane)
                if has_residual_grad:  # used last: in flight through the sums
                    load_row(dres, dres_local, row, lane)
                if centered:
                    part[0] = 0.0
                    for i in T.unroll(vecs):
                        for j in T.unroll(vec):
                            part[0] = part[0] + T.cast(h_local[i, j], f32)
                    row_sums(part, 1, red_mean, 0, r, lane)
                    mean[0] = part[0] / n
                for q in T.unroll(n_sums):
                    part[q] = 0.0
                for i in T.unroll(vecs):
                    for j in T.unroll(vec):
                        c = T.cast(h_local[i, j], f32)
                        if centered:
                            c = c - mean[0]
                        g = T.cast(dy_local[i, j], f32)
                        if has_weight:
                            g = g * T.cast(w_local[i, j], f32)
                        part[0] = part[0] + c * c
                        part[1] = part[1] + g * c
                        if centered:
                            part[2] = part[2] + g
                row_sums(part, n_sums, red, step % 2, r, lane)
                stat[0] = T.rsqrt(part[0] / n + eps)
                stat[1] = part[1] * stat[0] / n  # mean(g xhat)
                if centered:
                    stat[2] = part[2] / n  # mean(g)
                for i in T.unroll(vecs):
                    for j in T.unroll(vec):
                        d = T.cast(dy_local[i, j], f32)
                        xhat = T.cast(h_local[i, j], f32)
                        if centered:
                            xhat = xhat - mean[0]
                        xhat = xhat * stat[0]
                        g = d * T.cast(w_local[i, j], f32) if has_weight else d
                        res = T.cast(dres_local[i, j], f32) if has_residual_grad else None
                        if row_in < rows:
                            if has_weight:
                                accumulate(dw_local, dw_shared, r, lane, i, j, d * xhat)
                            if has_bias:
                                accumulate(db_local, db_shared, r, lane, i, j, d)
                        # dx over h: this element of h is not read again
                        h_local[i, j] = T.cast(dx_value(
                            g, xhat, stat[1], stat[2] if centered else None, stat[0], res), dtype)
                if row_in < rows:
                    for i in T.unroll(vecs):
                        for j in T.vectorized(vec):
                            dx[row, col(i, j, lane)] = h_local[i, j]
                if dynamic and warps == 1:  # (row_sums' barrier publishes the deal otherwise)
                    T.sync_threads()
            if stages:  # the ring's copies past the last step, landed before the exit
                T.ptx_wait_group(0)
            if dynamic:
                # every thread has read its last dealt row (TileLang may place the CTA's
                # dW / dB rows over `firsts`, and its own sync pass is off here)
                T.sync_threads()
            if has_weight:
                write_partial(dw_local, dw_shared, dw_part, bx, r, lane)
            if has_bias:
                write_partial(db_local, db_shared, db_part, bx, r, lane)
            if dynamic:
                leave(sched, tx)

    return body
