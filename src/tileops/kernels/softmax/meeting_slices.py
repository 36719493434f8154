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
"""

import tilelang.language as T

from .row_map import RowMap, exp


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
        arrived[0] = T.atomic_add(count[row], T.int32(1), memory_order="acq_rel",
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


def scratch_for(x, slices: int, values: int) -> tuple:
    """(partials, counts) scratch buffers of a launch over the rows of x [rows, n]."""
    import torch

    from ..workspace import scratch, zeroed_scratch

    rows = x.shape[0]
    return (scratch(x.device, slices * values, rows, torch.float32),
            zeroed_scratch(x.device, 1, rows, torch.int32)[0])
