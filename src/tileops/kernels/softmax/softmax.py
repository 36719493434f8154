"""softmax, log_softmax and logsumexp over the last dim, forward and backward.

    forward:  m, s = max(x), sum(exp(x - m))      (one pass, online)
              softmax = exp(x - m) / s;  log_softmax = x - (m + log s);  logsumexp = m + log s
    backward: softmax:     dx = y * (dy - sum(dy * y))
              log_softmax: dx = dy - exp(y) * sum(dy)
              logsumexp:   dx = g * exp(x - lse)   (one pass: the row statistic is an input)

Math in fp32, outputs in the input dtype (as torch). The streaming kernels' two-pass kinds
read their rows twice (row_map.py: the thread map, why the grid is persistent, the second
pass's walks); the slice forms read them once, holding each slice in registers and
swapping partial statistics within a thread-block cluster (cluster_rows.py) or through
global memory (meeting_slices.py).
"""

import dataclasses
from dataclasses import dataclass

import tilelang.language as T

from .. import fast_math, l2_hints
from ..base import Kernel
from ..cluster_occupancy import resident_clusters
from ..vectors import ELEM_BYTES
from .cluster_rows import (
    MAX_CLUSTER,
    ClusterRows,
    cluster_shapes,
    kept_factor,
    landed_shapes,
    slice_shape,
)
from .meeting_slices import meeting_macros, reduced_slice_macro, scratch_for, scratch_shapes
from .row_map import NEG_INF, RowMap, exp, vector_width

KINDS = ("softmax", "log_softmax", "logsumexp", "softmax_bwd", "log_softmax_bwd",
         "logsumexp_bwd")
SM_COUNT = 132  # H200
L2_BYTES = 50 * 2**20  # H200


@dataclass(frozen=True)
class RowConfig:
    """The streaming thread map of row_map.py (with `reverse` and `l2_hints`, its second
    pass's walks); or, with `cluster` > 0, each row split over a cluster of that many CTAs
    of `threads` threads holding it in registers (cluster_rows.py; row_threads, vecs and
    ctas_per_sm unused), or with `meet` over that many unclustered CTAs that meet through
    global memory (meeting_slices.py: the one-pass statistics, logsumexp and the loss), or
    with `landed` each CTA's slice of the next row landing in shared memory by TMA while
    it works on this one (ClusterRows.row_source; forward kinds and the loss). With
    `kept_exp` (softmax forward on persistent clusters) each thread keeps its exp(x - its
    max) in float registers from the statistics pass, so the outputs take a multiply, not a
    second exp (the SFU's 16 lanes an SM bound the two-exp form on the H200)."""

    threads: int = 256
    row_threads: int = 256
    vecs: int = 2
    ctas_per_sm: int = 2
    cluster: int = 0
    reverse: bool = False
    l2_hints: bool = False
    meet: bool = False
    landed: bool = False
    kept_exp: bool = False


def row_map(n: int, dtype: str, config: RowConfig) -> RowMap:
    return RowMap(n, dtype, config.threads, config.row_threads, config.vecs,
                  SM_COUNT * config.ctas_per_sm, config.reverse, config.l2_hints)


def softmax_program(kind: str, n: int, dtype: str, config: RowConfig):
    if config.meet:
        if kind == "logsumexp_bwd" or not config.cluster:
            raise ValueError(f"meet={config.meet} needs slices (cluster > 1) and a kind with "
                             f"statistics to share; got kind {kind!r}, cluster={config.cluster}")
        if kind == "logsumexp":
            return meeting_logsumexp_program(n, dtype, config)
    if config.cluster and kind != "logsumexp_bwd":
        return cluster_softmax_program(kind, n, dtype, config)
    rows = T.dynamic("rows")
    rm = row_map(n, dtype, config)
    load, store, reduce_sum, reduce_max_sum, chunk_max_sum = rm.macros(rows)
    vecs, vec, rpc, rt, ctas = rm.vecs, rm.vec, rm.rows_per_cta, rm.row_threads, rm.ctas
    warps = max(rm.row_warps, 1)
    # a row that fits one chunk stays in registers between the passes: read once
    reload = rm.chunks > 1
    hint_state, first_load, second_load, out_store = two_pass_accesses(rm, load, store)

    @T.macro
    def forward(x, y, lse_out, clusters):
        with T.Kernel(rm.grid(rows), threads=rm.threads) as bx:
            fast_math.import_source()
            tx = T.get_thread_binding()
            r, lane = tx // rt, tx % rt
            xl = T.alloc_local((vecs, vec), "float")
            m = T.alloc_local((1,), "float")
            s = T.alloc_local((1,), "float")
            red_m = T.alloc_shared((rpc, warps), "float")
            red_s = T.alloc_shared((rpc, warps), "float")
            raw, policy = hint_state()
            for step in T.serial(rm.row_loop_bounds(rows)):
                row, guard, live = rm.placed_row(step * ctas + bx, r, rows)
                if guard:
                    m[0] = NEG_INF
                    s[0] = 0.0
                    for c in T.serial(rm.chunks):
                        first_load(x, row, c, raw, xl, lane, NEG_INF, policy)
                        chunk_max_sum(xl, m, s)
                    reduce_max_sum(m, s, red_m, red_s, r, lane)
                    if kind == "logsumexp":
                        if live:
                            if lane == 0:
                                lse_out[row] = T.cast(rm.logsumexp_of(m[0], s[0]),
                                                      lse_out.dtype)
                    else:
                        # softmax: exp(x - m) / s; log_softmax: x - (m + log s)
                        shift = rm.shift_of(m[0])
                        scale = 1.0 / s[0]
                        lse = m[0] + T.log(s[0])
                        for step2 in T.serial(rm.chunks):
                            c = rm.second_pass_chunk(step2)
                            if reload:  # else the one chunk is still in registers
                                second_load(x, row, c, raw, xl, lane, 0.0, policy)
                            for i in T.unroll(vecs):
                                for j in T.unroll(vec):
                                    if kind == "softmax":
                                        xl[i, j] = exp(xl[i, j] - shift) * scale
                                    else:
                                        xl[i, j] = xl[i, j] - lse
                            if live:
                                out_store(xl, raw, y, row, c, lane, policy)
                # the shared partials are reused by the next row group
                if rm.row_warps > 1:
                    T.sync_threads()

    @T.macro
    def backward(dy, y, dx, clusters):
        with T.Kernel(rm.grid(rows), threads=rm.threads) as bx:
            fast_math.import_source()
            tx = T.get_thread_binding()
            r, lane = tx // rt, tx % rt
            dyl = T.alloc_local((vecs, vec), "float")
            yl = T.alloc_local((vecs, vec), "float")
            total = T.alloc_local((1,), "float")
            red = T.alloc_shared((rpc, warps), "float")
            raw, policy = hint_state()
            for step in T.serial(rm.row_loop_bounds(rows)):
                row, guard, live = rm.placed_row(step * ctas + bx, r, rows)
                if guard:
                    total[0] = 0.0
                    for c in T.serial(rm.chunks):
                        first_load(dy, row, c, raw, dyl, lane, 0.0, policy)
                        if kind == "softmax_bwd" or not reload:
                            first_load(y, row, c, raw, yl, lane, 0.0, policy)
                        for i in T.unroll(vecs):
                            for j in T.unroll(vec):
                                if kind == "softmax_bwd":
                                    total[0] = total[0] + dyl[i, j] * yl[i, j]
                                else:
                                    total[0] = total[0] + dyl[i, j]
                    reduce_sum(total, red, r, lane)
                    for step2 in T.serial(rm.chunks):
                        c = rm.second_pass_chunk(step2)
                        if reload:
                            second_load(dy, row, c, raw, dyl, lane, 0.0, policy)
                            second_load(y, row, c, raw, yl, lane, 0.0, policy)
                        for i in T.unroll(vecs):
                            for j in T.unroll(vec):
                                if kind == "softmax_bwd":
                                    dyl[i, j] = yl[i, j] * (dyl[i, j] - total[0])
                                else:
                                    dyl[i, j] = dyl[i, j] - exp(yl[i, j]) * total[0]
                        if live:
                            out_store(dyl, raw, dx, row, c, lane, policy)
                if rm.row_warps > 1:
                    T.sync_threads()

    @T.macro
    def lse_backward(g, x, lse, dx, clusters):
        with T.Kernel(rm.grid(rows), threads=rm.threads) as bx:
            fast_math.import_source()
            tx = T.get_thread_binding()
            r, lane = tx // rt, tx % rt
            xl = T.alloc_local((vecs, vec), "float")
            for step in T.serial(rm.row_loop_bounds(rows)):
                row = (step * ctas + bx) * rpc + r
                if row < rows:
                    gr = T.cast(g[row], "float")
                    lr = T.cast(lse[row], "float")
                    for c in T.serial(rm.chunks):
                        load(x, row, c, xl, lane, 0.0)
                        for i in T.unroll(vecs):
                            for j in T.unroll(vec):
                                xl[i, j] = gr * exp(xl[i, j] - lr)
                        store(xl, dx, row, c, lane)

    return prim_func_of(kind, rows, n, dtype, forward, backward, lse_backward)


def two_pass_accesses(rm: RowMap, load, store):
    """(hint_state, first_load, second_load, out_store) macros of a two-pass row kernel:
    the plain `load` / `store` of the row map, or with `rm.l2_hints` their hinted forms (the
    first read kept in L2, the second read and the outputs evicted first). hint_state(),
    called at the top of the kernel, returns the (raw staging buffer, policies) they share
    (None, None without hints); the loads take (buf, row, c, raw, local, lane, fill,
    policy), the store (local, raw, buf, row, c, lane, policy)."""
    hints = rm.l2_hints
    load_hinted, store_hinted = rm.hinted_macros() if hints else (None, None)

    def hint_state():
        if not hints:
            return None, None
        l2_hints.import_hints()
        raw = T.alloc_local((rm.vecs, rm.vec), rm.dtype)
        policy = T.alloc_local((2,), "uint64")
        T.buffer_store(policy, l2_hints.keep_policy(), [0])
        T.buffer_store(policy, l2_hints.drop_policy(), [1])
        return raw, policy

    @T.macro
    def load_as(buf, row, c, raw, local, lane, fill, policy, use):
        if hints:
            load_hinted(buf, row, c, raw, local, lane, fill, policy[use])
        else:
            load(buf, row, c, local, lane, fill)

    def first_load(buf, row, c, raw, local, lane, fill, policy):
        return load_as(buf, row, c, raw, local, lane, fill, policy, 0)  # kept in L2

    def second_load(buf, row, c, raw, local, lane, fill, policy):
        return load_as(buf, row, c, raw, local, lane, fill, policy, 1)  # evicted first

    @T.macro
    def out_store(local, raw, buf, row, c, lane, policy):
        if hints:
            store_hinted(local, raw, buf, row, c, lane, policy[1])
        else:
            store(local, buf, row, c, lane)

    return hint_state, first_load, second_load, out_store


def cluster_softmax_program(kind: str, n: int, dtype: str, config: RowConfig):
    """The KINDS but logsumexp_bwd (one pass, nothing to share) on rows split over a cluster:
    one read of each input, the statistics swapped between the cluster's CTAs; persistent
    clusters, `ctas_per_sm` CTAs made resident on each SM. With `config.meet` (the two-pass
    kinds) the slices are unclustered CTAs, one per slice of every row, swapping through
    global memory (meeting_slices.exchange_macro; the program takes the scratch buffers)."""
    rows = T.dynamic("rows")
    meet = config.meet
    cr = ClusterRows(n, dtype, config.cluster, config.threads, config.ctas_per_sm, meet)
    load, slice_max_sum, begin, _, merged_max_sum, merged_sum = cr.macros()
    reduce_sum, reduce_max_sum = cr.reductions()
    per, vec, cluster = cr.per_thread, cr.vec, cr.cluster
    swap, parity = cr.swap_macros(1 if kind.endswith("_bwd") else 2)
    cr.check_landed(config.landed, not kind.endswith("_bwd"), f"kind {kind!r} (two inputs)")
    alloc_source, first_row, fetch = cr.row_source(config.landed, rows)
    kept = config.kept_exp
    kept_max_sum, max_then_sum = cr.kept_macros()
    cr.check_kept(kept, kind == "softmax", f"kind {kind!r} (kept exps: softmax only)")

    @T.macro
    def forward(x, y, lse_out, clusters, gpart=None, counts=None):
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
            e = T.alloc_local((per, vec) if kept else (1, 1), "float")  # kept exps
            thread_max = T.alloc_local((1,), "float")
            red_m = T.alloc_shared((1, cr.warps), "float")
            red_s = T.alloc_shared((1, cr.warps), "float")
            mine = T.alloc_shared((2,), "float")
            part = T.alloc_shared((2, cluster, 2), "float")
            arrived = T.alloc_local((1,), "int32")
            src = alloc_source()
            begin(part, tx)
            first_row(x, bx, rank, src, clusters)
            for step in T.serial(cr.launch_steps(rows, clusters)):
                row = cr.row_of(step, bx, clusters)
                if row < rows:
                    fetch(x, row, step, bx, rank, tx, raw, NEG_INF, src, clusters)
                    if kept:
                        kept_max_sum(raw, e, thread_max, m, s, None, rank, tx)
                        max_then_sum(thread_max, m, s, red_m, red_s, tx)
                    else:
                        slice_max_sum(raw, m, s)
                        reduce_max_sum(m, s, red_m, red_s, 0, tx)
                    swap((m, s), mine, part, step, rank, tx, row, gpart, counts, arrived)
                    merged_max_sum(part, parity(step), m, s)
                    if kind == "logsumexp":
                        if (rank == 0) & (tx == 0):
                            lse_out[row] = T.cast(RowMap.logsumexp_of(m[0], s[0]),
                                                  lse_out.dtype)
                    else:
                        shift = RowMap.shift_of(m[0])
                        scale = 1.0 / s[0]
                        lse = m[0] + T.log(s[0])
                        kept_scale = kept_factor(thread_max[0], shift) * scale
                        for i in T.unroll(per):
                            if cr.valid(rank, tx, i):
                                for j in T.vectorized(vec):
                                    if kept:
                                        y[row, cr.column(rank, tx, i) + j] = T.cast(
                                            e[i, j] * kept_scale, dtype)
                                    elif kind == "softmax":
                                        y[row, cr.column(rank, tx, i) + j] = T.cast(
                                            exp(T.cast(raw[i, j], "float") - shift) * scale,
                                            dtype)
                                    else:
                                        y[row, cr.column(rank, tx, i) + j] = T.cast(
                                            T.cast(raw[i, j], "float") - lse, dtype)

    @T.macro
    def backward(dy, y, dx, clusters, gpart=None, counts=None):
        with T.Kernel(cr.launch_grid(rows, clusters), threads=cr.threads,
                      cluster_dims=cr.launch_cluster) as bx:
            T.assume(clusters > 0)  # rows from it are >= 0: no sign guards on them
            fast_math.import_source()
            T.annotate_min_blocks_per_sm(config.ctas_per_sm)
            tx = T.get_thread_binding()
            rank = bx % cluster
            dyr = T.alloc_local((per, vec), dtype)
            yr = T.alloc_local((per, vec), dtype)
            total = T.alloc_local((1,), "float")
            red = T.alloc_shared((1, cr.warps), "float")
            mine = T.alloc_shared((1,), "float")
            part = T.alloc_shared((2, cluster, 1), "float")
            arrived = T.alloc_local((1,), "int32")
            begin(part, tx)
            for step in T.serial(cr.launch_steps(rows, clusters)):
                row = cr.row_of(step, bx, clusters)
                if row < rows:
                    load(dy, row, rank, tx, dyr, 0.0)
                    load(y, row, rank, tx, yr, 0.0)
                    total[0] = 0.0
                    for i in T.unroll(per):
                        for j in T.unroll(vec):
                            if kind == "softmax_bwd":
                                total[0] = total[0] + T.cast(dyr[i, j], "float") * T.cast(
                                    yr[i, j], "float")
                            else:
                                total[0] = total[0] + T.cast(dyr[i, j], "float")
                    reduce_sum(total, red, 0, tx)
                    swap((total,), mine, part, step, rank, tx, row, gpart, counts, arrived)
                    merged_sum(part, parity(step), 0, total)
                    for i in T.unroll(per):
                        if cr.valid(rank, tx, i):
                            for j in T.vectorized(vec):
                                if kind == "softmax_bwd":
                                    dx[row, cr.column(rank, tx, i) + j] = T.cast(
                                        T.cast(yr[i, j], "float")
                                        * (T.cast(dyr[i, j], "float") - total[0]), dtype)
                                else:
                                    dx[row, cr.column(rank, tx, i) + j] = T.cast(
                                        T.cast(dyr[i, j], "float")
                                        - exp(T.cast(yr[i, j], "float")) * total[0], dtype)

    return prim_func_of(kind, rows, n, dtype, forward, backward, meeting=meet)


def meeting_logsumexp_program(n: int, dtype: str, config: RowConfig):
    """logsumexp with each row cut into `config.cluster` slices, one CTA each, meeting
    through global memory (meeting_slices.py); one read of each element."""
    rows = T.dynamic("rows")
    P, C = scratch_shapes()
    cr = ClusterRows(n, dtype, config.cluster, config.threads)
    slice_max_sum = cr.macros()[1]
    meet, merged_max_sum, _ = meeting_macros(cr.cluster, LOGSUMEXP_PARTIALS)

    @T.macro
    def max_sum(raw, rank, tx, cap, m, s, zsum):
        slice_max_sum(raw, m, s)

    reduced_slice = reduced_slice_macro(cr, max_sum, smoothing=False)

    @T.prim_func
    def logsumexp_fwd(x: T.Tensor((rows, n), dtype), out: T.Tensor((rows,), dtype),
                      part: T.Tensor(P, "float"), count: T.Tensor(C, "int32"),
                      clusters: T.int32):  # unused: one CTA per slice of every row
        with T.Kernel(cr.grid(rows), threads=cr.threads) as bx:
            fast_math.import_source()
            tx = T.get_thread_binding()
            row, rank = bx // cr.cluster, bx % cr.cluster
            m = T.alloc_local((1,), "float")
            s = T.alloc_local((1,), "float")
            arrived = T.alloc_local((1,), "int32")
            reduced_slice(x, row, rank, tx, None, m, s, None)
            if tx == 0:
                meet(part, count, row, rank, (m, s), arrived)
                if arrived[0] == cr.cluster - 1:
                    merged_max_sum(part, row, m, s)
                    out[row] = T.cast(RowMap.logsumexp_of(m[0], s[0]), dtype)
                    count[0, row] = 0

    return logsumexp_fwd


LOGSUMEXP_PARTIALS = 2  # max, exp-sum


def meeting_configs(n: int, dtype: str, config_class: type = RowConfig) -> list:
    """The `meet` configs of a row length: slice_shape's slices at 4, 8 and 16 vectors a
    thread (rows of more than one CTA's worth only)."""
    if n // vector_width(n, dtype) <= 1024:
        return []
    shapes = dict.fromkeys(slice_shape(n, dtype, per) for per in (4, 8, 16))
    return [config_class(threads, threads, 1, 1, slices, meet=True)
            for slices, threads in shapes]


def landed_configs(n: int, dtype: str, config_class: type = RowConfig) -> list:
    """The `landed` configs of a row length (cluster_rows.landed_shapes)."""
    return [config_class(threads, threads, 4, 1, cluster, landed=True)
            for cluster, threads in landed_shapes(n, dtype)]


# The landed default's slice: at most this many 16-byte vectors a thread of 512. H100,
# bf16, 2026-12-05: 16 vectors (Llama-3's row in 2 slices) ran 1692 us for the CE loss +
# gradient at 8K tokens against 1792 in 4 slices; Qwen3's row in 2 slices (19 vectors)
# 2723 against 2039 in 4 (8); 1024 threads lost everywhere (0.57-1.01x the streaming map).
LANDED_VECTORS = 16
# log_softmax holds more a thread: at 16 vectors ptxas spills 332 bytes (softmax 68) and
# Llama-3's row in 2 slices ran 1534 us against 841 in 4 (8 vectors, no spill); at 10
# (Qwen3's row in 4) nothing spills.
LOG_SOFTMAX_LANDED_VECTORS = 10
LANDED_MIN_COLUMNS = 32000  # the shortest row it was measured on (Mistral's vocabulary)


def landed_default(n: int, dtype: str, config_class: type = RowConfig,
                   max_vectors: int = LANDED_VECTORS):
    """The landed config a vocabulary row of 16-bit values runs by default, or None: 512
    threads, one CTA an SM, the fewest slices of at most `max_vectors` vectors a thread.
    H100, bf16, many rows, against the streaming map (walked): softmax 1.15x (Llama-3 4K
    tokens), 1.18x (Qwen3), 1.23x (Gemma-2, 4 slices; 5 ran 1.29x), log_softmax 1.17x; CE
    loss + gradient 1.23-1.30x (Llama-3 and Qwen3 8K, DeepSeek-V3 4K, Mistral 16K in one CTA
    a row). fp32 rows and rows under LANDED_MIN_COLUMNS were not measured and keep the
    streaming map."""
    if ELEM_BYTES[dtype] != 2 or n < LANDED_MIN_COLUMNS:
        return None
    for cluster, threads in landed_shapes(n, dtype):
        if threads == 512 and ClusterRows(n, dtype, cluster, threads).per_thread \
                <= max_vectors:
            return config_class(threads, threads, 4, 1, cluster, landed=True)
    return None


PAIRED_VECTORS = 10  # kept float exps, or log_softmax's values: 128 registers, no spill


def paired_default(n: int, dtype: str, kept: bool, config_class: type = RowConfig):
    """Where landed_default needs more than one slice a row: the landed slices on CTAs of
    256 threads, two an SM (one CTA's cluster barrier and stores overlap the other's
    reductions), the fewest slices of at most PAIRED_VECTORS vectors a thread; with `kept`
    the exps kept as floats (RowConfig.kept_exp). H100, bf16, against the 512-thread
    landed default: softmax with kept exps 1.115x (Llama-3 4K tokens, 8 slices) and 1.121x
    (Qwen3), log_softmax 1.06-1.07x. None where no such shape exists (Gemma-2's 256000
    columns need 16 vectors a thread) or one CTA holds the row (Mistral's: no gain)."""
    landed = landed_default(n, dtype, config_class)
    if landed is None or landed.cluster == 1:
        return None
    for cluster in range(2, MAX_CLUSTER + 1):
        cr = ClusterRows(n, dtype, cluster, 256, 2)
        if cr.lands_whole_slices and 2 <= cr.per_thread <= PAIRED_VECTORS:
            return config_class(256, 256, 4, 2, cluster, landed=True, kept_exp=kept)
    return None


def prim_func_of(kind: str, rows, n: int, dtype: str, forward, backward, lse_backward=None,
                 meeting: bool = False):
    """The program of `kind` around the kernel macros (the streaming or the cluster ones,
    which size their grids by the same symbolic `rows`); `meeting`: the two-pass kinds'
    meeting slices, which take the scratch buffers (meeting_slices.scratch_for). Every
    program takes `clusters` last: the persistent cluster kernels' grid (the clusters the
    GPU holds at once, RowKernel.run); the others ignore it."""
    R, V = (rows, n), (rows,)
    if meeting:
        P, C = scratch_shapes()
        if kind in ("softmax", "log_softmax"):
            @T.prim_func
            def softmax_fwd_meeting(x: T.Tensor(R, dtype), y: T.Tensor(R, dtype),
                                    gpart: T.Tensor(P, "float"), counts: T.Tensor(C, "int32"),
                                    clusters: T.int32):
                forward(x, y, None, clusters, gpart, counts)
            return softmax_fwd_meeting

        @T.prim_func
        def softmax_bwd_meeting(dy: T.Tensor(R, dtype), y: T.Tensor(R, dtype),
                                dx: T.Tensor(R, dtype), gpart: T.Tensor(P, "float"),
                                counts: T.Tensor(C, "int32"), clusters: T.int32):
            backward(dy, y, dx, clusters, gpart, counts)
        return softmax_bwd_meeting
    if kind == "logsumexp":
        @T.prim_func
        def logsumexp_fwd(x: T.Tensor(R, dtype), out: T.Tensor(V, dtype), clusters: T.int32):
            forward(x, None, out, clusters)
        return logsumexp_fwd
    if kind in ("softmax", "log_softmax"):
        @T.prim_func
        def softmax_fwd(x: T.Tensor(R, dtype), y: T.Tensor(R, dtype), clusters: T.int32):
            forward(x, y, None, clusters)
        return softmax_fwd
    if kind == "logsumexp_bwd":
        @T.prim_func
        def logsumexp_bwd(g: T.Tensor(V, dtype), x: T.Tensor(R, dtype),
                          lse: T.Tensor(V, dtype), dx: T.Tensor(R, dtype), clusters: T.int32):
            lse_backward(g, x, lse, dx, clusters)
        return logsumexp_bwd

    @T.prim_func
    def softmax_bwd(dy: T.Tensor(R, dtype), y: T.Tensor(R, dtype), dx: T.Tensor(R, dtype),
                    clusters: T.int32):
        backward(dy, y, dx, clusters)
    return softmax_bwd


def default_row_config(n: int, dtype: str, few_rows: bool) -> RowConfig:
    """Rows up to 1024 vectors (8K bf16 columns at 16 bytes each) fit one chunk of at most 4 vectors
    per thread and stay in registers between the passes (read once); a warp per row for
    short rows, so a CTA holds several. Longer rows stream in chunks of 512 threads x 4
    vectors, read twice, with at most 2 CTAs per SM so the second read hits L2. (Rows split
    over persistent clusters, read once, are in the config space but measured slower:
    cluster_rows.py.)"""
    vectors = n // vector_width(n, dtype)
    if vectors <= 1024:
        row_threads = 32
        while row_threads * 4 < vectors:
            row_threads *= 2
        vecs = -(-vectors // row_threads)
        threads = max(256, row_threads)
        return RowConfig(threads=threads, row_threads=row_threads, vecs=vecs,
                         ctas_per_sm=max(1, 2048 // threads))
    return RowConfig(threads=512, row_threads=512, vecs=4, ctas_per_sm=1 if few_rows else 2)


def walked(config: RowConfig, n: int, dtype: str) -> RowConfig:
    """`config` with its second pass reversed, with L2 hints where its vectors are 16 bytes."""
    hints = row_map(n, dtype, config).vec * ELEM_BYTES[dtype] == l2_hints.VECTOR_BYTES
    return dataclasses.replace(config, reverse=True, l2_hints=hints)


def walk_variants(config: RowConfig, n: int, dtype: str) -> list[RowConfig]:
    """`config` with its second pass reversed, and reversed with L2 hints at one and two CTAs
    an SM (16-byte vectors only); none for a row of one chunk (read once). In the tuner's
    space; `walked` is the default where rows_outgrow_l2."""
    rm = row_map(n, dtype, config)
    if rm.chunks == 1:
        return []
    variants = [dataclasses.replace(config, reverse=True)]
    if rm.vec * ELEM_BYTES[dtype] == l2_hints.VECTOR_BYTES:
        variants += [dataclasses.replace(config, reverse=True, l2_hints=True, ctas_per_sm=c)
                     for c in (1, 2)]
    return variants


def rows_outgrow_l2(n: int, dtype: str, config: RowConfig, inputs: int) -> bool:
    """Whether the rows a streaming grid has in flight (one a CTA, `inputs` tensors of each)
    outgrow the L2, so that the second pass rereads a row's first chunks from HBM. Where they
    do, the walks and the meeting slices pay (measured 2026-12-04 at 2-8K rows: softmax and
    log_softmax 1.03-1.10x walked on Llama-3, Qwen3 and Gemma-2 vocabularies, softmax_bwd
    1.19-1.28x on meeting slices); where they do not (Mistral's 32K rows, 17-34 MB in
    flight) both measured 0.74-0.79x."""
    return SM_COUNT * config.ctas_per_sm * n * ELEM_BYTES[dtype] * inputs > L2_BYTES


WHOLE_ROW_THREADS = 512
WHOLE_ROW_VECTORS = 8  # a thread's vectors of each input: 64 bf16 values in 32 registers


def whole_row_default(n: int, dtype: str) -> RowConfig | None:
    """The backward kinds' rows of more than one streaming chunk that one CTA of 512 threads
    holds whole in registers (at most 8 vectors a thread: 8K-32K bf16 columns): a cluster
    of one, every load of both inputs in flight before the first use, each element read
    once, one CTA an SM (90 registers; two an SM spill). Mistral's 32000 columns, 8K rows
    (H200, bf16 and fp16): softmax_bwd 374.6 us against the streaming map's 477.7 (1.28x;
    torch.compile 367.6-373.7), log_softmax_bwd 374.3 against 406.5 (1.09x; torch.compile
    363.6-365.0); 1024 threads the same, a cluster of two 1-3% slower. None where the row
    does not fit."""
    rows = ClusterRows(n, dtype, 1, WHOLE_ROW_THREADS)
    if rows.per_thread > WHOLE_ROW_VECTORS:
        return None
    return RowConfig(WHOLE_ROW_THREADS, WHOLE_ROW_THREADS, 4, 1, cluster=1)


def meeting_default(n: int, dtype: str, held: int) -> RowConfig | None:
    """The two-pass kinds' meeting slices: rows in 8 slices of 256 threads at 2 CTAs an SM,
    or of 512 threads at one where `held` slices of 256 would not fit the registers (Gemma's
    256K columns: 0.28x at 256 threads, 1.19x at 512); None if neither fits."""
    shapes = cluster_shapes(n, dtype, held)
    for cluster, threads, ctas_per_sm in ((MAX_CLUSTER, 256, 2), (MAX_CLUSTER, 512, 1)):
        if (cluster, threads, ctas_per_sm) in shapes:
            return RowConfig(threads, threads, 4, ctas_per_sm, cluster, meet=True)
    return None


class RowKernel(Kernel):
    """Base of the row kernels (this module's and cross-entropy's): one program per key,
    launched with every buffer; buckets `few` rows (decode batches) and `many`."""

    Config = RowConfig
    clustered = True  # whether the kernel has a cluster form for long rows
    held = 1  # inputs its cluster form keeps in registers
    offers_walks = True  # whether its space adds walk_variants (rows read twice)
    meeting_partials = LOGSUMEXP_PARTIALS  # floats each slice of a `meet` config leaves
    meets_in_two_passes = True  # whether its cluster shapes also come as `meet` configs

    def run(self, config: RowConfig, compiled: tuple, *tensors) -> None:
        if config.meet:  # the slices' scratch (partials, counts) after the op's arguments
            compiled[0](*tensors, *scratch_for(tensors[0], config.cluster,
                                               self.meeting_partials), 1)
            return
        clusters = 1  # the `clusters` launch argument: unused but by persistent clusters,
        if self.persistent(config):  # which assume it positive
            clusters = resident_clusters(tensors[0].device, config.cluster, config.threads,
                                         config.ctas_per_sm)
        compiled[0](*tensors, clusters)

    def direct_args(self, config: RowConfig) -> tuple | None:
        return None if config.meet or self.persistent(config) else (1,)

    def persistent(self, config: RowConfig) -> bool:
        """Whether `config` runs persistent clusters (a grid of the resident clusters)."""
        return bool(config.cluster) and not config.meet

    def bucket_of(self, rows: int) -> str:
        return "few" if rows <= 256 else "many"

    def heuristic_config(self, bucket: str, arch: str) -> RowConfig:
        return default_row_config(self.key["n"], self.key["dtype"], bucket == "few")

    def config_space(self, bucket: str) -> list[RowConfig]:
        n, dtype = self.key["n"], self.key["dtype"]
        space = [self.heuristic_config(bucket, "sm_90a"), default_row_config(n, dtype,
                                                                             bucket == "few")]
        for threads in (256, 512, 1024):
            for row_threads in (32, 128, 256, 512, 1024):
                for vecs in (1, 2, 4):
                    for ctas_per_sm in (1, 2, 4):
                        if row_threads <= threads:
                            space.append(RowConfig(threads, row_threads, vecs, ctas_per_sm))
        if self.clustered and n // vector_width(n, dtype) > 1024:
            for cluster, threads, ctas_per_sm in cluster_shapes(n, dtype, self.held):
                space.append(RowConfig(threads, threads, 4, ctas_per_sm, cluster))
                if self.meets_in_two_passes:  # the same slices, exchanging through memory
                    space.append(RowConfig(threads, threads, 4, ctas_per_sm, cluster,
                                           meet=True))
        if self.offers_walks:
            space += walk_variants(default_row_config(n, dtype, bucket == "few"), n, dtype)
        return list(dict.fromkeys(space))


class SoftmaxKernel(RowKernel):
    """key: kind (see KINDS), dtype, n (row length)."""

    name = "softmax"

    @property
    def clustered(self) -> bool:
        return self.key["kind"] != "logsumexp_bwd"  # one pass from a given lse: nothing to share

    @property
    def held(self) -> int:
        return 2 if self.key["kind"] in ("softmax_bwd", "log_softmax_bwd") else 1

    @property
    def offers_walks(self) -> bool:
        return self.key["kind"] not in ("logsumexp", "logsumexp_bwd")

    @property
    def meets_in_two_passes(self) -> bool:
        return self.offers_walks  # the kinds with a second pass

    @property
    def meeting_partials(self) -> int:
        return 1 if self.key["kind"].endswith("_bwd") else LOGSUMEXP_PARTIALS

    def heuristic_config(self, bucket: str, arch: str) -> RowConfig:
        """The streaming map (default_row_config), but on rows longer than one chunk: the
        backward kinds on meeting slices for few rows (each row over 8 CTAs instead of one:
        1.12-1.16x at 64 rows); for many rows, whole in one CTA where they stay in L2 and
        fit its registers (whole_row_default), softmax_bwd on meeting slices where they
        outgrow the L2; the forward two-pass kinds walked for many rows that outgrow it
        (rows_outgrow_l2), or on landed slices where landed_default has a shape."""
        streaming = super().heuristic_config(bucket, arch)
        n, dtype, kind = self.key["n"], self.key["dtype"], self.key["kind"]
        if n // vector_width(n, dtype) <= 1024 or not self.offers_walks:
            return streaming
        if kind.endswith("_bwd"):
            if bucket == "few":
                return meeting_default(n, dtype, self.held) or streaming
            if not rows_outgrow_l2(n, dtype, streaming, 2):
                return whole_row_default(n, dtype) or streaming
            if kind == "softmax_bwd":
                return meeting_default(n, dtype, self.held) or streaming
            return streaming
        if bucket == "many":
            landed = paired_default(n, dtype, kept=kind == "softmax") or landed_default(
                n, dtype, max_vectors=LOG_SOFTMAX_LANDED_VECTORS if kind == "log_softmax"
                else LANDED_VECTORS)
            if landed is not None:
                return landed
            if rows_outgrow_l2(n, dtype, streaming, 1):
                return walked(streaming, n, dtype)
        return streaming

    def config_space(self, bucket: str) -> list[RowConfig]:
        space = super().config_space(bucket)
        n, dtype, kind = self.key["n"], self.key["dtype"], self.key["kind"]
        if kind == "logsumexp":
            space += meeting_configs(n, dtype)
        if not kind.endswith("_bwd"):
            space += landed_configs(n, dtype)
        if kind in ("softmax", "log_softmax"):
            paired = paired_default(n, dtype, kept=kind == "softmax")
            space += [paired] if paired is not None and paired not in space else []
        if kind == "softmax":  # the landed shapes whose slices fit the registers as floats
            space += [dataclasses.replace(c, kept_exp=True) for c in landed_configs(n, dtype)
                      if ClusterRows(n, dtype, c.cluster, c.threads).holds_floats]
        if kind in ("softmax_bwd", "log_softmax_bwd") and n // vector_width(n, dtype) > 1024:
            whole_row = whole_row_default(n, dtype)  # a cluster of one, where rows fit
            if whole_row is not None and whole_row not in space:
                space.append(whole_row)
        return space

    def program(self, config: RowConfig, bucket: str):
        return softmax_program(self.key["kind"], self.key["n"], self.key["dtype"], config)
