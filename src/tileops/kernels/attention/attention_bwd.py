"""FlashAttention-2 style backward on Hopper: dq, dk, dv from q, k, v, o, do and lse.

Three passes: `delta = rowsum(do * o)` per query row; the main pass, where each CTA owns
one key/value block of one query head, keeps dk and dv for it in registers and walks the
query blocks its mask lets see the block (recomputing P from the saved lse), adding each dq
contribution into an fp32 buffer with atomics; and the casts of the fp32 gradients (torch
copies, and for dq_bulk's head-major dq buffer a program of its own). With
GQA the query heads of a group add into the same fp32 dk/dv rows, also with atomics (with
`tma_dkv`, two TMA reduce-adds of whole tiles). With
`group_loop` a CTA owns the key/value block of a KV head instead and walks the query blocks
of every query head of its group, so dk and dv sum in registers and are stored once, in the
input dtype, with no atomics, no fp32 buffers and K/V loaded once per group. With
`async_mma` each consumer warpgroup issues the two score-side GEMMs (K Q^T, V dO^T) and
then the three gradient GEMMs (dV, dK, dQ) back to back with one wait per group, instead of
waiting after each GEMM.

Gradients w.r.t. the raw scores: dS = P * (dP - delta) * scale, times (1 - tanh^2) when
the logits are soft-capped. Rows whose lse is -inf (they saw no key) contribute nothing.
"""

import dataclasses
import math
from dataclasses import dataclass

import tilelang.language as T
import torch
from tilelang.layout import make_linear_layout

from .. import fast_math
from ..base import Kernel
from ..fast_math import LOG2E
from .attention_fwd import SMEM_LIMIT, sm_sharing
from .mask import TIR_OPS, query_block_range, tile_fully_visible

DQ_BARRIER = 8  # a named barrier of the consumer threads, clear of the ones TileLang uses
# ds_handoff's named barriers, each plus a consumer warpgroup's index (0 or 1): its dS half
# is in shared memory; the other warpgroup's dQ GEMM has read its dS half; its own threads.
DS_READY, DS_FREE, WARPGROUP_BARRIER = 9, 11, 13
# dq_rows: 8 more floats per shared row shift each row by 8 banks, so a warp's float2 stores
# (8 rows x 4 columns) take two wavefronts instead of eight; rows stay 16-byte aligned
DQ_ROW_PAD = 8
ROWS = T.GemmWarpPolicy.FullRow


@dataclass(frozen=True)
class AttentionBwdConfig:
    block_kv: int = 128  # two consumer warpgroups x 64 key rows
    block_q: int = 64
    stages: int = 1
    threads: int = 256
    tma_dq: bool = False  # dq adds through shared memory by one TMA reduce per tile
    group_loop: bool = False  # one CTA per KV head walks its whole query-head group
    async_mma: bool = False  # issue GEMMs two and three at a time, one wait per batch
    # Tiles every (key, query) pair of which is visible (all but the causal diagonal, the
    # window edges and the tails) skip the per-element mask and the -inf lse test.
    edge_masks_only: bool = False
    # lse and delta come with Q and dO: the producer loads each query block's by TMA into
    # shared memory (the op pads them to a multiple of 4 rows for the TMA stride), instead of
    # every thread reading them from global memory after the score GEMMs.
    staged_stats: bool = False
    # Launch order: key blocks split into this many runs, heaviest (first) runs of every head
    # first; 1 keeps key blocks fastest, so the CTAs of one head share Q/dO in L2.
    kv_chunks: int = 1
    # dq through the tma_dq tile by one bulk reduce per row (block_q consumer threads issue
    # one each) instead of one per tile, and the wait for them to read shared memory moves
    # from right after the issue to right before the next tile overwrites it, so no warp
    # stalls on it inside the loop.
    dq_rows: bool = False
    # 2: two CTAs share an SM (block_kv 64, one consumer warpgroup each), so one's score
    # math, barriers, epilogue atomics and prologue can run under the other's GEMMs. 7%
    # slower on the H200 (8B 4 x 4K): each Q/dO tile feeds half the keys, dq twice the adds.
    ctas_per_sm: int = 1
    # Without async_mma: the first wgmma of S, dP and dQ overwrites its accumulator (the
    # scale-d operand off, as the forward's S GEMM does) instead of zeroing it first: 96
    # fewer register moves per thread and tile.
    clear_by_mma: bool = False
    # With GQA's atomics (not group_loop): dk and dv leave the CTA by two TMA bulk
    # reduce-adds from shared memory instead of 2 x block_kv x head_dim / threads float2
    # atomics per thread. ncu sampled the consumers stalled on those atomics 12-14% of the
    # time (8B 8 x 2K), yet the change measured within the noise: the next CTA's start did
    # not wait for them.
    tma_dkv: bool = False
    # The two consumer warpgroups stop meeting at CTA-wide barriers inside the key loop,
    # where ncu found them in lockstep (both in their GEMMs, then both in their softmax
    # while the tensor cores idle). Each stores its dS half right after its softmax and
    # signals it with a one-sided named barrier, runs its dV and dK GEMMs, and waits for the
    # other half only before dQ; a second pair of barriers hands each half back once the
    # other's dQ GEMM has read it. Each warpgroup reduces its own 64 dq columns: one TMA
    # reduce of them (its first thread issues and waits), or with dq_rows one bulk reduce
    # per row, awaited only before the rewrite, or with dq_bulk (below). Every
    # shared-memory sync of the kernel is then placed here by hand (TileLang's automatic
    # ones are off).
    ds_handoff: bool = False
    # With ds_handoff: dq accumulates in a head-major fp32 buffer [B, H, 2, Sq rounded up to
    # block_q, head_dim / 2 + DQ_ROW_PAD] (the op's own, cast into dq at the end), where a
    # warpgroup's 64-row half tile is one contiguous run: one bulk reduce-add of it, and the
    # issuing thread awaits its read of shared memory only before the next rewrite, not
    # right after the issue (a tensor-map reduce's wait held up the warpgroup's next GEMM).
    dq_bulk: bool = False
    # Launch order of about the last `tail_ctas` CTAs: those (batch, head)s go key block by
    # key block, so under a causal mask their heavy first key blocks start first and the
    # last wave holds light CTAs instead of a heavy one that runs on while the other SMs
    # idle. Only the tail: their Q and dO (about tail_ctas x 64 KiB) still fit in L2 while
    # the whole grid keeps its head-by-head order (kv_chunks, heavy first everywhere, lost
    # that locality).
    tail_ctas: int = 0
    # exp2 and the softcap's tanh of the recomputed P on the SFU's ex2 alone (fast_math:
    # exp2f's subnormal fix-up is three more instructions per score), as the forward's.
    fast_exp: bool = False

    def __post_init__(self):
        if self.dq_rows and not self.tma_dq:
            raise ValueError("AttentionBwdConfig: dq_rows adds through the tma_dq tile, got "
                             "tma_dq=False")
        if self.async_mma and self.block_q < 64:
            # async dQ = dS K must be a wgmma, and a wgmma takes at least 64 rows
            raise ValueError(f"AttentionBwdConfig: async_mma needs block_q >= 64, got "
                             f"block_q={self.block_q}")
        if self.ds_handoff and (self.async_mma or not self.tma_dq or self.threads != 256
                                or self.block_kv != 128 or self.ctas_per_sm != 1):
            raise ValueError("AttentionBwdConfig: ds_handoff is written for two consumer "
                             "warpgroups of 64 keys each, T.gemm and dq through shared "
                             f"memory (tma_dq), got {self}")
        if self.dq_bulk and (not self.ds_handoff or self.dq_rows):
            raise ValueError("AttentionBwdConfig: dq_bulk is a dq path of ds_handoff, other "
                             f"than dq_rows, got {self}")
        if self.tail_ctas and self.kv_chunks != 1:
            raise ValueError("AttentionBwdConfig: tail_ctas reorders the head-by-head launch "
                             f"order, kv_chunks replaces it; got both: {self}")
        if self.tma_dkv and self.group_loop:
            raise ValueError("AttentionBwdConfig: tma_dkv adds dk and dv into fp32 buffers; "
                             "group_loop stores them whole, got both")
        if self.clear_by_mma and self.async_mma:
            raise ValueError("AttentionBwdConfig: clear_by_mma is written for T.gemm, not "
                             "for async_mma's T.wgmma_gemm")

    def smem_bytes(self, head_dim: int, elem_bytes: int = 2) -> int:
        """K and V tiles, `stages` Q and dO tiles (and lse/delta rows), dS, and the fp32 dq
        tile with tma_dq; tma_dkv's fp32 dk and dv tiles lie over the K/V and Q/dO tiles."""
        tiles = (2 * self.block_kv + 2 * self.stages * self.block_q) * head_dim * elem_bytes
        if self.tma_dkv:
            tiles = max(tiles, 2 * self.block_kv * head_dim * 4)
        ds = self.block_kv * self.block_q * elem_bytes
        stats = 2 * self.stages * self.block_q * 4 if self.staged_stats else 0
        # dq_bulk pads each warpgroup's half row
        dq_row = head_dim + DQ_ROW_PAD * (self.dq_rows + 2 * self.dq_bulk)
        return tiles + ds + stats + (self.block_q * dq_row * 4 if self.tma_dq else 0)

    def fits(self, head_dim: int) -> bool:
        """Whether `ctas_per_sm` CTAs of this config fit in one SM's shared memory."""
        return self.ctas_per_sm * self.smem_bytes(head_dim) <= SMEM_LIMIT


def tail_launch_order(bx, flat_head, n_kv, n_heads, tail_ctas: int, ops=TIR_OPS):
    """(key block, flattened batch x head) of the CTA launched as (bx, flat_head) in a grid
    of n_kv key blocks (fastest) x n_heads: the order is kept, except that the last
    ceil(tail_ctas / n_kv) heads go key block by key block (tail_ctas)."""
    n_tail = ops.min(ops.ceildiv(tail_ctas, n_kv), n_heads)
    tail_start = n_heads - n_tail
    rank = bx + n_kv * (flat_head - tail_start)  # the CTA's place in the tail
    in_tail = flat_head >= tail_start
    return (ops.select(in_tail, ops.floordiv(rank, n_tail), bx),
            ops.select(in_tail, tail_start + ops.floormod(rank, n_tail), flat_head))


def attention_delta_program(heads: int, head_dim: int, dtype: str, block_q: int = 64,
                            threads: int = 128):
    """delta[b, h, i] = sum_d o[b, i, h, d] * do[b, i, h, d] in fp32."""
    batch, seq_q = T.dynamic("batch, seq_q")
    shape = (batch, seq_q, heads, head_dim)
    # TileLang 0.1.15 finds no fragment layout for rows of 80 or 96 (no power of two): such
    # rows are read into a tile padded to the next power of two, the padding zero
    padded = 1 << (head_dim - 1).bit_length()

    @T.prim_func
    def attention_delta(o: T.Tensor(shape, dtype), do: T.Tensor(shape, dtype),
                        delta: T.Tensor((batch, heads, seq_q), "float")):
        with T.Kernel(T.ceildiv(seq_q, block_q), heads, batch, threads=threads) as (bx, by, bz):
            o_local = T.alloc_fragment((block_q, padded), dtype)
            do_local = T.alloc_fragment((block_q, padded), dtype)
            prod_local = T.alloc_fragment((block_q, padded), "float")
            delta_local = T.alloc_fragment((block_q,), "float")
            if padded == head_dim:
                T.copy(o[bz, bx * block_q:(bx + 1) * block_q, by, :], o_local)
                T.copy(do[bz, bx * block_q:(bx + 1) * block_q, by, :], do_local)
            else:
                for i, j in T.Parallel(block_q, padded):
                    row = bx * block_q + i
                    inside = (j < head_dim) & (row < seq_q)
                    o_local[i, j] = T.if_then_else(inside, o[bz, row, by, j], T.cast(0, dtype))
                    do_local[i, j] = T.if_then_else(inside, do[bz, row, by, j],
                                                    T.cast(0, dtype))
            for i, j in T.Parallel(block_q, padded):
                prod_local[i, j] = T.cast(o_local[i, j], "float") * T.cast(do_local[i, j],
                                                                           "float")
            T.reduce_sum(prod_local, delta_local, dim=1)
            T.copy(delta_local, delta[bz, by, bx * block_q:(bx + 1) * block_q])

    return attention_delta


def attention_dq_cast_program(heads: int, head_dim: int, dtype: str, block_q: int = 64,
                               threads: int = 128):
    """dq[b, i, h, :] = dq_bulk's fp32 rows [b, h, 0 and 1, i, :head_dim / 2] in the input
    dtype, whole rows in and out. torch's copy through the permuted view read them at half
    the bandwidth (200 us at 8B 8 x 2K, where the 436 MB need about 100)."""
    batch, seq_q, seq_dq = T.dynamic("batch, seq_q, seq_dq")
    half = head_dim // 2

    @T.prim_func
    def attention_dq_cast(dq32: T.Tensor((batch, heads, 2, seq_dq, half + DQ_ROW_PAD), "float"),
                          dq: T.Tensor((batch, seq_q, heads, head_dim), dtype)):
        with T.Kernel(T.ceildiv(seq_q, block_q), heads, batch, threads=threads) as (bx, by, bz):
            for i, part, j in T.Parallel(block_q, 2, half):
                if bx * block_q + i < seq_q:
                    dq[bz, bx * block_q + i, by, part * half + j] = T.cast(
                        dq32[bz, by, part, bx * block_q + i, j], dtype)

    return attention_dq_cast


def attention_bwd_program(heads: int, kv_heads: int, head_dim: int, dtype: str,
                          window_left: int, window_right: int, softcap: float,
                          config: AttentionBwdConfig):
    """The main pass; dq is an fp32 accumulator the caller zeroes, and so are dk and dv
    unless `group_loop`, where they are the outputs (input dtype), each element stored once.
    With `staged_stats` lse and delta have seq_stats >= seq_q rows (a multiple of 4)."""
    block_kv, block_q, stages, threads = (config.block_kv, config.block_q, config.stages,
                                          config.threads)
    tma_dq, group_loop, async_mma = config.tma_dq, config.group_loop, config.async_mma
    dq_rows, clear_by_mma = config.dq_rows, config.clear_by_mma
    edge_masks_only, staged_stats = config.edge_masks_only, config.staged_stats
    kv_chunks, tma_dkv, ds_handoff = config.kv_chunks, config.tma_dkv, config.ds_handoff
    dq_bulk = config.dq_bulk
    exp2, tanh = (fast_math.exp2, fast_math.tanh) if config.fast_exp else (T.exp2, T.tanh)
    batch, seq_q, seq_kv = T.dynamic("batch, seq_q, seq_kv")
    stats_shape = (batch, heads, T.dynamic("seq_stats") if staged_stats else seq_q)
    group = heads // kv_heads
    q_shape = (batch, seq_q, heads, head_dim)
    kv_shape = (batch, seq_kv, kv_heads, head_dim)
    dq_half_row = head_dim // 2 + DQ_ROW_PAD  # dq_bulk: a warpgroup's padded half row
    dq_shape = ((batch, heads, 2, T.dynamic("seq_dq"), dq_half_row) if dq_bulk else q_shape)
    masked_right = window_right >= 0
    masked_left = window_left >= 0
    dkv_dtype = dtype if group_loop else "float"
    heads_per_cta = group if group_loop else 1
    cta_heads = kv_heads if group_loop else heads  # the grid's head dimension
    # Accumulator registers per thread, for the fences that tell ptxas a wgmma has landed.
    regs_scores = block_kv * block_q // threads
    regs_dkv = block_kv * head_dim // threads
    regs_dq = block_q * head_dim // threads

    def visited_query_blocks(kv_start, seq_q, seq_kv):
        """(first, count) of the query blocks the key block at kv_start walks."""
        begin, count = query_block_range(kv_start, seq_q, seq_kv, block_kv, block_q,
                                         window_left, window_right)
        if kv_chunks > 1:  # the last run's padding blocks lie past the keys: no work
            count = T.if_then_else(kv_start < seq_kv, count, 0)
        return begin, count

    @T.macro
    def probs_and_grads(stats, s_local, dp_local, p_local, ds_local, bz, head, q_start,
                        kv_start, seq_q, seq_kv, scale, masked):
        """P and dS of the tile from S^T and dP^T; `masked` (a build-time choice) zeroes the
        pairs the mask hides and the rows that saw no key. `stats` is (lse, delta): the
        global [B, H, Sq] tensors, or with staged_stats this query block's rows in shared
        memory."""
        lse, delta = stats
        for i, j in T.Parallel(block_kv, block_q):
            if staged_stats:  # zeros past the end (padding, TMA fill): masked rows
                row_lse = lse[j]
                row_delta = delta[j]
            else:
                # read straight from global memory (L1 serves the repeats): a TMA box over
                # [B, H, Sq] needs Sq % 4 == 0, which staged_stats gets by padding
                row = T.min(q_start + j, seq_q - 1) if masked else q_start + j
                row_lse = lse[bz, head, row]
                row_delta = delta[bz, head, row]
            if softcap > 0:
                capped = tanh(s_local[i, j] * (scale / softcap))
                prob = exp2(capped * (softcap * LOG2E) - row_lse * LOG2E)
                grad = (dp_local[i, j] - row_delta) * scale * (1 - capped * capped)
            else:
                prob = exp2(s_local[i, j] * (scale * LOG2E) - row_lse * LOG2E)
                grad = (dp_local[i, j] - row_delta) * scale
            if masked:
                rel = kv_start + i - (q_start + j) - (seq_kv - seq_q)
                visible = (kv_start + i < seq_kv) & (q_start + j < seq_q) & (
                    row_lse != -T.infinity("float"))
                if masked_right:
                    visible = visible & (rel <= window_right)
                if masked_left:
                    visible = visible & (rel >= -window_left)
                p_local[i, j] = T.if_then_else(visible, prob, 0)
                ds_local[i, j] = T.if_then_else(visible, prob * grad, 0)
            else:
                p_local[i, j] = prob
                ds_local[i, j] = prob * grad

    @T.macro
    def clear_for_gemm(acc):
        """Zero a GEMM's accumulator, unless clear_by_mma has its first wgmma do it."""
        if not clear_by_mma:
            T.clear(acc)

    @T.macro
    def dv_dk_gemms(p_local, ds_local, q_shared, do_shared, dv_local, dk_local):
        T.gemm(p_local, do_shared, dv_local, policy=ROWS)  # dV += P^T dO
        T.gemm(ds_local, q_shared, dk_local, policy=ROWS)  # dK += dS^T Q

    @T.macro
    def dq_gemm(ds_shared, k_shared, dq_local):
        clear_for_gemm(dq_local)
        T.gemm(ds_shared, k_shared, dq_local, transpose_A=True,
               policy=T.GemmWarpPolicy.FullCol, clear_accum=clear_by_mma)  # dQ = dS K

    def consumer_warpgroup():
        """0 or 1: which of the two consumer warpgroups runs this thread (ds_handoff)."""
        return T.get_thread_binding() // (threads // 2)

    # The threads that write and reduce one part of the dq tile: all consumers and whole
    # rows with dq_rows; with ds_handoff each warpgroup and its half of the columns (dQ's
    # FullCol split), synced on its own barrier.
    dq_part_threads = threads // 2 if ds_handoff else threads

    def bulk_reduce_add(src, dst, nbytes):
        """dst += src (nbytes from shared to global memory) by one bulk reduce on plain
        addresses, committed to the issuing thread's bulk group."""
        return T.call_extern("handle", "tl::tma_store_add", T.access_ptr(src, "r"),
                             T.access_ptr(dst, "w"), nbytes)

    def issues_dq_row(tx):
        """Whether consumer thread tx issues (and later awaits) a row's bulk reduce."""
        return tx % (dq_part_threads // block_q) == 0

    @T.macro
    def add_dq_rows(dq, dq_local, dq_shared, bz, head, q_start, seq_q):
        """dq[rows of this tile] += dq_local by one bulk reduce per row (or, with
        ds_handoff, per row of a warpgroup's columns). Thread t of a part issues row
        t // (part threads // block_q): bulk groups belong to the thread that commits
        them, so the same thread waits for its row to be read out before the tile after
        this one overwrites dq_shared."""
        tx = T.get_thread_binding()
        part = tx // dq_part_threads  # 0 unless ds_handoff
        row = tx % dq_part_threads // (dq_part_threads // block_q)
        columns = head_dim * dq_part_threads // threads
        barrier = WARPGROUP_BARRIER + part if ds_handoff else DQ_BARRIER
        issues = issues_dq_row(tx)
        if issues:
            T.tma_store_wait(0, True)  # the previous tile's reduce has read this row
        T.sync_threads(barrier, dq_part_threads)  # every row read out before any rewrite
        T.copy(dq_local, dq_shared[:, :head_dim])  # each thread writes its own part
        T.fence_proxy_async()  # the generic-proxy writes, seen by the bulk copies
        T.sync_threads(barrier, dq_part_threads)
        if issues:
            if q_start + row < seq_q:
                bulk_reduce_add(dq_shared[row, part * columns],
                                dq[bz, q_start + row, head, part * columns], columns * 4)
            T.tma_store_arrive()

    @T.macro
    def add_dq_halves(dq, dq_local, dq_shared, bz, head, q_start):
        """ds_handoff without dq_rows or dq_bulk: each consumer warpgroup adds its dQ
        columns by one TMA reduce, issued (and awaited) by its first thread; TMA clips the
        Sq tail."""
        half = consumer_warpgroup()
        cols = head_dim // 2
        T.sync_threads(WARPGROUP_BARRIER + half, threads // 2)  # last reduce read out
        T.copy(dq_local, dq_shared)  # each warpgroup writes its own columns
        T.sync_threads(WARPGROUP_BARRIER + half, threads // 2)
        # TileLang elects the first thread of each branch (thread 0 and threads // 2)
        if half == 0:
            T.atomic_add(dq[bz, q_start:q_start + block_q, head, 0:cols],
                         dq_shared[:, 0:cols], use_tma=True)
        else:
            T.atomic_add(dq[bz, q_start:q_start + block_q, head, cols:head_dim],
                         dq_shared[:, cols:head_dim], use_tma=True)

    def issues_dq_bulk(tx):
        """Whether consumer thread tx issues (and later awaits) its warpgroup's bulk reduce."""
        return tx % (threads // 2) == 0

    @T.macro
    def add_dq_bulk(dq, dq_local, dq_shared, bz, head, q_start):
        """dq_bulk: each consumer warpgroup copies its dQ columns into its padded half of
        dq_shared (rows h * block_q ...) and adds them by one bulk reduce of the contiguous
        run; its first thread issues it and awaits the read before the next rewrite."""
        tx = T.get_thread_binding()
        half = consumer_warpgroup()
        cols = head_dim // 2
        if issues_dq_bulk(tx):
            T.tma_store_wait(0, True)  # our previous reduce has read our half
        T.sync_threads(WARPGROUP_BARRIER + half, threads // 2)
        for i, j in T.Parallel(block_q, head_dim):
            dq_shared[j // cols * block_q + i, j % cols] = dq_local[i, j]
        T.fence_proxy_async()  # the generic-proxy writes, seen by the bulk copy
        T.sync_threads(WARPGROUP_BARRIER + half, threads // 2)
        if issues_dq_bulk(tx):
            bulk_reduce_add(dq_shared[half * block_q, 0], dq[bz, head, half, q_start, 0],
                            block_q * dq_half_row * 4)
            T.tma_store_arrive()

    @T.macro
    def gradient_gemms_handing_off_ds(p_local, ds_local, ds_shared, dq_local, q_shared,
                                      do_shared, k_shared, dv_local, dk_local, t, n_tiles):
        """ds_handoff: dV, dK and dQ of tile t of n_tiles with the dS halves handed over
        by one-sided named barriers. Each pairs one warpgroup's arrive with the other's sync
        (so both count `threads`), one for one: a hand-back is given only when a tile
        follows and awaited only after the first. (Barriers arrived on before the loop
        would run in TileLang's prologue, shared with the producer.)"""
        half = consumer_warpgroup()
        if t > 0:
            T.sync_threads(DS_FREE + half, threads)  # the other's dQ GEMM read our half
        T.copy(ds_local, ds_shared)  # our 64 key rows
        T.fence_proxy_async()  # the generic-proxy writes, seen by the wgmma reads
        T.named_barrier_arrive(DS_READY + half, threads)
        dv_dk_gemms(p_local, ds_local, q_shared, do_shared, dv_local, dk_local)
        T.sync_threads(DS_READY + 1 - half, threads)  # the other half is in
        T.sync_threads(WARPGROUP_BARRIER + half, threads // 2)  # and all of our own
        dq_gemm(ds_shared, k_shared, dq_local)
        if t + 1 < n_tiles:
            T.named_barrier_arrive(DS_FREE + 1 - half, threads)  # the other's half is read

    share_sm = sm_sharing(threads, config.ctas_per_sm, config.fast_exp)

    @T.macro
    def key_block(q, k, v, do, lse, delta, dq, dk, dv, scale, bx, by, bz):
        """One CTA: key/value block bx of query head (KV head with group_loop) by, batch bz."""
        share_sm()
        k_shared = T.alloc_shared((block_kv, head_dim), dtype)
        v_shared = T.alloc_shared((block_kv, head_dim), dtype)
        q_shared = T.alloc_shared((block_q, head_dim), dtype)
        do_shared = T.alloc_shared((block_q, head_dim), dtype)
        ds_shared = T.alloc_shared((block_kv, block_q), dtype)
        s_local = T.alloc_fragment((block_kv, block_q), "float")  # keys x queries
        p_local = T.alloc_fragment((block_kv, block_q), dtype)
        dp_local = T.alloc_fragment((block_kv, block_q), "float")
        ds_local = T.alloc_fragment((block_kv, block_q), dtype)
        dk_local = T.alloc_fragment((block_kv, head_dim), "float")
        dv_local = T.alloc_fragment((block_kv, head_dim), "float")
        dq_local = T.alloc_fragment((block_q, head_dim), "float")
        # dq_rows: rows whole and in order (each one or two bulk reduces), DQ_ROW_PAD floats
        # apart so the fragment's stores spread over the banks
        if dq_bulk:  # the two warpgroups' halves one after the other, rows padded
            dq_shared = T.alloc_shared((2 * block_q, dq_half_row), "float")
        else:
            dq_shared = T.alloc_shared((block_q, head_dim + DQ_ROW_PAD * dq_rows),
                                       "float") if tma_dq else None
        lse_shared = T.alloc_shared((block_q,), "float") if staged_stats else None
        delta_shared = T.alloc_shared((block_q,), "float") if staged_stats else None
        hold = T.alloc_local((1,), dtype) if async_mma else None
        # tma_dkv: used only after the key loop, when the K/V and Q/dO tiles are dead, so
        # TileLang's shared-memory planner lays them over those (no extra shared memory)
        dk_shared = T.alloc_shared((block_kv, head_dim), "float") if tma_dkv else None
        dv_shared = T.alloc_shared((block_kv, head_dim), "float") if tma_dkv else None
        if dq_rows or dq_bulk:
            T.annotate_layout({dq_shared: make_linear_layout(dq_shared)})

        kv_head = by if group_loop else by // group
        kv_start = bx * block_kv
        q_begin, n_blocks = visited_query_blocks(kv_start, seq_q, seq_kv)

        T.copy(k[bz, kv_start:kv_start + block_kv, kv_head, :], k_shared)
        T.copy(v[bz, kv_start:kv_start + block_kv, kv_head, :], v_shared)
        T.clear(dk_local)
        T.clear(dv_local)
        # With group_loop, t visits each visible query block for every query head of the
        # group in turn (heads innermost: their rows sit side by side in BSHD, and the
        # index math divides by a compile-time constant).
        for t in T.Pipelined(heads_per_cta * n_blocks, num_stages=stages):
            head = kv_head * group + t % group if group_loop else by
            q_start = (q_begin + t // heads_per_cta) * block_q
            T.copy(q[bz, q_start:q_start + block_q, head, :], q_shared)
            T.copy(do[bz, q_start:q_start + block_q, head, :], do_shared)
            if staged_stats:
                T.copy(lse[bz, head, q_start:q_start + block_q], lse_shared)
                T.copy(delta[bz, head, q_start:q_start + block_q], delta_shared)
            clear_for_gemm(s_local)
            # Each consumer warpgroup owns block_kv / 2 key rows in every key-major GEMM,
            # so S^T, dP^T, P, dS, dK and dV share one register layout.
            if async_mma:
                T.clear(dp_local)
                T.wgmma_gemm(k_shared, q_shared, s_local, transpose_B=True, policy=ROWS)
                T.wgmma_gemm(v_shared, do_shared, dp_local, transpose_B=True,
                             policy=ROWS)
                # TileLang 0.1.15 fences the whole tile before each wgmma (64 registers
                # where a thread holds 32), so ptxas still waits for K Q^T before
                # issuing V dO^T (C7517); the three gradient GEMMs below do overlap.
                T.wait_wgmma(0)
                T.warpgroup_fence_operand(s_local, num_regs=regs_scores)
                T.warpgroup_fence_operand(dp_local, num_regs=regs_scores)
            else:
                T.gemm(k_shared, q_shared, s_local, transpose_B=True, policy=ROWS,
                       clear_accum=clear_by_mma)  # K Q^T
                clear_for_gemm(dp_local)
                T.gemm(v_shared, do_shared, dp_local, transpose_B=True, policy=ROWS,
                       clear_accum=clear_by_mma)  # V dO^T
            # (lse, delta) of this block's rows: staged in shared memory, or global
            stats = (lse_shared, delta_shared) if staged_stats else (lse, delta)
            if edge_masks_only:
                # every row of a fully visible tile sees keys, so its lse is finite
                if tile_fully_visible(q_start, kv_start, seq_q, seq_kv, block_q, block_kv,
                                      window_left, window_right) & (
                                          q_start + block_q <= seq_q):
                    probs_and_grads(stats, s_local, dp_local, p_local, ds_local, bz, head,
                                    q_start, kv_start, seq_q, seq_kv, scale, False)
                else:
                    probs_and_grads(stats, s_local, dp_local, p_local, ds_local, bz, head,
                                    q_start, kv_start, seq_q, seq_kv, scale, True)
            else:
                probs_and_grads(stats, s_local, dp_local, p_local, ds_local, bz, head,
                                q_start, kv_start, seq_q, seq_kv, scale, True)
            if async_mma:
                T.copy(ds_local, ds_shared)
                T.clear(dq_local)
                T.wgmma_gemm(p_local, do_shared, dv_local, policy=ROWS)
                T.wgmma_gemm(ds_local, q_shared, dk_local, policy=ROWS)
                T.wgmma_gemm(ds_shared, k_shared, dq_local, transpose_A=True,
                             policy=T.GemmWarpPolicy.FullCol)
                T.wait_wgmma(0)
                T.warpgroup_fence_operand(dv_local, num_regs=regs_dkv)
                T.warpgroup_fence_operand(dk_local, num_regs=regs_dkv)
                T.warpgroup_fence_operand(dq_local, num_regs=regs_dq)
                # TileLang hands a Q/dO stage back to the producer after its last use
                # in the iteration; this read keeps that after the wait, not at the
                # asynchronous issue, so the next TMA load cannot overwrite the tiles
                # while a wgmma still reads them.
                hold[0] = q_shared[0, 0] + do_shared[0, 0]
            elif ds_handoff:
                gradient_gemms_handing_off_ds(p_local, ds_local, ds_shared, dq_local,
                                              q_shared, do_shared, k_shared, dv_local,
                                              dk_local, t, heads_per_cta * n_blocks)
            else:
                dv_dk_gemms(p_local, ds_local, q_shared, do_shared, dv_local, dk_local)
                T.copy(ds_local, ds_shared)
                dq_gemm(ds_shared, k_shared, dq_local)
            if dq_rows:
                add_dq_rows(dq, dq_local, dq_shared, bz, head, q_start, seq_q)
            elif dq_bulk:
                add_dq_bulk(dq, dq_local, dq_shared, bz, head, q_start)
            elif ds_handoff:
                add_dq_halves(dq, dq_local, dq_shared, bz, head, q_start)
            elif tma_dq:  # one bulk reduce-add of the tile (TMA clips the Sq tail)
                T.copy(dq_local, dq_shared)
                T.atomic_add(dq[bz, q_start:q_start + block_q, head, :], dq_shared,
                             use_tma=True)
            else:
                for i, j in T.Parallel(block_q, head_dim):
                    if q_start + i < seq_q:
                        T.atomic_add(dq[bz, q_start + i, head, j], dq_local[i, j])
        # dq_rows and dq_bulk defer each wait to the next tile: the last tile's reduce is
        # read out before the CTA exits, and before the tma_dkv tiles (which the planner may
        # lay over dq_shared) are written
        if dq_rows or dq_bulk:
            issuer = issues_dq_row if dq_rows else issues_dq_bulk
            if issuer(T.get_thread_binding()):
                T.tma_store_wait(0, True)
        if group_loop:  # this CTA holds the whole sum: store it
            for i, j in T.Parallel(block_kv, head_dim):
                if kv_start + i < seq_kv:
                    dk[bz, kv_start + i, kv_head, j] = T.cast(dk_local[i, j], dtype)
                    dv[bz, kv_start + i, kv_head, j] = T.cast(dv_local[i, j], dtype)
        elif tma_dkv:
            # Two bulk reduce-adds (TMA clips the Skv tail). A block no query sees adds
            # nothing, and must not write its tiles: they lie over K and V, whose loads
            # nobody waited for.
            if n_blocks > 0:
                if ds_handoff:  # no automatic syncs: K/V and dq read out before overwriting
                    T.sync_threads(DQ_BARRIER, threads)
                T.copy(dk_local, dk_shared)
                T.copy(dv_local, dv_shared)
                if ds_handoff:
                    T.sync_threads(DQ_BARRIER, threads)
                T.atomic_add(dk[bz, kv_start:kv_start + block_kv, kv_head, :], dk_shared,
                             use_tma=True)
                T.atomic_add(dv[bz, kv_start:kv_start + block_kv, kv_head, :], dv_shared,
                             use_tma=True)
        else:
            for i, j in T.Parallel(block_kv, head_dim):
                if kv_start + i < seq_kv:
                    T.atomic_add(dk[bz, kv_start + i, kv_head, j], dk_local[i, j])
                    T.atomic_add(dv[bz, kv_start + i, kv_head, j], dv_local[i, j])

    @T.prim_func
    def attention_bwd(q: T.Tensor(q_shape, dtype), k: T.Tensor(kv_shape, dtype),
                      v: T.Tensor(kv_shape, dtype), do: T.Tensor(q_shape, dtype),
                      lse: T.Tensor(stats_shape, "float"),
                      delta: T.Tensor(stats_shape, "float"),
                      dq: T.Tensor(dq_shape, "float"), dk: T.Tensor(kv_shape, dkv_dtype),
                      dv: T.Tensor(kv_shape, dkv_dtype), scale: T.float32):
        n_kv = T.ceildiv(seq_kv, block_kv)
        if kv_chunks == 1:
            with T.Kernel(n_kv, cta_heads, batch, threads=threads) as (bx, by, bz):
                if config.tail_ctas:
                    block, head = tail_launch_order(bx, bz * cta_heads + by, n_kv,
                                                    cta_heads * batch, config.tail_ctas)
                    # computed once into registers: as expressions they were inlined into
                    # every use (93 integer divisions in the PTX)
                    block_var = T.alloc_var("int32", init=block)
                    head_var = T.alloc_var("int32", init=head)
                    key_block(q, k, v, do, lse, delta, dq, dk, dv, scale, block_var,
                              head_var % cta_heads, head_var // cta_heads)
                else:
                    key_block(q, k, v, do, lse, delta, dq, dk, dv, scale, bx, by, bz)
        else:
            # Key blocks in kv_chunks runs, the first run of every head and batch launched
            # before the second: under a causal mask the first key blocks see the most query
            # blocks, so the last wave holds light CTAs instead of a heavy tail.
            per_chunk = T.ceildiv(n_kv, kv_chunks)
            with T.Kernel(per_chunk, cta_heads, batch * kv_chunks,
                          threads=threads) as (bx, by, bz):
                key_block(q, k, v, do, lse, delta, dq, dk, dv, scale,
                          bz // batch * per_chunk + bx, by, bz % batch)

    return attention_bwd


class AttentionBwdKernel(Kernel):
    """key: dtype, heads, kv_heads, head_dim, window_left, window_right, softcap."""

    name = "attention_bwd"
    Config = AttentionBwdConfig

    def program(self, config: AttentionBwdConfig, bucket: str):
        k = self.key
        main = attention_bwd_program(k["heads"], k["kv_heads"], k["head_dim"], k["dtype"],
                                     k["window_left"], k["window_right"], k["softcap"], config)
        delta = attention_delta_program(k["heads"], k["head_dim"], k["dtype"])
        if config.dq_bulk:  # its fp32 dq is head-major, halves apart: a kernel of its own
            return delta, main, attention_dq_cast_program(k["heads"], k["head_dim"],
                                                          k["dtype"], config.block_q)
        return delta, main

    def pass_configs(self, config: AttentionBwdConfig, program_index: int) -> dict:
        # ds_handoff places every shared-memory sync of the main pass by hand; TileLang's
        # own would put back the CTA-wide barriers it removes
        if program_index == 1 and config.ds_handoff:
            return {"tl.disable_thread_storage_sync": True}
        return {}

    def run(self, config: AttentionBwdConfig, compiled: tuple, q, k, v, o, do, lse, dq, dk,
            dv, scale: float) -> None:
        batch, seq_q, heads, _ = q.shape
        delta = torch.empty((batch, heads, seq_q), dtype=torch.float32, device=q.device)
        compiled[0](o, do, delta)
        if config.edge_masks_only:
            # A row that saw no key (lse -inf) must get P = 0 on tiles that skip the mask
            # tests too: the varlen backward's padded rows sit in fully visible tiles. With
            # lse +inf, exp2(s - lse) is 0 on every path. One elementwise kernel (a mask and
            # a fill would be two); NaN and +inf stay as they are.
            lse = lse.nan_to_num(nan=math.nan, posinf=math.inf, neginf=math.inf)
        if config.staged_stats and seq_q % 4:  # pad rows to a 16-byte TMA stride
            lse, delta = (torch.nn.functional.pad(t, (0, -seq_q % 4)) for t in (lse, delta))
        if config.dq_bulk:  # head-major, halves apart, rows padded (see dq_bulk)
            half = q.shape[-1] // 2
            rows = -(-seq_q // config.block_q) * config.block_q
            dq32 = torch.zeros((batch, heads, 2, rows, half + DQ_ROW_PAD),
                               dtype=torch.float32, device=q.device)
        else:
            dq32 = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        if config.group_loop:  # dk and dv are stored whole by their CTAs
            compiled[1](q, k, v, do, lse, delta, dq32, dk, dv, scale)
        else:
            dk32 = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
            dv32 = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
            compiled[1](q, k, v, do, lse, delta, dq32, dk32, dv32, scale)
            dk.copy_(dk32)
            dv.copy_(dv32)
        if config.dq_bulk:
            compiled[2](dq32, dq)
        else:
            dq.copy_(dq32)

    def heuristic_config(self, bucket: str, arch: str) -> AttentionBwdConfig:
        config = self._heuristic_tiles()
        if self.key["softcap"] > 0:
            # the soft cap's tanh (and exp2) on the SFU's ex2, as in the forward: Gemma-2-9B
            # training 2 x 4K local layer (head_dim 256, softcap 50), bf16 on the H200, 8721.7
            # against 9164.9 us; without a cap within 1.3% (8B 4 x 4K 3077.4 vs 3117.6, 70B
            # 2 x 8K level), so those keep exp2f
            config = dataclasses.replace(config, fast_exp=True)
        return config

    def _heuristic_tiles(self) -> AttentionBwdConfig:
        if self.key["head_dim"] >= 256:
            return AttentionBwdConfig(block_kv=128, block_q=32, stages=1, threads=256)
        if self.key["head_dim"] >= 192:
            # DeepSeek-V3's q/k width (its v zero-padded to it by the op): two 128 x 192 fp32
            # accumulators leave room for 32-row Q tiles in one stage only; the default to 128's
            # loop then spills least (ptxas: 168 registers, 144 B of spill stores;
            # the plain loop 260 B; 256 wide, 17 KB)
            return dataclasses.replace(self._default_to_128(), block_q=32, stages=1)
        return self._default_to_128()

    @staticmethod
    def _default_to_128() -> AttentionBwdConfig:
        """The default of head dims up to 128, as measured there (the 192 default narrows
        its Q tiles)."""
        # H200 tuning (Llama-3.1-8B training 4 x 4K): the TMA dq reduce with two Q/dO stages
        # ran 7% faster than per-element atomics with one stage; masking only the tiles a mask
        # cuts through, with lse and delta staged by TMA, 18% faster again (3702.7 vs 4499.3
        # us, bf16; edge masks alone 3964.2, staged stats alone 5006.2). A third Q/dO stage
        # (210 KiB of shared memory) won by about 1% in three tune runs (3639.7 / 3643.0 /
        # 3670.8 vs 3674.4 / 3675.0 / 3730.4 us).
        # The first wgmma of S, dP and dQ overwriting its accumulator (clear_by_mma) won by
        # 1.1% (3599.7 vs 3638.9 us). dk and dv by two TMA reduces (tma_dkv) on top of it:
        # 3607.9 vs 3618.7 us, within the noise; kept, as it frees the epilogue of 128 float2
        # atomics per thread (ncu had sampled consumers stalled there 12-14% of the time).
        # The two consumer warpgroups out of lockstep (ds_handoff) on top: 3558.7 vs 3640.0
        # us (2.2%); with dq_rows 3736.2. Its dq by one bulk reduce per warpgroup with the
        # wait deferred (dq_bulk): 3452.5 vs 3541.6 us (2.5%). Out of lockstep, two Q/dO
        # stages beat three again: 1916.1 vs 1955.0 us at 8 x 2K, 3266.0 vs 3306.7 at 4 x 4K
        # (compare, 6ee9f0f). The last 256 CTAs heavy first (tail_ctas): 1859.4 vs 1910.0 us
        # at 8 x 2K, 3151.1 vs 3192.5 at 4 x 4K (compare, eb392f8; 512 gave the same).
        return AttentionBwdConfig(block_kv=128, block_q=64, stages=2, threads=256, tma_dq=True,
                                  edge_masks_only=True, staged_stats=True, clear_by_mma=True,
                                  tma_dkv=True, ds_handoff=True, dq_bulk=True, tail_ctas=256)

    def config_space(self, bucket: str) -> list[AttentionBwdConfig]:
        space = [self.heuristic_config(bucket, "sm_90a")]
        # the default in the grid's plain order, as the twins below were measured
        plain_order = dataclasses.replace(space[0], tail_ctas=0)
        space.append(plain_order)
        # block_q 128 does not build in TileLang 0.1.15 (a shared-memory sync would fall in
        # a 252-thread divergent region), so the space stops at 64.
        for block_kv, block_q in ((128, 64), (128, 32)):
            for stages in (1, 2):
                for tma_dq in (False, True):
                    space.append(AttentionBwdConfig(block_kv, block_q, stages, 256, tma_dq))
                for async_mma in (False, True) if block_q >= 64 else (False,):
                    space.append(AttentionBwdConfig(block_kv, block_q, stages, 256, True, True,
                                                    async_mma))
                # the lighter loop: masks only on cut tiles, lse and delta by TMA
                space.append(AttentionBwdConfig(block_kv, block_q, stages, 256, True,
                                                edge_masks_only=True, staged_stats=True))
        space.append(AttentionBwdConfig(128, 64, 2, 256, True, edge_masks_only=True))
        # group_loop lost by 1-7% both with and without the lighter loop
        group_loop = AttentionBwdConfig(128, 64, 2, 256, True, True, edge_masks_only=True,
                                        staged_stats=True)
        space.append(group_loop)
        # The twins below vary the lighter loop with two stages (the default until the third
        # stage won), as they were measured; at head_dim 256, its own default.
        base = (dataclasses.replace(plain_order, stages=2, clear_by_mma=False, tma_dkv=False,
                                    ds_handoff=False, dq_bulk=False)
                if plain_order.staged_stats else plain_order)
        # heavy key blocks first (kv_chunks); group_loop has a quarter of the CTAs (GQA 4),
        # so its tail weighs more
        space += [dataclasses.replace(base, kv_chunks=n) for n in (2, 4)]
        if base.tma_dq:
            # dq by row reduces whose wait is deferred a tile (no warp stalls on the reduce
            # reading shared memory), with two and three stages
            space += [dataclasses.replace(base, dq_rows=True),
                      dataclasses.replace(base, dq_rows=True, stages=3)]
        if base.block_q >= 64:
            # the GEMMs issued in batches on the lighter loop (tried only with group_loop
            # before), with either dq path
            space += [dataclasses.replace(base, async_mma=True),
                      dataclasses.replace(base, async_mma=True, dq_rows=base.tma_dq)]
        space.append(dataclasses.replace(group_loop, kv_chunks=2))
        # two CTAs per SM (64 keys, one consumer warpgroup each): dq by the TMA tile with
        # one Q/dO stage, or by atomics with two (either fits twice in shared memory).
        # async_mma does not fit their registers: ptxas serializes its wgmmas (C7512).
        two_ctas = AttentionBwdConfig(64, 64, 1, 128, True, edge_masks_only=True,
                                      staged_stats=True, ctas_per_sm=2)
        space += [two_ctas, dataclasses.replace(two_ctas, stages=2, tma_dq=False)]
        # the two-stage lighter loop without the accumulator zeroing (the default's twins
        # in lockstep follow)
        if base.edge_masks_only and not base.async_mma:
            space.append(dataclasses.replace(base, clear_by_mma=True))
        if plain_order.edge_masks_only:
            # the default with three Q/dO stages, as the choices below were measured (the
            # third stage won in lockstep)
            three_stages = dataclasses.replace(plain_order, stages=3)
            space.append(three_stages)
            # in lockstep, with and without each of its two previous choices
            space += [dataclasses.replace(three_stages, clear_by_mma=clear, tma_dkv=tma_dkv,
                                          ds_handoff=False, dq_bulk=False)
                      for clear in (False, True) for tma_dkv in (False, True)]
            # out of lockstep with dq by one tensor-map reduce per warpgroup, or by rows
            space += [dataclasses.replace(three_stages, dq_bulk=False, dq_rows=rows)
                      for rows in (False, True)]
            # the default walking the whole GQA group (no fp32 dk/dv buffers, zero fills or
            # casts: 335 MB less traffic per call at 8B 8 x 2K), heavy key blocks first or
            # not: 6-10% slower on the H200 (8B 4 x 4K and 8 x 2K)
            space += [dataclasses.replace(three_stages, group_loop=True, tma_dkv=False,
                                          kv_chunks=n) for n in (1, 2)]
        # the default with exp2 and tanh on the SFU's ex2 alone, or without (soft cap)
        space.append(dataclasses.replace(space[0], fast_exp=not space[0].fast_exp))
        head_dim = self.key["head_dim"]
        return [c for c in dict.fromkeys(space) if c.fits(head_dim)]
