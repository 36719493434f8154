"""Cross-entropy over vocabulary rows: the per-row loss, and its gradient in the same pass.

Per row, with z = softcap * tanh(x / softcap) (Gemma-2's final logit soft-capping; z = x
without it), lse = logsumexp(z), p = softmax(z), eps = label_smoothing, V = the row length:

    loss = lse - (1 - eps) * z[t] - eps / V * sum(z) + zloss * lse^2
    dloss/dz = p - (1 - eps) * onehot(t) - eps / V + 2 * zloss * lse * p
    dloss/dx = dloss/dz * (1 - (z / softcap)^2)

A row whose target is `ignore_index` has loss 0 and gradient 0. A target outside [0, V)
(and not ignore_index) gives a NaN loss and a NaN gradient row: loud, not silent; the op
offers a checked mode that raises instead.

Modes: `loss` (one pass: loss and lse per row, fp32), `loss_and_grad` (two passes: also the
unscaled gradient; it may be written over the logits, each element being read before it is
written), `grad` (one pass from the saved lse, scaled by dloss per row or one dloss for all).
"""


import dataclasses
from dataclasses import dataclass

import tilelang.language as T

from .. import fast_math
from .cluster_rows import SHARED_BYTES, ClusterRows, kept_factor, slice_shape
from .meeting_slices import meeting_macros, reduced_slice_macro, scratch_shapes
from .row_map import LOG2E, NEG_INF, RowMap, exp, vector_width
from .softmax import (
    SM_COUNT,
    RowConfig,
    RowKernel,
    default_row_config,
    landed_configs,
    landed_default,
    meeting_configs,
    paired_default,
    row_map,
    two_pass_accesses,
    walk_variants,
)

MODES = ("loss", "loss_and_grad", "grad")
SMEM_BYTES = SHARED_BYTES


@dataclass(frozen=True)
class CrossEntropyConfig(RowConfig):
    """RowConfig, plus
    - `kept_chunks`: in `loss_and_grad` mode, how many leading chunks of each row the
      statistics pass keeps in shared memory for the gradient pass (0: the gradient pass
      reads the whole row again from L2 / HBM). The other chunks are read again first,
      right after the statistics pass read them, so they come from L2.
    - `prefetch`: the first pass over a row (statistics; in `grad` mode the only one) loads
      chunk c + 1 into registers while it works on chunk c, so loads stay in flight through
      the arithmetic (a second register buffer of vecs x 16 bytes per thread).
    - `launch_bound`: `ctas_per_sm` CTAs are made resident together (__launch_bounds__'s
      minimum blocks: registers capped at 65536 / (ctas_per_sm x threads)). Without it the
      compiler takes what it likes (88-120 registers at 512 threads), so one CTA is
      resident per SM whatever `ctas_per_sm` says: the grid has that many CTAs per SM, but
      they run one after another.
    (RowConfig's `landed`: in the `loss` and `loss_and_grad` modes.)"""

    kept_chunks: int = 0
    prefetch: bool = False
    launch_bound: bool = False


def kept_chunks_of(mode: str, rm: RowMap, config: RowConfig) -> int:
    """The chunks kept in shared memory (none for a one-chunk row: it stays in registers)."""
    if mode != "loss_and_grad" or rm.chunks == 1:
        return 0
    return min(getattr(config, "kept_chunks", 0), rm.chunks)


def kept_row_configs(n: int, dtype: str) -> list[CrossEntropyConfig]:
    """The `loss_and_grad` configs that keep rows in shared memory: one CTA per SM (the kept
    chunks take most of its shared memory), 512 or 1024 threads on one row, as many chunks
    kept as fit. Empty for rows of one chunk (kept in registers anyway)."""
    configs = []
    for threads, vecs in ((512, 2), (512, 4), (512, 8), (1024, 2), (1024, 4)):
        config = CrossEntropyConfig(threads, threads, vecs, 1)
        rm = RowMap(n, dtype, threads, threads, vecs, SM_COUNT)
        fit = min(rm.chunks, (SMEM_BYTES - 4096) // rm.kept_bytes(1))
        if rm.chunks > 1 and fit > 0:
            configs.append(dataclasses.replace(config, kept_chunks=fit))
            # the second register buffer (raw vectors, 4 registers each) next to the fp32
            # chunk, under the launch bound of one CTA per SM (estimate; ptxas checks)
            if vecs * (rm.vec + 8) + 40 <= 65536 // threads:
                configs.append(dataclasses.replace(config, kept_chunks=fit, prefetch=True))
    return configs


def default_variants(default: CrossEntropyConfig, mode: str, n: int,
                     dtype: str) -> list[CrossEntropyConfig]:
    """The default thread map with prefetch, with its CTAs per SM made resident, and both
    (not in `grad` mode: its prefetch buffer spills under the 64-register bound); in
    `loss_and_grad` mode also its second-pass walks (softmax.walk_variants), resident."""
    variants = [dataclasses.replace(default, prefetch=True),
                dataclasses.replace(default, launch_bound=True)]
    if mode != "grad":
        variants.append(dataclasses.replace(default, prefetch=True, launch_bound=True))
    if mode == "loss_and_grad":  # the second pass's walks, made resident as configured
        variants += [dataclasses.replace(v, launch_bound=True)
                     for v in walk_variants(default, n, dtype)]
    return variants


def target_column(t, n: int):
    """The target's column as int32, -1 where it is no column (ignored or out of range:
    those rows' gradients are scaled by 0 or NaN anyway), so the one-hot compare per
    element is a 32-bit one."""
    return T.cast(T.if_then_else((t >= 0) & (t < n), t, T.int64(-1)), "int32")


def soft_capped(x, cap):
    """cap * tanh(x / cap) written as cap - 2 cap / (e^(2x / cap) + 1): a multiply into the
    SFU's ex2, an add, the approximate reciprocal and a fused multiply-add an element, the
    factors 2 log2(e) / cap and 2 cap loop-invariant (hoisted). Exact at +-inf, absolute
    error ~cap * 1e-7. An IEEE division per element made these kernels compute-bound (24% of
    HBM, 2026-12-02), tanh from exp2f and three multiplies by 1 / cap still issue-bound (48%,
    2026-12-02)."""
    return fast_math.scaled_tanh(x, 1.0 / cap, cap)


def z_loss_factor(lse, zloss):
    """What the softmax is multiplied by in the gradient with the z-loss term."""
    return 1.0 + 2.0 * zloss * lse


def gradient_from_softmax(p, col, t, eps, n: int):
    """d loss / dz at one element from p = its softmax e^(z - lse) times z_loss_factor: col
    its column, t target_column(target)."""
    return p - eps / n - T.if_then_else(col == t, 1.0 - eps, 0.0)


def gradient_of(z, col, t, lse, scale, cap, eps, zloss, n: int, softcap: bool):
    """d(loss * scale)/dx at one element: z its soft-capped logit, col its column, t
    target_column(target). e^(z - lse) as 2^(z log2 e - lse log2 e): one fused multiply-add
    into the ex2."""
    g = gradient_from_softmax(fast_math.exp2(z * LOG2E - lse * LOG2E) * z_loss_factor(lse, zloss),
                              col, t, eps, n)
    if softcap:
        g = g * (1.0 - (z * (1.0 / cap)) * (z * (1.0 / cap)))
    return g * scale


def row_scale(t, ignore_index, n: int, value):
    """A row's loss / gradient factor: 0 for an ignored row, NaN for a target outside the
    row (loud, not silent), else `value`."""
    bad = (t != ignore_index) & ((t < 0) | (t >= n))
    return T.if_then_else(t == ignore_index, T.float32(0.0),
                          T.if_then_else(bad, T.float32(float("nan")), value))


def slice_macros(cr: ClusterRows, softcap: bool, smoothing: bool):
    """(z_of, slice_statistics) over a thread's slots of a slice held as loaded (raw)."""

    def z_of(raw, rank, tx, i, j, cap):
        """Slot (i, j)'s soft-capped logit (the logit without softcap; -inf padding stays)."""
        x = T.cast(raw[i, j], "float")
        if not softcap:
            return x
        return T.if_then_else(cr.valid(rank, tx, i), soft_capped(x, cap), NEG_INF)

    @T.macro
    def slice_statistics(raw, rank, tx, cap, m, s, zsum):
        """The thread's (max, exp-sum, and with smoothing the z-sum) of its slots."""
        m[0] = NEG_INF
        for i in T.unroll(cr.per_thread):
            for j in T.unroll(cr.vec):
                m[0] = T.max(m[0], z_of(raw, rank, tx, i, j, cap))
        shift = RowMap.shift_of(m[0])
        s[0] = 0.0
        zsum[0] = 0.0
        for i in T.unroll(cr.per_thread):
            for j in T.unroll(cr.vec):
                s[0] = s[0] + exp(z_of(raw, rank, tx, i, j, cap) - shift)
                if smoothing:
                    zsum[0] = zsum[0] + T.if_then_else(
                        cr.valid(rank, tx, i), z_of(raw, rank, tx, i, j, cap), 0.0)

    return z_of, slice_statistics


def target_logit(x, row, t, ignore_index, n: int, cap, softcap: bool):
    """z[t] of the row (soft-capped), 0 for an ignored row or a target outside it."""
    inside = (t != ignore_index) & (t >= 0) & (t < n)
    z = T.cast(x[row, T.if_then_else(inside, t, T.int64(0))], "float")
    if softcap:
        z = soft_capped(z, cap)
    return T.if_then_else(inside, z, T.float32(0.0))


def row_loss(lse, zt, zsum, eps, zloss, n: int):
    """loss of a row from its lse, target logit and z-sum (label smoothing eps, z-loss)."""
    return lse - (1.0 - eps) * zt - eps / n * zsum + zloss * lse * lse


CROSS_ENTROPY_PARTIALS = 3  # max, exp-sum, z-sum


def meeting_cross_entropy_program(n: int, dtype: str, softcap: bool, smoothing: bool,
                                  config: RowConfig):
    """The `loss` mode with each row cut into `config.cluster` slices, one CTA each, meeting
    through global memory (meeting_slices.py): one read of the logits; the last CTA of a row
    reads z[target] and writes the loss and lse."""
    rows = T.dynamic("rows")
    P, C = scratch_shapes()
    cr = ClusterRows(n, dtype, config.cluster, config.threads)
    reduced_slice = reduced_slice_macro(cr, slice_macros(cr, softcap, smoothing)[1], smoothing)
    meet, merged_max_sum, merged_sum = meeting_macros(cr.cluster, CROSS_ENTROPY_PARTIALS)
    R, V = (rows, n), (rows,)

    @T.prim_func
    def cross_entropy_fwd(x: T.Tensor(R, dtype), target: T.Tensor(V, "int64"),
                          loss: T.Tensor(V, "float"), lse_out: T.Tensor(V, "float"),
                          ignore_index: T.int64, cap: T.float32, eps: T.float32,
                          zloss: T.float32, part: T.Tensor(P, "float"),
                          count: T.Tensor(C, "int32"),
                          clusters: T.int32):  # unused: one CTA per slice of every row
        with T.Kernel(cr.grid(rows), threads=cr.threads) as bx:
            fast_math.import_source()
            tx = T.get_thread_binding()
            row, rank = bx // cr.cluster, bx % cr.cluster
            m = T.alloc_local((1,), "float")
            s = T.alloc_local((1,), "float")
            zsum = T.alloc_local((1,), "float")
            arrived = T.alloc_local((1,), "int32")
            reduced_slice(x, row, rank, tx, cap, m, s, zsum)
            if tx == 0:
                meet(part, count, row, rank, (m, s, zsum), arrived)
                if arrived[0] == cr.cluster - 1:
                    merged_max_sum(part, row, m, s)
                    if smoothing:
                        merged_sum(part, row, 2, zsum)
                    t = target[row]
                    lse = m[0] + T.log(s[0])
                    zt = target_logit(x, row, t, ignore_index, n, cap, softcap)
                    loss[row] = row_scale(t, ignore_index, n,
                                          row_loss(lse, zt, zsum[0], eps, zloss, n))
                    lse_out[row] = lse
                    count[0, row] = 0

    return cross_entropy_fwd


def cluster_cross_entropy_program(mode: str, n: int, dtype: str, softcap: bool,
                                  smoothing: bool, dloss_per_row: bool, config: RowConfig):
    """The MODES on rows split over a cluster (cluster_rows.py): the logits are read once and
    kept in registers as loaded; the CTAs swap their (max, exp-sum, z-sum) partials; the
    gradient comes from the registers (written over the logits when asked: each CTA writes
    only the slice it holds). Persistent clusters; with `config.meet` (loss_and_grad)
    unclustered CTAs, one per slice of every row, swapping through global memory
    (meeting_slices.exchange_macro). The `grad` mode has nothing to swap: one unclustered
    CTA per slice of every row."""
    rows = T.dynamic("rows")
    meet = config.meet
    cr = ClusterRows(n, dtype, config.cluster, config.threads, config.ctas_per_sm, meet)
    load, _, begin, _, merged_max_sum, merged_sum = cr.macros()
    reduce_sum, reduce_max_sum = cr.reductions()
    per, vec, cluster = cr.per_thread, cr.vec, cr.cluster
    z_of, slice_statistics = slice_macros(cr, softcap, smoothing)
    swap, parity = cr.swap_macros(CROSS_ENTROPY_PARTIALS)
    landed = config.landed
    cr.check_landed(landed, mode != "grad", "mode 'grad' (one CTA per slice of every row)")
    alloc_source, first_row, fetch = cr.row_source(landed, rows)
    kept = config.kept_exp
    cr.check_kept(kept, mode == "loss_and_grad" and not softcap,
                  f"mode {mode!r}, softcap={softcap} (kept exps: the gradient without softcap)")
    kept_max_sum, max_then_sum = cr.kept_macros(smoothing)

    @T.macro
    def store_kept_gradient(e, thread_max, grad, row, rank, tx, t, lse, scale, eps, zloss):
        """grad's slice <- d(loss * scale)/dx from the kept exps: softmax = e * exp(thread
        max - lse), one multiply an element (gradient_of's terms otherwise)."""
        factor = kept_factor(thread_max[0], lse) * z_loss_factor(lse, zloss)
        g = T.alloc_local((vec,), "float")
        for i in T.unroll(per):
            if cr.valid(rank, tx, i):
                for j in T.unroll(vec):
                    g[j] = gradient_from_softmax(e[i, j] * factor, cr.column(rank, tx, i) + j,
                                                 t, eps, n) * scale
                for j in T.vectorized(vec):
                    grad[row, cr.column(rank, tx, i) + j] = T.cast(g[j], dtype)

    @T.macro
    def store_gradient(raw, grad, row, rank, tx, t, lse, scale, cap, eps, zloss):
        """grad's slice <- d(loss * scale)/dx from the logits held in raw."""
        g = T.alloc_local((vec,), "float")
        for i in T.unroll(per):
            if cr.valid(rank, tx, i):
                for j in T.unroll(vec):
                    g[j] = gradient_of(z_of(raw, rank, tx, i, j, cap),
                                       cr.column(rank, tx, i) + j, t, lse, scale, cap, eps,
                                       zloss, n, softcap)
                for j in T.vectorized(vec):
                    grad[row, cr.column(rank, tx, i) + j] = T.cast(g[j], dtype)

    @T.macro
    def forward(x, target, loss, lse_out, grad, ignore_index, cap, eps, zloss, clusters,
                gpart=None, counts=None):
        with T.Kernel(cr.launch_grid(rows, clusters), threads=cr.threads,
                      cluster_dims=cr.launch_cluster) as bx:
            T.assume(clusters > 0)  # rows from it are >= 0: no sign guards on them
            fast_math.import_source()
            T.annotate_min_blocks_per_sm(config.ctas_per_sm)
            tx = T.get_thread_binding()
            rank = bx % cluster
            raw = T.alloc_local((per, vec), dtype)
            m = T.alloc_local((1,), "float")
            s = T.alloc_local((1,), "float")
            zsum = T.alloc_local((1,), "float")
            zt = T.alloc_local((1,), "float")
            e = T.alloc_local((per, vec) if kept else (1, 1), "float")  # kept exps
            thread_max = T.alloc_local((1,), "float")
            red_m = T.alloc_shared((1, cr.warps), "float")
            red_s = T.alloc_shared((1, cr.warps), "float")
            red_z = T.alloc_shared((1, cr.warps), "float")
            mine = T.alloc_shared((3,), "float")
            part = T.alloc_shared((2, cluster, 3), "float")
            arrived = T.alloc_local((1,), "int32")
            src = alloc_source()
            begin(part, tx)
            first_row(x, bx, rank, src, clusters)
            for step in T.serial(cr.launch_steps(rows, clusters)):
                row = cr.row_of(step, bx, clusters)
                if row < rows:
                    fetch(x, row, step, bx, rank, tx, raw, NEG_INF, src, clusters)
                    t = target[row]
                    # z[t], read before the exchange (a barrier of the row's CTAs), so before
                    # any CTA of the row stores a gradient (possibly over x)
                    zt[0] = 0.0
                    if (rank == 0) & (tx == 0) & (t != ignore_index) & (t >= 0) & (t < n):
                        zt[0] = T.cast(x[row, t], "float")
                        if softcap:
                            zt[0] = soft_capped(zt[0], cap)
                    if kept:
                        kept_max_sum(raw, e, thread_max, m, s, zsum, rank, tx)
                        max_then_sum(thread_max, m, s, red_m, red_s, tx)
                    else:
                        slice_statistics(raw, rank, tx, cap, m, s, zsum)
                        reduce_max_sum(m, s, red_m, red_s, 0, tx)
                    if smoothing:
                        reduce_sum(zsum, red_z, 0, tx)
                    swap((m, s, zsum), mine, part, step, rank, tx, row, gpart, counts, arrived)
                    merged_max_sum(part, parity(step), m, s)
                    if smoothing:
                        merged_sum(part, parity(step), 2, zsum)
                    lse = m[0] + T.log(s[0])
                    if (rank == 0) & (tx == 0):
                        loss[row] = row_scale(t, ignore_index, n,
                                              row_loss(lse, zt[0], zsum[0], eps, zloss, n))
                        lse_out[row] = lse
                    if kept:
                        store_kept_gradient(e, thread_max, grad, row, rank, tx,
                                            target_column(t, n), lse,
                                            row_scale(t, ignore_index, n, T.float32(1.0)), eps,
                                            zloss)
                    elif mode == "loss_and_grad":
                        store_gradient(raw, grad, row, rank, tx, target_column(t, n), lse,
                                       row_scale(t, ignore_index, n, T.float32(1.0)), cap, eps,
                                       zloss)

    @T.macro
    def backward(dloss, x, target, lse_in, grad, ignore_index, cap, eps, zloss, clusters):
        with T.Kernel(cr.grid(rows), threads=cr.threads) as bx:
            fast_math.import_source()
            tx = T.get_thread_binding()
            row, rank = bx // cluster, bx % cluster
            raw = T.alloc_local((per, vec), dtype)
            load(x, row, rank, tx, raw, NEG_INF)
            t = target[row]
            d = dloss[row] if dloss_per_row else dloss[0]
            store_gradient(raw, grad, row, rank, tx, target_column(t, n), lse_in[row],
                           row_scale(t, ignore_index, n, d), cap, eps, zloss)

    return rows, forward, backward


def cross_entropy_program(mode: str, n: int, dtype: str, softcap: bool, smoothing: bool,
                          dloss_per_row: bool, config: RowConfig):
    if config.meet:
        if mode == "grad" or not config.cluster:
            raise ValueError(f"meet={config.meet} needs slices (cluster > 1) and statistics "
                             f"to share; got mode {mode!r}, cluster={config.cluster}")
        if mode == "loss":
            return meeting_cross_entropy_program(n, dtype, softcap, smoothing, config)
    if config.cluster:
        rows, forward, backward = cluster_cross_entropy_program(
            mode, n, dtype, softcap, smoothing, dloss_per_row, config)
        return prim_func_of(mode, rows, n, dtype, dloss_per_row, forward, backward,
                            meeting=config.meet)
    rows = T.dynamic("rows")
    rm = row_map(n, dtype, config)
    load, store, reduce_sum, reduce_max_sum, chunk_max_sum = rm.macros(rows)
    vecs, vec, rpc, rt, ctas, chunk = rm.vecs, rm.vec, rm.rows_per_cta, rm.row_threads, \
        rm.ctas, rm.chunk
    warps = max(rm.row_warps, 1)
    reload = rm.chunks > 1  # a one-chunk row stays in registers between the passes
    kept = kept_chunks_of(mode, rm, config)
    if rm.kept_bytes(kept) * config.ctas_per_sm > SMEM_BYTES:
        raise ValueError(f"kept_chunks={kept} of {rm.chunk}-element rows x {rpc} rows x "
                         f"{config.ctas_per_sm} CTAs per SM needs {rm.kept_bytes(kept)} bytes "
                         f"of shared memory per CTA; an SM has {SMEM_BYTES}")
    load_raw, unpack = rm.kept_macros(kept)
    prefetch = getattr(config, "prefetch", False) and rm.chunks > 1
    bound = getattr(config, "launch_bound", False)

    @T.macro
    def resident():
        if bound:
            T.annotate_min_blocks_per_sm(config.ctas_per_sm)
    raw_path = prefetch or kept > 0  # else the plain `load` (the code of the default)
    if rm.l2_hints and raw_path:
        raise ValueError("l2_hints is a form of the plain streaming walk: not with "
                         f"prefetch={prefetch} or kept_chunks={kept}")
    hint_state, first_load, second_load, out_store = two_pass_accesses(rm, load, store)

    @T.macro
    def fetch(x, row, c, raw, raw_next, lane):
        """raw <- chunk c of x's row. With prefetch it is already in raw_next (the caller
        loaded chunk 0 there before the loop) and chunk c + 1 goes there now."""
        if prefetch:
            for i in T.unroll(vecs):
                for j in T.unroll(vec):
                    raw[i, j] = raw_next[i, j]
            if c + 1 < rm.chunks:
                load_raw(x, row, c + 1, raw_next, lane)
        else:
            load_raw(x, row, c, raw, lane)

    @T.macro
    def capped(xl, c, lane, cap, zsum, add_sum):
        """xl <- z = cap * tanh(xl / cap) (the soft-capped logits) on the row's columns, the
        padding past the row left as loaded; zsum += the row's z (label smoothing)."""
        for i in T.unroll(vecs):
            if c * chunk + (i * rt + lane) * vec < n:
                for j in T.unroll(vec):
                    if softcap:
                        xl[i, j] = soft_capped(xl[i, j], cap)
                    if add_sum:
                        zsum[0] = zsum[0] + xl[i, j]

    def column_of(t):
        return target_column(t, n)

    @T.macro
    def gradient(xl, row, c, lane, t, lse, scale, cap, eps, zloss):
        """xl (soft-capped logits of chunk c) <- d(loss * scale)/dx; t: column_of(target)."""
        for i in T.unroll(vecs):
            for j in T.unroll(vec):
                col = c * chunk + (i * rt + lane) * vec + j
                xl[i, j] = gradient_of(xl[i, j], col, t, lse, scale, cap, eps, zloss, n,
                                       softcap)

    @T.macro
    def forward(x, target, loss, lse_out, grad, ignore_index, cap, eps, zloss, clusters):
        with T.Kernel(rm.grid(rows), threads=rm.threads) as bx:
            fast_math.import_source()
            resident()
            tx = T.get_thread_binding()
            r, lane = tx // rt, tx % rt
            xl = T.alloc_local((vecs, vec), "float")
            m = T.alloc_local((1,), "float")
            s = T.alloc_local((1,), "float")
            zsum = T.alloc_local((1,), "float")
            zt = T.alloc_local((1,), "float")
            red_m = T.alloc_shared((rpc, warps), "float")
            red_s = T.alloc_shared((rpc, warps), "float")
            red_z = T.alloc_shared((rpc, warps), "float")
            kept_shared = T.alloc_shared((rpc, kept * chunk), dtype) if kept else None
            raw = T.alloc_local((vecs, vec), dtype) if raw_path else None
            raw_next = T.alloc_local((vecs, vec), dtype) if prefetch else None
            hinted_raw, policy = hint_state()
            for step in T.serial(rm.row_loop_bounds(rows)):
                row, guard, live = rm.placed_row(step * ctas + bx, r, rows)
                if guard:
                    m[0] = NEG_INF
                    s[0] = 0.0
                    zsum[0] = 0.0
                    if prefetch:
                        load_raw(x, row, 0, raw_next, lane)
                    for c in T.serial(rm.chunks):
                        if raw_path:  # padding: exp(-inf) = 0
                            fetch(x, row, c, raw, raw_next, lane)
                            unpack(raw, c, xl, kept_shared, r, lane, NEG_INF)
                        else:
                            first_load(x, row, c, hinted_raw, xl, lane, NEG_INF, policy)
                        capped(xl, c, lane, cap, zsum, smoothing)
                        chunk_max_sum(xl, m, s)
                    t = target[row]
                    # z[t] is read before the reductions: their barrier (shuffles within a
                    # warp) orders it before any gradient store of the row, which may
                    # overwrite x in place
                    zt[0] = 0.0
                    if (lane == 0) & (t != ignore_index) & (t >= 0) & (t < n):
                        zt[0] = T.cast(x[row, t], "float")
                        if softcap:
                            zt[0] = soft_capped(zt[0], cap)
                    reduce_max_sum(m, s, red_m, red_s, r, lane)
                    if smoothing:
                        reduce_sum(zsum, red_z, r, lane)
                    lse = m[0] + T.log(s[0])
                    if live:
                        if lane == 0:
                            loss[row] = row_scale(t, ignore_index, n,
                                                  row_loss(lse, zt[0], zsum[0], eps, zloss, n))
                            lse_out[row] = lse
                    if mode == "loss_and_grad":
                        scale = row_scale(t, ignore_index, n, T.float32(1.0))
                        tc = column_of(t)
                        # the chunks not kept first: the statistics pass read them last
                        if kept < rm.chunks:
                            for step2 in T.serial(rm.chunks - kept):
                                c = rm.second_pass_chunk(step2, kept)
                                if reload:  # else the one chunk's z is still in registers
                                    second_load(x, row, c, hinted_raw, xl, lane, 0.0, policy)
                                    capped(xl, c, lane, cap, None, False)
                                gradient(xl, row, c, lane, tc, lse, scale, cap, eps, zloss)
                                if live:
                                    out_store(xl, hinted_raw, grad, row, c, lane, policy)
                        if kept:
                            for c in T.serial(kept):
                                load(kept_shared, r, c, xl, lane, 0.0)  # from shared memory
                                capped(xl, c, lane, cap, None, False)
                                gradient(xl, row, c, lane, tc, lse, scale, cap, eps, zloss)
                                if live:
                                    store(xl, grad, row, c, lane)
                if rm.row_warps > 1:
                    T.sync_threads()

    @T.macro
    def backward(dloss, x, target, lse_in, grad, ignore_index, cap, eps, zloss, clusters):
        with T.Kernel(rm.grid(rows), threads=rm.threads) as bx:
            fast_math.import_source()
            resident()
            tx = T.get_thread_binding()
            r, lane = tx // rt, tx % rt
            xl = T.alloc_local((vecs, vec), "float")
            raw = T.alloc_local((vecs, vec), dtype) if prefetch else None
            raw_next = T.alloc_local((vecs, vec), dtype) if prefetch else None
            for step in T.serial(rm.row_loop_bounds(rows)):
                row = (step * ctas + bx) * rpc + r
                if row < rows:
                    t = target[row]
                    d = dloss[row] if dloss_per_row else dloss[0]
                    scale = row_scale(t, ignore_index, n, d)
                    lse = lse_in[row]
                    tc = column_of(t)
                    if prefetch:
                        load_raw(x, row, 0, raw_next, lane)
                    for c in T.serial(rm.chunks):
                        if prefetch:
                            fetch(x, row, c, raw, raw_next, lane)
                            unpack(raw, c, xl, None, r, lane, 0.0)
                        else:
                            load(x, row, c, xl, lane, 0.0)
                        capped(xl, c, lane, cap, None, False)
                        gradient(xl, row, c, lane, tc, lse, scale, cap, eps, zloss)
                        store(xl, grad, row, c, lane)

    return prim_func_of(mode, rows, n, dtype, dloss_per_row, forward, backward)


def prim_func_of(mode: str, rows, n: int, dtype: str, dloss_per_row: bool, forward, backward,
                 meeting: bool = False):
    """The program of `mode` around the kernel macros (the streaming or the cluster ones,
    which size their grids by the same symbolic `rows`); `meeting`: loss_and_grad on
    meeting slices, which takes the scratch buffers (meeting_slices.scratch_for). Every
    program takes `clusters` last (softmax.prim_func_of)."""
    R, V = (rows, n), (rows,)
    if meeting:
        P, C = scratch_shapes()

        @T.prim_func
        def cross_entropy_loss_grad_meeting(
                x: T.Tensor(R, dtype), target: T.Tensor(V, "int64"),
                loss: T.Tensor(V, "float"), lse: T.Tensor(V, "float"),
                grad: T.Tensor(R, dtype), ignore_index: T.int64, cap: T.float32,
                eps: T.float32, zloss: T.float32, gpart: T.Tensor(P, "float"),
                counts: T.Tensor(C, "int32"), clusters: T.int32):
            forward(x, target, loss, lse, grad, ignore_index, cap, eps, zloss, clusters, gpart,
                    counts)
        return cross_entropy_loss_grad_meeting
    if mode == "grad":
        D = (rows,) if dloss_per_row else (1,)

        @T.prim_func
        def cross_entropy_bwd(dloss: T.Tensor(D, "float"), x: T.Tensor(R, dtype),
                              target: T.Tensor(V, "int64"), lse: T.Tensor(V, "float"),
                              grad: T.Tensor(R, dtype), ignore_index: T.int64,
                              cap: T.float32, eps: T.float32, zloss: T.float32,
                              clusters: T.int32):
            backward(dloss, x, target, lse, grad, ignore_index, cap, eps, zloss, clusters)
        return cross_entropy_bwd
    if mode == "loss_and_grad":
        @T.prim_func
        def cross_entropy_loss_grad(x: T.Tensor(R, dtype), target: T.Tensor(V, "int64"),
                                    loss: T.Tensor(V, "float"), lse: T.Tensor(V, "float"),
                                    grad: T.Tensor(R, dtype), ignore_index: T.int64,
                                    cap: T.float32, eps: T.float32, zloss: T.float32,
                                    clusters: T.int32):
            forward(x, target, loss, lse, grad, ignore_index, cap, eps, zloss, clusters)
        return cross_entropy_loss_grad

    @T.prim_func
    def cross_entropy_fwd(x: T.Tensor(R, dtype), target: T.Tensor(V, "int64"),
                          loss: T.Tensor(V, "float"), lse: T.Tensor(V, "float"),
                          ignore_index: T.int64, cap: T.float32, eps: T.float32,
                          zloss: T.float32, clusters: T.int32):
        forward(x, target, loss, lse, None, ignore_index, cap, eps, zloss, clusters)
    return cross_entropy_fwd


class CrossEntropyKernel(RowKernel):
    """key: mode (see MODES), dtype, n (vocab), softcap and smoothing (whether those terms
    are compiled in), dloss_per_row (`grad` mode: reduction 'none')."""

    name = "cross_entropy"
    Config = CrossEntropyConfig
    offers_walks = False  # default_variants adds them, resident, in loss_and_grad mode only
    meeting_partials = CROSS_ENTROPY_PARTIALS

    @property
    def meets_in_two_passes(self) -> bool:
        return self.key["mode"] == "loss_and_grad"

    def persistent(self, config: RowConfig) -> bool:
        # mode 'grad' runs one unclustered CTA per slice of every row
        return super().persistent(config) and self.key["mode"] != "grad"

    def heuristic_config(self, bucket: str, arch: str) -> CrossEntropyConfig:
        row = super().heuristic_config(bucket, arch)
        n, dtype = self.key["n"], self.key["dtype"]
        if self.key["mode"] == "grad" and n // vector_width(n, dtype) > 1024:
            # one pass over rows past one chunk: unclustered slices, every load in flight.
            # Soft-capped logits (a tanh and an exp an element) want the most warps an SM to
            # hide the SFU's latency: Gemma-2's 256K row in 4 slices of 1024 threads, 1472
            # us against 1752 in 8 of 512 (H200, 2026-12-04)
            slices, threads = slice_shape(n, dtype,
                                          min_threads=1024 if self.key["softcap"] else 256)
            row = RowConfig(threads, threads, row.vecs, 1, slices)
        if self.key["mode"] == "loss_and_grad" and n // vector_width(n, dtype) > 1024 * row.vecs:
            # Loss and gradient in one kernel (two walks of the row) on one CTA of 1024
            # threads an SM where a row spans more than one such chunk: more warps to hide
            # the walks' exp and reductions. H200, bf16, 2026-12-04, against two CTAs of 512:
            # Gemma-2 softcap 2046.9 vs 2242.5 us, Qwen3 8K 1831.1 vs 2084.0, DeepSeek-V3 4K
            # 773.4 vs 842.7, Llama-3 16K smoothing 2994.0 vs 3382.1; Mistral's 32000 (one
            # chunk) lost, 888.5 vs 833.2. The loss pass alone stayed fastest on two of 512.
            row = dataclasses.replace(row, threads=1024, row_threads=1024, ctas_per_sm=1)
        if self.key["mode"] == "loss_and_grad" and bucket == "many" and not self.key["softcap"]:
            # Slices landed by TMA on 16-bit vocabulary rows (softmax.landed_default): 1.23-1.30x
            # the map above on H100 (Mistral's 32000: 1.30x the two CTAs of 512; Llama-3 16K
            # with smoothing 0.1: 3618 us against 4224); not with softcap (Gemma-2: 3106-3990
            # us against 2235). The gradient from kept exps on 256-thread CTAs two an SM
            # (softmax.paired_default, the softmax forward's default) measured no faster
            # here: Llama-3 8K 1749.5 us against 1702.5, Qwen3 8K 2030.2 against 2036.6 (H100,
            # forty-first session); it is in the tuner's space.
            landed = landed_default(n, dtype, CrossEntropyConfig)
            if landed is not None:
                return landed
        return CrossEntropyConfig(**dataclasses.asdict(row))

    def config_space(self, bucket: str) -> list[CrossEntropyConfig]:
        space = [CrossEntropyConfig(**dataclasses.asdict(c))
                 for c in super().config_space(bucket)]
        if self.key["mode"] == "loss_and_grad":
            space += kept_row_configs(self.key["n"], self.key["dtype"])
            if not self.key["softcap"]:
                paired = paired_default(self.key["n"], self.key["dtype"], True,
                                        CrossEntropyConfig)
                space += [paired] if paired is not None else []
        streaming = default_row_config(self.key["n"], self.key["dtype"], bucket == "few")
        space += default_variants(CrossEntropyConfig(**dataclasses.asdict(streaming)),
                                  self.key["mode"], self.key["n"], self.key["dtype"])
        if self.key["mode"] == "loss":
            space += meeting_configs(self.key["n"], self.key["dtype"], CrossEntropyConfig)
        if self.key["mode"] != "grad":
            space += landed_configs(self.key["n"], self.key["dtype"], CrossEntropyConfig)
        return list(dict.fromkeys(space))

    def program(self, config: RowConfig, bucket: str):
        k = self.key
        return cross_entropy_program(k["mode"], k["n"], k["dtype"], k["softcap"],
                                     k["smoothing"], k["dloss_per_row"], config)
