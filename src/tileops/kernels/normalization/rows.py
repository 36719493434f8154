"""Row tiles shared by the normalization kernels: the thread map and guarded row I/O.

A CTA holds `block_rows` whole rows of `n` elements in registers. When 16-byte vectors of
the tile split evenly over the threads the tile is exactly [block_rows, n] and moves by
vectorized copies; otherwise it is padded to a multiple of the thread count and moves by
guarded scalar accesses, the padding reading as zero (it adds nothing to any row sum).
"""

from __future__ import annotations

from dataclasses import dataclass

import tilelang.language as T

VEC = 8  # 16-byte accesses of fp16/bf16
SMS = 132  # streaming multiprocessors of an H100 SXM / H200: one persistent wave


def vector_map_ok(n: int, block_rows: int, threads: int) -> bool:
    """Whether 16-byte vectors of a [block_rows, n] tile split evenly over the threads.

    Threads must tile a row's vectors evenly, or (short rows) cover whole rows; the row
    reduction also needs a power-of-two thread count. Other shapes take the padded path.
    """
    if n % VEC or threads & (threads - 1):
        return False
    row_vecs = n // VEC
    return row_vecs % threads == 0 or (threads % row_vecs == 0
                                       and block_rows % (threads // row_vecs) == 0)


def stageable(n: int, block_rows: int, threads: int) -> bool:
    """Whether rows can be staged through shared memory by TMA (16-byte rows) into an exact
    [block_rows, n] register tile: 16-byte vectors split evenly, or one row whose 8-byte
    vectors do (5120 and 7168 columns over 256 threads; TileLang lays a multi-row tile of
    that kind out as whole rows per thread)."""
    if n % VEC or threads & (threads - 1):
        return False
    return vector_map_ok(n, block_rows, threads) or (block_rows == 1 and n % (4 * threads) == 0)


def fused_sums_ok(n: int, block_rows: int, threads: int, exact: bool = False) -> bool:
    """Whether a CTA's row sums can be taken by `cta_sums` (`fused_sums`, forward and
    backward): more than a warp, each thread holding a share of every one of its rows
    (`exact`: the staged [block_rows, n] tile)."""
    return threads > 32 and RowTile(n, block_rows, threads, exact).rows_per_thread == block_rows


@dataclass(frozen=True)
class RowTile:
    """The [block_rows, n_tile] register tile of `n`-element rows and how it moves;
    `exact` (rows staged through shared memory, see `stageable`) keeps it [block_rows, n]."""

    n: int
    block_rows: int
    threads: int
    exact: bool = False

    @property
    def aligned(self) -> bool:
        return self.exact or vector_map_ok(self.n, self.block_rows, self.threads)

    @property
    def rows_per_thread(self) -> int:
        """How many of the tile's rows each thread holds a share of: the row sums it takes
        part in, which one batched all-reduce can combine (one set of barriers for all)."""
        # TileLang vectorizes the tile's columns by the widest of 8, 4, 2, 1 elements that
        # divides them and deals the vectors out row by row; when a row has fewer vectors
        # than threads, the threads split into groups of rows. (A wrong count fails the
        # compile, it cannot reduce the wrong values.)
        width = next(v for v in (VEC, 4, 2, 1)
                     if self.n_tile % v == 0
                     and (self.block_rows * self.n_tile // v) % self.threads == 0)
        row_vecs = self.n_tile // width
        if row_vecs >= self.threads:
            return self.block_rows
        return max(1, self.block_rows // (self.threads // row_vecs))

    @property
    def n_tile(self) -> int:
        return self.n if self.aligned else -(-self.n // self.threads) * self.threads

    @property
    def shape(self) -> tuple[int, int]:
        return (self.block_rows, self.n_tile)

    def macros(self, rows):
        """(load, store) macros moving the tile at row `row0` of a [rows, n] tensor; rows
        past `rows` load as zero and are not stored."""
        n, block_rows, n_tile, aligned = self.n, self.block_rows, self.n_tile, self.aligned

        @T.macro
        def load(gmem, tile, first_row):
            if aligned:
                T.copy(gmem[first_row, 0], tile)
            else:
                for i, j in T.Parallel(block_rows, n_tile):
                    tile[i, j] = T.if_then_else((j < n) & (first_row + i < rows),
                                                gmem[first_row + i, j], T.cast(0, gmem.dtype))

        @T.macro
        def store(tile_out, gmem_out, row_out):
            if aligned:
                T.copy(tile_out, gmem_out[row_out, 0])
            else:
                for i, j in T.Parallel(block_rows, n_tile):
                    if (j < n) & (row_out + i < rows):
                        gmem_out[row_out + i, j] = tile_out[i, j]

        return load, store


def row_configs(n: int, elems_per_thread: tuple[int, int], threads_options=(64, 128, 256, 512)):
    """(block_rows, threads) pairs whose tiles map onto 16-byte vectors and give each thread
    a number of elements within `elems_per_thread` (the tuning spaces)."""
    lo, hi = elems_per_thread
    found = []
    for block_rows in (1, 2, 4, 8, 16, 32):
        for threads in threads_options:
            if lo <= block_rows * n / threads <= hi and vector_map_ok(n, block_rows, threads):
                found.append((block_rows, threads))
    return found


def lane_row_macros(row_threads: int, vec: int, vecs: int):
    """(col, load_row, load_vector) of the lane map: thread `lane` of a row's
    `row_threads` holds vectors i * row_threads + lane (i < vecs, `vec` elements each), so a
    warp's accesses are contiguous. col(i, j, lane) is element j of its vector i; load_row
    fills local[vecs, vec] from row `row` of a [rows, n] tensor, load_vector from an [n]
    one."""
    def col(i, j, lane):
        return (i * row_threads + lane) * vec + j

    @T.macro
    def load_row(gmem, local, row, lane):
        for i in T.unroll(vecs):
            for j in T.vectorized(vec):
                local[i, j] = gmem[row, col(i, j, lane)]

    @T.macro
    def load_vector(gmem, local, lane):
        for i in T.unroll(vecs):
            for j in T.vectorized(vec):
                local[i, j] = gmem[col(i, j, lane)]

    return col, load_row, load_vector


def lane_ring_macros(row_threads: int, vec: int, vecs: int):
    """(ring_issue, ring_read) of the lane map's shared ring: ring_issue copies this thread's
    vectors of row `row` of a [rows, n] tensor into ring[slot, r] by cp.async (not waited:
    the caller commits and waits by groups), ring_read reads them back into local[vecs,
    vec]. Each thread reads only what it copied, so only its own cp.async waits order
    them."""
    col, _, _ = lane_row_macros(row_threads, vec, vecs)

    @T.macro
    def ring_issue(gmem, ring, slot, row, r, lane):
        for i in T.unroll(vecs):
            T.ptx_cp_async(T.access_ptr(ring[slot, r, col(i, 0, lane)], "w", vec),
                           T.access_ptr(gmem[row, col(i, 0, lane)], "r", vec), vec)

    @T.macro
    def ring_read(ring, local, slot, r, lane):
        for i in T.unroll(vecs):
            for j in T.vectorized(vec):
                local[i, j] = ring[slot, r, col(i, j, lane)]

    return ring_issue, ring_read


def dx_value(g, xhat, dot, gsum, rstd, dres):
    """A row norm's input gradient (fp32 expressions): rstd (g - xhat dot - gsum) + dres,
    with g = dy w, dot = mean(g xhat), gsum = mean(g) (LayerNorm; None for RMSNorm) and
    dres the residual sum's gradient (the fused add; else None)."""
    v = g - xhat * dot
    if gsum is not None:
        v = v - gsum
    v = v * rstd
    return v if dres is None else v + dres


@T.macro
def cta_sums(part, red, count: int, threads: int):
    """part[0:count] <- each one summed over the CTA's `threads` threads (every thread gets
    the sums): warp shuffles, the warps' partials through `red` [count, threads // 32] in
    shared memory, one barrier (TileLang inserts it; a warp-specialized consumer's own).
    TileLang's all-reduce syncs twice per level above a warp, for every sum."""
    warps = threads // 32
    for q in T.unroll(count):
        for k in T.unroll(5):
            part[q] = part[q] + T.shfl_xor(part[q], 1 << k)
    tx = T.get_thread_binding()
    if tx % 32 == 0:  # a warp-specialized consumer's warps may start past 0: any order
        for q in T.unroll(count):
            red[q, (tx // 32) % warps] = part[q]
    for q in T.unroll(count):
        part[q] = red[q, 0]
        for w in T.unroll(warps - 1):
            part[q] = part[q] + red[q, w + 1]


@T.macro
def merge_moments(cnt, mean, m2, q, other):
    """Row q's (count, mean, sum of squared deviations) <- merged with `other` [3]'s
    (Chan et al.'s pairwise update: the deviations of two groups' means, never a difference
    of two large sums, so rows far from zero mean keep their variance). Reads the old
    values before writing each."""
    total = T.max(cnt[q] + other[0], 1.0)  # two empty groups stay empty
    delta = other[1] - mean[q]
    m2[q] = m2[q] + other[2] + delta * delta * cnt[q] * other[0] / total
    mean[q] = mean[q] + delta * other[0] / total
    cnt[q] = cnt[q] + other[0]


@T.macro
def cta_moments(cnt, mean, m2, red, count: int, threads: int):
    """cnt / mean / m2 [0:count] (fp32 registers) <- each row's element count, mean and sum
    of squared deviations over the CTA's `threads` threads, from each thread's own: warp
    shuffles, the warps' moments through `red` [3, count, threads // 32] in shared memory,
    one barrier. A LayerNorm's mean and variance in one exchange, where `cta_sums` needs one
    for the mean and another for the squares about it."""
    warps = threads // 32
    other = T.alloc_local((3,), "float")
    for q in T.unroll(count):
        for k in T.unroll(5):
            other[0] = T.shfl_xor(cnt[q], 1 << k)
            other[1] = T.shfl_xor(mean[q], 1 << k)
            other[2] = T.shfl_xor(m2[q], 1 << k)
            merge_moments(cnt, mean, m2, q, other)
    tx = T.get_thread_binding()
    if tx % 32 == 0:  # a warp-specialized consumer's warps may start past 0: any order
        for q in T.unroll(count):
            red[0, q, (tx // 32) % warps] = cnt[q]
            red[1, q, (tx // 32) % warps] = mean[q]
            red[2, q, (tx // 32) % warps] = m2[q]
    for q in T.unroll(count):
        cnt[q] = red[0, q, 0]
        mean[q] = red[1, q, 0]
        m2[q] = red[2, q, 0]
        for w in T.unroll(warps - 1):
            for v in T.unroll(3):
                other[v] = red[v, q, w + 1]
            merge_moments(cnt, mean, m2, q, other)
