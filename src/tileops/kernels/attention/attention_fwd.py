"""FlashAttention-style forward on Hopper: TMA loads, wgmma, online softmax in registers.

q [B, Sq, H, D], k/v [B, Skv, Hkv, D] (BSHD), o like q, lse [B, H, Sq] (fp32, natural log).
B, Sq and Skv are symbolic; head_dim, head counts and the mask options are compiled in.
`head_dim_v` (DeepSeek-V3's MLA prefill: q/k 192, v and o 128) sets V's and O's width
apart from Q's and K's; only the shared tiles and the P V product see it.
Each CTA owns `block_m` query rows of one head and walks the key/value tiles its mask can
reach (causal and sliding windows skip whole tiles), keeping the running row max and sum in
fp32. Masks align bottom-right: query i sees key j when j - i - (Skv - Sq) lies in
[-window_left, window_right] (-1 = unbounded; causal is window_right = 0). A row that sees
no key gets o = 0 and lse = -inf.

A producer warpgroup streams K and V tiles by TMA; two consumer warpgroups own 64 query rows
each. By default each wgmma is waited for, so a warpgroup's softmax overlaps only the other
warpgroup's wgmmas. With `overlap`, each warpgroup issues Q K^T of tile t and P V of tile
t - 1 asynchronously and runs tile t's softmax while P V runs (FlashAttention-3's
intra-warpgroup pipelining; TileLang 0.1.15 ignores manual `order`/`stage` schedules once it
warp-specializes a loop, so the overlap is written out with T.wgmma_gemm / T.wait_wgmma).
"""

import dataclasses
import math
from dataclasses import dataclass
from types import SimpleNamespace

import tilelang.language as T

from .. import fast_math
from ..base import Kernel
from ..fast_math import LOG2E
from .mask import key_tile_range, tile_fully_visible

LN2 = math.log(2.0)
SMEM_LIMIT = 227 * 1024
# The per-CTA register state of the forward, in alloc_state's order.
STATE = ("s", "p", "o", "m", "m_prev", "m_safe", "rescale", "row_sum", "l", "lse", "hold",
         "stale")
# lazy_rescale keeps a row's running max while the tile max exceeds it by at most this many
# doublings: probabilities then reach at most 2^8 (fine in fp32 sums and bf16/fp16 P).
LAZY_RESCALE_LOG2 = 8.0


@dataclass(frozen=True)
class AttentionFwdConfig:
    block_m: int = 128
    block_n: int = 128
    stages: int = 2
    threads: int = 256  # consumer threads; warp specialization adds a producer warpgroup
    overlap: bool = False  # softmax of tile t overlaps the P V wgmma of tile t - 1
    # 2: two CTAs share an SM (block_m 64, one consumer warpgroup each), so one's prologue
    # and epilogue run under the other's key loop; short sequences expose them most.
    ctas_per_sm: int = 1
    # Mask only the tiles a mask cuts through (the causal diagonal, window edges, the key
    # tail): S starts from a zeroed accumulator and interior tiles skip the per-element test.
    edge_masks_only: bool = False
    # Rescale O only when some row's max grew by more than 2^LAZY_RESCALE_LOG2 (a warp-wide
    # vote, so the skip is uniform): after the first tiles the max settles and the O pass,
    # head_dim multiplies per row per tile, is skipped. Exact: O, l and lse share the max.
    lazy_rescale: bool = False
    # Varlen only (the dense kernel always does this): a query block that lies inside its
    # sequence stores O through shared memory by TMA, whole tiles instead of row by row
    # under a guard; blocks at a sequence's end still store row by row.
    tile_store: bool = False
    # The grid walks the query heads of one GQA group fastest, then the query blocks, then
    # the KV heads, so the CTAs in flight read the K/V of one or two KV heads, which stays
    # in L2 at any length. With heads fastest every KV head streams at once: at 16K keys
    # (8 KV heads, head_dim 128) that is 64 MB of K/V against the H200's 50 MB of L2.
    kv_head_major: bool = False
    # exp2 (and the softcap's tanh) on the SFU's ex2 alone (fast_math.exp2, subnormal
    # probabilities flushed to 0) instead of exp2f, whose subnormal fix-up is three more
    # instructions per score (every MUFU.EX2 of the forward's SASS has one) in the stream
    # the softmax shares with the wgmma issue.
    fast_exp: bool = False

    def __post_init__(self):
        for name in ("edge_masks_only", "lazy_rescale"):
            if getattr(self, name) and self.overlap:
                raise ValueError(f"AttentionFwdConfig: {name} is not written for the "
                                 "overlap schedule")

    def smem_bytes(self, head_dim: int, elem_bytes: int = 2,
                   head_dim_v: int | None = None) -> int:
        """Q tile plus `stages` K and V tiles (TileLang reuses the Q buffer for O)."""
        dim_v = head_dim_v or head_dim
        return (self.block_m * head_dim
                + self.stages * self.block_n * (head_dim + dim_v)) * elem_bytes

    def fits(self, head_dim: int, head_dim_v: int | None = None) -> bool:
        """Whether `ctas_per_sm` CTAs of this config fit in one SM's shared memory."""
        return self.ctas_per_sm * self.smem_bytes(head_dim, head_dim_v=head_dim_v) <= SMEM_LIMIT


def consumer_registers(threads: int, ctas_per_sm: int) -> int:
    """Registers per consumer thread once the producer warpgroup has given its share back
    (setmaxnreg), with `ctas_per_sm` CTAs of `threads` consumers resident: 240 for one CTA
    of 384 threads, 232 for two CTAs of 256."""
    launch = min(255, 65536 // (ctas_per_sm * (threads + 128)) // 8 * 8)
    return min(240, (launch + (launch - 24) * 128 // threads) // 8 * 8)


def sm_sharing(threads: int, ctas_per_sm: int, fast_exp: bool = False):
    """A macro for the top of a warp-specialized kernel: with ctas_per_sm > 1, the launch
    bound that lets the CTAs be resident together, and the consumer/producer register split
    that fits in their share; with fast_exp, the fast-math CUDA its exp2 calls reach."""

    @T.macro
    def share_sm():
        if ctas_per_sm > 1:
            T.annotate_min_blocks_per_sm(ctas_per_sm)
            T.annotate_producer_reg_dealloc(24)
            T.annotate_consumer_reg_alloc(consumer_registers(threads, ctas_per_sm))
        if fast_exp:
            fast_math.import_source()

    return share_sm


def launch_grid(config: AttentionFwdConfig, heads: int, kv_heads: int, n_blocks, n_seqs):
    """The grid's extents: (heads, query blocks, sequences), or with kv_head_major
    (group, query blocks, sequences x KV heads)."""
    if config.kv_head_major:
        return heads // kv_heads, n_blocks, n_seqs * kv_heads
    return heads, n_blocks, n_seqs


def head_and_sequence(config: AttentionFwdConfig, heads: int, kv_heads: int, bx, bz):
    """(query head, sequence) of the CTA at grid x bx and z bz of `launch_grid`."""
    if config.kv_head_major:
        return bz % kv_heads * (heads // kv_heads) + bx, bz // kv_heads
    return bx, bz


def _attention_macros(head_dim: int, dtype: str, window_left: int, window_right: int,
                      softcap: float, config: AttentionFwdConfig):
    """The steps the dense and the varlen programs share, as TileLang macros; `head_dim` is
    the output's (V's) width, the only one the register state sees."""
    block_m, block_n, stages, threads = (config.block_m, config.block_n, config.stages,
                                         config.threads)
    overlap = config.overlap
    masked_right = window_right >= 0
    masked_left = window_left >= 0

    def tile_range(q_start, seq_q, seq_kv):
        return key_tile_range(q_start, seq_q, seq_kv, block_m, block_n, window_left,
                              window_right)

    def alloc_state():
        """Register tiles: scores, probabilities, output accumulator, row statistics and a
        scratch scalar, in `STATE` order (unpack them by name: TileLang names buffers after
        the variables they are assigned to), then wrap them with `state`."""
        return (T.alloc_fragment((block_m, block_n), "float"),
                T.alloc_fragment((block_m, block_n), dtype),
                T.alloc_fragment((block_m, head_dim), "float"),
                *[T.alloc_fragment((block_m,), "float") for _ in range(7)],
                T.alloc_local((1,), dtype),
                T.alloc_local((1,), "int32") if config.lazy_rescale else None)

    def state(*buffers):
        return SimpleNamespace(**dict(zip(STATE, buffers, strict=True)))

    share_sm = sm_sharing(threads, config.ctas_per_sm, config.fast_exp)
    exp2 = fast_math.exp2 if config.fast_exp else T.exp2

    def capped(x, scale):
        """log2(e) * softcap * tanh(x * scale / softcap): the scores in exp2's units; with
        fast_exp as c - 2c / (2^(2 x log2(e) scale / softcap) + 1), c = softcap log2(e)
        (one ex2, one approximate reciprocal, an FMA; tanhf is a long polynomial)."""
        if config.fast_exp:
            return fast_math.scaled_tanh(x, scale / softcap, softcap * LOG2E)
        return T.tanh(x * (scale / softcap)) * (softcap * LOG2E)

    def exp2_scale(scale):
        """Factor that turns the score tile into log2 units inside exp2 (one FFMA)."""
        return 1.0 if softcap > 0 else scale * LOG2E

    @T.macro
    def init(st):
        T.fill(st.o, 0)
        T.fill(st.l, 0)
        T.fill(st.m, -T.infinity("float"))

    def visible(i, j, q_start, kv_start, seq_q, seq_kv, live=None):
        """Whether query row i sees key column j of the tile; `live` (a condition) can
        mask the whole tile."""
        rel = kv_start + j - (q_start + i) - (seq_kv - seq_q)  # key minus query position
        seen = kv_start + j < seq_kv
        if live is not None:
            seen = seen & live
        if masked_right:
            seen = seen & (rel <= window_right)
        if masked_left:
            seen = seen & (rel >= -window_left)
        return seen

    # s = q k^T, -inf where the mask hides the key. Without softcap the mask is the
    # accumulator's initial value (0 or -inf) and the scale is applied inside exp2, so no
    # extra pass runs over the tile; with softcap, s = log2(e) * softcap * tanh(scaled
    # logit) needs its own pass after the product, which masks too.
    @T.macro
    def score_init(st, q_start, kv_start, seq_q, seq_kv, live=None):
        if softcap > 0:
            T.clear(st.s)
        else:
            for i, j in T.Parallel(block_m, block_n):
                st.s[i, j] = T.if_then_else(
                    visible(i, j, q_start, kv_start, seq_q, seq_kv, live), 0,
                    -T.infinity("float"))

    @T.macro
    def score_cap(st, q_start, kv_start, seq_q, seq_kv, scale, live=None):
        if softcap > 0:
            for i, j in T.Parallel(block_m, block_n):
                st.s[i, j] = T.if_then_else(
                    visible(i, j, q_start, kv_start, seq_q, seq_kv, live),
                    capped(st.s[i, j], scale),
                    -T.infinity("float"))

    @T.macro
    def scores_edge_masked(st, q_shared, k_shared, q_start, kv_start, seq_q, seq_kv, scale):
        """S = Q K^T into a zeroed accumulator (no clearing pass), capped, then masked only
        when the tile is not fully visible: few tiles of a long causal row block are."""
        T.gemm(q_shared, k_shared, st.s, transpose_B=True, clear_accum=True,
               policy=T.GemmWarpPolicy.FullRow)
        if softcap > 0:
            for i, j in T.Parallel(block_m, block_n):
                st.s[i, j] = capped(st.s[i, j], scale)
        if T.Not(tile_fully_visible(q_start, kv_start, seq_q, seq_kv, block_m, block_n,
                                    window_left, window_right)):
            for i, j in T.Parallel(block_m, block_n):
                st.s[i, j] = T.if_then_else(visible(i, j, q_start, kv_start, seq_q, seq_kv),
                                            st.s[i, j], -T.infinity("float"))

    def rescale_factor(st, i, scale):
        """What row i's O and sum are multiplied by when its max moves to m_safe."""
        return exp2(st.m_prev[i] * exp2_scale(scale) - st.m_safe[i])

    @T.macro
    def online_softmax(st, scale):
        """Folds one score tile into the running max and sum; s becomes
        exp2((s - max) * exp2_scale), the unnormalized probabilities."""
        T.copy(st.m, st.m_prev)
        T.reduce_max(st.s, st.m, dim=1, clear=False)
        if config.lazy_rescale:
            st.stale[0] = 0
            for i in T.Parallel(block_m):
                # keep the old max unless the new one is far above it (a first finite max,
                # from -inf, is always taken: the difference is inf or NaN)
                kept = (st.m[i] - st.m_prev[i]) * exp2_scale(scale) <= LAZY_RESCALE_LOG2
                st.stale[0] = T.max(st.stale[0], T.if_then_else(kept, 0, 1))
                st.m[i] = T.if_then_else(kept, st.m_prev[i], st.m[i])
        for i in T.Parallel(block_m):
            # -inf rows (nothing visible yet) must not turn exp2 into NaN.
            st.m_safe[i] = T.if_then_else(st.m[i] == -T.infinity("float"), 0,
                                          st.m[i] * exp2_scale(scale))
            if config.lazy_rescale:  # a kept max rescales by exactly 1, like O's skip
                st.rescale[i] = T.if_then_else(st.m[i] == st.m_prev[i], 1.0,
                                               rescale_factor(st, i, scale))
            else:
                st.rescale[i] = rescale_factor(st, i, scale)
        for i, j in T.Parallel(block_m, block_n):
            st.s[i, j] = exp2(st.s[i, j] * exp2_scale(scale) - st.m_safe[i])
        T.reduce_sum(st.s, st.row_sum, dim=1)
        for i in T.Parallel(block_m):
            st.l[i] = st.l[i] * st.rescale[i] + st.row_sum[i]

    @T.macro
    def multiply_output(st):
        for i, j in T.Parallel(block_m, head_dim):
            st.o[i, j] *= st.rescale[i]

    @T.macro
    def rescale_output(st):
        if config.lazy_rescale:
            # only warps where a row moved its max multiply O (any_sync: a warp-uniform
            # branch); the other rows' factors are exactly 1
            if T.any_sync(st.stale[0]) != 0:
                multiply_output(st)
        else:
            multiply_output(st)

    @T.macro
    def sync_scores(st, q_shared, k_shared, q_start, kv_start, seq_q, seq_kv, scale):
        """Key tile t in order, waiting for each wgmma: S = Q K^T, softmax, O rescaled and
        P cast; the caller loads V and issues O += P V (the next tile's loads overlap)."""
        if config.edge_masks_only:
            scores_edge_masked(st, q_shared, k_shared, q_start, kv_start, seq_q, seq_kv, scale)
        else:
            score_init(st, q_start, kv_start, seq_q, seq_kv)
            T.gemm(q_shared, k_shared, st.s, transpose_B=True,
                   policy=T.GemmWarpPolicy.FullRow)
            score_cap(st, q_start, kv_start, seq_q, seq_kv, scale)
        online_softmax(st, scale)
        T.copy(st.s, st.p)
        rescale_output(st)

    @T.macro
    def overlapped_step(st, t, n_tiles, q_shared, k_shared, v_shared, q_start, kv_start,
                        seq_q, seq_kv, scale):
        """Iteration t of n_tiles + 1 (FlashAttention-3's intra-warpgroup overlap): issue
        S = Q K_t^T and O += P_{t-1} V_{t-1} without waiting, run tile t's softmax once S
        has landed while P V still runs, then rescale O and cast P for the next iteration.
        The loop loads K_min(t, n-1) and V_max(t-1, 0).

        Nothing here branches on t: ptxas serializes every wgmma of the kernel when a wgmma
        or its wait sits under a branch. Instead the first P V multiplies a zero P and the
        last iteration's scores are all masked, which leaves the running max, sum and O
        unchanged (rescale 1, P 0): one extra tile of work per block for the overlap."""
        live = t < n_tiles
        score_init(st, q_start, kv_start, seq_q, seq_kv, live)
        T.wgmma_gemm(q_shared, k_shared, st.s, transpose_B=True,
                     policy=T.GemmWarpPolicy.FullRow)
        T.wgmma_gemm(st.p, v_shared, st.o, policy=T.GemmWarpPolicy.FullRow)
        T.wait_wgmma(1)  # S, issued first, has landed; P V may still run
        # Tell ptxas S has settled. Counts are registers per thread: the default, the whole
        # tile, would also touch the in-flight P V's accumulators.
        T.warpgroup_fence_operand(st.s, num_regs=block_m * block_n // threads)
        score_cap(st, q_start, kv_start, seq_q, seq_kv, scale, live)
        online_softmax(st, scale)
        T.wait_wgmma(0)
        T.warpgroup_fence_operand(st.o, num_regs=block_m * head_dim // threads)
        # TileLang releases a K/V stage to the producer after the stage's last use in the
        # iteration; without this read that is the asynchronous issue, and the next TMA
        # load could overwrite the tile while a wgmma still reads it.
        st.hold[0] = k_shared[0, 0] + v_shared[0, 0]
        rescale_output(st)
        T.copy(st.s, st.p)

    @T.macro
    def key_loop(st, kv_rows, seq_at, head, k, v, n_tiles, tile_begin, q_shared, k_shared,
                 v_shared, q_start, seq_q, seq_kv, scale):
        """Walks the key tiles; `kv_rows(buf, tile, seq_at, head)` is a K/V tile's region."""
        if overlap:
            T.clear(st.p)  # the first P V adds P * V_0 = 0
            for t in T.Pipelined(n_tiles + 1, num_stages=stages):
                T.copy(kv_rows(k, tile_begin + T.min(t, n_tiles - 1), seq_at, head), k_shared)
                T.copy(kv_rows(v, tile_begin + T.max(t - 1, 0), seq_at, head), v_shared)
                overlapped_step(st, t, n_tiles, q_shared, k_shared, v_shared, q_start,
                                (tile_begin + t) * block_n, seq_q, seq_kv, scale)
        else:
            for t in T.Pipelined(n_tiles, num_stages=stages):
                T.copy(kv_rows(k, tile_begin + t, seq_at, head), k_shared)
                sync_scores(st, q_shared, k_shared, q_start, (tile_begin + t) * block_n,
                            seq_q, seq_kv, scale)
                T.copy(kv_rows(v, tile_begin + t, seq_at, head), v_shared)
                T.gemm(st.p, v_shared, st.o, policy=T.GemmWarpPolicy.FullRow)

    @T.macro
    def finish(st, scale):
        """o /= l and the natural-log lse; rows that saw no key get 0 and -inf."""
        # one reciprocal per row, then multiplies: an IEEE division per element costs a
        # refinement sequence each (64 per thread at head_dim 128)
        for i in T.Parallel(block_m):
            st.row_sum[i] = 1.0 / st.l[i]
        for i, j in T.Parallel(block_m, head_dim):
            st.o[i, j] = T.if_then_else(st.l[i] > 0, st.o[i, j] * st.row_sum[i], 0)
        for i in T.Parallel(block_m):
            st.lse[i] = T.if_then_else(
                st.l[i] > 0, (st.m[i] * exp2_scale(scale) + T.log2(st.l[i])) * LN2,
                -T.infinity("float"))

    return SimpleNamespace(alloc_state=alloc_state, state=state, share_sm=share_sm,
                           tile_range=tile_range, init=init, key_loop=key_loop, finish=finish,
                           online_softmax=online_softmax, rescale_output=rescale_output)


def attention_fwd_program(heads: int, kv_heads: int, head_dim: int, dtype: str,
                          window_left: int, window_right: int, softcap: float,
                          config: AttentionFwdConfig, head_dim_v: int | None = None):
    """Dense BSHD batch: q [B, Sq, H, D], k [B, Skv, Hkv, D], v [B, Skv, Hkv, Dv],
    o [B, Sq, H, Dv], lse [B, H, Sq] (Dv = head_dim_v, default D)."""
    batch, seq_q, seq_kv = T.dynamic("batch, seq_q, seq_kv")
    group = heads // kv_heads
    dim_v = head_dim_v or head_dim
    q_shape = (batch, seq_q, heads, head_dim)
    kv_shape = (batch, seq_kv, kv_heads, head_dim)
    v_shape = (batch, seq_kv, kv_heads, dim_v)
    o_shape = (batch, seq_q, heads, dim_v)
    block_m, block_n, threads = config.block_m, config.block_n, config.threads
    step = _attention_macros(dim_v, dtype, window_left, window_right, softcap, config)

    def kv_rows(buf, tile, batch_index, head):
        return buf[batch_index, tile * block_n:(tile + 1) * block_n, head, :]

    @T.prim_func
    def attention_fwd(q: T.Tensor(q_shape, dtype), k: T.Tensor(kv_shape, dtype),
                      v: T.Tensor(v_shape, dtype), o: T.Tensor(o_shape, dtype),
                      lse: T.Tensor((batch, heads, seq_q), "float"), scale: T.float32):
        # Heads vary fastest and query blocks run last-first, so the first wave takes the
        # blocks a causal mask leaves the most key tiles to (longest-first scheduling), and
        # the query heads of one GQA group share K/V in L2 (see kv_head_major).
        n_blocks = T.ceildiv(seq_q, block_m)
        with T.Kernel(*launch_grid(config, heads, kv_heads, n_blocks, batch),
                      threads=threads) as (bx, by, bz_):
            head, bz = head_and_sequence(config, heads, kv_heads, bx, bz_)
            step.share_sm()
            q_shared = T.alloc_shared((block_m, head_dim), dtype)
            k_shared = T.alloc_shared((block_n, head_dim), dtype)
            v_shared = T.alloc_shared((block_n, dim_v), dtype)
            o_shared = T.alloc_shared((block_m, dim_v), dtype)
            (s_local, p_local, o_local, m_local, m_prev, m_safe, rescale, row_sum, l_local,
             lse_local, hold, stale) = step.alloc_state()
            st = step.state(s_local, p_local, o_local, m_local, m_prev, m_safe, rescale,
                            row_sum, l_local, lse_local, hold, stale)

            q_start = (n_blocks - 1 - by) * block_m
            tile_begin, reachable = step.tile_range(q_start, seq_q, seq_kv)
            # At least one (then fully masked) tile: the consumers wait for Q's TMA load in
            # the first iteration, and o_shared overlays q_shared, so a block whose rows see
            # no key (Sq > Skv) would otherwise store O while that load may still land.
            n_tiles = T.max(reachable, 1)
            T.copy(q[bz, q_start:q_start + block_m, head, :], q_shared)
            step.init(st)
            step.key_loop(st, kv_rows, bz, head // group, k, v, n_tiles, tile_begin, q_shared,
                          k_shared, v_shared, q_start, seq_q, seq_kv, scale)
            step.finish(st, scale)
            T.copy(st.o, o_shared)
            T.copy(o_shared, o[bz, q_start:q_start + block_m, head, :])  # TMA clips Sq's tail
            T.copy(st.lse, lse[bz, head, q_start:q_start + block_m])

    return attention_fwd


def attention_varlen_fwd_program(heads: int, kv_heads: int, head_dim: int, dtype: str,
                                 window_left: int, window_right: int, softcap: float,
                                 config: AttentionFwdConfig, head_dim_v: int | None = None):
    """Packed sequences: q [Tq, H, D], k [Tkv, Hkv, D], v [Tkv, Hkv, Dv], o [Tq, H, Dv],
    cu_seqlens [B + 1], lse [H, Tq].

    The grid covers max_seqlen_q rows per sequence; blocks past a sequence's end do no
    work, and rows past it are never stored (they belong to the next sequence).
    """
    total_q, total_kv, batch_1 = T.dynamic("total_q, total_kv, batch_1")
    group = heads // kv_heads
    dim_v = head_dim_v or head_dim
    block_m, block_n, threads = config.block_m, config.block_n, config.threads
    step = _attention_macros(dim_v, dtype, window_left, window_right, softcap, config)

    def kv_rows(buf, tile, seq_offset, head):
        return buf[seq_offset + tile * block_n:seq_offset + (tile + 1) * block_n, head, :]

    @T.macro
    def store_rows(st, o, lse, q_offset, q_start, seq_q, head):
        """Row by row: rows past the sequence's end belong to the next sequence."""
        for i, j in T.Parallel(block_m, dim_v):
            if q_start + i < seq_q:
                o[q_offset + q_start + i, head, j] = st.o[i, j]
        for i in T.Parallel(block_m):
            if q_start + i < seq_q:
                lse[head, q_offset + q_start + i] = st.lse[i]

    @T.prim_func
    def attention_varlen_fwd(q: T.Tensor((total_q, heads, head_dim), dtype),
                             k: T.Tensor((total_kv, kv_heads, head_dim), dtype),
                             v: T.Tensor((total_kv, kv_heads, dim_v), dtype),
                             cu_seqlens_q: T.Tensor((batch_1,), "int32"),
                             cu_seqlens_kv: T.Tensor((batch_1,), "int32"),
                             o: T.Tensor((total_q, heads, dim_v), dtype),
                             lse: T.Tensor((heads, total_q), "float"), max_seqlen_q: T.int32,
                             scale: T.float32):
        n_blocks = T.ceildiv(max_seqlen_q, block_m)  # longest-first, as in the dense grid
        with T.Kernel(*launch_grid(config, heads, kv_heads, n_blocks, batch_1 - 1),
                      threads=threads) as (bx, by, bz_):
            head, bz = head_and_sequence(config, heads, kv_heads, bx, bz_)
            step.share_sm()
            q_shared = T.alloc_shared((block_m, head_dim), dtype)
            k_shared = T.alloc_shared((block_n, head_dim), dtype)
            v_shared = T.alloc_shared((block_n, dim_v), dtype)
            if config.tile_store:
                o_shared = T.alloc_shared((block_m, dim_v), dtype)
            (s_local, p_local, o_local, m_local, m_prev, m_safe, rescale, row_sum, l_local,
             lse_local, hold, stale) = step.alloc_state()
            st = step.state(s_local, p_local, o_local, m_local, m_prev, m_safe, rescale,
                            row_sum, l_local, lse_local, hold, stale)

            q_offset = cu_seqlens_q[bz]
            kv_offset = cu_seqlens_kv[bz]
            seq_q = cu_seqlens_q[bz + 1] - q_offset
            seq_kv = cu_seqlens_kv[bz + 1] - kv_offset
            q_start = (n_blocks - 1 - by) * block_m
            tile_begin, reachable = step.tile_range(q_start, seq_q, seq_kv)
            n_tiles = T.if_then_else(q_start < seq_q, reachable, 0)
            T.copy(q[q_offset + q_start:q_offset + q_start + block_m, head, :], q_shared)
            step.init(st)
            # With overlap, a block with no tile loads (never uses) tile -1, which lies
            # inside the packed tensor or is clipped by TMA.
            step.key_loop(st, kv_rows, kv_offset, head // group, k, v, n_tiles, tile_begin,
                          q_shared, k_shared, v_shared, q_start, seq_q, seq_kv, scale)
            step.finish(st, scale)
            if config.tile_store:
                # n_tiles > 0: the consumers have awaited Q's load, which o_shared may overlay
                if q_start + block_m <= seq_q and n_tiles > 0:
                    T.copy(st.o, o_shared)
                    T.copy(o_shared,
                           o[q_offset + q_start:q_offset + q_start + block_m, head, :])
                    T.copy(st.lse, lse[head, q_offset + q_start:q_offset + q_start + block_m])
                else:
                    store_rows(st, o, lse, q_offset, q_start, seq_q, head)
            else:
                store_rows(st, o, lse, q_offset, q_start, seq_q, head)

    return attention_varlen_fwd


SHORT_KEYS = 4096  # key counts up to this use the two-CTA forward (measured at 2K, 4K, 8K)


class AttentionFwdKernel(Kernel):
    """key: dtype, heads, kv_heads, head_dim, window_left, window_right, softcap, and
    head_dim_v only when V is narrower than Q/K (so the other keys keep their entries)."""

    name = "attention_fwd"
    Config = AttentionFwdConfig

    def program(self, config: AttentionFwdConfig, bucket: str):
        k = self.key
        return attention_fwd_program(k["heads"], k["kv_heads"], k["head_dim"], k["dtype"],
                                     k["window_left"], k["window_right"], k["softcap"],
                                     config, k.get("head_dim_v"))

    def run(self, config: AttentionFwdConfig, compiled: tuple, q, k, v, o, lse,
            scale: float) -> None:
        compiled[0](q, k, v, o, lse, scale)

    def bucket_of(self, seq_kv: int) -> str:
        """Buckets by key count (the longest sequence's, for varlen): it sets how many key
        tiles each CTA walks, so how much its prologue and epilogue weigh."""
        return "short" if seq_kv <= SHORT_KEYS else "long"

    def heuristic_config(self, bucket: str, arch: str) -> AttentionFwdConfig:
        config = self._heuristic_tiles(bucket)
        if self.key["softcap"] > 0:
            # the soft cap's tanh on ex2 and a reciprocal: Gemma-2-9B 8K local layer (head_dim
            # 256, softcap 50), bf16 on the H200: 830.9 against 958.1 us with tanhf. Without a
            # cap the saved fix-up was within noise or lost (8B causal 926.5 vs 932.2,
            # bidirectional 16K 7499.7 vs 7132.9, head_dim 64 671.1 vs 642.0).
            config = dataclasses.replace(config, fast_exp=True)
        return config

    def _heuristic_tiles(self, bucket: str) -> AttentionFwdConfig:
        # H200 tuning (Llama-3.1-8B, bf16): masking only the tiles a mask cuts through ran
        # 10.6% faster at 8K causal (945.7-949.8 vs 1057.3 us) and 8.8% at batch 8 x 2K
        # (604.7 vs 662.8 us); the lazy rescale lost 3-6% on top of it.
        if self.key["head_dim"] >= 256:
            return AttentionFwdConfig(block_m=128, block_n=64, stages=2, threads=256,
                                      edge_masks_only=True)
        if bucket == "short":
            # Two 64-row CTAs per SM, one's prologue and epilogue under the other's key loop:
            # 3-5% faster than 128-row CTAs at 2K keys (batch 8), 8% at 4K (243.5 vs 263.7
            # us, 8B causal), tied at 8K.
            return AttentionFwdConfig(block_m=64, block_n=128, stages=1, threads=128,
                                      ctas_per_sm=2, edge_masks_only=True)
        if self.key["window_left"] < 0 and self.key["window_right"] < 0:
            # Every key visible: no causal order to keep, so the grid goes KV head by KV head
            # (kv_head_major) and K/V stays in L2 at 16K. In that order 128 x 192 tiles won
            # (8B bidirectional 16K, bf16: 7122.5 us in the tuner against 7816.8 for the two
            # 64 x 176 CTAs per SM that won at 8K in the heads-first order, 7448.1 for
            # 128 x 192 heads-first; bench 16K 8115.0 -> 7107.3 us, 8K 1724.3 -> 1636.3).
            return AttentionFwdConfig(block_m=128, block_n=192, stages=1, threads=256,
                                      edge_masks_only=True, kv_head_major=True)
        # 176-key tiles with one stage beat 128 keys x 2 stages by 2-6% (8K, causal and not);
        # the overlap variant lost by 0-8%.
        return AttentionFwdConfig(block_m=128, block_n=176, stages=1, threads=256,
                                  edge_masks_only=True)

    def config_space(self, bucket: str) -> list[AttentionFwdConfig]:
        space = [self.heuristic_config(bucket, "sm_90a")]
        # at 256 the O tile alone needs 128 registers (O is V's width: 128 for q/k 192)
        two_ctas = self.key.get("head_dim_v", self.key["head_dim"]) <= 128
        for block_n in (64, 128, 176):
            for stages in (1, 2):
                for overlap in (False, True):  # every mask on every tile, as overlap needs
                    space.append(AttentionFwdConfig(128, block_n, stages, 256, overlap))
                if two_ctas:
                    space.append(AttentionFwdConfig(64, block_n, stages, 128, ctas_per_sm=2))
            # edge masks only, at one stage: the depth that won without them at 128 and 176
            space.append(AttentionFwdConfig(128, block_n, 1, 256, edge_masks_only=True))
            if two_ctas:
                space.append(AttentionFwdConfig(64, block_n, 1, 128, ctas_per_sm=2,
                                                edge_masks_only=True))
        # wider key tiles, which the lighter edge-mask loop leaves registers for (ptxas: no
        # spills; 208 keys, or 192 with two CTAs, spill and serialize the wgmma)
        space.append(AttentionFwdConfig(128, 192, 1, 256, edge_masks_only=True))
        if two_ctas:
            space.append(AttentionFwdConfig(64, 160, 1, 128, ctas_per_sm=2,
                                            edge_masks_only=True))
        space.append(dataclasses.replace(space[0], lazy_rescale=True))
        # the default with exp2 and tanh on the SFU's ex2 alone (not yet measured)
        space.append(dataclasses.replace(space[0], fast_exp=not space[0].fast_exp))
        # each default with the other grid order; where the default walks KV heads (every key
        # visible), the edge-mask tilings in that order too, to compare them at equal L2 reuse
        space.append(dataclasses.replace(space[0], kv_head_major=not space[0].kv_head_major))
        if space[0].kv_head_major:
            space += [dataclasses.replace(c, kv_head_major=True) for c in space
                      if c.edge_masks_only and not c.lazy_rescale]
        if two_ctas:
            # the intra-warpgroup overlap inside each of two CTAs: with one consumer warpgroup
            # per CTA there is no second warpgroup to contend with for the barriers
            for block_n in (128, 176):
                space.append(AttentionFwdConfig(64, block_n, 1, 128, overlap=True,
                                                ctas_per_sm=2))
        return [c for c in dict.fromkeys(space)
                if c.fits(self.key["head_dim"], self.key.get("head_dim_v"))]


class AttentionVarlenFwdKernel(AttentionFwdKernel):
    """Packed sequences (cu_seqlens); same key and configs as the dense kernel."""

    name = "attention_varlen_fwd"

    def program(self, config: AttentionFwdConfig, bucket: str):
        k = self.key
        return attention_varlen_fwd_program(
            k["heads"], k["kv_heads"], k["head_dim"], k["dtype"], k["window_left"],
            k["window_right"], k["softcap"], config, k.get("head_dim_v"))

    def heuristic_config(self, bucket: str, arch: str) -> AttentionFwdConfig:
        # The dense default with whole-tile stores for the blocks inside their sequence
        # (H200, 8B 8 x 2K equal lengths, bf16: 537.6 vs 603.5 us with row stores in the
        # tuner; in the bench 560.9 vs 624.4, 0.95x the dense kernel's throughput on the same
        # tokens). O reuses the Q buffer, so it fits wherever the dense default does.
        # (The dense grid order: kv_head_major is measured on dense batches only.)
        return dataclasses.replace(super().heuristic_config(bucket, arch), tile_store=True,
                                   kv_head_major=False)

    def config_space(self, bucket: str) -> list[AttentionFwdConfig]:
        # the dense space (this default first), then both buckets' defaults with row stores
        # and with tile stores
        dense_defaults = [super(AttentionVarlenFwdKernel, self).heuristic_config(b, "sm_90a")
                          for b in ("short", "long")]
        extra = dense_defaults + [dataclasses.replace(c, tile_store=True)
                                  for c in dense_defaults]
        return list(dict.fromkeys(super().config_space(bucket) + extra))

    def run(self, config: AttentionFwdConfig, compiled: tuple, q, k, v, cu_seqlens_q,
            cu_seqlens_kv, o, lse, max_seqlen_q: int, scale: float) -> None:
        compiled[0](q, k, v, cu_seqlens_q, cu_seqlens_kv, o, lse, max_seqlen_q, scale)
