"""FlashAttention-style forward on Hopper: TMA loads, wgmma, online softmax in registers.

q [B, Sq, H, D], k/v [B, Skv, Hkv, D] (BSHD), o like q, lse [B, H, Sq] (fp32, natural log).
B, Sq and Skv are symbolic; head_dim, head counts and the mask options are compiled in.
Each CTA owns `block_m` query rows of one head and walks the key/value tiles its mask can
reach (causal and sliding windows skip whole tiles), keeping the running row max and sum in
fp32. Masks align bottom-right: query i sees key j when j - i - (Skv - Sq) lies in
[-window_left, window_right] (-1 = unbounded; causal is window_right = 0). A row that sees
no key gets o = 0 and lse = -inf.
"""

import math
from dataclasses import dataclass
from types import SimpleNamespace

import tilelang.language as T

from ..base import Kernel
from .mask import key_tile_range

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
SMEM_LIMIT = 227 * 1024


@dataclass(frozen=True)
class AttentionFwdConfig:
    block_m: int = 128
    block_n: int = 128
    stages: int = 2
    threads: int = 256  # consumer threads; warp specialization adds a producer warpgroup

    def smem_bytes(self, head_dim: int, elem_bytes: int = 2) -> int:
        """Q tile plus `stages` K and V tiles (TileLang reuses the Q buffer for O)."""
        return (self.block_m + 2 * self.stages * self.block_n) * head_dim * elem_bytes


def _attention_macros(head_dim: int, dtype: str, window_left: int, window_right: int,
                      softcap: float, block_m: int, block_n: int):
    """The steps the dense and the varlen programs share, as TileLang macros."""
    masked_right = window_right >= 0
    masked_left = window_left >= 0

    def tile_range(q_start, seq_q, seq_kv):
        return key_tile_range(q_start, seq_q, seq_kv, block_m, block_n, window_left,
                              window_right)

    def alloc_state():
        """Register tiles: scores, probabilities, output accumulator and row statistics."""
        rows = [T.alloc_fragment((block_m,), "float") for _ in range(7)]
        return (T.alloc_fragment((block_m, block_n), "float"),
                T.alloc_fragment((block_m, block_n), dtype),
                T.alloc_fragment((block_m, head_dim), "float"), *rows)

    def exp2_scale(scale):
        """Factor that turns the score tile into log2 units inside exp2 (one FFMA)."""
        return 1.0 if softcap > 0 else scale * LOG2E

    @T.macro
    def init(o_local, l_local, m_local):
        T.fill(o_local, 0)
        T.fill(l_local, 0)
        T.fill(m_local, -T.infinity("float"))

    def visible(i, j, q_start, kv_start, seq_q, seq_kv):
        rel = kv_start + j - (q_start + i) - (seq_kv - seq_q)  # key minus query position
        seen = kv_start + j < seq_kv
        if masked_right:
            seen = seen & (rel <= window_right)
        if masked_left:
            seen = seen & (rel >= -window_left)
        return seen

    @T.macro
    def scores(q_shared, k_shared, s_local, q_start, kv_start, seq_q, seq_kv, scale):
        """s = q k^T, -inf where the mask hides the key.

        Without softcap the mask is the accumulator's initial value (0 or -inf) and the
        scale is applied inside exp2, so no extra pass runs over the tile; with softcap,
        s = log2(e) * softcap * tanh(scaled logit) needs its own pass, which masks too.
        """
        if softcap > 0:
            T.clear(s_local)
        else:
            for i, j in T.Parallel(block_m, block_n):
                s_local[i, j] = T.if_then_else(
                    visible(i, j, q_start, kv_start, seq_q, seq_kv), 0, -T.infinity("float"))
        T.gemm(q_shared, k_shared, s_local, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
        if softcap > 0:
            for i, j in T.Parallel(block_m, block_n):
                s_local[i, j] = T.if_then_else(
                    visible(i, j, q_start, kv_start, seq_q, seq_kv),
                    T.tanh(s_local[i, j] * (scale / softcap)) * (softcap * LOG2E),
                    -T.infinity("float"))

    @T.macro
    def online_softmax(s_local, p_local, m_local, m_prev, m_safe, rescale, row_sum, l_local,
                       scale):
        """Folds one tile into the running max and sum; p = exp2((s - max) * exp2_scale)."""
        T.copy(m_local, m_prev)
        T.reduce_max(s_local, m_local, dim=1, clear=False)
        for i in T.Parallel(block_m):
            # -inf rows (nothing visible yet) must not turn exp2 into NaN.
            m_safe[i] = T.if_then_else(m_local[i] == -T.infinity("float"), 0,
                                       m_local[i] * exp2_scale(scale))
            rescale[i] = T.exp2(m_prev[i] * exp2_scale(scale) - m_safe[i])
        for i, j in T.Parallel(block_m, block_n):
            s_local[i, j] = T.exp2(s_local[i, j] * exp2_scale(scale) - m_safe[i])
        T.reduce_sum(s_local, row_sum, dim=1)
        for i in T.Parallel(block_m):
            l_local[i] = l_local[i] * rescale[i] + row_sum[i]
        T.copy(s_local, p_local)

    @T.macro
    def rescale_output(o_local, rescale):
        for i, j in T.Parallel(block_m, head_dim):
            o_local[i, j] *= rescale[i]

    @T.macro
    def finish(o_local, l_local, m_local, lse_local, scale):
        """o /= l and the natural-log lse; rows that saw no key get 0 and -inf."""
        for i, j in T.Parallel(block_m, head_dim):
            o_local[i, j] = T.if_then_else(l_local[i] > 0, o_local[i, j] / l_local[i], 0)
        for i in T.Parallel(block_m):
            lse_local[i] = T.if_then_else(
                l_local[i] > 0, (m_local[i] * exp2_scale(scale) + T.log2(l_local[i])) * LN2,
                -T.infinity("float"))

    return SimpleNamespace(alloc_state=alloc_state, tile_range=tile_range, init=init,
                           scores=scores, online_softmax=online_softmax,
                           rescale_output=rescale_output, finish=finish)


def attention_fwd_program(heads: int, kv_heads: int, head_dim: int, dtype: str,
                          window_left: int, window_right: int, softcap: float,
                          block_m: int, block_n: int, stages: int, threads: int):
    """Dense BSHD batch: q [B, Sq, H, D], k/v [B, Skv, Hkv, D], lse [B, H, Sq]."""
    batch, seq_q, seq_kv = T.dynamic("batch, seq_q, seq_kv")
    group = heads // kv_heads
    q_shape = (batch, seq_q, heads, head_dim)
    kv_shape = (batch, seq_kv, kv_heads, head_dim)
    step = _attention_macros(head_dim, dtype, window_left, window_right, softcap, block_m,
                             block_n)

    @T.prim_func
    def attention_fwd(q: T.Tensor(q_shape, dtype), k: T.Tensor(kv_shape, dtype),
                      v: T.Tensor(kv_shape, dtype), o: T.Tensor(q_shape, dtype),
                      lse: T.Tensor((batch, heads, seq_q), "float"), scale: T.float32):
        # Heads vary fastest and query blocks run last-first, so the first wave takes the
        # blocks a causal mask leaves the most key tiles to (longest-first scheduling), and
        # the query heads of one GQA group share K/V in L2.
        n_blocks = T.ceildiv(seq_q, block_m)
        with T.Kernel(heads, n_blocks, batch, threads=threads) as (bx, by, bz):
            q_shared = T.alloc_shared((block_m, head_dim), dtype)
            k_shared = T.alloc_shared((block_n, head_dim), dtype)
            v_shared = T.alloc_shared((block_n, head_dim), dtype)
            o_shared = T.alloc_shared((block_m, head_dim), dtype)
            (s_local, p_local, o_local, m_local, m_prev, m_safe, rescale, row_sum, l_local,
             lse_local) = step.alloc_state()

            q_start = (n_blocks - 1 - by) * block_m
            tile_begin, reachable = step.tile_range(q_start, seq_q, seq_kv)
            # At least one (then fully masked) tile: the consumers wait for Q's TMA load in
            # the first iteration, and o_shared overlays q_shared, so a block whose rows see
            # no key (Sq > Skv) would otherwise store O while that load may still land.
            n_tiles = T.max(reachable, 1)
            T.copy(q[bz, q_start:q_start + block_m, bx, :], q_shared)
            step.init(o_local, l_local, m_local)
            for t in T.Pipelined(n_tiles, num_stages=stages):
                T.copy(k[bz, (tile_begin + t) * block_n:(tile_begin + t + 1) * block_n,
                         bx // group, :], k_shared)
                step.scores(q_shared, k_shared, s_local, q_start, (tile_begin + t) * block_n,
                            seq_q, seq_kv, scale)
                step.online_softmax(s_local, p_local, m_local, m_prev, m_safe, rescale,
                                    row_sum, l_local, scale)
                step.rescale_output(o_local, rescale)
                T.copy(v[bz, (tile_begin + t) * block_n:(tile_begin + t + 1) * block_n,
                         bx // group, :], v_shared)
                T.gemm(p_local, v_shared, o_local, policy=T.GemmWarpPolicy.FullRow)
            step.finish(o_local, l_local, m_local, lse_local, scale)
            T.copy(o_local, o_shared)
            T.copy(o_shared, o[bz, q_start:q_start + block_m, bx, :])  # TMA clips the Sq tail
            T.copy(lse_local, lse[bz, bx, q_start:q_start + block_m])

    return attention_fwd


def attention_varlen_fwd_program(heads: int, kv_heads: int, head_dim: int, dtype: str,
                                 window_left: int, window_right: int, softcap: float,
                                 block_m: int, block_n: int, stages: int, threads: int):
    """Packed sequences: q [Tq, H, D], k/v [Tkv, Hkv, D], cu_seqlens [B + 1], lse [H, Tq].

    The grid covers max_seqlen_q rows per sequence; blocks past a sequence's end do no
    work, and rows past it are never stored (they belong to the next sequence).
    """
    total_q, total_kv, batch_1 = T.dynamic("total_q, total_kv, batch_1")
    group = heads // kv_heads
    step = _attention_macros(head_dim, dtype, window_left, window_right, softcap, block_m,
                             block_n)

    @T.prim_func
    def attention_varlen_fwd(q: T.Tensor((total_q, heads, head_dim), dtype),
                             k: T.Tensor((total_kv, kv_heads, head_dim), dtype),
                             v: T.Tensor((total_kv, kv_heads, head_dim), dtype),
                             cu_seqlens_q: T.Tensor((batch_1,), "int32"),
                             cu_seqlens_kv: T.Tensor((batch_1,), "int32"),
                             o: T.Tensor((total_q, heads, head_dim), dtype),
                             lse: T.Tensor((heads, total_q), "float"), max_seqlen_q: T.int32,
                             scale: T.float32):
        n_blocks = T.ceildiv(max_seqlen_q, block_m)  # longest-first, as in the dense grid
        with T.Kernel(heads, n_blocks, batch_1 - 1, threads=threads) as (bx, by, bz):
            q_shared = T.alloc_shared((block_m, head_dim), dtype)
            k_shared = T.alloc_shared((block_n, head_dim), dtype)
            v_shared = T.alloc_shared((block_n, head_dim), dtype)
            (s_local, p_local, o_local, m_local, m_prev, m_safe, rescale, row_sum, l_local,
             lse_local) = step.alloc_state()

            q_offset = cu_seqlens_q[bz]
            kv_offset = cu_seqlens_kv[bz]
            seq_q = cu_seqlens_q[bz + 1] - q_offset
            seq_kv = cu_seqlens_kv[bz + 1] - kv_offset
            q_start = (n_blocks - 1 - by) * block_m
            tile_begin, reachable = step.tile_range(q_start, seq_q, seq_kv)
            n_tiles = T.if_then_else(q_start < seq_q, reachable, 0)
            T.copy(q[q_offset + q_start:q_offset + q_start + block_m, bx, :], q_shared)
            step.init(o_local, l_local, m_local)
            for t in T.Pipelined(n_tiles, num_stages=stages):
                T.copy(k[kv_offset + (tile_begin + t) * block_n:
                         kv_offset + (tile_begin + t + 1) * block_n, bx // group, :], k_shared)
                step.scores(q_shared, k_shared, s_local, q_start, (tile_begin + t) * block_n,
                            seq_q, seq_kv, scale)
                step.online_softmax(s_local, p_local, m_local, m_prev, m_safe, rescale,
                                    row_sum, l_local, scale)
                step.rescale_output(o_local, rescale)
                T.copy(v[kv_offset + (tile_begin + t) * block_n:
                         kv_offset + (tile_begin + t + 1) * block_n, bx // group, :], v_shared)
                T.gemm(p_local, v_shared, o_local, policy=T.GemmWarpPolicy.FullRow)
            step.finish(o_local, l_local, m_local, lse_local, scale)
            for i, j in T.Parallel(block_m, head_dim):
                if q_start + i < seq_q:
                    o[q_offset + q_start + i, bx, j] = o_local[i, j]
            for i in T.Parallel(block_m):
                if q_start + i < seq_q:
                    lse[bx, q_offset + q_start + i] = lse_local[i]

    return attention_varlen_fwd


class AttentionFwdKernel(Kernel):
    """key: dtype, heads, kv_heads, head_dim, window_left, window_right, softcap."""

    name = "attention_fwd"
    Config = AttentionFwdConfig

    def program(self, config: AttentionFwdConfig, bucket: str):
        k = self.key
        return attention_fwd_program(k["heads"], k["kv_heads"], k["head_dim"], k["dtype"],
                                     k["window_left"], k["window_right"], k["softcap"],
                                     config.block_m, config.block_n, config.stages,
                                     config.threads)

    def run(self, config: AttentionFwdConfig, compiled: tuple, q, k, v, o, lse,
            scale: float) -> None:
        compiled[0](q, k, v, o, lse, scale)

    def heuristic_config(self, bucket: str, arch: str) -> AttentionFwdConfig:
        if self.key["head_dim"] >= 256:
            return AttentionFwdConfig(block_m=128, block_n=64, stages=2, threads=256)
        return AttentionFwdConfig(block_m=128, block_n=128, stages=2, threads=256)

    def config_space(self, bucket: str) -> list[AttentionFwdConfig]:
        space = [self.heuristic_config(bucket, "sm_90a")]
        for block_n in (64, 128, 176):
            for stages in (1, 2):
                space.append(AttentionFwdConfig(128, block_n, stages, 256))
        return [c for c in dict.fromkeys(space) if c.smem_bytes(self.key["head_dim"]) <= SMEM_LIMIT]


class AttentionVarlenFwdKernel(AttentionFwdKernel):
    """Packed sequences (cu_seqlens); same key and configs as the dense kernel."""

    name = "attention_varlen_fwd"

    def program(self, config: AttentionFwdConfig, bucket: str):
        k = self.key
        return attention_varlen_fwd_program(
            k["heads"], k["kv_heads"], k["head_dim"], k["dtype"], k["window_left"],
            k["window_right"], k["softcap"], config.block_m, config.block_n, config.stages,
            config.threads)

    def run(self, config: AttentionFwdConfig, compiled: tuple, q, k, v, cu_seqlens_q,
            cu_seqlens_kv, o, lse, max_seqlen_q: int, scale: float) -> None:
        compiled[0](q, k, v, cu_seqlens_q, cu_seqlens_kv, o, lse, max_seqlen_q, scale)
