"""MLA decode with two consumer warp groups taking key tiles in turns (`MLADecodeConfig.seesaw`).

The plain program (mla_decode.py) splits every GEMM of a key tile between its two consumer
warp groups and waits for each: the tensor cores idle while the softmax and its cross-warp-
group row max run, and S = Q K^T runs as two m64n32 halves that read Q twice. Here the key
tiles come in pairs (a, b) and each warp group owns half of the 512 output columns:

  warp group 0: S_a = Q K_a^T; m_a = max(m, rowmax S_a); P_a = exp(S_a - m_a) -> shared;
                O_lo = O_lo * e^(m - m_a) + P_a V_a,lo (P_a from registers);
                then, given P_b: O_lo = O_lo * e^(m_a - m_b) + P_b V_b,lo (P_b from shared)
  warp group 1: S_b = Q K_b^T (alongside S_a); given m_a: m_b = max(m_a, rowmax S_b);
                O_hi = O_hi * e^(m - m_a) + P_a V_a,hi (P_a from shared), while its own
                softmax runs; P_b -> shared; O_hi = O_hi * e^(m_a - m_b) + P_b V_b,hi

so each S is one m64n64 product over the 576 columns, and one warp group's softmax runs
while the other's wgmmas do (FlashMLA's "seesaw" schedule, written here for TileLang).
The hand-offs are one-sided named barriers, each arrive matched by one sync: m_a and P_a
ready, P_b ready (with m_b and its rescale), and the two P buffers free again. A TMA
producer warp group loads Q's latent part (its own barrier), then fills two K/V buffers
(tile a's, tile b's) on full/empty mbarriers.
Shared memory: Q 64 KB, two 72 KB key tiles, the two P tiles 16 KB; q_pe (64 x 64) is
held in each warp group's registers (an rs wgmma) so that it all fits in 227 KB.

The planned schedule deals runs of key tiles; with `pair_runs` runs of whole pairs (its
tile is PAIR_KEYS keys: no run but a request's last ends on a masked tile b, at half the
splits for a short batch).

Row sums: each warp group sums its own tiles' probabilities, rescaled alongside its O half
by every factor, and the two sums are added at the end. A run of an odd number of tiles
ends on a masked tile b (P_b = 0, rescale 1).

`part_waits`: each key tile lands as three TMA parts (the rope columns, then the two latent
halves), each on its own full barrier, and S's three wgmmas are issued as their parts land
(a tile's first product starts after 8 of its 72 KB) instead of after the whole tile.

`cluster`: the CTAs of a slot's two 64-head blocks form a thread-block cluster and each key
tile is read once for both: the first CTA's producer multicasts it into both CTAs' buffers
(TMA multicast), and a buffer is refilled once the consumers of both have released it (one
arrival a consumer warp on each CTA's empty barrier). Without it each CTA reads every tile
of its slot from L2 or HBM, twice the KV bytes (measured on an H100: no gain from sharing,
sixtieth session)."""

import tilelang.language as T

from ..fast_math import LOG2E
from ..gemm.async_pipeline import PRODUCER_THREADS, register_budgets

BLOCK_H = 64  # heads per CTA: one wgmma M tile a warp group
BLOCK_N = 64  # keys per tile
PAIR_KEYS = 2 * BLOCK_N  # the schedule's unit: a pair of tiles, one for each warp group
WARP_GROUP = 128
# named barriers (ids clear of TileLang's own): one-sided hand-offs between the warp groups
A_READY, B_READY, A_FREE, B_FREE, BOTH = 8, 9, 10, 11, 12


def smem_bytes(dim: int, rope: int, elem_bytes: int = 2) -> int:
    """Q's latent part, two key tiles (latent + rope), two P tiles, five rows of fp32."""
    return ((BLOCK_H * dim + 2 * BLOCK_N * (dim + rope) + 2 * BLOCK_H * BLOCK_N) * elem_bytes
            + 5 * BLOCK_H * 4)


def mla_decode_seesaw_program(heads: int, dim: int, rope: int, page_size: int, dtype: str,
                              part_waits: bool = False, cluster: bool = False,
                              pair_runs: bool = False):
    """The same contract as mla_decode.mla_decode_program (o / lse for a request of one
    split, else fp32 partials for the planned combine), on the seesaw schedule above."""
    batch, n_pages, max_pages, n_slots = T.dynamic("batch, n_pages, max_pages, n_slots")
    half = dim // 2
    assert page_size % BLOCK_N == 0 and heads % BLOCK_H == 0 and dim % 128 == 0
    assert not cluster or heads % (2 * BLOCK_H) == 0
    ctas = 2 if cluster else 1  # CTAs sharing each key tile
    unit = 2 if pair_runs else 1  # key tiles a unit of the schedule
    consumers = 2 * WARP_GROUP
    producer_regs, consumer_regs = register_budgets(consumers)
    score_regs = BLOCK_H * BLOCK_N // WARP_GROUP
    out_regs = BLOCK_H * half // WARP_GROUP
    neg_inf = -T.infinity("float")
    # a buffer's full barriers, in load order: the rope part, the latent halves (or one)
    parts = 3 if part_waits else 1
    PE, LO, HI = (0, 1, 2) if part_waits else (0, 0, 0)

    @T.macro
    def scores(q_lo, q_hi, q_pe_local, kv_lo, kv_hi, pe, full, buf, phase, s):
        """S = Q K^T of the tile in buffer `buf` (the latent halves from shared memory, the
        rope part with q_pe from registers), each product issued once its part has landed,
        then waited for."""
        T.mbarrier_wait_parity(full[buf * parts + PE], phase)
        T.wgmma_gemm(q_pe_local, pe[buf, :, :], s, transpose_B=True, clear_accum=True)
        if part_waits:
            T.mbarrier_wait_parity(full[buf * parts + LO], phase)
        T.wgmma_gemm(q_lo, kv_lo[buf, :, :], s, transpose_B=True)
        if part_waits:
            T.mbarrier_wait_parity(full[buf * parts + HI], phase)
        T.wgmma_gemm(q_hi, kv_hi[buf, :, :], s, transpose_B=True)
        T.wait_wgmma(0)
        T.warpgroup_fence_operand(s, num_regs=score_regs)

    @T.macro
    def release(empty, buf):
        """A consumer thread done with buffer `buf`: on each CTA of the cluster, one
        arrival a warp (its lanes have all waited for their wgmmas)."""
        if cluster:
            if T.get_thread_binding() % 32 == 0:
                for rank in T.unroll(ctas):
                    T.mbarrier_arrive(empty[buf], rank)
        else:
            T.mbarrier_arrive(empty[buf])

    @T.macro
    def mask(s, first, t, mine, seqlen):
        """Keys past the run (t >= mine: a pair's missing tile b) or the request: -inf."""
        for i, j in T.Parallel(BLOCK_H, BLOCK_N):
            s[i, j] = T.if_then_else((t < mine) & ((first + t) * BLOCK_N + j < seqlen), s[i, j],
                                     neg_inf)

    @T.macro
    def add_other_sums(rows, total, own, other):
        """Row sums of both warp groups: ours into rows[own], then the other's added."""
        for r in T.Parallel(BLOCK_H):
            rows[own, r] = total[r]
        T.sync_threads(BOTH, consumers)
        for r in T.Parallel(BLOCK_H):
            total[r] += rows[other, r]

    @T.macro
    def finish(acc, total, m, o, lse, o_part, lse_part, slot_table, b, bz, h0, col0,
               scale, writes_lse):
        """O / l into o (one split) or the fp32 partials; lse from warp group 0."""
        if slot_table[bz, 3] == 1:
            for i, d in T.Parallel(BLOCK_H, half):
                o[b, 0, h0 + i, col0 + d] = T.if_then_else(total[i] > 0, acc[i, d] / total[i],
                                                           0.0)
        else:
            for i, d in T.Parallel(BLOCK_H, half):
                o_part[bz, 0, h0 + i, col0 + d] = T.if_then_else(total[i] > 0,
                                                                 acc[i, d] / total[i], 0.0)
        if writes_lse:
            for i in T.Parallel(BLOCK_H):
                value = T.if_then_else(total[i] > 0,
                                       T.if_then_else(m[i] == neg_inf, 0.0, m[i]) * scale
                                       + T.log(total[i]), neg_inf)
                if slot_table[bz, 3] == 1:
                    lse[b, h0 + i, 0] = value
                else:
                    lse_part[bz, 0, h0 + i] = value

    @T.prim_func
    def mla_decode_seesaw(q_nope: T.Tensor((batch, heads, dim), dtype),
                          q_pe: T.Tensor((batch, heads, rope), dtype),
                          kv: T.Tensor((n_pages, page_size, dim + rope), dtype),
                          block_table: T.Tensor((batch, max_pages), "int32"),
                          cache_seqlens: T.Tensor((batch,), "int32"),
                          slot_table: T.Tensor((n_slots, 4), "int32"),
                          o: T.Tensor((batch, 1, heads, dim), dtype),
                          lse: T.Tensor((batch, heads, 1), "float"),
                          o_part: T.Tensor((n_slots, 1, heads, dim), "float"),
                          lse_part: T.Tensor((n_slots, 1, heads), "float"),
                          scale: T.float32):
        with T.Kernel(heads // BLOCK_H, n_slots, threads=consumers + PRODUCER_THREADS,
                      cluster_dims=(ctas, 1, 1) if cluster else None) as (hx, bz):
            q_lo = T.alloc_shared((BLOCK_H, half), dtype)
            q_hi = T.alloc_shared((BLOCK_H, half), dtype)
            kv_lo = T.alloc_shared((2, BLOCK_N, half), dtype)
            kv_hi = T.alloc_shared((2, BLOCK_N, half), dtype)
            pe = T.alloc_shared((2, BLOCK_N, rope), dtype)
            p_shared = T.alloc_shared((2, BLOCK_H, BLOCK_N), dtype)
            # rows handed over: m_a, m_b, e^(m_a - m_b), and each warp group's row sums
            rows = T.alloc_shared((5, BLOCK_H), "float")
            full = T.alloc_barrier([PRODUCER_THREADS] * (2 * parts))
            q_full = T.alloc_barrier([PRODUCER_THREADS])  # Q's latent part landed
            if cluster:
                empty = T.alloc_cluster_barrier([consumers // 32 * ctas] * 2)
            else:
                empty = T.alloc_barrier([consumers] * 2)
            multicast = (1 << ctas) - 1 if cluster else None
            # warp group g's state: its scores, P, O half, q_pe and per-row values
            s = [T.alloc_fragment((BLOCK_H, BLOCK_N), "float") for _ in range(2)]
            p = [T.alloc_fragment((BLOCK_H, BLOCK_N), dtype) for _ in range(2)]
            acc = [T.alloc_fragment((BLOCK_H, half), "float") for _ in range(2)]
            q_pe_local = [T.alloc_fragment((BLOCK_H, rope), dtype) for _ in range(2)]
            m = [T.alloc_fragment((BLOCK_H,), "float") for _ in range(2)]
            m_prev = [T.alloc_fragment((BLOCK_H,), "float") for _ in range(2)]
            m_safe = [T.alloc_fragment((BLOCK_H,), "float") for _ in range(2)]
            rescale_a = [T.alloc_fragment((BLOCK_H,), "float") for _ in range(2)]
            rescale_b = [T.alloc_fragment((BLOCK_H,), "float") for _ in range(2)]
            row_sum = [T.alloc_fragment((BLOCK_H,), "float") for _ in range(2)]
            total = [T.alloc_fragment((BLOCK_H,), "float") for _ in range(2)]
            tx = T.get_thread_binding()
            if slot_table[bz, 0] >= 0:
                # The slot, read once into registers: as expressions of global loads they
                # were reloaded after every barrier wait (a memory clobber), a chain of two
                # dependent loads in each mask (ncu: 37% of stalls on L1TEX).
                slot = T.alloc_local((6,), "int32")
                slot[0] = slot_table[bz, 0]  # the request
                slot[1] = cache_seqlens[slot[0]]  # its length
                # The run, in the schedule's units (tiles, or pairs: PAIR_KEYS keys), cut to
                # the request's units (the last run is open-ended, 2^30: cut before scaling;
                # a stale schedule stays exact, see decode.schedule_program), then to its
                # tiles; walked as pairs, at least one, an odd run's last one masked in b.
                slot[2] = unit * slot_table[bz, 1]  # the run's first tile
                slot[3] = T.max(T.min(unit * T.max(T.min(
                    slot_table[bz, 2], T.ceildiv(slot[1], unit * BLOCK_N) - slot_table[bz, 1]),
                    0), T.ceildiv(slot[1], BLOCK_N) - slot[2]), 0)  # its tiles
                slot[4] = T.max(T.ceildiv(slot[3], 2), 1)  # its pairs
                slot[5] = T.max(T.ceildiv(slot[1], BLOCK_N) - 1, 0)  # the request's last tile
                b, seqlen, first, mine, pairs, last_tile = (slot[0], slot[1], slot[2], slot[3],
                                                            slot[4], slot[5])
                h0 = hx * BLOCK_H
                if tx >= consumers:
                    T.set_max_nreg(producer_regs, 0)
                    # Q by TMA first: its load overlaps the first key tiles' (the CTA's own
                    # heads, never multicast)
                    T.tma_copy(q_nope[b, h0:h0 + BLOCK_H, 0:half], q_lo, barrier=q_full)
                    T.tma_copy(q_nope[b, h0:h0 + BLOCK_H, half:dim], q_hi, barrier=q_full)
                    T.mbarrier_arrive(q_full)
                    for t in T.serial(2 * pairs):
                        buf = t % 2
                        T.mbarrier_wait_parity(empty[buf], ((t // 2) & 1) ^ 1)
                        # tiles past the run are loaded (clamped) and masked by the consumers
                        tile = T.min(first + t, last_tile)
                        page = block_table[b, T.min(tile * BLOCK_N // page_size, max_pages - 1)]
                        row = tile * BLOCK_N % page_size
                        T.tma_copy(kv[page, row:row + BLOCK_N, dim:dim + rope], pe[buf, :, :],
                                   barrier=full[buf * parts + PE], cluster_mask=multicast)
                        T.tma_copy(kv[page, row:row + BLOCK_N, 0:half], kv_lo[buf, :, :],
                                   barrier=full[buf * parts + LO], cluster_mask=multicast)
                        T.tma_copy(kv[page, row:row + BLOCK_N, half:dim], kv_hi[buf, :, :],
                                   barrier=full[buf * parts + HI], cluster_mask=multicast)
                        for part in T.unroll(parts):
                            T.mbarrier_arrive(full[buf * parts + part])
                elif tx < WARP_GROUP:
                    T.set_max_nreg(consumer_regs, 1)
                    c = scale * LOG2E
                    T.copy(q_pe[b, h0:h0 + BLOCK_H, :], q_pe_local[0])
                    T.mbarrier_wait_parity(q_full, 0)
                    T.fill(acc[0], 0.0)
                    T.fill(total[0], 0.0)
                    T.fill(m[0], neg_inf)
                    for i in T.serial(pairs):
                        scores(q_lo, q_hi, q_pe_local[0], kv_lo, kv_hi, pe, full, 0, i & 1, s[0])
                        mask(s[0], first, 2 * i, mine, seqlen)
                        T.copy(m[0], m_prev[0])
                        T.reduce_max(s[0], m[0], dim=1, clear=False)
                        for r in T.Parallel(BLOCK_H):
                            m_safe[0][r] = T.if_then_else(m[0][r] == neg_inf, 0.0, m[0][r])
                            rescale_a[0][r] = T.exp2((m_prev[0][r] - m_safe[0][r]) * c)
                        for r, j in T.Parallel(BLOCK_H, BLOCK_N):
                            s[0][r, j] = T.exp2((s[0][r, j] - m_safe[0][r]) * c)
                        T.reduce_sum(s[0], row_sum[0], dim=1)
                        for r in T.Parallel(BLOCK_H):
                            total[0][r] = total[0][r] * rescale_a[0][r] + row_sum[0][r]
                        T.copy(s[0], p[0])
                        if i > 0:
                            T.sync_threads(A_FREE, consumers)  # warp group 1 read P_a, m_a
                        T.copy(p[0], p_shared[0, :, :])
                        for r in T.Parallel(BLOCK_H):
                            rows[0, r] = m[0][r]
                        T.fence_proxy_async()  # P_a, seen by warp group 1's wgmma
                        T.named_barrier_arrive(A_READY, consumers)
                        for r, d in T.Parallel(BLOCK_H, half):
                            acc[0][r, d] *= rescale_a[0][r]
                        T.wgmma_gemm(p[0], kv_lo[0, :, :], acc[0])
                        T.sync_threads(B_READY, consumers)  # P_b, m_b, e^(m_a - m_b)
                        T.mbarrier_wait_parity(full[parts + LO], i & 1)  # V_b,lo seen here
                        for r in T.Parallel(BLOCK_H):
                            rescale_b[0][r] = rows[2, r]
                            m[0][r] = rows[1, r]
                            total[0][r] *= rescale_b[0][r]
                        T.wait_wgmma(0)
                        T.warpgroup_fence_operand(acc[0], num_regs=out_regs)
                        release(empty, 0)
                        for r, d in T.Parallel(BLOCK_H, half):
                            acc[0][r, d] *= rescale_b[0][r]
                        T.wgmma_gemm(p_shared[1, :, :], kv_lo[1, :, :], acc[0])
                        T.wait_wgmma(0)
                        T.warpgroup_fence_operand(acc[0], num_regs=out_regs)
                        if i + 1 < pairs:
                            T.named_barrier_arrive(B_FREE, consumers)
                        release(empty, 1)
                    add_other_sums(rows, total[0], 3, 4)
                    finish(acc[0], total[0], m[0], o, lse, o_part, lse_part, slot_table, b,
                           bz, h0, 0, scale, True)
                else:
                    T.set_max_nreg(consumer_regs, 1)
                    c = scale * LOG2E
                    T.copy(q_pe[b, h0:h0 + BLOCK_H, :], q_pe_local[1])
                    T.mbarrier_wait_parity(q_full, 0)
                    T.fill(acc[1], 0.0)
                    T.fill(total[1], 0.0)
                    T.fill(m[1], neg_inf)
                    for i in T.serial(pairs):
                        scores(q_lo, q_hi, q_pe_local[1], kv_lo, kv_hi, pe, full, 1, i & 1, s[1])
                        mask(s[1], first, 2 * i + 1, mine, seqlen)
                        T.reduce_max(s[1], row_sum[1], dim=1)  # tile b's own row max
                        T.sync_threads(A_READY, consumers)  # P_a and m_a
                        T.mbarrier_wait_parity(full[HI], i & 1)  # V_a,hi seen here
                        for r in T.Parallel(BLOCK_H):
                            m_prev[1][r] = rows[0, r]  # m_a
                            # e^(m - m_a), as warp group 0 computed it
                            rescale_a[1][r] = T.exp2(
                                (m[1][r] - T.if_then_else(m_prev[1][r] == neg_inf, 0.0,
                                                          m_prev[1][r])) * c)
                            m[1][r] = T.max(m_prev[1][r], row_sum[1][r])  # m_b
                            m_safe[1][r] = T.if_then_else(m[1][r] == neg_inf, 0.0, m[1][r])
                            rescale_b[1][r] = T.exp2((m_prev[1][r] - m_safe[1][r]) * c)
                        for r, d in T.Parallel(BLOCK_H, half):
                            acc[1][r, d] *= rescale_a[1][r]
                        T.wgmma_gemm(p_shared[0, :, :], kv_hi[0, :, :], acc[1])  # under the softmax
                        for r, j in T.Parallel(BLOCK_H, BLOCK_N):
                            s[1][r, j] = T.exp2((s[1][r, j] - m_safe[1][r]) * c)
                        T.reduce_sum(s[1], row_sum[1], dim=1)
                        for r in T.Parallel(BLOCK_H):
                            total[1][r] = (total[1][r] * rescale_a[1][r] * rescale_b[1][r]
                                           + row_sum[1][r])
                        T.copy(s[1], p[1])
                        if i > 0:
                            T.sync_threads(B_FREE, consumers)  # warp group 0 read P_b's
                        T.copy(p[1], p_shared[1, :, :])
                        for r in T.Parallel(BLOCK_H):
                            rows[1, r] = m[1][r]
                            rows[2, r] = rescale_b[1][r]
                        T.fence_proxy_async()
                        T.named_barrier_arrive(B_READY, consumers)
                        T.wait_wgmma(0)
                        T.warpgroup_fence_operand(acc[1], num_regs=out_regs)
                        if i + 1 < pairs:
                            T.named_barrier_arrive(A_FREE, consumers)
                        release(empty, 0)
                        for r, d in T.Parallel(BLOCK_H, half):
                            acc[1][r, d] *= rescale_b[1][r]
                        T.wgmma_gemm(p[1], kv_hi[1, :, :], acc[1])
                        T.wait_wgmma(0)
                        T.warpgroup_fence_operand(acc[1], num_regs=out_regs)
                        release(empty, 1)
                    add_other_sums(rows, total[1], 4, 3)
                    finish(acc[1], total[1], m[1], o, lse, o_part, lse_part, slot_table, b,
                           bz, h0, half, scale, False)
                if cluster:  # no CTA leaves while its peer may still multicast into it
                    T.cluster_sync()

    return mla_decode_seesaw
