"""The decode key loop's register state and online softmax with keys on the wgmma's M side.

A decode CTA holds few query rows: group x q_len of them (4-8 for Llama-3.x and Qwen3 GQA),
padded to the 64-row M of a wgmma in the forward's layout (`attention_fwd._attention_macros`),
so 7/8 of its tensor work and of its softmax (exp2 per score) is padding. Key-major turns
the products around:

    S^T [keys, rows] = K [keys, D] Q^T        (wgmma M = keys, N = the rows padded to 16)
    O^T [D, rows]   += V^T [D, keys] P^T      (M = D, N = rows; P^T from shared memory)

so the padding is at most 15 rows and the softmax runs over block_n x rows scores. The
reductions run down the columns (dim 0, across the warpgroup's warps). The interface is
the forward macros' (alloc_state, state, init, online_softmax, rescale_output, finish,
share_sm) with every tile transposed: s [block_n, rows], p (shared) [block_n, rows] and
o [D, rows].
"""

from types import SimpleNamespace

import tilelang.language as T

from .attention_fwd import LN2, LOG2E, STATE, sm_sharing


def key_major_macros(rows: int, block_n: int, head_dim: int, dtype: str, softcap: float,
                     threads: int, ctas_per_sm: int):
    """Macros for `rows` query rows (a multiple of 16) against `block_n`-key tiles; P is
    `dtype`, the products' operand type."""

    def exp2_scale(scale):
        return 1.0 if softcap > 0 else scale * LOG2E

    def alloc_state():
        return (T.alloc_fragment((block_n, rows), "float"),
                T.alloc_shared((block_n, rows), dtype),
                T.alloc_fragment((head_dim, rows), "float"),
                *[T.alloc_fragment((rows,), "float") for _ in range(7)],
                None, None)

    def state(*buffers):
        return SimpleNamespace(**dict(zip(STATE, buffers, strict=True)))

    @T.macro
    def init(st):
        T.fill(st.o, 0)
        T.fill(st.l, 0)
        T.fill(st.m, -T.infinity("float"))

    @T.macro
    def online_softmax(st, scale):
        """As the forward's, down the key axis: s becomes the unnormalized P^T."""
        T.copy(st.m, st.m_prev)
        T.reduce_max(st.s, st.m, dim=0, clear=False)
        for j in T.Parallel(rows):
            # -inf rows (nothing visible yet) must not turn exp2 into NaN
            st.m_safe[j] = T.if_then_else(st.m[j] == -T.infinity("float"), 0,
                                          st.m[j] * exp2_scale(scale))
            st.rescale[j] = T.exp2(st.m_prev[j] * exp2_scale(scale) - st.m_safe[j])
        for i, j in T.Parallel(block_n, rows):
            st.s[i, j] = T.exp2(st.s[i, j] * exp2_scale(scale) - st.m_safe[j])
        T.reduce_sum(st.s, st.row_sum, dim=0)
        for j in T.Parallel(rows):
            st.l[j] = st.l[j] * st.rescale[j] + st.row_sum[j]

    @T.macro
    def rescale_output(st):
        for d, j in T.Parallel(head_dim, rows):
            st.o[d, j] *= st.rescale[j]

    @T.macro
    def finish(st, scale):
        """o /= l and the natural-log lse; rows that saw no key get 0 and -inf."""
        for j in T.Parallel(rows):
            st.row_sum[j] = 1.0 / st.l[j]
        for d, j in T.Parallel(head_dim, rows):
            st.o[d, j] = T.if_then_else(st.l[j] > 0, st.o[d, j] * st.row_sum[j], 0)
        for j in T.Parallel(rows):
            st.lse[j] = T.if_then_else(
                st.l[j] > 0, (st.m[j] * exp2_scale(scale) + T.log2(st.l[j])) * LN2,
                -T.infinity("float"))

    return SimpleNamespace(alloc_state=alloc_state, state=state, init=init,
                           online_softmax=online_softmax, rescale_output=rescale_output,
                           finish=finish, share_sm=sm_sharing(threads, ctas_per_sm))
