"""Row statistics from unclustered slices that meet through global memory, in one launch.

The one-pass statistics (logsumexp, cross-entropy's loss) need a whole row's max and
exp-sum. The streaming kernels (row_map.py) walk a row in chunks, each chunk's loads waiting
for the last chunk's arithmetic; cross-entropy's gradient pass instead cuts each row into
slices, one CTA a slice with every load of its slice in flight at once (cluster_rows.py's
thread map, no cluster), and reads at 86-96% of HBM. Here the statistics passes take that
form: CTA `rank` of row `row` reduces its slice to partials (max, exp-sum and, where asked,
more sums), its thread 0 stores them in a scratch row and counts itself in with an
acquire-release atomic add; the CTA that arrives last sees every partial, merges them,
writes the row's results and sets the count back to zero for the next launch on the stream
(`workspace.zeroed_scratch`; the partials' buffer is `workspace.scratch`, written before it
is read). No second launch: a merge kernel would cost host time per call (argmax.py).

The two-pass kinds (softmax, log_softmax, their backward, the loss and gradient) keep
their slices in registers as the cluster kernels do and need every slice's partials
before any writes: `exchange_macro` (arrive, wait for the row's slices, depart) replaces
the cluster's distributed-shared-memory swap, with no cluster to place.
"""

import tilelang.language as T
import torch

from ..workspace import scratch, zeroed_scratch
from .row_map import NEG_INF, RowMap, exp


def meeting_macros(slices: int, values: int):
    """(meet, merged_max_sum, merged_sum) for rows of `slices` slices, each leaving `values`
    float partials (max and exp-sum first) in part[rank * values + k, row] (rows last: the
    scratch buffer's short side is the slots')."""

    @T.macro
    def meet(part, count, row, rank, partials, arrived):
        """Thread 0 of each CTA: stores its partials (local [1] buffers), then counts itself
        in; arrived[0] is the number of the row's CTAs in before it (slices - 1: the last).
        The release orders the stores before the count, the acquire orders the last CTA's
        reads of the others' partials after it."""
        for k, value in enumerate(partials):  # unrolled while tracing
            part[rank * values + k, row] = value[0]
        # (return_prev: TileLang's integer AtomicAdd without it drops the memory order)
        arrived[0] = T.atomic_add(count[0, row], T.int32(1), memory_order="acq_rel",
                                  return_prev=True)

    @T.macro
    def merged_max_sum(part, row, m, s):
        """(m[0], s[0]) <- the row's max and exp-sum from the slices' pairs (a slice of
        -inf only adds 0; see RowMap.shift_of)."""
        m[0] = part[0, row]
        for k in T.unroll(slices - 1):
            m[0] = T.max(m[0], part[(k + 1) * values, row])
        shift = RowMap.shift_of(m[0])
        s[0] = 0.0
        for k in T.unroll(slices):
            s[0] = s[0] + part[k * values + 1, row] * exp(part[k * values, row] - shift)

    @T.macro
    def merged_sum(part, row, column, total):
        """total[0] <- the sum of the slices' partial `column`."""
        total[0] = 0.0
        for k in T.unroll(slices):
            total[0] = total[0] + part[k * values + column, row]

    return meet, merged_max_sum, merged_sum


def reduced_slice_macro(cr, statistics, smoothing: bool):
    """`reduced_slice(x, row, rank, tx, cap, m, s, zsum)` of a one-pass kernel: the CTA's
    slice of x's row (cr: a ClusterRows) loaded into registers at once, every thread left
    with the slice's max and exp-sum (and with `smoothing` its z-sum) in m, s, zsum;
    `statistics(raw, rank, tx, cap, m, s, zsum)` folds a thread's slots."""
    load = cr.macros()[0]
    reduce_sum, reduce_max_sum = cr.reductions()

    @T.macro
    def reduced_slice(x, row, rank, tx, cap, m, s, zsum):
        raw = T.alloc_local((cr.per_thread, cr.vec), cr.dtype)
        red_m = T.alloc_shared((1, cr.warps), "float")
        red_s = T.alloc_shared((1, cr.warps), "float")
        load(x, row, rank, tx, raw, NEG_INF)
        statistics(raw, rank, tx, cap, m, s, zsum)
        reduce_max_sum(m, s, red_m, red_s, 0, tx)
        if smoothing:
            red_z = T.alloc_shared((1, cr.warps), "float")
            reduce_sum(zsum, red_z, 0, tx)

    return reduced_slice


def scratch_shapes() -> tuple:
    """The symbolic shapes (partials, counts) of scratch_for's buffers in a program. Each has
    its own sizes: the workspace grows each buffer on its own, so their columns differ."""
    return ((T.dynamic("part_rows"), T.dynamic("part_slots")),
            (T.dynamic("count_rows"), T.dynamic("count_slots")))


def scratch_for(x, slices: int, values: int) -> tuple:
    """(partials [>= slices * values, >= rows] float32, counts [>= 2, >= rows] int32, zero)
    scratch buffers of a launch over the rows of x [rows, n]: counts[0] the arrivals,
    counts[1] the departures (the two-pass kernels' exchange)."""
    rows = x.shape[0]
    return (scratch(x.device, slices * values, rows, torch.float32),
            zeroed_scratch(x.device, 2, rows, torch.int32))


def exchange_macro(slices: int, values: int):
    """`exchange`: the two-pass kernels' form of ClusterRows' `share` for meeting slices.
    Every CTA of a row must have its partials before any writes outputs, so thread 0
    stores its partials, counts itself in (release), and waits until the row's `slices`
    CTAs are in (acquire); it copies every CTA's partials into the shared
    part[0, c, k] (the layout the cluster kernels' merge macros read), then counts itself
    out, and the last CTA out sets both counts back to zero (no CTA reads them after its
    own departure). A barrier then hands part to the CTA's threads.

    The wait needs the row's CTAs resident together. They are adjacent in the grid and the
    GPU dispatches a grid's CTAs in order, so at most one row is partly dispatched at a
    time and every other resident CTA belongs to a row whose CTAs are all running: those
    finish and free their slots for the rest of the partial row (a row has at most 8 CTAs;
    an SM holds one to four)."""

    @T.macro
    def exchange(partials, part, gpart, counts, row, rank, tx, arrived):
        if tx == 0:
            for k, value in enumerate(partials):  # unrolled while tracing
                gpart[rank * values + k, row] = value[0]
            arrived[0] = T.atomic_add(counts[0, row], T.int32(1), memory_order="acq_rel",
                                      return_prev=True)
            while T.atomic_load(counts[0, row], memory_order="acquire") < slices:
                T.evaluate(0)
            for c in T.unroll(slices):
                for k in T.unroll(values):
                    part[0, c, k] = gpart[c * values + k, row]
            arrived[0] = T.atomic_add(counts[1, row], T.int32(1), memory_order="acq_rel",
                                      return_prev=True)
            if arrived[0] == slices - 1:
                counts[0, row] = 0
                counts[1, row] = 0
        T.sync_threads()

    return exchange
