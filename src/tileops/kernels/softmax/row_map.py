"""How the softmax-family kernels spread rows of any length (128 to 256K columns) over a
CTA, and the per-row reductions they share.

A CTA runs `threads` threads; `row_threads` of them (whole warps, or a power of two below
a warp) share one row, so a CTA holds `threads // row_threads` rows at a time. A row is
walked in chunks of `row_threads * vecs` vectors: thread `lane` of the row loads vectors
`i * row_threads + lane` of the chunk (i < vecs), so a warp's accesses are contiguous. A
vector is the widest power of two <= 16 bytes that divides the row length, so it never
crosses a row; only vectors past the row's end (last chunk) are guarded. Row sums and
maxima run per thread across chunks and are combined once per row: warp shuffles, then
shared memory across the row's warps.

The grid is persistent: at most `ctas` CTAs (a config value, a multiple of the SM count)
each take every `ctas`-th group of rows. The two-pass kernels (statistics, then outputs)
read a row twice; bounding the rows in flight keeps more of the second read in L2 for
vocab-size rows, and so do two walk options: `reverse` (the second pass takes the chunks
last to first, so it starts with those the first pass read last) and `l2_hints` (eviction
priorities on the loads and stores: l2_hints.py). Row count is symbolic; the row length is
compiled in.
"""

import math
from dataclasses import dataclass

import tilelang.language as T

from .. import fast_math, l2_hints
from ..fast_math import LOG2E
from ..vectors import ELEM_BYTES, vector_width

NEG_INF = -math.inf


def exp(v):
    """e^v as 2^(v log2 e): a multiply and the SFU's ex2 (fast_math.exp2: one instruction,
    subnormal results flushed to 0). expf costs several more instructions per element, which
    made these kernels compute-bound; a kernel using this calls fast_math.import_source()."""
    return fast_math.exp2(v * LOG2E)


@dataclass(frozen=True)
class RowMap:
    n: int
    dtype: str
    threads: int
    row_threads: int
    vecs: int
    ctas: int
    reverse: bool = False
    l2_hints: bool = False

    def __post_init__(self):
        rt = self.row_threads
        # lanes past the first warp meet in shared memory, so any whole number of warps works;
        # a row of fewer threads is reduced by shuffles inside its aligned lane group
        if (rt % 32 if rt >= 32 else rt & (rt - 1)) or rt < 1 or self.threads % rt:
            raise ValueError(f"row_threads={rt} must be a multiple of 32 or a power of two "
                             f"below 32, dividing threads={self.threads}")
        if self.l2_hints and self.vec * ELEM_BYTES[self.dtype] != l2_hints.VECTOR_BYTES:
            raise ValueError(f"l2_hints needs 16-byte vectors; rows of {self.n} {self.dtype} "
                             f"take {self.vec}-element ones")

    @property
    def vec(self) -> int:
        return vector_width(self.n, self.dtype)

    @property
    def rows_per_cta(self) -> int:
        return self.threads // self.row_threads

    @property
    def chunk(self) -> int:
        return self.row_threads * self.vecs * self.vec

    @property
    def chunks(self) -> int:
        return -(-self.n // self.chunk)

    @property
    def row_warps(self) -> int:
        return self.row_threads // 32

    def grid(self, rows):
        return T.min(T.ceildiv(rows, self.rows_per_cta), self.ctas)

    def macros(self, rows):
        """(rows_of_cta, load, store, reduce_sum, reduce_max_sum) macros for a [rows, n]
        problem; see each one's comment."""
        n, vec, vecs, rt = self.n, self.vec, self.vecs, self.row_threads
        chunk, warps = self.chunk, self.row_warps
        shuffles = int(math.log2(min(rt, 32)))

        @T.macro
        def load(buf, row, c, local, lane, fill):
            """local[vecs, vec] (float) <- chunk c of buf's row; `fill` past the row."""
            for i in T.unroll(vecs):
                col = c * chunk + (i * rt + lane) * vec
                if col < n:
                    for j in T.vectorized(vec):
                        local[i, j] = T.cast(buf[row, col + j], "float")
                else:
                    for j in T.unroll(vec):
                        local[i, j] = fill

        @T.macro
        def store(local, buf, row, c, lane):
            """chunk c of buf's row <- local[vecs, vec] (in buf's dtype)."""
            for i in T.unroll(vecs):
                col = c * chunk + (i * rt + lane) * vec
                if col < n:
                    for j in T.vectorized(vec):
                        buf[row, col + j] = T.cast(local[i, j], buf.dtype)

        @T.macro
        def reduce_sum(v, red, r, lane):
            """v[0] <- the sum of v[0] over the row's threads (every thread gets it).
            `red` is a shared [rows_per_cta, row_warps] float buffer of this reduction."""
            for k in T.unroll(shuffles):
                v[0] = v[0] + T.shfl_xor(v[0], 1 << k)
            if warps > 1:
                if lane % 32 == 0:
                    red[r, lane // 32] = v[0]
                T.sync_threads()
                v[0] = red[r, 0]
                for w in T.unroll(warps - 1):
                    v[0] = v[0] + red[r, w + 1]

        def safe_shift(hi):
            return T.if_then_else(hi == NEG_INF, T.float32(0), hi)

        @T.macro
        def merge(m, s, m_o, s_o):
            # (m, s) <- the max and rescaled exp-sum of two partials. The shift is 0 while
            # the max is -inf (all masked so far): exp(-inf) = 0 instead of NaN. A +inf
            # entry makes s NaN, as in torch's softmax (see `logsumexp_of` for lse).
            hi = T.max(m[0], m_o)
            shift = safe_shift(hi)
            s[0] = s[0] * exp(m[0] - shift) + s_o * exp(m_o - shift)
            m[0] = hi

        @T.macro
        def reduce_max_sum(m, s, red_m, red_s, r, lane):
            """(m[0], s[0]) <- the row's max and its sum of exp(x - max) from each thread's
            partial pair (every thread gets them)."""
            for k in T.unroll(shuffles):
                merge(m, s, T.shfl_xor(m[0], 1 << k), T.shfl_xor(s[0], 1 << k))
            if warps > 1:
                if lane % 32 == 0:
                    red_m[r, lane // 32] = m[0]
                    red_s[r, lane // 32] = s[0]
                T.sync_threads()
                m[0] = red_m[r, 0]
                s[0] = red_s[r, 0]
                for w in T.unroll(warps - 1):
                    merge(m, s, red_m[r, w + 1], red_s[r, w + 1])

        @T.macro
        def chunk_max_sum(local, m, s):
            """Folds one loaded chunk (float, or as loaded: widened per use) into the
            thread's running (max, exp-sum) pair."""
            hi = T.alloc_local((1,), "float")
            hi[0] = m[0]
            for i in T.unroll(vecs):
                for j in T.unroll(vec):
                    hi[0] = T.max(hi[0], T.cast(local[i, j], "float"))
            shift = safe_shift(hi[0])
            s[0] = s[0] * exp(m[0] - shift)
            for i in T.unroll(vecs):
                for j in T.unroll(vec):
                    s[0] = s[0] + exp(T.cast(local[i, j], "float") - shift)
            m[0] = hi[0]

        return load, store, reduce_sum, reduce_max_sum, chunk_max_sum

    def second_pass_chunk(self, step, first: int = 0):
        """The chunk a two-pass kernel's second pass takes at its `step`, walking chunks
        `first` to the last (`reverse`: the last down to `first`)."""
        return self.chunks - 1 - step if self.reverse else first + step

    def hinted_macros(self):
        """(load_hinted, store_hinted): `load` and `store` through a raw[vecs, vec] local
        buffer of the row dtype, each 16-byte vector moved with an L2 cache policy (a uint64
        from l2_hints.keep_policy / drop_policy). The kernel calls l2_hints.import_hints()."""
        n, vec, vecs, rt, chunk = self.n, self.vec, self.vecs, self.row_threads, self.chunk
        unpack = self.kept_macros(0)[1]  # raw -> float, `fill` past the row (nothing kept)

        @T.macro
        def load_hinted(buf, row, c, raw, local, lane, fill, policy):
            for i in T.unroll(vecs):  # every load issued before the first use
                col = c * chunk + (i * rt + lane) * vec
                if col < n:
                    T.evaluate(l2_hints.load16(raw[i, 0], buf[row, col], policy))
            unpack(raw, c, local, None, 0, lane, fill)

        @T.macro
        def store_hinted(local, raw, buf, row, c, lane, policy):
            for i in T.unroll(vecs):
                col = c * chunk + (i * rt + lane) * vec
                if col < n:
                    for j in T.unroll(vec):
                        raw[i, j] = T.cast(local[i, j], raw.dtype)
                    T.evaluate(l2_hints.store16(buf[row, col], raw[i, 0], policy))

        return load_hinted, store_hinted

    def kept_bytes(self, kept_chunks: int) -> int:
        """Shared memory of `kept_chunks` chunks of every row a CTA holds, in the row dtype."""
        return self.rows_per_cta * kept_chunks * self.chunk * ELEM_BYTES[self.dtype]

    def kept_macros(self, kept_chunks: int):
        """(load_raw, unpack) for a two-pass kernel that keeps the first
        `kept_chunks` chunks of its rows in shared memory between the passes, so its second
        pass reads them there and not from L2 / HBM (a 256 KB vocabulary row does not stay
        in L2 while 132 SMs stream theirs), and may load chunk c + 1 into registers while it
        works on chunk c (`load_raw` into a second buffer: twice the bytes in flight). Each
        thread keeps and reads back only its own vectors: no barrier."""
        n, vec, vecs, rt, chunk = self.n, self.vec, self.vecs, self.row_threads, self.chunk

        @T.macro
        def load_raw(buf, row, c, raw, lane):
            """raw[vecs, vec] (buf's dtype) <- chunk c of buf's row; zeros past the row (never
            read: written so that no register carries a value from an earlier chunk)."""
            for i in T.unroll(vecs):
                col = c * chunk + (i * rt + lane) * vec
                if col < n:
                    for j in T.vectorized(vec):
                        raw[i, j] = buf[row, col + j]
                else:
                    for j in T.unroll(vec):
                        raw[i, j] = T.cast(0, raw.dtype)

        @T.macro
        def unpack(raw, c, local, kept, r, lane, fill):
            """local (float) <- raw (chunk c, `fill` past the row); chunks c < kept_chunks are
            also copied, as they are, to kept[r, :]."""
            for i in T.unroll(vecs):
                col = c * chunk + (i * rt + lane) * vec
                if col < n:
                    if kept_chunks > 0:
                        if c < kept_chunks:
                            for j in T.vectorized(vec):
                                kept[r, col + j] = raw[i, j]
                    for j in T.vectorized(vec):
                        local[i, j] = T.cast(raw[i, j], "float")
                else:
                    for j in T.unroll(vec):
                        local[i, j] = fill

        return load_raw, unpack

    @staticmethod
    def logsumexp_of(m, s):
        """m + log(s), and +inf when the max is +inf (torch.logsumexp's answer; s is NaN)."""
        return T.if_then_else(m == -NEG_INF, T.float32(-NEG_INF), m + T.log(s))

    @staticmethod
    def shift_of(m):
        """The exponent shift of a row with max m: 0 for a fully masked row (-inf), so its
        softmax is 0 / 0 = NaN as torch's, not exp(NaN)."""
        return T.if_then_else(m == NEG_INF, T.float32(0), m)

    def placed_row(self, group, r, rows):
        """(row, guard, live) of row slot r of row group `group` in a [rows, n] problem. A CTA
        whose rows each span several warps meets at CTA-wide barriers inside the row work
        (the reductions' shared-memory step), and CUDA wants every thread at each one; so in
        its last group the slots past the end run along on the last row (guard True) and
        store nothing (live: row < rows). Otherwise such slots skip the row (guard: row <
        rows) and a slot that runs stores (live True)."""
        row = group * self.rows_per_cta + r
        if self.rows_per_cta > 1 and self.row_warps > 1:
            return T.min(row, rows - 1), True, row < rows
        return row, row < rows, True

    def row_loop_bounds(self, rows):
        """(number of row-group steps per CTA) for the persistent loop."""
        return T.ceildiv(rows, self.rows_per_cta * self.ctas)
