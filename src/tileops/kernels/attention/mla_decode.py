"""MLA decode (DeepSeek-V2/V3, absorbed form) over a paged latent cache, split-KV.

q_nope [B, H, Dc] (the queries already multiplied by W_UK), q_pe [B, H, Dr], one latent
cache kv [num_pages, page_size, Dc + Dr] (the compressed KV c, then the rope key k_pe),
block_table [B, max_pages], cache_seqlens [B]. Every head attends over the same latent
rows: s = (q_nope . c + q_pe . k_pe) * sm_scale, o = softmax(s) @ c, o [B, H, Dc] (then
multiplied by W_UV outside). DeepSeek-V3: H = 128 (per GPU without TP), Dc = 512, Dr = 64,
pages of 64 tokens.

A CTA owns 64 heads of one request and one run of its key tiles (the planned decode's
slots: `decode.schedule_program` splits each request's tiles on the GPU, the planned
combine merges the runs). Two consumer warpgroups split both GEMMs by columns (FullCol):
S = Q K^T gives each half of the 64 key columns, P goes through shared memory so that
each warpgroup's P V covers 256 of the 512 output columns with every key (the 64 x 512
fp32 accumulator is 128 registers per thread). A TMA producer streams each 64-key tile as
its latent part (the P V operand too) and its rope part.
"""

from dataclasses import dataclass

import tilelang.language as T

from ..base import Kernel
from .attention_fwd import LOG2E
from .decode import combine_program, schedule_program
from .mla_decode_seesaw import BLOCK_N as SEESAW_TILE
from .mla_decode_seesaw import PAIR_KEYS, mla_decode_seesaw_program
from .mla_decode_seesaw import smem_bytes as seesaw_smem_bytes

BLOCK_H = 64  # heads per CTA: one wgmma M tile
# The seesaw (pair runs) is the default for calls whose block table can hold at least this
# many (request, 64 heads, 64-key tile) units of work, with 128 or more heads. H100, against
# the plain program: 1.01-1.18x on DeepSeek-V3's rows from batch 16 x 8K and 32 x 4K (4096
# units) up, but 0.83-0.85x at batch 16-32 x 1K and 0.66-0.89x at batch 1 (runs of a few
# pairs end before the pipeline is under way), and 0.97x with 64 heads (no second CTA
# reading each tile through L2). The table's width bounds the lengths from above: a table
# far wider than the lengths it holds picks the seesaw for short requests.
SEESAW_MIN_UNITS = 4096
SEESAW_MIN_HEADS = 128
# Waves of splits a `fit_waves` schedule may choose from (its partials: batch + that many
# waves of slots; 4 at batch 128 x 128 heads: 103 MB of fp32, against 51 MB for one wave).
FIT_WAVES = 4


@dataclass(frozen=True)
class MLADecodeConfig:
    block_n: int = 64  # keys per tile (within one page)
    stages: int = 2
    # the two consumer warp groups take 64-key tiles in turns (mla_decode_seesaw.py; its
    # tiles are 64 keys in two buffers whatever block_n and stages say)
    seesaw: bool = False
    pair_runs: bool = False  # seesaw only: the schedule deals runs of tile pairs
    evict_first: bool = True  # seesaw only: key tiles load with L2's evict-first hint
    # > 0: the schedule picks its split rule by an estimate of the makespan among one wave
    # rounded up or down and 2 .. fit_waves waves (decode.schedule_program's `fit_waves`;
    # the op's partials then hold that many waves). 0 until measured: built and CPU-checked
    # in the sixty-third session, which had no device.
    fit_waves: int = 0
    # > 0: the combine merges each row in CTAs of this many of Dc's columns (four times the
    # loads in flight at 128; decode.combine_program's `chunk`); 0: whole rows. 0 until
    # measured (sixty-third session, no device).
    combine_cols: int = 0

    def smem_bytes(self, dim: int, rope: int, elem_bytes: int = 2) -> int:
        if self.seesaw:
            return seesaw_smem_bytes(dim, rope, elem_bytes)
        return (BLOCK_H * (dim + rope + self.block_n)
                + self.stages * self.block_n * (dim + rope)) * elem_bytes


def mla_decode_program(heads: int, dim: int, rope: int, page_size: int, dtype: str,
                       config: MLADecodeConfig):
    """The attention over one slot's run of key tiles (see the module docstring): writes
    o [B, 1, H, Dc] and lse [B, H, 1] for a request of one split, else fp32 partials
    o_part [slots, 1, H, Dc] and lse_part [slots, 1, H] for the planned combine.

    H need not be a multiple of 64 (DeepSeek-V3 under tensor parallelism: 16 heads a GPU
    at TP 8, 32 at TP 4): the last block's rows past H load zeros and store nothing (the
    rows are wgmma's M, so those blocks run at the cost of 64 heads: memory-bound at
    16-32 heads all the same)."""
    batch, n_pages, max_pages, n_slots = T.dynamic("batch, n_pages, max_pages, n_slots")
    block_n, stages = config.block_n, config.stages
    assert page_size % block_n == 0
    ragged = heads % BLOCK_H != 0  # the last block's rows past H are masked

    def real_head(h0, i):  # whether row i of the block at head h0 is one of the H heads
        return h0 + i < heads if ragged else True

    @T.prim_func
    def mla_decode(q_nope: T.Tensor((batch, heads, dim), dtype),
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
        with T.Kernel(T.ceildiv(heads, BLOCK_H), n_slots, threads=256) as (hx, bz):
            q_shared = T.alloc_shared((BLOCK_H, dim), dtype)
            q_pe_shared = T.alloc_shared((BLOCK_H, rope), dtype)
            kv_shared = T.alloc_shared((block_n, dim), dtype)
            pe_shared = T.alloc_shared((block_n, rope), dtype)
            p_shared = T.alloc_shared((BLOCK_H, block_n), dtype)
            s = T.alloc_fragment((BLOCK_H, block_n), "float")
            acc = T.alloc_fragment((BLOCK_H, dim), "float")
            m = T.alloc_fragment((BLOCK_H,), "float")
            m_prev = T.alloc_fragment((BLOCK_H,), "float")
            m_safe = T.alloc_fragment((BLOCK_H,), "float")
            rescale = T.alloc_fragment((BLOCK_H,), "float")
            row_sum = T.alloc_fragment((BLOCK_H,), "float")
            total = T.alloc_fragment((BLOCK_H,), "float")
            # the slot's request and run of tiles are global loads, not registers set
            # before the key loop (warp specialization copies local state per role)
            if slot_table[bz, 0] >= 0:
                b = slot_table[bz, 0]
                seqlen = cache_seqlens[b]
                h0 = hx * BLOCK_H
                if ragged:
                    for i, d in T.Parallel(BLOCK_H, dim):
                        q_shared[i, d] = T.if_then_else(real_head(h0, i), q_nope[
                            b, T.min(h0 + i, heads - 1), d], T.cast(0, dtype))
                    for i, d in T.Parallel(BLOCK_H, rope):
                        q_pe_shared[i, d] = T.if_then_else(real_head(h0, i), q_pe[
                            b, T.min(h0 + i, heads - 1), d], T.cast(0, dtype))
                else:
                    T.copy(q_nope[b, h0:h0 + BLOCK_H, :], q_shared)
                    T.copy(q_pe[b, h0:h0 + BLOCK_H, :], q_pe_shared)
                T.fill(acc, 0.0)
                T.fill(total, 0.0)
                T.fill(m, -T.infinity("float"))
                # the run cut to the request's tiles now (the last run is open-ended: a
                # stale schedule stays exact, see decode.schedule_program)
                mine = T.max(T.min(slot_table[bz, 2],
                                   T.ceildiv(seqlen, block_n) - slot_table[bz, 1]), 0)
                for t in T.Pipelined(T.max(mine, 1), num_stages=stages):
                    # an empty run walks one masked tile inside the request's pages
                    tile = T.min(slot_table[bz, 1] + t,
                                 T.max(T.ceildiv(seqlen, block_n) - 1, 0))
                    page = block_table[b, T.min(tile * block_n // page_size, max_pages - 1)]
                    row = tile * block_n % page_size
                    T.copy(kv[page, row:row + block_n, 0:dim], kv_shared)
                    T.copy(kv[page, row:row + block_n, dim:dim + rope], pe_shared)
                    T.gemm(q_shared, kv_shared, s, transpose_B=True, clear_accum=True,
                           policy=T.GemmWarpPolicy.FullCol)
                    T.gemm(q_pe_shared, pe_shared, s, transpose_B=True,
                           policy=T.GemmWarpPolicy.FullCol)
                    for i, j in T.Parallel(BLOCK_H, block_n):
                        s[i, j] = T.if_then_else(
                            (t < mine) & ((slot_table[bz, 1] + t) * block_n + j < seqlen),
                            s[i, j], -T.infinity("float"))
                    T.copy(m, m_prev)
                    T.reduce_max(s, m, dim=1, clear=False)
                    for i in T.Parallel(BLOCK_H):
                        m_safe[i] = T.if_then_else(m[i] == -T.infinity("float"), 0.0, m[i])
                        rescale[i] = T.exp2((m_prev[i] - m_safe[i]) * (scale * LOG2E))
                    for i, j in T.Parallel(BLOCK_H, block_n):
                        s[i, j] = T.exp2((s[i, j] - m_safe[i]) * (scale * LOG2E))
                    T.reduce_sum(s, row_sum, dim=1)
                    for i in T.Parallel(BLOCK_H):
                        total[i] = total[i] * rescale[i] + row_sum[i]
                    T.copy(s, p_shared)
                    for i, d in T.Parallel(BLOCK_H, dim):
                        acc[i, d] = acc[i, d] * rescale[i]
                    T.gemm(p_shared, kv_shared, acc, policy=T.GemmWarpPolicy.FullCol)
                if slot_table[bz, 3] == 1:
                    for i, d in T.Parallel(BLOCK_H, dim):
                        if real_head(h0, i):
                            o[b, 0, h0 + i, d] = T.if_then_else(
                                total[i] > 0, acc[i, d] / total[i], 0.0)
                    for i in T.Parallel(BLOCK_H):
                        if real_head(h0, i):
                            lse[b, h0 + i, 0] = T.if_then_else(
                                total[i] > 0, m_safe[i] * scale + T.log(total[i]),
                                -T.infinity("float"))
                else:
                    for i, d in T.Parallel(BLOCK_H, dim):
                        if real_head(h0, i):
                            o_part[bz, 0, h0 + i, d] = T.if_then_else(
                                total[i] > 0, acc[i, d] / total[i], 0.0)
                    for i in T.Parallel(BLOCK_H):
                        if real_head(h0, i):
                            lse_part[bz, 0, h0 + i] = T.if_then_else(
                                total[i] > 0, m_safe[i] * scale + T.log(total[i]),
                                -T.infinity("float"))

    return mla_decode


class MLADecodeKernel(Kernel):
    """key: dtype, heads, dim (Dc), rope (Dr), page_size. Programs: the schedule (one
    64-key tile = one unit of work), the attention, the planned combine. Buckets by the
    work the call's block table can hold: "short" (the plain program), "long" (the seesaw
    where it pays, see SEESAW_MIN_UNITS)."""

    name = "mla_decode"
    Config = MLADecodeConfig
    workspace_args = frozenset({6, 7, 10, 11})  # slot_table, split_ends, o_part, lse_part

    def program(self, config: MLADecodeConfig, bucket: str):
        k = self.key
        attention = (mla_decode_seesaw_program(k["heads"], k["dim"], k["rope"], k["page_size"],
                                               k["dtype"], config.pair_runs,
                                               config.evict_first)
                     if config.seesaw else
                     mla_decode_program(k["heads"], k["dim"], k["rope"], k["page_size"],
                                        k["dtype"], config))
        # the seesaw's tiles are 64 keys whatever block_n says; its runs pairs or tiles
        unit = ((PAIR_KEYS if config.pair_runs else SEESAW_TILE) if config.seesaw
                else config.block_n)
        return (schedule_program(1, unit, -1, True, config.fit_waves), attention,
                combine_program(k["heads"], k["dim"], 1, k["dtype"], planned=True,
                                chunk=config.combine_cols or None))

    def bucket_of(self, size: int) -> str:
        """`size`: (request, 64 heads) slots x the block table's 64-key tiles."""
        return "long" if size >= SEESAW_MIN_UNITS else "short"

    def heuristic_config(self, bucket: str, arch: str) -> MLADecodeConfig:
        if bucket == "long" and self.key["heads"] >= SEESAW_MIN_HEADS and self.seesaw_fits():
            return MLADecodeConfig(seesaw=True, pair_runs=True)
        # 64 KB of latent keys per stage, two stages: 224 KB of shared memory with Q
        return MLADecodeConfig(block_n=64, stages=2)

    def seesaw_fits(self) -> bool:
        # its rope part is one 64-column box, its latent halves 64-column boxes
        return self.key["rope"] == 64 and self.key["dim"] % 128 == 0 and \
            self.key["heads"] % BLOCK_H == 0 and \
            MLADecodeConfig(seesaw=True).smem_bytes(self.key["dim"], 64) <= 227 * 1024 - 1024

    def config_space(self, bucket: str) -> list[MLADecodeConfig]:
        space = [MLADecodeConfig(64, 2), MLADecodeConfig(64, 1), MLADecodeConfig(32, 2),
                 MLADecodeConfig(32, 3), MLADecodeConfig(64, 2, seesaw=True),
                 MLADecodeConfig(64, 2, seesaw=True, pair_runs=True),
                 MLADecodeConfig(64, 2, seesaw=True, evict_first=False),
                 MLADecodeConfig(64, 2, seesaw=True, pair_runs=True, fit_waves=FIT_WAVES),
                 MLADecodeConfig(64, 2, combine_cols=128),
                 MLADecodeConfig(64, 2, fit_waves=FIT_WAVES)]
        if not self.seesaw_fits():
            space = [c for c in space if not c.seesaw]
        return [c for c in space if c.smem_bytes(self.key["dim"], self.key["rope"])
                <= 227 * 1024 - 1024]

    def split_waves(self, size: int) -> int:
        """Waves of slots the partials must hold for a call of `size` (its config's
        `fit_waves`; a tuning kernel's candidates may take up to FIT_WAVES, and the schedule
        never takes more slots than the buffers hold)."""
        if self.tune:
            return FIT_WAVES
        found = self._by_bucket.get(self.bucket_of(size))
        config = found[0] if found is not None else self.config_for(self.bucket_of(size))
        return max(1, config.fit_waves)

    def run(self, config: MLADecodeConfig, compiled: tuple, schedule: bool, q_nope, q_pe, kv,
            block_table, cache_seqlens, slot_table, split_ends, o, lse, o_part, lse_part,
            target: int, scale: float) -> None:
        """With `schedule`, recomputes the split counts from cache_seqlens first; q_nope
        None: the schedule only (`MLADecodePlan.schedule`)."""
        if schedule:
            compiled[0](cache_seqlens, slot_table, split_ends, target)
        if q_nope is None:
            return
        compiled[1](q_nope, q_pe, kv, block_table, cache_seqlens, slot_table, o, lse, o_part,
                    lse_part, scale)
        compiled[2](o_part, lse_part, slot_table, split_ends, o, lse)
