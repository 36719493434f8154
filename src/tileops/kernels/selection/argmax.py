"""Row argmax over the last dim of logits [batch, vocab] (greedy decoding).

Pass 1 splits each row into `splits` chunks, one CTA each, so that batch 1 over a 256K
vocabulary still spreads over the SMs. A thread reads `vecs` 16-byte vectors of its chunk
(all loads first, then the compares), keeps its largest element by a plain fp32 compare
(`track_best`), turns it into a key (see `order`: NaN highest, ties to the lower index, as
torch), and the CTA reduces the keys through warp shuffles and shared memory.
With one chunk per row pass 1 writes the index; otherwise it writes each chunk's key (the
uint64 bits in an int64 workspace) and pass 2 (one warp-group per row) reduces the `splits`
keys. The batch is symbolic.
"""

from dataclasses import dataclass

import tilelang.language as T

from ..base import Kernel
from ..vectors import vector_width
from .order import best_key, index_of, larger, track_best

MERGE_THREADS = 128


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
    """(pass 1,) or (pass 1, pass 2) prim_funcs; the batch is symbolic."""
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

    @T.prim_func
    def argmax_chunks(logits: T.Tensor((batch, vocab), dtype),
                      partial: T.Tensor((batch, splits), "int64")):
        with T.Kernel(splits, batch, threads=threads) as (s, b):
            tx = T.get_thread_binding()
            best = T.alloc_local((1,), "uint64")
            other = T.alloc_local((1,), "uint64")
            red_shared = T.alloc_shared((warps,), "uint64")
            chunk_best(logits, b, s, tx, best)
            reduce_block_max(best, other, red_shared, tx, warps)
            if tx == 0:
                partial[b, s] = T.cast(best[0], "int64")  # bit-preserving

    @T.prim_func
    def argmax_merge(partial: T.Tensor((batch, splits), "int64"),
                     out: T.Tensor((batch,), "int64")):
        with T.Kernel(batch, threads=MERGE_THREADS) as b:
            tx = T.get_thread_binding()
            best = T.alloc_local((1,), "uint64")
            other = T.alloc_local((1,), "uint64")
            red_shared = T.alloc_shared((MERGE_THREADS // 32,), "uint64")
            best[0] = T.uint64(0)
            for i in T.serial(T.ceildiv(splits, MERGE_THREADS)):
                if i * MERGE_THREADS + tx < splits:
                    best[0] = larger(best[0], T.cast(partial[b, i * MERGE_THREADS + tx], "uint64"))
            reduce_block_max(best, other, red_shared, tx, MERGE_THREADS // 32)
            if tx == 0:
                out[b] = index_of(best[0], vocab)

    return argmax_chunks, argmax_merge


class ArgmaxKernel(Kernel):
    """key: dtype, vocab. Buckets by batch: `small` (few rows: small chunks, many splits, so
    the grid still fills the SMs) and `large` (long chunks: fewer partial keys to merge)."""

    name = "argmax"
    Config = ArgmaxConfig

    def program(self, config: ArgmaxConfig, bucket: str):
        return argmax_programs(self.key["vocab"], self.key["dtype"], config.threads,
                               config.vecs)

    def splits(self, config: ArgmaxConfig) -> int:
        return split_count(self.key["vocab"], self.key["dtype"], config.threads, config.vecs)

    def run(self, config: ArgmaxConfig, compiled: tuple, logits, out) -> None:
        if len(compiled) == 1:
            compiled[0](logits, out)
            return
        import torch

        # the chunks' keys (uint64 bits in int64): every slot is written by pass 1
        partial = torch.empty((logits.shape[0], self.splits(config)), dtype=torch.int64,
                              device=logits.device)
        compiled[0](logits, partial)
        compiled[1](partial, out)

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
