"""Token permutation for MoE without padding: a stable counting sort of the (token, k) slots
by expert, and the gather of hidden rows into expert order.

Slot s = t * top_k + j (token t's j-th expert) belongs to bucket b: its local expert
(expert_map[id] with an expert map, else the id), or the extra bucket E for slots whose
expert is not local or whose id is out of range. Rows of expert e are [offsets[e],
offsets[e+1]), in slot order (stable: the result never depends on scheduling); dropped
slots take the rows after offsets[E], which no expert owns. Sizes come from shapes only
(T * top_k rows): nothing is read back to the host.

Programs (chunks of CHUNK slots, one CTA each):
1. `chunk_counts`: each slot's rank among the earlier slots of its chunk with the same
   bucket (kept in row_index until step 3), and the chunk's count per bucket.
2. `bucket_scan`: one CTA per bucket turns its counts over the chunks into exclusive
   prefixes, in place, and writes the bucket's total.
3. `place`: every CTA scans the totals into bucket offsets (CTA 0 writes `offsets`), then
   slot s goes to row offsets[b] + prefix[b, chunk] + rank: row_index[s] = that row (-1
   when dropped) and source[row] = s (-1 on the dropped rows).
4. `gather`: permuted[row_index[s]] = hidden[s // top_k], 16-byte vectors.
"""

from dataclasses import dataclass

import tilelang.language as T

from ..base import Kernel
from ..selection.topk import exclusive_offsets

CHUNK = 512  # slots per CTA in steps 1 and 3; also their thread count (>= MAX_EXPERTS + 1)


@dataclass(frozen=True)
class GatherConfig:
    block_rows: int = 2  # slots per CTA of the gather
    threads: int = 128


def bucket_of(ids, expert_map, t, j, n_experts: int, n_global: int):
    """The bucket of slot (t, j): its local expert, or n_experts when it is dropped."""
    g = ids[t, j]
    if expert_map is None:
        return T.if_then_else(T.And(g >= 0, g < n_experts), g, n_experts)
    local = expert_map[T.max(T.min(g, n_global - 1), 0)]
    valid = T.And(T.And(g >= 0, g < n_global), T.And(local >= 0, local < n_experts))
    return T.if_then_else(valid, local, n_experts)


def sort_programs(n_experts: int, n_global: int, top_k: int, has_map: bool):
    """(chunk_counts, bucket_scan, place) prim_funcs; tokens and chunks are symbolic."""
    tokens, n_chunks = T.dynamic("tokens, n_chunks")
    buckets = n_experts + 1
    warps = CHUNK // 32

    @T.macro
    def count_chunk(ids, expert_map, row_index, counts, c, tx, bucket_shared):
        b = T.alloc_local((1,), "int32")
        acc = T.alloc_local((1,), "int32")
        b[0] = -1
        if c * CHUNK + tx < tokens * top_k:
            b[0] = bucket_of(ids, expert_map, (c * CHUNK + tx) // top_k,
                             (c * CHUNK + tx) % top_k, n_experts, n_global)
        bucket_shared[tx] = b[0]
        T.sync_threads()
        acc[0] = 0
        for i in T.serial(CHUNK):
            acc[0] = acc[0] + T.if_then_else(i < tx and bucket_shared[i] == b[0], 1, 0)
        if b[0] >= 0:
            row_index[(c * CHUNK + tx) // top_k, (c * CHUNK + tx) % top_k] = acc[0]
        if tx < buckets:  # thread e counts bucket e
            acc[0] = 0
            for i in T.serial(CHUNK):
                acc[0] = acc[0] + T.if_then_else(bucket_shared[i] == tx, 1, 0)
            counts[tx, c] = acc[0]

    @T.macro
    def place_chunk(ids, expert_map, totals, counts, offsets, row_index, source, c, tx,
                    base_shared, warp_sums):
        total = T.alloc_local((1,), "int32")
        mine = T.alloc_local((1,), "int32")
        base = T.alloc_local((1,), "int32")
        b = T.alloc_local((1,), "int32")
        row = T.alloc_local((1,), "int32")
        mine[0] = T.if_then_else(tx < buckets, totals[T.min(tx, buckets - 1)], 0)
        exclusive_offsets(mine, tx, CHUNK, warp_sums, base, total)
        if tx < buckets:
            base_shared[tx] = base[0]
            if c == 0:
                offsets[tx] = base[0]
        T.sync_threads()
        if c * CHUNK + tx < tokens * top_k:
            b[0] = bucket_of(ids, expert_map, (c * CHUNK + tx) // top_k,
                             (c * CHUNK + tx) % top_k, n_experts, n_global)
            row[0] = base_shared[b[0]] + counts[b[0], c] + \
                row_index[(c * CHUNK + tx) // top_k, (c * CHUNK + tx) % top_k]
            if b[0] < n_experts:
                source[row[0]] = c * CHUNK + tx
                row_index[(c * CHUNK + tx) // top_k, (c * CHUNK + tx) % top_k] = row[0]
            else:
                source[row[0]] = -1
                row_index[(c * CHUNK + tx) // top_k, (c * CHUNK + tx) % top_k] = -1

    @T.macro
    def scan_bucket(counts, totals, e, tx, warp_sums):
        mine = T.alloc_local((1,), "int32")
        prefix = T.alloc_local((1,), "int32")
        total = T.alloc_local((1,), "int32")
        run = T.alloc_local((1,), "int32")
        run[0] = 0
        for r in T.serial(T.ceildiv(n_chunks, CHUNK)):
            mine[0] = T.if_then_else(r * CHUNK + tx < n_chunks,
                                     counts[e, T.min(r * CHUNK + tx, n_chunks - 1)], 0)
            exclusive_offsets(mine, tx, CHUNK, warp_sums, prefix, total)
            if r * CHUNK + tx < n_chunks:
                counts[e, r * CHUNK + tx] = run[0] + prefix[0]
            run[0] = run[0] + total[0]
            T.sync_threads()  # warp_sums is rewritten by the next round
        if tx == 0:
            totals[e] = run[0]

    if has_map:
        @T.prim_func
        def chunk_counts(ids: T.Tensor((tokens, top_k), "int32"),
                         expert_map: T.Tensor((n_global,), "int32"),
                         row_index: T.Tensor((tokens, top_k), "int32"),
                         counts: T.Tensor((buckets, n_chunks), "int32")):
            with T.Kernel(n_chunks, threads=CHUNK) as c:
                bucket_shared = T.alloc_shared((CHUNK,), "int32")
                count_chunk(ids, expert_map, row_index, counts, c, T.get_thread_binding(),
                            bucket_shared)

        @T.prim_func
        def place(ids: T.Tensor((tokens, top_k), "int32"),
                  expert_map: T.Tensor((n_global,), "int32"),
                  totals: T.Tensor((buckets,), "int32"),
                  counts: T.Tensor((buckets, n_chunks), "int32"),
                  offsets: T.Tensor((buckets,), "int32"),
                  row_index: T.Tensor((tokens, top_k), "int32"),
                  source: T.Tensor((tokens * top_k,), "int32")):
            with T.Kernel(n_chunks, threads=CHUNK) as c:
                base_shared = T.alloc_shared((buckets,), "int32")
                warp_sums = T.alloc_shared((warps,), "int32")
                place_chunk(ids, expert_map, totals, counts, offsets, row_index, source, c,
                            T.get_thread_binding(), base_shared, warp_sums)
    else:
        @T.prim_func
        def chunk_counts(ids: T.Tensor((tokens, top_k), "int32"),
                         row_index: T.Tensor((tokens, top_k), "int32"),
                         counts: T.Tensor((buckets, n_chunks), "int32")):
            with T.Kernel(n_chunks, threads=CHUNK) as c:
                bucket_shared = T.alloc_shared((CHUNK,), "int32")
                count_chunk(ids, None, row_index, counts, c, T.get_thread_binding(),
                            bucket_shared)

        @T.prim_func
        def place(ids: T.Tensor((tokens, top_k), "int32"),
                  totals: T.Tensor((buckets,), "int32"),
                  counts: T.Tensor((buckets, n_chunks), "int32"),
                  offsets: T.Tensor((buckets,), "int32"),
                  row_index: T.Tensor((tokens, top_k), "int32"),
                  source: T.Tensor((tokens * top_k,), "int32")):
            with T.Kernel(n_chunks, threads=CHUNK) as c:
                base_shared = T.alloc_shared((buckets,), "int32")
                warp_sums = T.alloc_shared((warps,), "int32")
                place_chunk(ids, None, totals, counts, offsets, row_index, source, c,
                            T.get_thread_binding(), base_shared, warp_sums)

    @T.prim_func
    def bucket_scan(counts: T.Tensor((buckets, n_chunks), "int32"),
                    totals: T.Tensor((buckets,), "int32")):
        with T.Kernel(buckets, threads=CHUNK) as e:
            warp_sums = T.alloc_shared((warps,), "int32")
            scan_bucket(counts, totals, e, T.get_thread_binding(), warp_sums)

    return chunk_counts, bucket_scan, place


def gather_program(hidden: int, top_k: int, dtype: str, config: GatherConfig,
                   weighted: bool = False):
    """permuted[row_index[t, j]] = x[t] for every slot whose row is not -1; `weighted`
    scales each copy by weights[t, j] (fp32 math): the combine's gradient w.r.t. the expert
    rows."""
    tokens, rows = T.dynamic("tokens, rows")
    block_rows = config.block_rows

    @T.macro
    def body(x, weights, row_index, permuted):
        with T.Kernel(T.ceildiv(tokens * top_k, block_rows), threads=config.threads) as bx:
            for i, h in T.Parallel(block_rows, hidden):
                s = bx * block_rows + i
                if s < tokens * top_k:
                    if row_index[s // top_k, s % top_k] >= 0:
                        if weighted:
                            permuted[row_index[s // top_k, s % top_k], h] = T.cast(
                                T.cast(x[s // top_k, h], "float32")
                                * weights[s // top_k, s % top_k], dtype)
                        else:
                            permuted[row_index[s // top_k, s % top_k], h] = x[s // top_k, h]

    if weighted:
        @T.prim_func
        def gather_weighted(x: T.Tensor((tokens, hidden), dtype),
                            weights: T.Tensor((tokens, top_k), "float32"),
                            row_index: T.Tensor((tokens, top_k), "int32"),
                            permuted: T.Tensor((rows, hidden), dtype)):
            body(x, weights, row_index, permuted)
        return gather_weighted

    @T.prim_func
    def gather(x: T.Tensor((tokens, hidden), dtype),
               row_index: T.Tensor((tokens, top_k), "int32"),
               permuted: T.Tensor((rows, hidden), dtype)):
        body(x, None, row_index, permuted)

    return gather


class MoeSortKernel(Kernel):
    """key: n_experts (local), n_global (expert_map's length, or n_experts), top_k, has_map.

    One bucket: the chunks scale with the tokens, the program does not.
    """

    name = "moe_sort"
    Config = GatherConfig  # the sort has no tunables; its config is unused

    def program(self, config: GatherConfig, bucket: str):
        k = self.key
        return sort_programs(k["n_experts"], k["n_global"], k["top_k"], k["has_map"])

    def heuristic_config(self, bucket: str, arch: str) -> GatherConfig:
        return GatherConfig()

    def run(self, config: GatherConfig, compiled: tuple, ids, expert_map, offsets, row_index,
            source) -> None:
        import torch

        n_chunks = -(-ids.numel() // CHUNK)
        buckets = self.key["n_experts"] + 1
        counts = torch.empty((buckets, n_chunks), dtype=torch.int32, device=ids.device)
        totals = torch.empty((buckets,), dtype=torch.int32, device=ids.device)
        mapped = () if expert_map is None else (expert_map,)
        compiled[0](ids, *mapped, row_index, counts)
        compiled[1](counts, totals)
        compiled[2](ids, *mapped, totals, counts, offsets, row_index, source)


class MoeGatherKernel(Kernel):
    """key: dtype, hidden, top_k; weighted=True (a flag the plain gather's key leaves out)
    scales each row by its slot's weight. Launch with (x, row_index, permuted) or, weighted,
    (x, weights, row_index, permuted)."""

    name = "moe_gather"
    Config = GatherConfig

    def program(self, config: GatherConfig, bucket: str):
        k = self.key
        return gather_program(k["hidden"], k["top_k"], k["dtype"], config,
                              k.get("weighted", False))

    def heuristic_config(self, bucket: str, arch: str) -> GatherConfig:
        # a 7168-wide bf16 row is 896 16-byte vectors: 2 slots give each thread 14 in flight
        return GatherConfig()

    def config_space(self, bucket: str) -> list[GatherConfig]:
        return [GatherConfig(rows, threads) for rows in (1, 2, 4) for threads in (128, 256)]

    def run(self, config: GatherConfig, compiled: tuple, *tensors) -> None:
        compiled[0](*tensors)
