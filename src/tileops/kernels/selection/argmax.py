"""Row argmax over the last dim of logits [batch, vocab] (greedy decoding).

Pass 1 splits each row into `splits` chunks, one CTA each, so that batch 1 over a 256K
vocabulary still spreads over the SMs. A thread reads `vecs` 16-byte vectors of its chunk
(all loads first, then the compares), keeps its largest element by a plain fp32 compare
(`track_best`), turns it into a key (see `order`: NaN highest, ties to the lower index, as
torch), and the CTA reduces the keys through warp shuffles and shared memory.
With one chunk per row the CTA writes the index. Otherwise the row's CTAs meet in one
launch (no merge pass: a second launch cost ~6 us of host time per call, most of the gap to
torch.argmax): each CTA's thread 0 folds its chunk's key into the row's slot by an atomic
max, then counts itself in with an acquire-release atomic add; the CTA that arrives last
sees every other chunk's key, writes the index, and zeroes both slots for the next launch
(`workspace.zeroed_scratch`, one buffer per stream). The batch is symbolic.
"""

from dataclasses import dataclass
from typing import Any

import tilelang.language as T

from ..base import Kernel
from ..vectors import vector_width
from ..workspace import zeroed_scratch
from .order import best_key, index_of, larger, track_best


def split_count(vocab: int, dtype: str, threads: int, vecs: int) -> int:
    """Chunks per row: each CTA covers threads * vecs vectors."""
    row_vecs = vocab // vector_width(vocab, dtype)
    return -(-row_vecs // (threads * vecs))


@dataclass(frozen=True)
class ArgmaxConfig:
    threads: int = 256
    vecs: int = 4  # 16-byte vectors per thread


@T.macro
def reduce_block_max(best, other, red_shared, tx, warps):
    """Every thread ends with the CTA's largest key in best[0]."""
    for o in T.unroll(5):
        other[0] = T.shfl_xor(best[0], 16 >> o)
        best[0] = larger(best[0], other[0])
    if tx % 32 == 0:
        red_shared[tx // 32] = best[0]
    T.sync_threads()
    best[0] = red_shared[0]
    for w in T.unroll(1, warps):
        best[0] = larger(best[0], red_shared[w])


def argmax_programs(vocab: int, dtype: str, threads: int, vecs: int):
    """The one prim_func (rows of one chunk, or chunks meeting by atomics); the batch is
    symbolic."""
    batch = T.dynamic("batch")
    vec = vector_width(vocab, dtype)
    row_vecs = vocab // vec
    chunk_vecs = threads * vecs
    splits = split_count(vocab, dtype, threads, vecs)
    warps = threads // 32

    @T.macro
    def chunk_best(logits, b, s, tx, best):
        x_local = T.alloc_local((vecs, vec), dtype)
        for i in T.unroll(vecs):
            v = s * chunk_vecs + i * threads + tx
            if v < row_vecs:
                for j in T.vectorized(vec):
                    x_local[i, j] = logits[b, v * vec + j]
        best_val = T.alloc_local((1,), "float32")
        best_idx = T.alloc_local((1,), "int32")
        best_val[0] = T.float32(0)
        best_idx[0] = -1
        for i in T.unroll(vecs):
            v = s * chunk_vecs + i * threads + tx
            if v < row_vecs:
                for j in T.unroll(vec):
                    track_best(T.cast(x_local[i, j], "float32"), v * vec + j, best_val, best_idx)
        best[0] = best_key(best_val, best_idx, dtype, vocab)

    if splits == 1:
        @T.prim_func
        def argmax_rows(logits: T.Tensor((batch, vocab), dtype),
                        out: T.Tensor((batch,), "int64")):
            with T.Kernel(batch, threads=threads) as b:
                tx = T.get_thread_binding()
                best = T.alloc_local((1,), "uint64")
                other = T.alloc_local((1,), "uint64")
                red_shared = T.alloc_shared((warps,), "uint64")
                chunk_best(logits, b, 0, tx, best)
                reduce_block_max(best, other, red_shared, tx, warps)
                if tx == 0:
                    out[b] = index_of(best[0], vocab)
        return (argmax_rows,)

    slots = T.dynamic("slots")

    @T.prim_func
    def argmax_chunks(logits: T.Tensor((batch, vocab), dtype),
                      scratch: T.Tensor((2, slots), "uint64"),
                      out: T.Tensor((batch,), "int64")):
        # scratch[0, b]: the best key of row b's chunks so far; scratch[1, b]: how many of
        # its chunks are in. Zero before the launch and after it.
        with T.Kernel(splits, batch, threads=threads) as (s, b):
            tx = T.get_thread_binding()
            best = T.alloc_local((1,), "uint64")
            other = T.alloc_local((1,), "uint64")
            arrived = T.alloc_local((1,), "uint64")
            red_shared = T.alloc_shared((warps,), "uint64")
            chunk_best(logits, b, s, tx, best)
            reduce_block_max(best, other, red_shared, tx, warps)
            if tx == 0:
                T.atomic_max(scratch[0, b], best[0])
                # release: our key is in before we count; acquire: the last sees every key
                arrived[0] = T.atomic_add(scratch[1, b], T.uint64(1), memory_order="acq_rel",
                                          return_prev=True)
                if arrived[0] == T.uint64(splits - 1):
                    best[0] = T.atomic_max(scratch[0, b], T.uint64(0), memory_order="acquire",
                                           return_prev=True)
                    out[b] = index_of(best[0], vocab)
                    scratch[0, b] = T.uint64(0)
                    scratch[1, b] = T.uint64(0)

    return (argmax_chunks,)


class ArgmaxKernel(Kernel):
    """key: dtype, vocab. Buckets by batch: `small` (few rows: small chunks, many splits, so
    the grid still fills the SMs) and `large` (long chunks: fewer CTAs meeting per row)."""

    name = "argmax"
    Config = ArgmaxConfig

    def program(self, config: ArgmaxConfig, bucket: str):
        return argmax_programs(self.key["vocab"], self.key["dtype"], config.threads,
                               config.vecs)

    def splits(self, config: ArgmaxConfig) -> int:
        return split_count(self.key["vocab"], self.key["dtype"], config.threads, config.vecs)

    def run(self, config: ArgmaxConfig, compiled: tuple, logits, out) -> None:
        if self.splits(config) == 1:
            compiled[0](logits, out)
            return
        import torch

        scratch = zeroed_scratch(logits.device, 2, logits.shape[0], torch.uint64)
        compiled[0](logits, scratch, out)

    def direct_call(self, config: ArgmaxConfig, compiled: tuple,
                    size: int) -> tuple[Any, tuple]:
        if self.splits(config) == 1:
            return compiled[0], ()
        import torch

        exe, uint64 = compiled[0], torch.uint64

        def split_rows(logits, out) -> None:  # run's split branch, the row count bound
            exe(logits, zeroed_scratch(logits.device, 2, size, uint64), out)
        return split_rows, ()

    def bucket_of(self, batch: int) -> str:
        return "small" if batch <= 16 else "large"

    def heuristic_config(self, bucket: str, arch: str) -> ArgmaxConfig:
        # Loads in flight per thread: 2 x 16 B for few rows (the chunks are short so a 256K
        # row makes ~128 CTAs), 4 x 16 B otherwise (rows alone fill the SMs).
        if bucket == "small":
            return ArgmaxConfig(threads=128, vecs=2)
        return ArgmaxConfig(threads=256, vecs=4)

    def config_space(self, bucket: str) -> list[ArgmaxConfig]:
        space = [self.heuristic_config(bucket, "sm_90a")]
        for threads in (128, 256, 512):
            for vecs in (1, 2, 4, 8):
                space.append(ArgmaxConfig(threads, vecs))
        return list(dict.fromkeys(space))
