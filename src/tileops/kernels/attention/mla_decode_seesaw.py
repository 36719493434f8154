"""MLA decode with two consumer warp groups taking key tiles in turns (`MLADecodeConfig.seesaw`).

The plain program (mla_decode.py) splits every GEMM of a key tile between its two consumer
warp groups and waits for each: the tensor cores idle while the softmax and its cross-warp-
group row max run, and S = Q K^T runs as two m64n32 halves that read Q twice. Here the key
tiles come in pairs (a, b), each warp group computes the whole m64n64 S of its own tile and
owns half of the 512 output columns (FlashMLA's "seesaw" schedule, written here for
TileLang). With m the running row max and o_lo / o_hi the output halves:

  warp group 0: m_a = max(m, rowmax S_a); P_a = exp(S_a - m_a); o_lo = o_lo e^(m - m_a)
                + P_a V_a,lo (P_a from registers); given m_b: P_a e^(m_a - m_b) -> shared;
                o_lo = o_lo e^(m_a - m_b) + P_b V_b,lo (P_b from shared); S_a' of the next pair
  warp group 1: given m_a: m_b = max(m_a, rowmax S_b); P_b = exp(S_b - m_b) -> shared;
                o_hi = o_hi e^(m - m_b) + P_b V_b,hi (registers) + (P_a e^(m_a - m_b)) V_a,hi
                (shared); S_b' of the next pair

so one warp group's softmax runs while the other's wgmmas do, and each S of the next pair
is issued behind the P V products of this one. The hand-offs are one-sided named barriers,
each arrive matched by one sync (m_a ready, m_b ready, P_a ready, P_b ready); the P buffers
and the row values are reused a pair later, after waits that order them.

Loads: no producer warp group. A key tile lands as nine 64-column TMA boxes (the four of
each latent half, the rope part), each on its own full barrier, and S's products are
issued box by box as they land. A tile's parts are refilled with the next pair's tile by
the warp group that used them last, right after its last product on them (so no empty
barriers): warp group 0 refills tile a's rope part behind S_a, its lower half behind
P_a V_a,lo and tile b's lower half behind P_b V_b,lo; warp group 1 the rest of tile b and
tile a's upper half. Each S takes its boxes in the order they were refilled.
Shared memory: Q's latent part 64 KB, two 72 KB key tiles, the two P tiles 16 KB; q_pe
(64 x 64) is held in each warp group's registers (an rs wgmma) so that it fits 227 KB.

Row sums: each warp group sums its own tiles' probabilities, rescaled alongside its O half
by every factor, and the two sums are added at the end. A run of an odd number of tiles
ends on a masked tile b (P_b = 0).

The planned schedule deals runs of key tiles; with `pair_runs` runs of whole pairs (its
tile is PAIR_KEYS keys: no run but a request's last ends on a masked tile b, at half the
splits for a short batch). `evict_first`: the key boxes load with L2's evict-first hint
(FlashMLA's choice; the slot's other 64-head CTA reads the same tiles)."""

import tilelang.language as T

from ..fast_math import LOG2E

BLOCK_H = 64  # heads per CTA: one wgmma M tile a warp group
BLOCK_N = 64  # keys per tile
BOX = 64  # columns of a TMA box, and of one step of S
PAIR_KEYS = 2 * BLOCK_N  # the schedule's unit: a pair of tiles, one for each warp group
WARP_GROUP = 128
# named barriers (ids clear of TileLang's own): one-sided hand-offs between the warp groups
M_A_READY, M_B_READY, P_A_READY, P_B_READY, BOTH = 8, 9, 10, 11, 12


def smem_bytes(dim: int, rope: int, elem_bytes: int = 2) -> int:
    """Q's latent part, two key tiles (latent + rope), two P tiles, three rows of fp32."""
    return ((BLOCK_H * dim + 2 * BLOCK_N * (dim + rope) + 2 * BLOCK_H * BLOCK_N) * elem_bytes
            + 3 * BLOCK_H * 4)


def mla_decode_seesaw_program(heads: int, dim: int, rope: int, page_size: int, dtype: str,
                              pair_runs: bool = False, evict_first: bool = True):
    """The same contract as mla_decode.mla_decode_program (o / lse for a request of one
    split, else fp32 partials for the planned combine), on the seesaw schedule above."""
    batch, n_pages, max_pages, n_slots = T.dynamic("batch, n_pages, max_pages, n_slots")
    half = dim // 2
    assert page_size % BLOCK_N == 0 and heads % BLOCK_H == 0 and half % BOX == 0
    assert rope == BOX  # one box, q_pe's registers: DeepSeek's 64
    boxes = half // BOX  # boxes of a latent half
    # a buffer's full barriers: the boxes of the lower half (LO..), the upper half (HI..),
    # the rope part
    LO, HI, ROPE_BOX = 0, boxes, 2 * boxes
    per_buffer = 2 * boxes + 1
    unit = 2 if pair_runs else 1  # key tiles a unit of the schedule
    consumers = 2 * WARP_GROUP
    score_regs = BLOCK_H * BLOCK_N // WARP_GROUP
    out_regs = BLOCK_H * half // WARP_GROUP
    neg_inf = -T.infinity("float")
    policy = "evict_first" if evict_first else None

    def page_of(block_table, slot, t):
        """The page holding its run's tile t (clamped into the request: tiles past the run
        are masked)."""
        return block_table[slot[0], T.min(T.min(slot[2] + t, slot[5]) * BLOCK_N // page_size,
                                          max_pages - 1)]

    @T.macro
    def load(kv, page, full, slot, dst, col0, buf, t, bar0):
        """The calling warp group loads columns col0.. of its run's tile t, which lies in
        `page`, into dst[buf], a 64-column box a barrier (bar0.. of the buffer's)."""
        row = T.min(slot[2] + t, slot[5]) * BLOCK_N % page_size
        for j in T.unroll(dst.shape[2] // BOX):
            T.tma_copy(kv[page, row:row + BLOCK_N, col0 + j * BOX:col0 + (j + 1) * BOX],
                       dst[buf, :, j * BOX:(j + 1) * BOX],
                       barrier=full[buf * per_buffer + bar0 + j], eviction_policy=policy)
        for j in T.unroll(dst.shape[2] // BOX):
            T.mbarrier_arrive(full[buf * per_buffer + bar0 + j])

    @T.macro
    def prefetch_pages(block_table, slot, pages, i, pe_tile):
        """The pages of the tiles this warp group loads in pair i (the next pair's a and b,
        the rope part of tile pe_tile), read into registers at the top of the pair: read
        at the load, each TMA would wait out a global load's latency first."""
        pages[0] = page_of(block_table, slot, 2 * i + 2)
        pages[1] = page_of(block_table, slot, 2 * i + 3)
        pages[2] = page_of(block_table, slot, pe_tile)

    @T.macro
    def score_latent(q, k, s, full, buf, phase, bar0):
        """Issue S += Q K^T over one latent half of buffer `buf` (both from shared memory),
        a box's product once it has landed; the caller waits."""
        for j in T.unroll(boxes):
            T.mbarrier_wait_parity(full[buf * per_buffer + bar0 + j], phase)
            T.wgmma_gemm(q[:, j * BOX:(j + 1) * BOX], k[buf, :, j * BOX:(j + 1) * BOX], s,
                         transpose_B=True)

    @T.macro
    def score_rope(q_pe_local, pe, s, full, buf, phase):
        """Issue S = q_pe k_pe^T of buffer `buf` (q_pe from registers) once it has landed:
        the first product of every S."""
        T.mbarrier_wait_parity(full[buf * per_buffer + ROPE_BOX], phase)
        T.wgmma_gemm(q_pe_local, pe[buf, :, :], s, transpose_B=True, clear_accum=True)

    @T.macro
    def start(kv, block_table, q_pe, q_full, full, slot, pe, q_pe_local, acc, total, m, s, b,
              h0, buf, q_1, k_1, col_1, box_1, q_2, k_2, col_2, box_2):
        """A warp group's start: all of its first tile loaded (the rope part, then the two
        latent halves in the order its S takes them), q_pe into registers, its state
        cleared; that S once Q has landed, then the next pair's rope part loaded."""
        first = page_of(block_table, slot, buf)
        load(kv, first, full, slot, pe, dim, buf, buf, ROPE_BOX)
        load(kv, first, full, slot, k_1, col_1, buf, buf, box_1)
        load(kv, first, full, slot, k_2, col_2, buf, buf, box_2)
        T.copy(q_pe[b, h0:h0 + BLOCK_H, :], q_pe_local)
        T.fill(acc, 0.0)
        T.fill(total, 0.0)
        T.fill(m, neg_inf)
        T.mbarrier_wait_parity(q_full, 0)
        score_rope(q_pe_local, pe, s, full, buf, 0)
        score_latent(q_1, k_1, s, full, buf, 0, box_1)
        score_latent(q_2, k_2, s, full, buf, 0, box_2)
        T.wait_wgmma(0)
        T.warpgroup_fence_operand(s, num_regs=score_regs)
        if slot[4] > 1:
            load(kv, page_of(block_table, slot, buf + 2), full, slot, pe, dim, buf, buf + 2,
                 ROPE_BOX)

    @T.macro
    def mask(s, slot, t):
        """Keys past the run (t >= its tiles: a pair's missing tile b) or the request: -inf."""
        for i, j in T.Parallel(BLOCK_H, BLOCK_N):
            s[i, j] = T.if_then_else((t < slot[3]) & ((slot[2] + t) * BLOCK_N + j < slot[1]),
                                     s[i, j], neg_inf)

    @T.macro
    def exponentials(s, m_safe, row_sum, c):
        """s <- exp(s - m) (2^, prescaled), and its row sums."""
        for r, j in T.Parallel(BLOCK_H, BLOCK_N):
            s[r, j] = T.exp2((s[r, j] - m_safe[r]) * c)
        T.reduce_sum(s, row_sum, dim=1)

    @T.macro
    def finish(rows, acc, total, m, o, lse, o_part, lse_part, slot_table, b, bz, h0, col0,
               scale, own, other, writes_lse):
        """Both warp groups' row sums added (through rows[own], rows[other]); O / l into o
        (one split) or the fp32 partials; lse from warp group 0."""
        for r in T.Parallel(BLOCK_H):
            rows[own, r] = total[r]
        T.sync_threads(BOTH, consumers)
        for r in T.Parallel(BLOCK_H):
            total[r] += rows[other, r]
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
        with T.Kernel(heads // BLOCK_H, n_slots, threads=consumers) as (hx, bz):
            q_lo = T.alloc_shared((BLOCK_H, half), dtype)
            q_hi = T.alloc_shared((BLOCK_H, half), dtype)
            kv_lo = T.alloc_shared((2, BLOCK_N, half), dtype)
            kv_hi = T.alloc_shared((2, BLOCK_N, half), dtype)
            pe = T.alloc_shared((2, BLOCK_N, rope), dtype)
            p_shared = T.alloc_shared((2, BLOCK_H, BLOCK_N), dtype)
            # rows handed over: m_a (then warp group 0's row sums), m_b (then warp group 1's),
            # e^(m_a - m_b)
            rows = T.alloc_shared((3, BLOCK_H), "float")
            full = T.alloc_barrier([WARP_GROUP] * (2 * per_buffer))
            q_full = T.alloc_barrier([WARP_GROUP])  # Q's latent part landed
            # warp group g's state: its scores, P, O half, q_pe and per-row values
            s = [T.alloc_fragment((BLOCK_H, BLOCK_N), "float") for _ in range(2)]
            p = [T.alloc_fragment((BLOCK_H, BLOCK_N), dtype) for _ in range(2)]
            acc = [T.alloc_fragment((BLOCK_H, half), "float") for _ in range(2)]
            q_pe_local = [T.alloc_fragment((BLOCK_H, rope), dtype) for _ in range(2)]
            m = [T.alloc_fragment((BLOCK_H,), "float") for _ in range(2)]
            m_prev = [T.alloc_fragment((BLOCK_H,), "float") for _ in range(2)]
            m_safe = [T.alloc_fragment((BLOCK_H,), "float") for _ in range(2)]
            rescale = [T.alloc_fragment((BLOCK_H,), "float") for _ in range(2)]
            row_sum = [T.alloc_fragment((BLOCK_H,), "float") for _ in range(2)]
            total = [T.alloc_fragment((BLOCK_H,), "float") for _ in range(2)]
            tx = T.get_thread_binding()
            if slot_table[bz, 0] >= 0:
                # The slot, read once into registers (as expressions of global loads they
                # were reloaded after every barrier wait, a memory clobber).
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
                b, pairs = slot[0], slot[4]
                pages = T.alloc_local((3,), "int32")  # see prefetch_pages
                h0 = hx * BLOCK_H
                c = scale * LOG2E
                # a part of a tile: load(..., dst, its first column, buffer, tile, first box)
                if tx < WARP_GROUP:
                    # Q (the CTA's own heads), then all of tile a
                    T.tma_copy(q_nope[b, h0:h0 + BLOCK_H, 0:half], q_lo, barrier=q_full)
                    T.tma_copy(q_nope[b, h0:h0 + BLOCK_H, half:dim], q_hi, barrier=q_full)
                    T.mbarrier_arrive(q_full)
                    start(kv, block_table, q_pe, q_full, full, slot, pe, q_pe_local[0], acc[0],
                          total[0], m[0], s[0], b, h0, 0, q_lo, kv_lo, 0, LO, q_hi, kv_hi,
                          half, HI)
                    for i in T.serial(pairs):
                        prefetch_pages(block_table, slot, pages, i, 2 * i + 4)
                        mask(s[0], slot, 2 * i)
                        T.copy(m[0], m_prev[0])
                        T.reduce_max(s[0], m[0], dim=1, clear=False)  # m_a
                        for r in T.Parallel(BLOCK_H):
                            rows[0, r] = m[0][r]
                            m_safe[0][r] = T.if_then_else(m[0][r] == neg_inf, 0.0, m[0][r])
                            rescale[0][r] = T.exp2((m_prev[0][r] - m_safe[0][r]) * c)
                        T.named_barrier_arrive(M_A_READY, consumers)
                        exponentials(s[0], m_safe[0], row_sum[0], c)
                        for r in T.Parallel(BLOCK_H):
                            total[0][r] = total[0][r] * rescale[0][r] + row_sum[0][r]
                        T.copy(s[0], p[0])
                        for r, d in T.Parallel(BLOCK_H, half):
                            acc[0][r, d] *= rescale[0][r]
                        T.wgmma_gemm(p[0], kv_lo[0, :, :], acc[0])  # P_a V_a,lo
                        T.wait_wgmma(0)
                        T.warpgroup_fence_operand(acc[0], num_regs=out_regs)
                        if i + 1 < pairs:
                            load(kv, pages[0], full, slot, kv_lo, 0, 0, 2 * i + 2, LO)
                        T.sync_threads(M_B_READY, consumers)  # m_b, e^(m_a - m_b)
                        for r in T.Parallel(BLOCK_H):
                            rescale[0][r] = rows[2, r]
                            m[0][r] = rows[1, r]
                            total[0][r] *= rescale[0][r]
                        # P_a for warp group 1, at m_b
                        for r, j in T.Parallel(BLOCK_H, BLOCK_N):
                            p_shared[0, r, j] = T.cast(s[0][r, j] * rescale[0][r], dtype)
                        T.fence_proxy_async()
                        T.named_barrier_arrive(P_A_READY, consumers)
                        for r, d in T.Parallel(BLOCK_H, half):
                            acc[0][r, d] *= rescale[0][r]
                        T.sync_threads(P_B_READY, consumers)
                        T.wgmma_gemm(p_shared[1, :, :], kv_lo[1, :, :], acc[0])  # P_b V_b,lo
                        if i + 1 < pairs:  # S_a of the next pair behind it
                            score_rope(q_pe_local[0], pe, s[0], full, 0, (i + 1) & 1)
                            score_latent(q_lo, kv_lo, s[0], full, 0, (i + 1) & 1, LO)
                            T.wait_wgmma(boxes + 1)  # P_b V_b,lo done
                            load(kv, pages[1], full, slot, kv_lo, 0, 1, 2 * i + 3, LO)
                            score_latent(q_hi, kv_hi, s[0], full, 0, (i + 1) & 1, HI)
                        T.wait_wgmma(0)
                        T.warpgroup_fence_operand(acc[0], num_regs=out_regs)
                        T.warpgroup_fence_operand(s[0], num_regs=score_regs)
                        if i + 2 < pairs:
                            load(kv, pages[2], full, slot, pe, dim, 0, 2 * i + 4, ROPE_BOX)
                    finish(rows, acc[0], total[0], m[0], o, lse, o_part, lse_part, slot_table,
                           b, bz, h0, 0, scale, 0, 1, True)
                else:
                    start(kv, block_table, q_pe, q_full, full, slot, pe, q_pe_local[1], acc[1],
                          total[1], m[1], s[1], b, h0, 1, q_hi, kv_hi, half, HI, q_lo, kv_lo,
                          0, LO)
                    for i in T.serial(pairs):
                        prefetch_pages(block_table, slot, pages, i, 2 * i + 5)
                        mask(s[1], slot, 2 * i + 1)
                        T.reduce_max(s[1], row_sum[1], dim=1)  # tile b's own row max
                        T.sync_threads(M_A_READY, consumers)
                        for r in T.Parallel(BLOCK_H):
                            m_prev[1][r] = m[1][r]
                            m[1][r] = T.max(rows[0, r], row_sum[1][r])  # m_b
                            m_safe[1][r] = T.if_then_else(m[1][r] == neg_inf, 0.0, m[1][r])
                            rows[1, r] = m[1][r]
                            # e^(m_a - m_b) for warp group 0, e^(m - m_b) for this one
                            rows[2, r] = T.exp2((rows[0, r] - m_safe[1][r]) * c)
                            rescale[1][r] = T.exp2((m_prev[1][r] - m_safe[1][r]) * c)
                        T.named_barrier_arrive(M_B_READY, consumers)
                        exponentials(s[1], m_safe[1], row_sum[1], c)
                        for r in T.Parallel(BLOCK_H):
                            total[1][r] = total[1][r] * rescale[1][r] + row_sum[1][r]
                        T.copy(s[1], p[1])
                        T.copy(p[1], p_shared[1, :, :])
                        T.fence_proxy_async()
                        T.named_barrier_arrive(P_B_READY, consumers)
                        for r, d in T.Parallel(BLOCK_H, half):
                            acc[1][r, d] *= rescale[1][r]
                        T.wgmma_gemm(p[1], kv_hi[1, :, :], acc[1])  # P_b V_b,hi
                        T.sync_threads(P_A_READY, consumers)
                        T.wgmma_gemm(p_shared[0, :, :], kv_hi[0, :, :], acc[1])  # P_a V_a,hi
                        if i + 1 < pairs:  # refills, then S_b of the next pair
                            T.wait_wgmma(1)
                            load(kv, pages[1], full, slot, kv_hi, half, 1, 2 * i + 3, HI)
                            T.wait_wgmma(0)
                            load(kv, pages[0], full, slot, kv_hi, half, 0, 2 * i + 2, HI)
                            score_rope(q_pe_local[1], pe, s[1], full, 1, (i + 1) & 1)
                            score_latent(q_hi, kv_hi, s[1], full, 1, (i + 1) & 1, HI)
                            score_latent(q_lo, kv_lo, s[1], full, 1, (i + 1) & 1, LO)
                        T.wait_wgmma(0)
                        T.warpgroup_fence_operand(acc[1], num_regs=out_regs)
                        T.warpgroup_fence_operand(s[1], num_regs=score_regs)
                        if i + 2 < pairs:
                            load(kv, pages[2], full, slot, pe, dim, 1, 2 * i + 5, ROPE_BOX)
                    finish(rows, acc[1], total[1], m[1], o, lse, o_part, lse_part, slot_table,
                           b, bz, h0, half, scale, 1, 0, False)

    return mla_decode_seesaw
