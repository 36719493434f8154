"""Rows split over a thread-block cluster, each CTA holding its slice in registers.

A vocabulary row (32K-256K columns, up to 512 KB) is longer than one CTA's registers, and
the streaming kernels (row_map.py) that read it twice find the second read evicted from L2
(132 SMs stream their 256 KB rows past the 50 MB L2 between an element's two reads). Here a
row is cut into `cluster` slices, one per CTA of a Hopper thread-block cluster (up to 8 CTAs
that can write each other's shared memory). A CTA loads its whole slice into registers with
every load in flight before the first is used (16-64 KB per CTA: enough bytes in flight to
keep HBM busy), reduces it, and the cluster's CTAs swap their partial statistics through
distributed shared memory; the second pass (outputs, gradients) then runs from registers.
Each element is read from HBM once.

Thread map: vector v of a CTA's slice (a vector is the widest power of two <= 16 bytes that
divides the row length, so it never crosses a row) is loaded by thread v % threads into its
register slot v // threads, so a warp's loads are contiguous. Rank r of a cluster takes
slice r. The row count is symbolic, the row length is compiled in.

The grid is persistent: as many clusters as are resident at once (`ctas_per_sm` CTAs on each
SM, enforced by the launch bound; the count is asked of the driver per device,
cluster_occupancy.py, and passed as the launch argument `clusters`), each taking every
so-many-th row. One cluster per row
measured 1.8-4x slower on the H200 (2026-12-02: every cluster is placed and its barriers
met anew, and a cluster of 8 waits for 8 free SMs of one GPC). Clusters of 2 always tile
the SMs (a GPC holds whole TPCs of 2 SMs); larger ones may leave a GPC's last SMs idle.
Persistent, they still measured slower than the streaming kernels (an SM holds one or two
such CTAs, idle at the cluster barrier and while storing), so they are tuner options, not
defaults. Unclustered slices (`slice_shape`) are the default of cross-entropy's one-pass
gradient, which has nothing to share (86-96% of HBM).
"""

from dataclasses import dataclass

import tilelang.language as T

from ..cluster_occupancy import SM_SHARED_BYTES
from ..vectors import ELEM_BYTES, vector_width
from .meeting_slices import exchange_macro
from .row_map import NEG_INF, RowMap, exp

MAX_CLUSTER = 8  # the portable cluster size on Hopper
SHARED_BYTES = 227 * 1024  # H200: dynamic shared memory of one CTA


@dataclass(frozen=True)
class ClusterRows:
    n: int
    dtype: str
    cluster: int
    threads: int
    ctas_per_sm: int = 1
    meet: bool = False  # the slices are unclustered CTAs meeting through global memory

    def __post_init__(self):
        if not 1 <= self.cluster <= MAX_CLUSTER or self.threads % 32 or self.threads > 1024:
            raise ValueError(f"cluster={self.cluster} must be in [1, {MAX_CLUSTER}] and "
                             f"threads={self.threads} a multiple of 32 up to 1024")

    @property
    def vec(self) -> int:
        return vector_width(self.n, self.dtype)

    @property
    def slice_vectors(self) -> int:
        return -(-(self.n // self.vec) // self.cluster)

    @property
    def per_thread(self) -> int:
        return -(-self.slice_vectors // self.threads)

    @property
    def warps(self) -> int:
        return self.threads // 32

    def grid(self, rows):
        """One CTA per slice of every row (the unclustered one-pass kernels)."""
        return rows * self.cluster

    # The persistent grid: `clusters` (a launch argument, the kernel's `clusters`) is how
    # many clusters of this shape the GPU holds at once (cluster_occupancy.py), so the grid
    # fills the chip in one wave whatever its GPC layout.
    def persistent_grid(self, rows, clusters):
        return T.min(rows, clusters) * self.cluster

    def row_steps(self, rows, clusters):
        """Rows per cluster of the persistent grid (the last step partly empty)."""
        return T.ceildiv(rows, clusters)

    # the launch of the two-pass kernels: persistent clusters, or with `meet` one CTA per
    # slice of every row, unclustered (meeting_slices.exchange_macro)
    def launch_grid(self, rows, clusters):
        return self.grid(rows) if self.meet else self.persistent_grid(rows, clusters)

    @property
    def launch_cluster(self) -> int:
        return 1 if self.meet else self.cluster

    def launch_steps(self, rows, clusters):
        return 1 if self.meet else self.row_steps(rows, clusters)

    def row_of(self, step, bx, clusters):
        """The row that CTA bx takes at `step` (the same in the whole cluster)."""
        if self.meet:
            return bx // self.cluster
        return step * clusters + bx // self.cluster

    def column(self, rank, tx, i):
        """The first column of register slot i's vector."""
        return (rank * self.slice_vectors + i * self.threads + tx) * self.vec

    def valid(self, rank, tx, i):
        """Whether slot i holds a vector of the row (the last slices may be short)."""
        in_row = self.column(rank, tx, i) < self.n
        if self.slice_vectors % self.threads == 0:  # every slot is in the slice
            return in_row
        return (i * self.threads + tx < self.slice_vectors) & in_row

    def reductions(self):
        """(reduce_sum, reduce_max_sum) over the CTA's threads: the row kernels' own, with the
        CTA as one row (row_map.py)."""
        rm = RowMap(self.n, self.dtype, self.threads, self.threads, 1, 1)
        _, _, reduce_sum, reduce_max_sum, _ = rm.macros(None)
        return reduce_sum, reduce_max_sum

    def kept_macros(self, smoothing: bool = False):
        """(kept_max_sum, max_then_sum) of the kept-exp forms (RowConfig.kept_exp): each
        thread keeps e[i, j] = exp(x - its max) in float registers from the statistics pass,
        so the outputs (softmax, the loss's gradient) take a multiply by `kept_factor`, not
        a second exp; the SFU's 16 lanes an SM bound the two-exp forms on the H200."""
        per, vec, warps = self.per_thread, self.vec, self.warps
        reduce_sum = self.reductions()[0]

        @T.macro
        def kept_max_sum(raw, e, thread_max, m, s, zsum, rank, tx):
            """(m[0], s[0]) <- the thread's max and exp-sum, e <- its exps (0 past the slice,
            whose -inf fill adds nothing), thread_max[0] <- its max; zsum[0] (unless None)
            <- with `smoothing` the sum of its values in the row, else 0."""
            thread_max[0] = NEG_INF
            for i in T.unroll(per):
                for j in T.unroll(vec):
                    thread_max[0] = T.max(thread_max[0], T.cast(raw[i, j], "float"))
            shift = RowMap.shift_of(thread_max[0])
            s[0] = 0.0
            if zsum is not None:  # the loss reads it, smoothed or not
                zsum[0] = 0.0
            for i in T.unroll(per):
                for j in T.unroll(vec):
                    e[i, j] = exp(T.cast(raw[i, j], "float") - shift)
                    s[0] = s[0] + e[i, j]
                    if smoothing:
                        zsum[0] = zsum[0] + T.if_then_else(
                            self.valid(rank, tx, i), T.cast(raw[i, j], "float"), 0.0)
            m[0] = thread_max[0]

        @T.macro
        def max_then_sum(thread_max, m, s, red_m, red_s, tx):
            """The CTA's (max, exp-sum) in two reductions: the max, then each thread's sum
            rescaled to it once and summed. Two exps a thread, where merging (max, sum) pairs
            up the tree takes two at every step (45 a thread at 512 threads)."""
            for k in T.unroll(5):
                m[0] = T.max(m[0], T.shfl_xor(m[0], 1 << k))
            if warps > 1:
                if tx % 32 == 0:
                    red_m[0, tx // 32] = m[0]
                T.sync_threads()
                m[0] = red_m[0, 0]
                for w in T.unroll(warps - 1):
                    m[0] = T.max(m[0], red_m[0, w + 1])
            s[0] = T.if_then_else(thread_max[0] == NEG_INF, T.float32(0),
                                  s[0] * exp(thread_max[0] - RowMap.shift_of(m[0])))
            reduce_sum(s, red_s, 0, tx)

        return kept_max_sum, max_then_sum

    def macros(self):
        """(load, slice_max_sum, begin, share, merged_max_sum, merged_sum); see each one's
        comment."""
        per, vec, cluster = self.per_thread, self.vec, self.cluster
        chunk_max_sum = RowMap(self.n, self.dtype, self.threads, self.threads, per, 1).macros(
            None)[4]

        @T.macro
        def load(buf, row, rank, tx, raw, fill):
            """raw[per_thread, vec] (buf's dtype) <- this thread's vectors of the CTA's slice
            of buf's row, `fill` in the slots past it. Fully unrolled, no use in between:
            every load is in flight at once."""
            for i in T.unroll(per):
                if self.valid(rank, tx, i):
                    for j in T.vectorized(vec):
                        raw[i, j] = buf[row, self.column(rank, tx, i) + j]
                else:
                    for j in T.unroll(vec):
                        raw[i, j] = T.cast(fill, raw.dtype)

        @T.macro
        def slice_max_sum(raw, m, s):
            """(m[0], s[0]) <- the max of the thread's values (as float) and the sum of their
            exp(x - max); -inf padding adds 0 (the streaming kernels' chunk fold, one chunk)."""
            m[0] = NEG_INF
            s[0] = 0.0
            chunk_max_sum(raw, m, s)

        @T.macro
        def begin(part, tx):
            """First thing in the kernel: zero `part` ([2, cluster, k]: one buffer per row
            parity) and meet the cluster, so no CTA writes a peer's `part` before the peer
            has started. As `part` is live from here on, the shared-memory planner lends none
            of its bytes to another buffer (it does not see the peers' remote writes)."""
            if tx < cluster:
                for p in T.unroll(2):
                    for c in T.unroll(part.shape[2]):
                        part[p, tx, c] = 0.0
            if not self.meet and cluster > 1:
                T.cluster_sync()

        @T.macro
        def share(values, mine, part, parity, rank, tx):
            """part[parity, k, :] <- the values (local [1] buffers, the same in every thread
            of a CTA) of the cluster's CTA k, in every CTA of the cluster: each CTA writes
            its row of `part` into every CTA's shared memory, and the cluster barrier then
            publishes the writes. The next row writes the other parity, which no peer still
            reads: each has passed this barrier, after its reads of the row before. After
            the last barrier no CTA touches another's shared memory, so any may exit."""
            if tx == 0:
                for k, value in enumerate(values):  # unrolled while tracing
                    mine[k] = value[0]
                    if cluster == 1:  # no peers: the CTA's own row of part
                        part[parity, 0, k] = value[0]
            T.sync_threads()
            if cluster > 1:
                for dst in T.unroll(cluster):
                    T.copy_cluster(mine, part[parity, rank, :], dst_block=dst)
                T.cluster_sync()

        @T.macro
        def merged_max_sum(part, parity, m, s):
            """(m[0], s[0]) <- the row's max and exp-sum from the CTAs' pairs
            part[parity, :, 0:2]."""
            m[0] = part[parity, 0, 0]
            for k in T.unroll(cluster - 1):
                m[0] = T.max(m[0], part[parity, k + 1, 0])
            shift = RowMap.shift_of(m[0])
            s[0] = 0.0
            for k in T.unroll(cluster):
                s[0] = s[0] + part[parity, k, 1] * exp(part[parity, k, 0] - shift)

        @T.macro
        def merged_sum(part, parity, column, total):
            """total[0] <- the sum of part[parity, :, column] over the cluster."""
            total[0] = 0.0
            for k in T.unroll(cluster):
                total[0] = total[0] + part[parity, k, column]

        return load, slice_max_sum, begin, share, merged_max_sum, merged_sum

    def swap_macros(self, values: int):
        """(swap, parity) of a two-pass kernel's exchange of `values` partials a CTA:
        swap(partials, mine, part, step, rank, tx, row, gpart, counts, arrived) leaves every
        CTA of the row the row's partials in part[parity(step), :, :], through the cluster
        (`share`; gpart, counts, arrived unused) or, with `meet`, through global memory
        (meeting_slices.exchange_macro; mine unused)."""
        share = self.macros()[3]
        exchange = exchange_macro(self.cluster, values) if self.meet else None
        meet = self.meet

        @T.macro
        def swap(partials, mine, part, step, rank, tx, row, gpart, counts, arrived):
            if meet:
                exchange(partials, part, gpart, counts, row, rank, tx, arrived)
            else:
                share(partials, mine, part, step % 2, rank, tx)

        def parity(step):
            return 0 if meet else step % 2

        return swap, parity

    # -- slices landing by TMA (`landed`): the next row's slice arrives while this one works

    @property
    def lands_whole_slices(self) -> bool:
        """Whether every slice is the same whole number of 16-byte vectors (what one bulk TMA
        copy a slice needs: its size and its global address 16-byte aligned)."""
        return (self.n % (self.cluster * self.vec) == 0
                and self.vec * ELEM_BYTES[self.dtype] == 16)

    @property
    def slice_length(self) -> int:
        return self.slice_vectors * self.vec

    def row_source(self, landed: bool, rows):
        """(alloc, first, fetch): how a persistent cluster kernel gets each row's slice into
        the registers `raw` (as `load` leaves them, `fill` past the slice). alloc() (in the
        kernel, before `begin`) makes the landed form's shared slot and its barrier;
        first(x, bx, rank, src) starts the first row; fetch(x, row, step, bx, rank, tx, raw,
        fill, src) brings row `row` of the CTA's `step`.

        Without `landed`, fetch loads the slice from global memory (`load`: every load in
        flight at once, but issued only once the row before is done). With it, one bulk TMA
        copy lands the CTA's slice of a row in the slot (an elected thread issues it, its
        bytes expected on the barrier, one arrival a thread); fetch waits for it, copies it
        into `raw`, frees the slot and lands the next row's slice at once, so it streams in
        through this row's reductions, cluster barrier and stores, which left HBM idle."""
        per, vec, length = self.per_thread, self.vec, self.slice_length
        load = self.macros()[0]

        def alloc():
            if not landed:
                return None
            return T.alloc_shared((length,), self.dtype), T.alloc_barrier([self.threads])

        @T.macro
        def land(x, row, rank, src):
            slot, landing = src
            T.assume(0 <= row)  # so the copy is provably in bounds: one bulk copy, no map
            T.assume(row < rows)
            T.tma_copy(x[row, rank * length:(rank + 1) * length], slot, barrier=landing[0])
            T.mbarrier_arrive(landing[0])

        @T.macro
        def first(x, bx, rank, src, clusters):
            if landed:
                if self.row_of(0, bx, clusters) < rows:
                    land(x, self.row_of(0, bx, clusters), rank, src)

        @T.macro
        def take(src, phase, rank, tx, raw, fill):
            slot, landing = src
            T.mbarrier_wait_parity(landing[0], phase)
            for i in T.unroll(per):
                if self.valid(rank, tx, i):
                    for j in T.vectorized(vec):
                        raw[i, j] = slot[(i * self.threads + tx) * vec + j]
                else:
                    for j in T.unroll(vec):
                        raw[i, j] = T.cast(fill, raw.dtype)
            T.sync_threads()  # every thread has read the slot: the next landing may fill it

        @T.macro
        def fetch(x, row, step, bx, rank, tx, raw, fill, src, clusters):
            if landed:
                take(src, step % 2, rank, tx, raw, fill)
                if self.row_of(step + 1, bx, clusters) < rows:
                    land(x, self.row_of(step + 1, bx, clusters), rank, src)
            else:
                load(x, row, rank, tx, raw, fill)

        return alloc, first, fetch

    @property
    def holds_floats(self) -> bool:
        """Whether a thread's slots fit the registers as floats (the kept exps)."""
        return fits_registers(self, 4 // ELEM_BYTES[self.dtype])

    def check_kept(self, kept: bool, program_keeps: bool, program: str) -> None:
        """Refuses kept exps where `program` has no use for them (`program_keeps` False),
        without persistent clusters, or where the slots do not fit as floats."""
        if kept and (not program_keeps or self.meet or not self.holds_floats):
            raise ValueError(f"kept_exp=True keeps a float exp a value in persistent clusters "
                             f"whose slices fit the registers as floats; got {program}, "
                             f"meet={self.meet}, {self.per_thread} vectors a thread of "
                             f"{self.threads} threads, {self.ctas_per_sm} CTAs an SM")

    def check_landed(self, landed: bool, program_lands: bool, program: str) -> None:
        """Refuses a landed form where the program has no next row of one input to land
        (`program_lands` False: `program` says why), without persistent clusters, or
        without whole 16-byte slices."""
        if landed and not program_lands:
            raise ValueError(f"landed=True lands one input's next row in a persistent "
                             f"cluster; not for {program}")
        if landed and (self.meet or not self.lands_whole_slices):
            raise ValueError(f"landed=True needs persistent clusters (meet={self.meet}) and "
                             f"slices of whole 16-byte vectors ({self.n} columns of "
                             f"{self.dtype} in {self.cluster})")
        if landed and self.ctas_per_sm * (self.slice_length * ELEM_BYTES[self.dtype] + 4096) \
                > SM_SHARED_BYTES:
            # the driver counts the clusters of ctas_per_sm CTAs an SM (cluster_occupancy);
            # fewer would fit, and the persistent grid would wait for a second wave
            raise ValueError(f"landed=True with {self.ctas_per_sm} CTAs an SM needs their "
                             f"slots ({self.slice_length} {self.dtype} values each) in one "
                             f"SM's {SM_SHARED_BYTES} bytes of shared memory")


def kept_factor(thread_max, to):
    """exp(thread max - to): what a thread's kept exps are multiplied by to be exp(x - to).
    A thread of -inf values kept zeros, so any finite factor will do: 1 (and a fully masked
    row's outputs stay 0 * inf = NaN where `to` came from a zero sum, as torch's)."""
    return exp(T.if_then_else(thread_max == NEG_INF, to, thread_max) - to)


REGISTERS = 65536  # per SM
RESERVED_REGISTERS = 40  # per thread, besides the held slices: indices, statistics, temporaries


def fits_registers(cr: ClusterRows, held: int) -> bool:
    """Whether `held` slices (inputs kept in registers as packed vectors, 4 bytes a register)
    fit a thread's share of the register file with `ctas_per_sm` CTAs on an SM."""
    data = held * cr.per_thread * cr.vec * ELEM_BYTES[cr.dtype] // 4
    return data + RESERVED_REGISTERS <= REGISTERS // (cr.threads * cr.ctas_per_sm)


def cluster_shapes(n: int, dtype: str, held: int = 1) -> list[tuple[int, int, int]]:
    """The (cluster, threads, ctas_per_sm) shapes whose `held` slices fit the registers,
    with every CTA holding part of the row and at least 2 vectors a thread."""
    vectors = n // vector_width(n, dtype)
    shapes = []
    for cluster in range(2, MAX_CLUSTER + 1):
        for threads in (256, 512, 1024):
            for ctas_per_sm in (1, 2):
                if threads * ctas_per_sm > 2048:
                    continue
                cr = ClusterRows(n, dtype, cluster, threads, ctas_per_sm)
                if cr.per_thread >= 2 and fits_registers(cr, held) \
                        and (cluster - 1) * cr.slice_vectors < vectors:
                    shapes.append((cluster, threads, ctas_per_sm))
    return shapes


def landed_shapes(n: int, dtype: str) -> list[tuple[int, int]]:
    """The (cluster, threads) shapes of the landed form (ClusterRows.row_source): clusters of
    1-8 CTAs of 512 or 1024 threads, one CTA an SM, whose slices are whole 16-byte vectors,
    fit shared memory and, held as loaded, the registers, at least 2 vectors a thread."""
    shapes = []
    for cluster in range(1, MAX_CLUSTER + 1):
        for threads in (512, 1024):
            cr = ClusterRows(n, dtype, cluster, threads)
            if cr.lands_whole_slices and cr.per_thread >= 2 and fits_registers(cr, 1) \
                    and cr.slice_length * ELEM_BYTES[dtype] + 4096 <= SHARED_BYTES:
                shapes.append((cluster, threads))
    return shapes


def slice_shape(n: int, dtype: str, per_thread: int = 8,
                min_threads: int = 256) -> tuple[int, int]:
    """(slices, threads) for a one-pass kernel that splits rows into unclustered CTAs (nothing
    to share): the fewest threads (`min_threads` up) whose slices take at most `per_thread`
    vectors a thread within MAX_CLUSTER slices (95% of HBM measured for cross-entropy's
    gradient pass at 8 x 256 on Llama-3's vocabulary)."""
    vectors = n // vector_width(n, dtype)
    for threads in (256, 512, 1024):
        slices = -(-vectors // (threads * per_thread))
        if threads >= min_threads and slices <= MAX_CLUSTER:
            return max(slices, 2), threads
    return MAX_CLUSTER, 1024
