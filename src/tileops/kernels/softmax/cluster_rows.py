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
register slot v // threads, so a warp's loads are contiguous. The grid has one cluster per
row (rank r of the cluster takes slice r); the row count is symbolic, the row length is
compiled in.
"""

import math
from dataclasses import dataclass

import tilelang.language as T

from ..vectors import vector_width
from .row_map import NEG_INF, RowMap, exp

MAX_CLUSTER = 8  # the portable cluster size on Hopper
MAX_PER_THREAD = 16  # vectors a thread holds: 16 x 16 bytes = 64 registers of packed data


@dataclass(frozen=True)
class ClusterRows:
    n: int
    dtype: str
    cluster: int
    threads: int

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
        return rows * self.cluster

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

    def macros(self):
        """(load, slice_max_sum, arrive, share, merged_max_sum, merged_sum); see each one's
        comment."""
        per, vec, cluster = self.per_thread, self.vec, self.cluster

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
            exp(x - max); -inf padding adds 0."""
            m[0] = NEG_INF
            for i in T.unroll(per):
                for j in T.unroll(vec):
                    m[0] = T.max(m[0], T.cast(raw[i, j], "float"))
            shift = T.if_then_else(m[0] == NEG_INF, T.float32(0), m[0])
            s[0] = 0.0
            for i in T.unroll(per):
                for j in T.unroll(vec):
                    s[0] = s[0] + exp(T.cast(raw[i, j], "float") - shift)

        @T.macro
        def arrive(part, tx):
            """First thing in the kernel: zero this CTA's `part` and arrive at the cluster
            barrier that `share` waits on. Until every CTA has arrived none writes another's
            `part`, so the zeros never land over a peer's values; and as `part` is live from
            here on, the shared-memory planner gives none of its bytes to another buffer
            (it does not see the peers' remote writes)."""
            if tx < cluster:
                for c in T.unroll(part.shape[1]):
                    part[tx, c] = 0.0
            T.cluster_arrive()

        @T.macro
        def share(values, mine, part, rank, tx):
            """part[k, :] <- the values (local [1] buffers, the same in every thread of a CTA)
            of the cluster's CTA k, in every CTA of the cluster. Each CTA writes its row of
            `part` into every CTA's shared memory once all have arrived (`arrive`); the
            cluster barrier then publishes the writes. After it no CTA touches another's
            shared memory, so any may exit."""
            if tx == 0:
                for k, value in enumerate(values):  # unrolled while tracing
                    mine[k] = value[0]
            T.sync_threads()
            T.cluster_wait()
            for dst in T.unroll(cluster):
                T.copy_cluster(mine, part[rank, :], dst_block=dst)
            T.cluster_sync()

        @T.macro
        def merged_max_sum(part, m, s):
            """(m[0], s[0]) <- the row's max and exp-sum from the CTAs' pairs part[:, 0:2]."""
            m[0] = part[0, 0]
            for k in T.unroll(cluster - 1):
                m[0] = T.max(m[0], part[k + 1, 0])
            shift = T.if_then_else(m[0] == NEG_INF, T.float32(0), m[0])
            s[0] = 0.0
            for k in T.unroll(cluster):
                s[0] = s[0] + part[k, 1] * exp(part[k, 0] - shift)

        @T.macro
        def merged_sum(part, column, total):
            """total[0] <- the sum of part[:, column] over the cluster."""
            total[0] = 0.0
            for k in T.unroll(cluster):
                total[0] = total[0] + part[k, column]

        return load, slice_max_sum, arrive, share, merged_max_sum, merged_sum


def cluster_shapes(n: int, dtype: str) -> list[tuple[int, int]]:
    """The (cluster, threads) pairs whose slices fit a thread's registers
    (<= MAX_PER_THREAD vectors) with every cluster slot holding part of the row."""
    vectors = n // vector_width(n, dtype)
    shapes = []
    for threads in (128, 256, 512, 1024):
        for cluster in range(2, MAX_CLUSTER + 1):
            cr = ClusterRows(n, dtype, cluster, threads)
            if cr.per_thread <= MAX_PER_THREAD and (cluster - 1) * cr.slice_vectors < vectors:
                shapes.append((cluster, threads))
    return shapes


def default_cluster_shape(n: int, dtype: str, per_thread: int = 8) -> tuple[int, int] | None:
    """The cluster for a row too long for one CTA: the fewest threads (256 up) whose slices
    take at most `per_thread` vectors per thread within MAX_CLUSTER CTAs, with the smallest
    such cluster; None if even 1024 threads x 8 CTAs cannot hold the row."""
    vectors = n // vector_width(n, dtype)
    for threads in (256, 512, 1024):
        cluster = math.ceil(vectors / (threads * per_thread))
        if cluster <= MAX_CLUSTER:
            return max(cluster, 2), threads
    return None
