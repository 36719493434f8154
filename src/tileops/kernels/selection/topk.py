"""Row top-k over the last dim of logits [batch, vocab] for sampling: values sorted
descending with int64 indices, ties to the lower index (see `order`).

Every element has a distinct 64-bit key (`order`), so a top-k is the set of keys at or above
the k-th largest key, which a radix select finds bit by bit with one `__syncthreads_count`
per bit (bits that never differ within a row are skipped; it stops as soon as the keys left
in range are exactly the ones still needed).

Pass 1: each CTA owns a chunk of `threads * vecs` 16-byte vectors of a row (a row is split
so that a few rows still fill the SMs). Each thread finds its largest element with plain
fp32 compares; the k-th largest of those thread maxima is a lower bound of the chunk's k-th
largest key (they are k distinct elements of the chunk), so only the elements at or above
it can be in the top-k, and they live in at most k threads: they are appended to a shared
buffer of k * elements-per-thread keys, which is then selected exactly. The chunk's top-k
keys go to a candidate buffer, or, when a row has one chunk, straight to the output.
Pass 2 (one CTA per row) runs the same selection over the candidates of every chunk, then
ranks the k winners (k compares each) and writes them in order, reading the values back
from the logits so that they are bit-exact (NaN payloads, -0.0).
"""

from dataclasses import dataclass

import tilelang.language as T

from ..base import Kernel
from .argmax import vector_width
from .order import (
    EMPTY,
    best_key,
    index_of,
    key_of,
    track_best,
    varying_bits,
)

MAX_K = 128
K_CAPS = (8, 64, MAX_K)  # k is runtime; the buffers are sized for the next cap up
MAX_MERGE_SLOTS_PER_THREAD = 32  # candidate keys per pass-2 thread (two registers each)


def k_cap_of(k: int) -> int:
    return next(c for c in K_CAPS if k <= c)


@dataclass(frozen=True)
class TopkConfig:
    threads: int = 256  # pass 1
    vecs: int = 4  # 16-byte vectors per pass-1 thread
    merge_threads: int = 256  # pass 2


def split_count(vocab: int, dtype: str, threads: int, vecs: int) -> int:
    row_vecs = vocab // vector_width(vocab, dtype)
    return -(-row_vecs // (threads * vecs))


@T.macro
def select_threshold(keys_shared, n, k, tx, threads, mask, prefix, k_rem, n_in, done, count,
                     want):
    """Sets prefix[0] so that exactly min(k, non-empty keys) of keys_shared[:n] are >= it.

    Keys the radix walk has not split yet form the range [prefix, prefix + 2^bit); n_in of
    them, of which k_rem are still wanted. Every thread computes the same values from the
    barrier counts, so the branches are uniform.
    """
    count[0] = 0
    for r in T.serial(T.ceildiv(n, threads)):
        count[0] = count[0] + T.syncthreads_count(
            r * threads + tx < n and keys_shared[r * threads + tx] != T.uint64(EMPTY))
    prefix[0] = T.uint64(0)
    k_rem[0] = k
    n_in[0] = n
    done[0] = 0
    if count[0] <= k:  # every non-empty key is in (keys are >= 1)
        prefix[0] = T.uint64(1)
        done[0] = 1
    for t in T.serial(64):
        if done[0] == 0 and ((T.uint64(mask) >> T.cast(63 - t, "uint64")) & T.uint64(1)) != \
                T.uint64(0):
            want[0] = prefix[0] | (T.uint64(1) << T.cast(63 - t, "uint64"))
            count[0] = 0
            for r in T.serial(T.ceildiv(n, threads)):
                count[0] = count[0] + T.syncthreads_count(
                    r * threads + tx < n
                    and (keys_shared[r * threads + tx] >> T.cast(63 - t, "uint64"))
                    == (want[0] >> T.cast(63 - t, "uint64")))
            if count[0] >= k_rem[0]:
                prefix[0] = want[0]
                n_in[0] = count[0]
            else:
                k_rem[0] = k_rem[0] - count[0]
                n_in[0] = n_in[0] - count[0]
            if n_in[0] == k_rem[0]:
                done[0] = 1


@T.macro
def exclusive_offsets(count, tx, threads, warp_sums, offset, total):
    """offset[0] = the sum of count[0] over the threads before this one; total[0] = over all.

    A warp scan through shuffles, then the warps' sums through shared memory.
    """
    other = T.alloc_local((1,), "int32")
    offset[0] = count[0]
    for o in T.unroll(5):
        other[0] = T.shfl_up(offset[0], 1 << o)
        offset[0] = offset[0] + T.if_then_else(tx % 32 >= (1 << o), other[0], 0)
    if tx % 32 == 31:
        warp_sums[tx // 32] = offset[0]
    T.sync_threads()
    offset[0] = offset[0] - count[0]
    total[0] = 0
    for w in T.unroll(threads // 32):
        offset[0] = offset[0] + T.if_then_else(w < tx // 32, warp_sums[w], 0)
        total[0] = total[0] + warp_sums[w]


def topk_programs(vocab: int, dtype: str, k_cap: int, threads: int, vecs: int,
                  merge_threads: int):
    """(pass 1,) when a row is one chunk, else (pass 1, pass 2); batch and k are runtime."""
    batch = T.dynamic("batch")
    kk = T.dynamic("k")  # the outputs' k; pass 1 of a split row takes it as a scalar
    vec = vector_width(vocab, dtype)
    row_vecs = vocab // vec
    chunk_vecs = threads * vecs
    per_thread = vecs * vec
    splits = split_count(vocab, dtype, threads, vecs)
    slots = splits * k_cap
    merge_per_thread = -(-slots // merge_threads)
    mask = varying_bits(dtype, vocab)

    @T.macro
    def select_and_emit(buf, n_c, k, tx, n_threads, state, sel_shared, counts):
        """The top-k of buf[:n_c] into sel_shared[:counts[1]] (any order)."""
        prefix, k_rem, n_in, done, count, want, pos = state
        pos[0] = n_c  # a register copy: loop bounds must not read shared memory
        select_threshold(buf, pos[0], k, tx, n_threads, mask, prefix, k_rem, n_in, done,
                         count, want)
        n_in[0] = pos[0]
        for r in T.serial(T.ceildiv(n_in[0], n_threads)):
            if r * n_threads + tx < n_in[0]:
                if buf[r * n_threads + tx] >= prefix[0]:
                    pos[0] = T.atomic_add(counts[1], 1, return_prev=True)
                    sel_shared[pos[0]] = buf[r * n_threads + tx]
        T.sync_threads()

    @T.macro
    def write_sorted(logits, values, indices, b, tx, n_threads, sel_shared, counts, rank):
        """Rank each winner by how many winners beat it (keys are distinct), then write."""
        n_sel = T.alloc_local((1,), "int32")
        n_sel[0] = counts[1]
        for r in T.serial(T.ceildiv(k_cap, n_threads)):
            if r * n_threads + tx < n_sel[0]:
                rank[0] = 0
                for j in T.serial(n_sel[0]):
                    rank[0] = rank[0] + T.if_then_else(
                        sel_shared[j] > sel_shared[r * n_threads + tx], 1, 0)
                indices[b, rank[0]] = index_of(sel_shared[r * n_threads + tx], vocab)
                values[b, rank[0]] = logits[b, index_of(sel_shared[r * n_threads + tx], vocab)]

    @T.macro
    def chunk_candidates(logits, b, s, k, tx, state, keys_shared, buf, counts, warp_sums):
        """Pass 1 up to the exact selection: the chunk's candidates in buf[:n_in[0]]."""
        prefix, k_rem, n_in, done, count, want, pos = state
        x_local = T.alloc_local((vecs, vec), dtype)
        best_val = T.alloc_local((1,), "float32")
        best_idx = T.alloc_local((1,), "int32")
        my_key = T.alloc_local((1,), "uint64")
        key_local = T.alloc_local((1,), "uint64")
        for i in T.unroll(vecs):
            v = s * chunk_vecs + i * threads + tx
            if v < row_vecs:
                for j in T.vectorized(vec):
                    x_local[i, j] = logits[b, v * vec + j]
        best_val[0] = T.float32(0)
        best_idx[0] = -1
        for i in T.unroll(vecs):
            v = s * chunk_vecs + i * threads + tx
            if v < row_vecs:
                for j in T.unroll(vec):
                    track_best(T.cast(x_local[i, j], "float32"), v * vec + j, best_val,
                               best_idx)
        my_key[0] = best_key(best_val, best_idx, dtype, vocab)
        keys_shared[tx] = my_key[0]
        if tx == 0:
            counts[1] = 0
        T.sync_threads()
        select_threshold(keys_shared, threads, k, tx, threads, mask, prefix, k_rem, n_in,
                         done, count, want)
        # Only the (at most k) threads whose maximum made the cut hold candidates: they
        # build keys, count, and write them densely at their offset in the chunk's order.
        count[0] = 0
        if my_key[0] >= prefix[0]:
            for i in T.unroll(vecs):
                v = s * chunk_vecs + i * threads + tx
                if v < row_vecs:
                    for j in T.unroll(vec):
                        key_local[0] = key_of(x_local[i, j], v * vec + j, dtype, vocab)
                        count[0] = count[0] + T.if_then_else(key_local[0] >= prefix[0], 1, 0)
        exclusive_offsets(count, tx, threads, warp_sums, pos, n_in)
        if my_key[0] >= prefix[0]:
            for i in T.unroll(vecs):
                v = s * chunk_vecs + i * threads + tx
                if v < row_vecs:
                    for j in T.unroll(vec):
                        key_local[0] = key_of(x_local[i, j], v * vec + j, dtype, vocab)
                        if key_local[0] >= prefix[0]:
                            buf[pos[0]] = key_local[0]
                            pos[0] = pos[0] + 1
        T.sync_threads()

    @T.macro
    def alloc_state():
        return (T.alloc_local((1,), "uint64"), T.alloc_local((1,), "int32"),
                T.alloc_local((1,), "int32"), T.alloc_local((1,), "int32"),
                T.alloc_local((1,), "int32"), T.alloc_local((1,), "uint64"),
                T.alloc_local((1,), "int32"))

    if splits == 1:
        @T.prim_func
        def topk_rows(logits: T.Tensor((batch, vocab), dtype),
                      values: T.Tensor((batch, kk), dtype),
                      indices: T.Tensor((batch, kk), "int64")):
            with T.Kernel(batch, threads=threads) as b:
                tx = T.get_thread_binding()
                state = alloc_state()
                rank = T.alloc_local((1,), "int32")
                keys_shared = T.alloc_shared((threads,), "uint64")
                buf = T.alloc_shared((k_cap * per_thread,), "uint64")
                sel_shared = T.alloc_shared((k_cap,), "uint64")
                counts = T.alloc_shared((2,), "int32")
                warp_sums = T.alloc_shared((threads // 32,), "int32")
                chunk_candidates(logits, b, 0, kk, tx, state, keys_shared, buf, counts,
                                 warp_sums)
                select_and_emit(buf, state[2][0], kk, tx, threads, state, sel_shared, counts)
                write_sorted(logits, values, indices, b, tx, threads, sel_shared,
                             counts, rank)
        return (topk_rows,)

    @T.prim_func
    def topk_chunks(logits: T.Tensor((batch, vocab), dtype),
                    candidates: T.Tensor((batch, slots), "int64"), k: T.int32):
        with T.Kernel(splits, batch, threads=threads) as (s, b):
            tx = T.get_thread_binding()
            state = alloc_state()
            keys_shared = T.alloc_shared((threads,), "uint64")
            buf = T.alloc_shared((k_cap * per_thread,), "uint64")
            sel_shared = T.alloc_shared((k_cap,), "uint64")
            counts = T.alloc_shared((2,), "int32")
            warp_sums = T.alloc_shared((threads // 32,), "int32")
            chunk_candidates(logits, b, s, k, tx, state, keys_shared, buf, counts, warp_sums)
            select_and_emit(buf, state[2][0], k, tx, threads, state, sel_shared, counts)
            for r in T.serial(T.ceildiv(k_cap, threads)):
                if r * threads + tx < k_cap:  # fewer than k keys leave empty slots
                    candidates[b, s * k_cap + r * threads + tx] = T.cast(T.if_then_else(
                        r * threads + tx < counts[1], sel_shared[r * threads + tx],
                        T.uint64(EMPTY)), "int64")  # bit-preserving

    @T.prim_func
    def topk_merge(logits: T.Tensor((batch, vocab), dtype),
                   candidates: T.Tensor((batch, slots), "int64"),
                   values: T.Tensor((batch, kk), dtype),
                   indices: T.Tensor((batch, kk), "int64")):
        with T.Kernel(batch, threads=merge_threads) as b:
            tx = T.get_thread_binding()
            state = alloc_state()
            rank = T.alloc_local((1,), "int32")
            cand_local = T.alloc_local((merge_per_thread,), "uint64")
            best = T.alloc_local((1,), "uint64")
            keys_shared = T.alloc_shared((merge_threads,), "uint64")
            buf = T.alloc_shared((k_cap * merge_per_thread,), "uint64")
            sel_shared = T.alloc_shared((k_cap,), "uint64")
            counts = T.alloc_shared((2,), "int32")
            warp_sums = T.alloc_shared((merge_threads // 32,), "int32")
            prefix, k_rem, n_in, done, count, want, pos = state
            for i in T.unroll(merge_per_thread):
                cand_local[i] = T.if_then_else(i * merge_threads + tx < slots,
                                               T.cast(candidates[b, i * merge_threads + tx],
                                                      "uint64"),
                                               T.uint64(EMPTY))
            best[0] = cand_local[0]
            for i in T.unroll(1, merge_per_thread):
                best[0] = T.if_then_else(cand_local[i] > best[0], cand_local[i], best[0])
            keys_shared[tx] = best[0]
            if tx == 0:
                counts[1] = 0
            T.sync_threads()
            select_threshold(keys_shared, merge_threads, kk, tx, merge_threads, mask, prefix,
                             k_rem, n_in, done, count, want)
            count[0] = 0
            for i in T.unroll(merge_per_thread):
                count[0] = count[0] + T.if_then_else(cand_local[i] >= prefix[0], 1, 0)
            exclusive_offsets(count, tx, merge_threads, warp_sums, pos, n_in)
            for i in T.unroll(merge_per_thread):
                if cand_local[i] >= prefix[0]:
                    buf[pos[0]] = cand_local[i]
                    pos[0] = pos[0] + 1
            T.sync_threads()
            select_and_emit(buf, n_in[0], kk, tx, merge_threads, state, sel_shared, counts)
            write_sorted(logits, values, indices, b, tx, merge_threads, sel_shared,
                         counts, rank)

    return topk_chunks, topk_merge


class TopkKernel(Kernel):
    """key: dtype, vocab, k_cap (the largest k the buffers hold; k itself is runtime).

    Buckets by batch: `small` (short chunks, so a few rows still fill the SMs) and `large`.
    """

    name = "topk"
    Config = TopkConfig

    def program(self, config: TopkConfig, bucket: str):
        k = self.key
        return topk_programs(k["vocab"], k["dtype"], k["k_cap"], config.threads, config.vecs,
                             config.merge_threads)

    def splits(self, config: TopkConfig) -> int:
        return split_count(self.key["vocab"], self.key["dtype"], config.threads, config.vecs)

    def run(self, config: TopkConfig, compiled: tuple, logits, values, indices) -> None:
        if len(compiled) == 1:
            compiled[0](logits, values, indices)
            return
        import torch

        # each chunk's k_cap best keys (uint64 bits in int64; empty slots are 0)
        candidates = torch.empty((logits.shape[0], self.splits(config) * self.key["k_cap"]),
                                 dtype=torch.int64, device=logits.device)
        compiled[0](logits, candidates, values.shape[1])
        compiled[1](logits, candidates, values, indices)

    def bucket_of(self, batch: int) -> str:
        return "small" if batch <= 16 else "large"

    def heuristic_config(self, bucket: str, arch: str) -> TopkConfig:
        # ~2K elements per CTA for few rows (a 256K row makes ~128 CTAs), ~8K otherwise
        # (fewer candidates to merge); longer chunks when pass 2 would hold too many keys.
        vocab, dtype, k_cap = self.key["vocab"], self.key["dtype"], self.key["k_cap"]
        threads = 256
        vec = vector_width(vocab, dtype)
        vecs = max(1, (2048 if bucket == "small" else 8192) // (threads * vec))
        while split_count(vocab, dtype, threads, vecs) * k_cap > \
                512 * MAX_MERGE_SLOTS_PER_THREAD:
            vecs *= 2
        slots = split_count(vocab, dtype, threads, vecs) * k_cap
        merge_threads = 256 if slots <= 256 * 16 else 512
        return TopkConfig(threads=threads, vecs=vecs, merge_threads=merge_threads)

    def config_space(self, bucket: str) -> list[TopkConfig]:
        space = [self.heuristic_config(bucket, "sm_90a")]
        for vecs in (1, 2, 4, 8):
            config = TopkConfig(256, vecs, 512)
            if split_count(self.key["vocab"], self.key["dtype"], 256, vecs) * \
                    self.key["k_cap"] <= 512 * MAX_MERGE_SLOTS_PER_THREAD:
                space.append(config)
        return list(dict.fromkeys(space))
