"""The decode key loop's register state and online softmax with keys on the wgmma's M side.

A decode CTA holds few query rows: group x q_len of them (4-8 for Llama-3.x and Qwen3 GQA),
padded to the 64-row M of a wgmma in the forward's layout (`attention_fwd._attention_macros`),
so 7/8 of its tensor work and of its softmax (exp2 per score) is padding. Key-major turns
the products around:

    S^T [keys, rows] = K [keys, D] Q^T        (wgmma M = keys, N = the rows padded to 16)
    O^T [D, rows]   += V^T [D, keys] P^T      (M = D, N = rows; P^T from shared memory)

so the padding is at most 15 rows and the softmax runs over block_n x rows scores. The
interface is the forward macros' (alloc_state, state, init, online_softmax,
rescale_output, finish, share_sm) with s [block_n, rows] and o [D, rows] transposed; P
(shared) is [rows, block_n] and online_softmax stores it.
"""

from types import SimpleNamespace

import tilelang.language as T

from .attention_fwd import LN2, LOG2E, STATE, sm_sharing


def key_major_macros(rows: int, block_n: int, head_dim: int, dtype: str, softcap: float,
                     threads: int, ctas_per_sm: int):
    """Macros for `rows` query rows (a multiple of 16) against `block_n`-key tiles; P is
    `dtype`, the products' operand type.

    The softmax does not run on S^T where the wgmma leaves it: its columns (a query row's
    scores) span the warpgroup's four warps, and TileLang 0.1.15 reduces across warps with
    a barrier and a shared-memory round per value (32 barriers a tile: slower than the
    padded row-major program). S^T goes through shared memory into a row-major fragment
    whose rows each lie within one warp, and the per-row factors O^T needs (rescale, 1/l)
    come back through shared memory."""
    extra = {}

    def exp2_scale(scale):
        return 1.0 if softcap > 0 else scale * LOG2E

    def alloc_state():
        s_shared = T.alloc_shared((block_n, rows), "float")
        s_rows = T.alloc_fragment((rows, block_n), "float")
        col_stats = T.alloc_shared((2, rows), "float")  # per row: rescale, 1 / l
        extra.update(s_shared=s_shared, s_rows=s_rows, col_stats=col_stats)
        return (T.alloc_fragment((block_n, rows), "float"),
                T.alloc_shared((rows, block_n), dtype),
                T.alloc_fragment((head_dim, rows), "float"),
                *[T.alloc_fragment((rows,), "float") for _ in range(7)],
                None, None)

    def state(*buffers):
        return SimpleNamespace(**dict(zip(STATE, buffers, strict=True)), **extra)

    @T.macro
    def init(st):
        T.fill(st.o, 0)
        T.fill(st.l, 0)
        T.fill(st.m, -T.infinity("float"))

    @T.macro
    def online_softmax(st, scale):
        """As the forward's, on the row-major copy of S^T; P lands in shared memory (the
        B operand of O^T += V^T P^T) and each row's rescale factor beside it."""
        for i, j in T.Parallel(block_n, rows):
            st.s_shared[i, j] = st.s[i, j]
        for r, i in T.Parallel(rows, block_n):
            st.s_rows[r, i] = st.s_shared[i, r]
        T.copy(st.m, st.m_prev)
        T.reduce_max(st.s_rows, st.m, dim=1, clear=False)
        for r in T.Parallel(rows):
            # -inf rows (nothing visible yet) must not turn exp2 into NaN
            st.m_safe[r] = T.if_then_else(st.m[r] == -T.infinity("float"), 0,
                                          st.m[r] * exp2_scale(scale))
            st.rescale[r] = T.exp2(st.m_prev[r] * exp2_scale(scale) - st.m_safe[r])
        for r, i in T.Parallel(rows, block_n):
            st.s_rows[r, i] = T.exp2(st.s_rows[r, i] * exp2_scale(scale) - st.m_safe[r])
        T.reduce_sum(st.s_rows, st.row_sum, dim=1)
        for r in T.Parallel(rows):
            st.l[r] = st.l[r] * st.rescale[r] + st.row_sum[r]
            st.col_stats[0, r] = st.rescale[r]
        T.copy(st.s_rows, st.p)

    @T.macro
    def rescale_output(st):
        for d, r in T.Parallel(head_dim, rows):
            st.o[d, r] *= st.col_stats[0, r]

    @T.macro
    def finish(st, scale):
        """o /= l and the natural-log lse; rows that saw no key get 0 and -inf."""
        for r in T.Parallel(rows):
            st.col_stats[1, r] = T.if_then_else(st.l[r] > 0, 1.0 / st.l[r], 0)
            st.lse[r] = T.if_then_else(
                st.l[r] > 0, (st.m[r] * exp2_scale(scale) + T.log2(st.l[r])) * LN2,
                -T.infinity("float"))
        for d, r in T.Parallel(head_dim, rows):
            st.o[d, r] = st.o[d, r] * st.col_stats[1, r]

    return SimpleNamespace(alloc_state=alloc_state, state=state, init=init,
                           online_softmax=online_softmax, rescale_output=rescale_output,
                           finish=finish, share_sm=sm_sharing(threads, ctas_per_sm))
