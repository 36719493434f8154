"""Attention over a KV cache: split-KV flash decoding with a combine step, and the same
program over packed chunks (chunked prefill).

q [B, Sq, H, D] (Sq = q_len, 1 for plain decoding, 2-16 for speculative decoding) or packed
chunks q [T, 1, H, D] with cu_seqlens_q (q_len 0 in the program key); the cache either
paged, k/v [num_pages, page_size, Hkv, D] with block_table [B, max_pages], or contiguous,
k/v [B, S_max, Hkv, D]; cache_seqlens [B] counts the keys of each request, its new tokens
included. Query token i of a request with n_q new tokens sits at position seqlen - n_q + i
and sees the keys at or before it (bottom-right causal; every key of the request when not
causal), and with a left window only those at most `window_left` positions behind it.

A CTA owns 64 rows of one request's (token, query head) rows under one KV head (row =
token * group + head, padded to one 64-row wgmma tile), so K and V are read once per KV
head and 64 / group tokens, and one split of the key tiles those rows see. A TMA producer
streams K/V tiles (page by page when pages are shorter than a tile), the consumer
warpgroup runs the forward's online softmax (`attention_fwd._attention_macros`), or with
`key_major` the transposed products of `decode_key_major` (rows padded to 16, not 64).
The key tiles are divided evenly over the splits, so a short request's CTAs finish early
and every split of a long one does the same work; nothing on the host reads
cache_seqlens. A CTA with no tile in its split still walks one fully masked tile and
writes a neutral partial (o = 0, lse = -inf).

With one split the CTA writes o and lse directly; otherwise it writes fp32 partials and a
second program merges them by their log-sum-exp.
"""

import dataclasses
import functools
import math
from dataclasses import dataclass

import tilelang.language as T
from tilelang.layout import make_swizzled_layout

from ..base import Kernel
from ..gemm.async_pipeline import PRODUCER_THREADS
from ..selection.topk import exclusive_offsets
from .attention_fwd import LOG2E, SMEM_LIMIT, AttentionFwdConfig, _attention_macros
from .decode_key_major import key_major_macros
from .mask import TIR_OPS

ROWS = 64  # query rows per CTA by default: one wgmma warpgroup tile
SMS = 132  # H200 SMs; the split rule aims at whole waves of them
MAX_SPLITS = 64
OPEN_RUN = 1 << 30  # tiles of a request's last planned run: to whatever end it has then
SWIZZLE_COLS = 64  # bf16/fp16 columns per 128-byte swizzle atom
T_BYTES = {"float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}
MAX_PIECES = 16  # TMA copies per paged tile: (pages per tile) x (head_dim / 64)
MIN_TILES_PER_SPLIT = 2  # fewer and the combine and per-CTA setup outweigh the split
SCHEDULE_THREADS = 512
# An fp8 cache's kernel runs fp16 (see decode_program): q enters it divided by this power of
# two, exact down to fp16's subnormals (|q| < 2^-10, negligible terms of a score)
FP8_Q_DIVISOR = 16.0
# The producer warpgroup of a producer_gather CTA keeps this many registers (setmaxnreg):
# it addresses the pages and, for fp8, widens (56 spilled there).
GATHER_PRODUCER_REGISTERS = 72
SIZE_CLASSES = 4  # split sizes the schedule orders its slots by (see schedule_program)


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int = 128  # keys per tile
    stages: int = 2  # K/V tiles in flight per CTA
    hoist_pages: bool = False  # pages shorter than a tile: their ids loaded once per tile
    # pages shorter than a tile gathered row by row by cp.async in a software pipeline of
    # all threads (no warp specialization) instead of one TMA copy per (page, 64 columns)
    gather: bool = False
    # pages gathered by cp.async from a producer warpgroup into `stages` K/V buffers, each
    # stage's arrival on one barrier (cp.async.mbarrier.arrive), the consumers' key loop
    # hand-written around those barriers (`produce` / `consume` in decode_program): the
    # gather overlaps the wgmmas as TMA tiles do, at one barrier a stage, not one a page
    producer_gather: bool = False
    # with producer_gather over 16-bit pages: each page by TMA (one thread issues a tile's
    # copies, all counted on the stage's one barrier) instead of cp.async from 128 threads
    producer_tma: bool = False
    # with producer_gather over an fp8 cache: V's tile fetched with K's, both before the
    # wait for a free stage (twice the loads in flight, two tiles in the producer's registers)
    fetch_both: bool = False
    # with producer_gather over an fp8 cache: the fp8 K/V tiles land by TMA in a ring of
    # this many shared stages, issued land_stages - 1 tiles ahead of the widening (0: each
    # tile fetched into the producer's registers just before it widens): the loads of later
    # tiles stay in flight while the producer waits for a free stage and widens
    land_stages: int = 0
    # query rows per CTA, a consumer warpgroup per 64: 128 for long prefill chunks, whose
    # compute-bound key loop wants the dense forward's two warpgroups per K/V tile
    block_m: int = ROWS
    # CTAs resident per SM (their shared memory must fit together): an fp8 cache's key loop
    # is bound by its consumer warpgroup (widening, the padded wgmmas, the softmax), so two
    # CTAs' consumers overlap where one waits
    ctas_per_sm: int = 1
    # S^T = K Q^T and O^T += V^T P^T (decode_key_major): keys on the wgmma's M side, the
    # CTA's group x q_len query rows padded to 16 on N instead of to 64 on M (q_len >= 1)
    key_major: bool = False

    def smem_bytes(self, head_dim: int, elem_bytes: int = 2, fp8: bool = False,
                   rows: int | None = None) -> int:
        """q (`rows` of it, block_m by default), the K/V stages, and for an fp8 cache the
        widened K and V tiles (key-major: one, shared) besides its fp8 stages."""
        rows = self.block_m if rows is None else rows
        # key-major: P, and S^T in fp32 on its way to the softmax's row-major fragment
        p_tile = self.block_n * rows * (elem_bytes + 4) if self.key_major else 0
        ring = 2 * self.land_stages * self.block_n * head_dim if fp8 else 0  # fp8 K and V
        if fp8 and not self.producer_gather:  # (producer_gather stages are widened)
            widened = self.block_n if self.key_major else 2 * self.block_n
            return (rows + widened) * head_dim * elem_bytes + \
                2 * self.stages * self.block_n * head_dim + p_tile + ring
        return (rows + 2 * self.stages * self.block_n) * head_dim * elem_bytes + p_tile + ring


def gather_registers(consumers: int, ctas_per_sm: int) -> tuple[int, int]:
    """setmaxnreg budgets (producer, consumer) of a producer_gather CTA with `consumers`
    consumer threads: together within what the launch gave the CTA (an increase past it
    waits forever). One CTA of 128 rows: 72 / 216 (the consumers spilled at 208); one of 64
    rows: 72 / 240; two of 64 rows an SM: 72 / 184."""
    threads = consumers + PRODUCER_THREADS
    launch = min(255, 65536 // (ctas_per_sm * threads)) // 8 * 8
    spare = launch * threads - PRODUCER_THREADS * GATHER_PRODUCER_REGISTERS
    return GATHER_PRODUCER_REGISTERS, min(240, spare // consumers // 8 * 8)


def key_major_rows(group: int, q_len: int, block_m: int) -> int:
    """Query rows a key-major CTA holds: its group x q_len rows padded to the wgmma's N
    granule of 16, at most block_m."""
    return min(block_m, -(-group * q_len // 16) * 16)


def row_blocks(heads: int, kv_heads: int, q_len: int) -> int:
    """CTAs per (request, KV head) along the query rows, ROWS rows each."""
    return -(-(heads // kv_heads) * q_len // ROWS)


@functools.lru_cache(maxsize=4096)  # on every call's host path: decode calls are host-bound
def choose_splits(batch: int, kv_heads: int, blocks: int, max_keys: int, block_n: int,
                  sms: int = SMS) -> int:
    """Splits per (request, KV head) from shapes only (no lengths read on the host).

    The fewest splits whose CTAs fill the SMs in whole waves to within 85% of the best
    fill, with at least MIN_TILES_PER_SPLIT key tiles per split at the longest length the
    cache can hold: batch 1 at 128K keys with 8 KV heads gets 16 splits (128 CTAs, one
    per SM), a batch that already fills the GPU gets 1 (no combine).
    """
    base = batch * kv_heads * blocks
    most = max(1, min(MAX_SPLITS, -(-max_keys // block_n) // MIN_TILES_PER_SPLIT))
    if base >= sms or most == 1:
        return 1
    fill = {s: base * s / (sms * math.ceil(base * s / sms)) for s in range(1, most + 1)}
    # fill counts partial waves; a split count below one wave leaves SMs idle outright
    score = {s: f * min(1.0, base * s / sms) for s, f in fill.items()}
    best = max(score.values())
    return min(s for s, f in score.items() if f >= 0.85 * best)


def block_tiles(first_position, last_position, seqlen, block_n: int, window_left: int,
                causal: bool, ops=TIR_OPS):
    """(first key tile, number of tiles) that queries at positions [first_position,
    last_position] of a request with `seqlen` keys can see."""
    first = 0
    if window_left >= 0:
        first = ops.floordiv(ops.max(first_position - window_left, 0), block_n)
    end = ops.ceildiv(last_position + 1 if causal else seqlen, block_n)
    return first, ops.max(end - first, 0)


def split_tiles(first, n_tiles, split_index, n_splits, ops=TIR_OPS):
    """(first tile, tiles) of split `split_index`: the tiles cut into n_splits runs of
    equal length (the last ones shorter or empty)."""
    per_split = ops.ceildiv(n_tiles, n_splits)
    begin = first + split_index * per_split
    return begin, ops.max(ops.min(per_split, first + n_tiles - begin), 0)


def slot_tiles(first, n_tiles, slot_first, slot_tiles_, ops=TIR_OPS):
    """(first tile, tiles) of a planned slot within a row block's visible tiles [first,
    first + n_tiles): the slot's run of the request's tiles cut to them (a row block of a
    multi-token request sees a sub-range of the request's tiles; no division at run time)."""
    begin = ops.max(slot_first, first)
    return begin, ops.max(ops.min(slot_first + slot_tiles_, first + n_tiles) - begin, 0)


def key_visible(position, key, seqlen, window_left: int, causal: bool):
    """Whether the query at `position` sees `key` of a request with `seqlen` keys."""
    seen = key <= position if causal else key < seqlen
    if window_left >= 0:
        seen = seen & (key >= position - window_left)
    return seen


def tile_visible(kv_start, first_position, last_position, seqlen, block_n: int,
                 window_left: int, causal: bool):
    """Whether every query at positions [first_position, last_position] sees every key of
    [kv_start, kv_start + block_n): such a tile needs no mask (the first query has the
    fewest keys, the last the latest window)."""
    seen = kv_start + block_n <= (first_position + 1 if causal else seqlen)
    if window_left >= 0:
        seen = seen & (kv_start >= last_position - window_left)
    return seen


def tile_keys(head_dim: int) -> int:
    """Keys per tile of the default config (the split rule counts tiles of this size)."""
    return 64 if head_dim >= 256 else 128


def decode_program(heads: int, kv_heads: int, head_dim: int, q_len: int, page_size: int,
                   dtype: str, window_left: int, softcap: float, causal: bool, split: bool,
                   config: DecodeConfig, planned: bool = False, kv_dtype: str | None = None,
                   heads_first: bool = False):
    """The attention kernel; `page_size` 0 means the contiguous cache, `q_len` 0 packed
    queries (chunked prefill: q [T, 1, H, D], request b owning rows cu_seqlens_q[b]:
    cu_seqlens_q[b + 1]), else q [B, q_len, H, D]. With `split`, writes partials
    o_part [rows, Sq, H, splits, D] and lse_part [rows, Sq, H, splits] (fp32, natural log);
    without, o like q and lse [rows, H, Sq]. `row_blocks` (a launch argument) counts the
    CTAs along one request's rows, group * (longest request's tokens) / block_m. The grid is
    (splits, row blocks, requests x KV heads): no index divides by a runtime size but the
    split count (TIR's floor division by a runtime divisor expands into sign tests at
    every use, which tripled the packed program's source and its compile time).

    `planned` (q [B, q_len, H, D] only): the split count is per request, read from the
    schedule `schedule_program` wrote (slot_table); the grid is (KV heads, row blocks,
    slots), a slot being one run of one request's key tiles (request -1: no work). A request of one
    split writes o and lse directly, the others fp32 partials o_part [slots, Sq, H, D] and
    lse_part [slots, Sq, H] that `combine_program(planned=True)` merges.

    `kv_dtype` "float8_e4m3fn": an fp8 cache with fp32 scales k_scale/v_scale [1] (per
    tensor) or [Hkv] (per KV head; a CTA serves one KV head, so both are exact here). K/V
    tiles arrive by TMA as fp8 and the consumers widen them to q's dtype in shared memory
    before the wgmmas; k_scale multiplies the softmax scale, v_scale the output (partials
    included). Other caches ignore k_scale/v_scale (placeholders).

    `heads_first` (kv_layout "HND"): the cache is [num_pages, Hkv, page_size, D] or
    [B, Hkv, S_max, D] (transformers' static cache, FlashInfer's HND); a KV head's keys of
    one page (or request) are then one contiguous block, the same TMA tiles either way."""
    group = heads // kv_heads
    kv_dtype = kv_dtype or dtype
    fp8 = kv_dtype != dtype
    # An fp8 cache widens to fp16 whatever q's dtype: e4m3 -> fp16 is one exact conversion
    # per two values (-> bf16 took two more per value, 64% of the key loop's time on the
    # H200). q enters fp16 divided by FP8_Q_DIVISOR (see attend), P is fp16 in [0, 1].
    compute = "float16" if fp8 else dtype
    n_scale = T.dynamic("n_scale")
    packed = q_len == 0
    tokens = 1 if packed else q_len  # q's second dimension
    block_n, stages, block_m = config.block_n, config.stages, config.block_m
    threads = 2 * block_m  # a consumer warpgroup per 64 rows
    paged = page_size > 0
    batch, n_splits, n_cu = T.dynamic("batch, n_splits, n_cu")
    q_rows = T.dynamic("q_rows") if packed else batch
    if paged:
        n_pages, max_pages = T.dynamic("n_pages, max_pages")
        rows = page_size
        outer = n_pages
    else:
        max_pages = None
        rows = T.dynamic("s_max")
        outer = batch
    cache_shape = ((outer, kv_heads, rows, head_dim) if heads_first
                   else (outer, rows, kv_heads, head_dim))
    table_shape = (batch, max_pages) if paged else (1, 1)
    q_shape = (q_rows, tokens, heads, head_dim)
    key_major = config.key_major
    if key_major:
        assert not packed, "key-major programs serve q [B, q_len, H, D]"
        tile_rows = key_major_rows(group, q_len, block_m)
        step = key_major_macros(tile_rows, block_n, head_dim, compute, softcap, threads,
                                config.ctas_per_sm)
    else:
        tile_rows = block_m
        fwd_config = AttentionFwdConfig(block_m=block_m, block_n=block_n, stages=stages,
                                        threads=threads, ctas_per_sm=config.ctas_per_sm)
        step = _attention_macros(head_dim, compute, -1, -1, softcap, fwd_config)

    def q_at(b, q_start, token):
        """(first, second) index of query token `token` of request b in q, o and lse."""
        if packed:
            return q_start + token, 0
        return b, token

    chunks = 1 if not paged or page_size >= block_n else block_n // page_size
    producer_gather = config.producer_gather
    # (16-bit caches: pages shorter than a tile, whose TMA tiles take a copy a page; an fp8
    # cache widens in the producer at any page size, or contiguous)
    assert not producer_gather or (chunks > 1 or fp8) and (fp8 or not key_major), \
        "producer_gather: 16-bit pages shorter than a tile, or fp8 (key-major: fp8 only)"
    launch_threads = threads + PRODUCER_THREADS if producer_gather else threads
    by_cp_async = producer_gather and not fp8 and not config.producer_tma
    land = config.land_stages if producer_gather and fp8 else 0
    assert land != 1, "land_stages: 0 (no ring) or at least 2"
    producer_registers, consumer_registers = gather_registers(threads, config.ctas_per_sm)
    hoist_pages = config.hoist_pages and chunks > 1 and not config.gather
    # columns per 128-byte swizzle atom of the landing tiles (128 fp8 columns)
    swizzle_cols = min(head_dim, SWIZZLE_COLS * 2 // T_BYTES[kv_dtype])
    parts = head_dim // swizzle_cols
    assert chunks == 1 or chunks * parts <= MAX_PIECES, (block_n, page_size, head_dim)

    def cache_rows(cache, first, start, stop, h, cols):
        """Rows [start, stop) of KV head h in page (or request) `first`, columns `cols`."""
        if heads_first:
            return cache[first, h, start:stop, cols]
        return cache[first, start:stop, h, cols]

    def tile_region(cache, table, b, tile, h):
        """The cache rows of key tile `tile` when it lies in one page (or contiguous)."""
        everything = slice(0, head_dim)
        if not paged:
            return cache_rows(cache, b, tile * block_n, (tile + 1) * block_n, h, everything)
        key0 = tile * block_n
        # entries past the request's pages may be anything: TMA zero-fills a page index
        # out of range, and such keys are masked
        page = table[b, T.min(key0 // page_size, max_pages - 1)]
        return cache_rows(cache, page, key0 % page_size, key0 % page_size + block_n, h,
                          everything)

    def page_of(table, b, tile, c):
        """Page `c` of key tile `tile` when pages are shorter than tiles."""
        return table[b, T.min(tile * chunks + c, max_pages - 1)]

    @T.macro
    def load_piece(cache, pages, h, dst, piece):
        if piece < chunks * parts:
            c, part = piece // parts, piece % parts
            cols = slice(part * swizzle_cols, (part + 1) * swizzle_cols)
            T.copy(cache_rows(cache, pages[c], 0, page_size, h, cols),
                   dst[c * page_size:(c + 1) * page_size, cols])

    # A loop of copies would keep the key loop out of TileLang's warp specialization (no
    # TMA, no pipelining), so a tile's page copies are written out, MAX_PIECES at most; each
    # covers one page and 64 columns, a contiguous block of the 128-byte swizzled tile.
    @T.macro
    def load_tile(cache, table, b, tile, h, dst, pages):
        if chunks == 1:
            T.copy(tile_region(cache, table, b, tile, h), dst)
        elif config.gather:
            for i, d in T.Parallel(block_n, head_dim):
                page = page_of(table, b, tile, i // page_size)
                dst[i, d] = cache[page, h, i % page_size, d] if heads_first \
                    else cache[page, i % page_size, h, d]
        else:
            load_piece(cache, pages, h, dst, 0)
            load_piece(cache, pages, h, dst, 1)
            load_piece(cache, pages, h, dst, 2)
            load_piece(cache, pages, h, dst, 3)
            load_piece(cache, pages, h, dst, 4)
            load_piece(cache, pages, h, dst, 5)
            load_piece(cache, pages, h, dst, 6)
            load_piece(cache, pages, h, dst, 7)
            load_piece(cache, pages, h, dst, 8)
            load_piece(cache, pages, h, dst, 9)
            load_piece(cache, pages, h, dst, 10)
            load_piece(cache, pages, h, dst, 11)
            load_piece(cache, pages, h, dst, 12)
            load_piece(cache, pages, h, dst, 13)
            load_piece(cache, pages, h, dst, 14)
            load_piece(cache, pages, h, dst, 15)

    st_shape = (block_n, tile_rows) if key_major else (tile_rows, block_n)

    @T.macro
    def share_sm():
        """The top of a program: several CTAs an SM need their launch bound (and for
        TileLang's warp specialization its register split; producer_gather sets its own)."""
        if producer_gather and config.ctas_per_sm > 1:
            T.annotate_min_blocks_per_sm(config.ctas_per_sm)
        else:
            step.share_sm()

    @T.macro
    def scores(st, q_shared, k_shared, kv_start, seqlen, n_q, row0, live, scale):
        """S = Q K^T (capped), -inf where row i's query (position seqlen - n_q + its token)
        does not see the key, or everywhere when the tile is not live."""
        if key_major:  # s is S^T [keys, rows]
            T.gemm(k_shared, q_shared, st.s, transpose_B=True, clear_accum=True)
        else:
            T.gemm(q_shared, k_shared, st.s, transpose_B=True, clear_accum=True,
                   policy=T.GemmWarpPolicy.FullRow)
        if softcap > 0:
            for i, j in T.Parallel(*st_shape):
                st.s[i, j] = T.tanh(st.s[i, j] * (scale / softcap)) * (softcap * LOG2E)
        first_position = seqlen - n_q + row0 // group
        last_position = seqlen - n_q + (row0 + block_m - 1) // group
        if T.Not(live & tile_visible(kv_start, first_position, last_position, seqlen,
                                     block_n, window_left, causal)):
            for i, j in T.Parallel(*st_shape):
                row, key = (j, i) if key_major else (i, j)
                st.s[i, j] = T.if_then_else(
                    live & key_visible(seqlen - n_q + (row0 + row) // group, kv_start + key,
                                       seqlen, window_left, causal),
                    st.s[i, j], -T.infinity("float"))

    def alloc_barriers():
        """(full K, full V, empty) barriers of the producer_gather stages: a stage is full
        once each producer thread's copies have landed, empty once every consumer thread
        is done with it."""
        if not producer_gather:
            return None
        bars = (T.alloc_barrier([PRODUCER_THREADS] * stages),
                T.alloc_barrier([PRODUCER_THREADS] * stages),
                T.alloc_barrier([threads] * stages))
        if land:  # (landed, read): a ring slot's K and V bytes in, the producer done with it
            bars += (T.alloc_barrier([PRODUCER_THREADS] * land),
                     T.alloc_barrier([PRODUCER_THREADS] * land))
        return bars

    def alloc_tiles():
        """(q, K, V, K landing, V landing, held): shared tiles, and for an fp8 cache the
        register tile `held` it passes through from its own fp8 landing tiles to the
        widened K/V tiles the wgmmas read."""
        q_tile = T.alloc_shared((tile_rows, head_dim), compute)
        if producer_gather:  # K and V stages: the producer fills them, the wgmmas read;
            # fp8: the tiles it holds between fetching and widening (K's, then V's)
            held = ring = None
            if fp8:
                held_k = T.alloc_fragment((block_n, head_dim), kv_dtype)
                held = (held_k, T.alloc_fragment((block_n, head_dim), kv_dtype)
                        if config.fetch_both or land else held_k)
            if land:  # the fp8 landing ring (K's slots, V's slots)
                ring = (T.alloc_shared((land, block_n, head_dim), kv_dtype),
                        T.alloc_shared((land, block_n, head_dim), kv_dtype))
            return (q_tile, T.alloc_shared((stages, block_n, head_dim), compute),
                    T.alloc_shared((stages, block_n, head_dim), compute), ring, None, held)
        k_tile = T.alloc_shared((block_n, head_dim), compute)
        # key-major fp8: K and V widen in turn into one tile (each product waits for its
        # wgmma before the next widening), which lets three CTAs share an SM
        v_tile = k_tile if fp8 and key_major else T.alloc_shared((block_n, head_dim), compute)
        tiles = (q_tile, k_tile, v_tile)
        if not fp8:
            return (*tiles, tiles[1], tiles[2], None)
        k_land = T.alloc_shared((block_n, head_dim), kv_dtype)
        v_land = T.alloc_shared((block_n, head_dim), kv_dtype)
        # the 128-byte swizzle TMA writes (TileLang infers none for tiles no wgmma reads)
        T.annotate_layout({k_land: make_swizzled_layout(k_land),
                           v_land: make_swizzled_layout(v_land)})
        # the fp8 tile in registers between landing and widening: its loads issue back to
        # back (shared-to-shared, each load waited for the previous store)
        return (*tiles, k_land, v_land, T.alloc_fragment((block_n, head_dim), kv_dtype))

    def kv_scale(scales, h):
        """The KV head's scale: scales [1] per tensor or [Hkv] per head."""
        return scales[T.min(h, n_scale - 1)]

    def out(st, i, d, v_scale, h):
        """Row i's output (or partial) element d, V's scale applied."""
        o = st.o[d, i] if key_major else st.o[i, d]
        return o * kv_scale(v_scale, h) if fp8 else o

    @T.macro
    def load_q(q, q_shared, b, h, q_start, n_q, row0):
        """Rows [row0, row0 + tile_rows) of request b's n_q * group (token, head) rows."""
        n_rows = n_q * group
        for i, d in T.Parallel(tile_rows, head_dim):
            # rows past the request's repeat its last row (never stored); an empty request
            # reads row 0 of q (kept inside q by the clamp)
            r = T.max(T.min(row0 + i, n_rows - 1), 0)
            qb, qt = q_at(b, q_start, r // group)
            value = q[T.min(qb, q_rows - 1), qt, h * group + r % group, d]
            # fp8: q enters fp16 divided by FP8_Q_DIVISOR, exactly (a power of two), so
            # bf16 queries up to 16 x 65504 stay finite; the softmax scale takes it back
            q_shared[i, d] = T.cast(T.cast(value, "float32") * (1.0 / FP8_Q_DIVISOR),
                                    compute) if fp8 else value

    def tile_span(seqlen, n_q, row0, split_index, n_split):
        """(first key tile rows [row0, row0 + block_m) of a request with `seqlen` keys see,
        how many, first tile of this split, its tiles)."""
        n_rows = n_q * group
        last_row = T.min(row0 + block_m, n_rows) - 1
        first, n_tiles = block_tiles(seqlen - n_q + row0 // group,
                                     seqlen - n_q + last_row // group, seqlen, block_n,
                                     window_left, causal)
        n_tiles = T.if_then_else(row0 < n_rows, n_tiles, 0)
        if planned:  # (split_index, n_split) = the slot's (first tile, tiles) of the request
            begin, mine = slot_tiles(first, n_tiles, split_index, n_split)
        else:
            begin, mine = split_tiles(first, n_tiles, split_index, n_split)
        return first, n_tiles, begin, mine

    def softmax_scale(scale, k_scale, h):
        # fp8: k's scale, and q's FP8_Q_DIVISOR taken back (see load_q)
        return scale * kv_scale(k_scale, h) * FP8_Q_DIVISOR if fp8 else scale

    @T.macro
    def attend(q, k, v, block_table, cache_seqlens, tiles, k_scale, st, b, h,
               q_start, n_q, row0, split_index, n_split, scale):
        """Request b's query rows [row0, row0 + block_m), then the online softmax over its
        split of the key tiles they see."""
        q_shared, k_shared, v_shared, k_land, v_land, held = tiles
        scale = softmax_scale(scale, k_scale, h)
        load_q(q, q_shared, b, h, q_start, n_q, row0)
        seqlen = cache_seqlens[b]
        first, n_tiles, begin, mine = tile_span(seqlen, n_q, row0, split_index, n_split)
        step.init(st)
        # an empty split walks one masked tile (its loads stay inside the table's row)
        for t in T.Pipelined(T.max(mine, 1), num_stages=stages):
            tile = T.min(begin + t, T.max(first + n_tiles - 1, 0))
            if hoist_pages:
                # the tile's page ids bound once, so the producer loads them together
                # ahead of its barrier waits (inline, each copy reloads its own after one)
                p0 = page_of(block_table, b, tile, 0)
                p1 = page_of(block_table, b, tile, T.min(1, chunks - 1))
                p2 = page_of(block_table, b, tile, T.min(2, chunks - 1))
                p3 = page_of(block_table, b, tile, T.min(3, chunks - 1))
                p4 = page_of(block_table, b, tile, T.min(4, chunks - 1))
                p5 = page_of(block_table, b, tile, T.min(5, chunks - 1))
                p6 = page_of(block_table, b, tile, T.min(6, chunks - 1))
                p7 = page_of(block_table, b, tile, T.min(7, chunks - 1))
                pages = (p0, p1, p2, p3, p4, p5, p6, p7)
            else:
                pages = tuple(page_of(block_table, b, tile, c) for c in range(chunks)) \
                    if chunks > 1 else ()
            load_tile(k, block_table, b, tile, h, k_land, pages)
            if fp8:
                T.copy(k_land, held)
                T.copy(held, k_shared)
            scores(st, q_shared, k_shared, (begin + t) * block_n, seqlen, n_q, row0, t < mine,
                   scale)
            step.online_softmax(st, scale)
            if not key_major:  # (the key-major softmax stores P itself)
                T.copy(st.s, st.p)
            step.rescale_output(st)
            load_tile(v, block_table, b, tile, h, v_land, pages)
            if fp8:
                T.copy(v_land, held)
                T.copy(held, v_shared)
            if key_major:
                T.gemm(v_shared, st.p, st.o, transpose_A=True, transpose_B=True)
            else:
                T.gemm(st.p, v_shared, st.o, policy=T.GemmWarpPolicy.FullRow)
        step.finish(st, scale)

    # -- producer_gather: the key loop split between a producer and the consumers --------
    def tile_pages(table, b, tile, c):
        """Page c of key tile `tile` (its only page when pages are at least a tile; the
        request itself for a contiguous cache), clamped into the pool: entries past a
        request's pages may be anything, and their keys are masked."""
        if not paged:
            return b
        index = tile * chunks + c if chunks > 1 else tile * block_n // page_size
        return T.max(T.min(table[b, T.min(index, max_pages - 1)], outer - 1), 0)

    def stage_source(cache, pages, tile, h, c):
        """Piece c of key tile `tile` in the cache: page c when pages are shorter than a
        tile, else the tile's rows of its one page (or of the request's contiguous rows)."""
        everything = slice(0, head_dim)
        if chunks > 1:
            return cache_rows(cache, pages[c], 0, page_size, h, everything)
        start = tile * block_n % page_size if paged else tile * block_n
        return cache_rows(cache, pages[0], start, start + block_n, h, everything)

    @T.macro
    def gather_stage(cache, pages, h, buffers, full, s):
        """A 16-bit key tile into stage s of `buffers` page by page (cp.async, or TMA with
        `producer_tma`), then this thread's arrival on full[s]: with cp.async once its
        copies land, with TMA at once (the copies' bytes are what full[s] waits for)."""
        for c in T.unroll(chunks):
            if config.producer_tma:  # a copy per swizzle atom's columns (a box per atom)
                for part in T.unroll(parts):
                    cols = slice(part * swizzle_cols, (part + 1) * swizzle_cols)
                    T.tma_copy(cache_rows(cache, pages[c], 0, page_size, h, cols),
                               buffers[s, c * page_size:(c + 1) * page_size, cols],
                               barrier=full[s])
            else:
                T.async_copy(stage_source(cache, pages, 0, h, c),
                             buffers[s, c * page_size:(c + 1) * page_size, :])
        if config.producer_tma:
            T.mbarrier_arrive(full[s])
        else:
            T.cp_async_barrier_noinc(full[s])

    @T.macro
    def fetch_fp8(cache, pages, tile, h, held):
        """An fp8 key tile into the producer's registers (every load of it in flight at
        once; the caller issues the next one before it waits for a free stage)."""
        piece = block_n // chunks
        for c in T.unroll(chunks):
            T.copy(stage_source(cache, pages, tile, h, c), held[c * piece:(c + 1) * piece, :])

    @T.macro
    def land_fp8(k, v, pages, tile, h, ring, landed, r):
        """K's and V's fp8 tiles of `tile` into ring slot r by TMA (one elected thread
        issues the copies, a page and 128 columns each, their bytes expected on landed[r]),
        then this thread's arrival on landed[r]."""
        piece = block_n // chunks
        for c in T.unroll(chunks):
            rows = slice(c * piece, (c + 1) * piece)
            T.tma_copy(stage_source(k, pages, tile, h, c), ring[0][r, rows, :],
                       barrier=landed[r])
            T.tma_copy(stage_source(v, pages, tile, h, c), ring[1][r, rows, :],
                       barrier=landed[r])
        T.mbarrier_arrive(landed[r])

    @T.macro
    def widen_fp8(held, buffers, full, s):
        """The fetched tile widened to the compute dtype into stage s, then this thread's
        arrival on full[s], fenced: generic-proxy stores the wgmmas read by the async
        proxy."""
        T.copy(held, buffers[s, :, :])
        T.fence_proxy_async()
        T.mbarrier_arrive(full[s])

    def clamped_tile(first, n_tiles, begin, t):
        """Key tile t of the split, kept inside the request's tiles (an empty split runs
        one masked step on its first tile)."""
        return T.min(begin + t, T.max(first + n_tiles - 1, 0))

    @T.macro
    def produce_landed(k, v, block_table, tiles, bars, b, h, pages, first, n_tiles, begin,
                       mine):
        """The fp8 producer with a landing ring: tile t + land - 1 issued by TMA into the
        slot tile t - 1 freed, then tile t copied from its slot into registers (the slot
        released), widened into the stage the consumers last released."""
        full_k, full_v, empty, landed, read = bars
        ring, held = tiles[3], tiles[5]
        n = T.max(mine, 1)
        for j in T.serial(land - 1):
            if j < n:
                tile = clamped_tile(first, n_tiles, begin, j)
                for c in T.unroll(chunks):
                    pages[c] = tile_pages(block_table, b, tile, c)
                land_fp8(k, v, pages, tile, h, ring, landed, j)
        for t in T.serial(n):
            s = t % stages
            r = t % land
            if t + land - 1 < n:  # into slot (t - 1) % land, once every thread has read it
                ahead = clamped_tile(first, n_tiles, begin, t + land - 1)
                for c in T.unroll(chunks):
                    pages[c] = tile_pages(block_table, b, ahead, c)
                if t > 0:
                    T.mbarrier_wait_parity(read[(t - 1) % land], ((t - 1) // land) % 2)
                land_fp8(k, v, pages, ahead, h, ring, landed, (t + land - 1) % land)
            T.mbarrier_wait_parity(landed[r], (t // land) % 2)
            T.copy(ring[0][r, :, :], held[0])
            T.copy(ring[1][r, :, :], held[1])
            T.mbarrier_arrive(read[r])
            T.mbarrier_wait_parity(empty[s], ((t // stages) % 2) ^ 1)
            widen_fp8(held[0], tiles[1], full_k, s)
            widen_fp8(held[1], tiles[2], full_v, s)

    @T.macro
    def produce_fetched(k, v, block_table, tiles, bars, b, h, pages, first, n_tiles, begin,
                        mine):
        """The producer without a ring: each tile fetched into registers (fp8) or gathered
        into its stage (16-bit) once the consumers release the stage."""
        k_stages, v_stages = tiles[1], tiles[2]
        full_k, full_v, empty = bars[0], bars[1], bars[2]
        for t in T.serial(T.max(mine, 1)):
            s = t % stages
            tile = clamped_tile(first, n_tiles, begin, t)
            # the tile's page ids in registers, for K and V, loaded ahead of the wait
            for c in T.unroll(chunks):
                pages[c] = tile_pages(block_table, b, tile, c)
            if fp8:  # K's loads (and V's) in flight while the stage may still be in use
                fetch_fp8(k, pages, tile, h, tiles[5][0])
                if config.fetch_both:
                    fetch_fp8(v, pages, tile, h, tiles[5][1])
            # a fresh barrier passes a wait for the parity before its first phase
            T.mbarrier_wait_parity(empty[s], ((t // stages) % 2) ^ 1)
            if fp8:  # the producer widens: the consumers attend as over fp16
                widen_fp8(tiles[5][0], k_stages, full_k, s)
                if not config.fetch_both:
                    fetch_fp8(v, pages, tile, h, tiles[5][1])
                widen_fp8(tiles[5][1], v_stages, full_v, s)
            else:
                gather_stage(k, pages, h, k_stages, full_k, s)
                gather_stage(v, pages, h, v_stages, full_v, s)

    @T.macro
    def produce(k, v, block_table, cache_seqlens, tiles, bars, b, h, n_q, row0,
                split_index, n_split):
        """The producer warpgroup: each K and V tile of the split into the stage the
        consumers last released, announced on its full barrier once the copies land."""
        empty = bars[2]
        seqlen = cache_seqlens[b]
        first, n_tiles, begin, mine = tile_span(seqlen, n_q, row0, split_index, n_split)
        pages = T.alloc_local((chunks,), "int32")
        if land:
            produce_landed(k, v, block_table, tiles, bars, b, h, pages, first, n_tiles, begin,
                           mine)
        else:
            produce_fetched(k, v, block_table, tiles, bars, b, h, pages, first, n_tiles, begin,
                            mine)
        # the tail: stay until the consumers have released every stage, so no producer
        # thread leaves with its copies (and their arrivals) still in flight
        for t in T.serial(stages):
            step_index = T.max(mine, 1) + t
            T.mbarrier_wait_parity(empty[step_index % stages], ((step_index // stages) % 2) ^ 1)

    @T.macro
    def consume(q, cache_seqlens, tiles, bars, k_scale, st, b, h, q_start, n_q, row0,
                split_index, n_split, scale):
        """The consumer warpgroups: attend's key loop over the producer's stages. Each
        program stores the result inside the same branch: behind a second `tx < threads`
        test the state's registers cross the join with the producer's 72-register path,
        and ptxas spilled them (12-152 bytes)."""
        q_shared, k_stages, v_stages = tiles[0], tiles[1], tiles[2]
        full_k, full_v, empty = bars[0], bars[1], bars[2]
        scale = softmax_scale(scale, k_scale, h)
        load_q(q, q_shared, b, h, q_start, n_q, row0)
        seqlen = cache_seqlens[b]
        _, _, begin, mine = tile_span(seqlen, n_q, row0, split_index, n_split)
        step.init(st)
        for t in T.serial(T.max(mine, 1)):
            s = t % stages
            T.mbarrier_wait_parity(full_k[s], (t // stages) % 2)
            if by_cp_async:  # cp.async wrote the stage through the generic proxy, the
                T.fence_proxy_async()  # wgmma reads it through the async one (fp8: the
                # producer fenced its own stores before arriving; TMA writes the async one)
            scores(st, q_shared, k_stages[s, :, :], (begin + t) * block_n, seqlen, n_q,
                   row0, t < mine, scale)
            step.online_softmax(st, scale)
            if not key_major:  # (the key-major softmax stores P itself)
                T.copy(st.s, st.p)
            step.rescale_output(st)
            T.mbarrier_wait_parity(full_v[s], (t // stages) % 2)
            if by_cp_async:
                T.fence_proxy_async()
            if key_major:
                T.gemm(v_stages[s, :, :], st.p, st.o, transpose_A=True, transpose_B=True)
            else:
                T.gemm(st.p, v_stages[s, :, :], st.o, policy=T.GemmWarpPolicy.FullRow)
            T.mbarrier_arrive(empty[s])  # (T.gemm has waited for its wgmmas)
        step.finish(st, scale)

    def head_of(r, h):
        return h * group + r % group

    @T.macro
    def store_direct(o, lse, st, b, h, q_start, n_q, row0, v_scale):
        for i, d in T.Parallel(tile_rows, head_dim):
            if row0 + i < n_q * group:
                qb, qt = q_at(b, q_start, (row0 + i) // group)
                o[qb, qt, head_of(row0 + i, h), d] = out(st, i, d, v_scale, h)
        for i in T.Parallel(tile_rows):
            if row0 + i < n_q * group:
                qb, qt = q_at(b, q_start, (row0 + i) // group)
                lse[qb, head_of(row0 + i, h), qt] = st.lse[i]

    @T.macro
    def store_split(o_part, lse_part, st, b, h, q_start, n_q, row0, sx, v_scale):
        for i, d in T.Parallel(tile_rows, head_dim):
            if row0 + i < n_q * group:
                qb, qt = q_at(b, q_start, (row0 + i) // group)
                o_part[qb, qt, head_of(row0 + i, h), sx, d] = out(st, i, d, v_scale, h)
        for i in T.Parallel(tile_rows):
            if row0 + i < n_q * group:
                qb, qt = q_at(b, q_start, (row0 + i) // group)
                lse_part[qb, qt, head_of(row0 + i, h), sx] = st.lse[i]

    @T.macro
    def store_planned_o(dst, first, st, h, row0, v_scale):
        for i, d in T.Parallel(tile_rows, head_dim):
            if row0 + i < q_len * group:
                dst[first, (row0 + i) // group, head_of(row0 + i, h),
                    d] = out(st, i, d, v_scale, h)

    @T.macro
    def store_planned(o, lse, o_part, lse_part, slot_table, st, b, h, row0, slot, v_scale):
        """o and lse when the request has one split, else the slot's partials."""
        if slot_table[slot, 3] == 1:
            store_planned_o(o, b, st, h, row0, v_scale)
            for i in T.Parallel(tile_rows):
                if row0 + i < q_len * group:
                    lse[b, head_of(row0 + i, h), (row0 + i) // group] = st.lse[i]
        else:
            store_planned_o(o_part, slot, st, h, row0, v_scale)
            for i in T.Parallel(tile_rows):
                if row0 + i < q_len * group:
                    lse_part[slot, (row0 + i) // group, head_of(row0 + i, h)] = st.lse[i]

    def request(cu_seqlens_q, b):
        """(first row in q, query tokens) of request b."""
        if packed:
            return cu_seqlens_q[b], cu_seqlens_q[b + 1] - cu_seqlens_q[b]
        return b, q_len

    if planned:
        assert not packed, "the planned program serves q [B, q_len, H, D]"
        n_slots = T.dynamic("n_slots")

        @T.prim_func
        def decode_planned(q: T.Tensor(q_shape, dtype), k: T.Tensor(cache_shape, kv_dtype),
                           v: T.Tensor(cache_shape, kv_dtype),
                           block_table: T.Tensor(table_shape, "int32"),
                           cache_seqlens: T.Tensor((batch,), "int32"),
                           slot_table: T.Tensor((n_slots, 4), "int32"),
                           k_scale: T.Tensor((n_scale,), "float"),
                           v_scale: T.Tensor((n_scale,), "float"),
                           o: T.Tensor(q_shape, dtype),
                           lse: T.Tensor((q_rows, heads, tokens), "float"),
                           o_part: T.Tensor((n_slots, tokens, heads, head_dim), "float"),
                           lse_part: T.Tensor((n_slots, tokens, heads), "float"),
                           row_blocks: T.int32, scale: T.float32):
            with T.Kernel(kv_heads, row_blocks, n_slots,
                          threads=launch_threads) as (bx, by, bz):
                share_sm()
                h = bx
                row0 = by * block_m
                tiles = alloc_tiles()
                (s_local, p_local, o_local, m_local, m_prev, m_safe, rescale, row_sum,
                 l_local, lse_local, hold, stale) = step.alloc_state()
                st = step.state(s_local, p_local, o_local, m_local, m_prev, m_safe, rescale,
                                row_sum, l_local, lse_local, hold, stale)
                # Every index below is an expression of global loads, not a register set
                # before the key loop: warp specialization gives the producer and the
                # consumers separate copies of local state (see moe/grouped_gemm.py).
                # slot_table[slot] = (request, first tile, tiles, splits of the request)
                bars = alloc_barriers()
                if slot_table[bz, 0] >= 0:
                    b = slot_table[bz, 0]
                    if producer_gather:
                        if T.get_thread_binding() >= threads:
                            T.set_max_nreg(producer_registers, 0)
                            produce(k, v, block_table, cache_seqlens, tiles, bars, b, h, q_len,
                                    row0, slot_table[bz, 1], slot_table[bz, 2])
                        else:
                            T.set_max_nreg(consumer_registers, 1)
                            consume(q, cache_seqlens, tiles, bars, k_scale, st, b, h, b, q_len,
                                    row0, slot_table[bz, 1], slot_table[bz, 2], scale)
                            store_planned(o, lse, o_part, lse_part, slot_table, st, b, h, row0,
                                          bz, v_scale)
                    else:
                        attend(q, k, v, block_table, cache_seqlens, tiles, k_scale,
                               st, b, h, b, q_len, row0, slot_table[bz, 1], slot_table[bz, 2],
                               scale)
                        store_planned(o, lse, o_part, lse_part, slot_table, st, b, h, row0, bz,
                                      v_scale)

        return decode_planned

    if split:
        @T.prim_func
        def decode_split(q: T.Tensor(q_shape, dtype), k: T.Tensor(cache_shape, kv_dtype),
                         v: T.Tensor(cache_shape, kv_dtype),
                         block_table: T.Tensor(table_shape, "int32"),
                         cache_seqlens: T.Tensor((batch,), "int32"),
                         cu_seqlens_q: T.Tensor((n_cu,), "int32"),
                         k_scale: T.Tensor((n_scale,), "float"),
                         v_scale: T.Tensor((n_scale,), "float"),
                         o_part: T.Tensor((q_rows, tokens, heads, n_splits, head_dim), "float"),
                         lse_part: T.Tensor((q_rows, tokens, heads, n_splits), "float"),
                         row_blocks: T.int32, scale: T.float32):
            with T.Kernel(n_splits, row_blocks, batch * kv_heads,
                          threads=launch_threads) as (sx, by, bz):
                share_sm()
                b, h = bz // kv_heads, bz % kv_heads
                row0 = by * block_m
                q_start, n_q = request(cu_seqlens_q, b)
                tiles = alloc_tiles()
                (s_local, p_local, o_local, m_local, m_prev, m_safe, rescale, row_sum,
                 l_local, lse_local, hold, stale) = step.alloc_state()
                st = step.state(s_local, p_local, o_local, m_local, m_prev, m_safe, rescale,
                                row_sum, l_local, lse_local, hold, stale)
                bars = alloc_barriers()
                if producer_gather:
                    if T.get_thread_binding() >= threads:
                        T.set_max_nreg(producer_registers, 0)
                        produce(k, v, block_table, cache_seqlens, tiles, bars, b, h, n_q,
                                row0, sx, n_splits)
                    else:
                        T.set_max_nreg(consumer_registers, 1)
                        consume(q, cache_seqlens, tiles, bars, k_scale, st, b, h, q_start,
                                n_q, row0, sx, n_splits, scale)
                        store_split(o_part, lse_part, st, b, h, q_start, n_q, row0, sx,
                                    v_scale)
                else:
                    attend(q, k, v, block_table, cache_seqlens, tiles, k_scale, st,
                           b, h, q_start, n_q, row0, sx, n_splits, scale)
                    store_split(o_part, lse_part, st, b, h, q_start, n_q, row0, sx, v_scale)

        return decode_split

    @T.prim_func
    def decode_direct(q: T.Tensor(q_shape, dtype), k: T.Tensor(cache_shape, kv_dtype),
                      v: T.Tensor(cache_shape, kv_dtype),
                      block_table: T.Tensor(table_shape, "int32"),
                      cache_seqlens: T.Tensor((batch,), "int32"),
                      cu_seqlens_q: T.Tensor((n_cu,), "int32"),
                      k_scale: T.Tensor((n_scale,), "float"),
                      v_scale: T.Tensor((n_scale,), "float"),
                      o: T.Tensor(q_shape, dtype),
                      lse: T.Tensor((q_rows, heads, tokens), "float"),
                      row_blocks: T.int32, scale: T.float32):
        with T.Kernel(1, row_blocks, batch * kv_heads, threads=launch_threads) as (sx, by, bz):
            share_sm()
            b, h = bz // kv_heads, bz % kv_heads
            row0 = by * block_m
            q_start, n_q = request(cu_seqlens_q, b)
            tiles = alloc_tiles()
            (s_local, p_local, o_local, m_local, m_prev, m_safe, rescale, row_sum,
             l_local, lse_local, hold, stale) = step.alloc_state()
            st = step.state(s_local, p_local, o_local, m_local, m_prev, m_safe, rescale,
                            row_sum, l_local, lse_local, hold, stale)
            bars = alloc_barriers()
            if producer_gather:
                if T.get_thread_binding() >= threads:
                    T.set_max_nreg(producer_registers, 0)
                    produce(k, v, block_table, cache_seqlens, tiles, bars, b, h, n_q, row0,
                            sx, 1)
                else:
                    T.set_max_nreg(consumer_registers, 1)
                    consume(q, cache_seqlens, tiles, bars, k_scale, st, b, h, q_start, n_q,
                            row0, sx, 1, scale)
                    store_direct(o, lse, st, b, h, q_start, n_q, row0, v_scale)
            else:
                attend(q, k, v, block_table, cache_seqlens, tiles, k_scale, st, b,
                       h, q_start, n_q, row0, sx, 1, scale)
                store_direct(o, lse, st, b, h, q_start, n_q, row0, v_scale)

    return decode_direct


def combine_program(heads: int, head_dim: int, q_len: int, dtype: str, planned: bool = False,
                    chunk: int | None = None):
    """o [B, Sq, H, D] and lse [B, H, Sq] from the splits' partials: weights
    exp(lse_s - lse), lse the log-sum-exp of the splits'; no split saw a key -> 0, -inf.

    `planned`: the partials are per slot, o_part [slots, Sq, H, D], request b owning the n
    slots before split_ends[b], n = slot_table[split_ends[b] - 1, 3] (see schedule_program);
    a request of one split was written by the attention program itself and is left alone.

    A CTA per (request, token, head) and `chunk` columns of D (default all of D; each CTA
    of a row finds the same lse, the first also stores it): MLA's 512 columns in chunks of
    128 put four times the loads in flight at batch 1 (128 CTAs of one row each on 132
    SMs, a load of 2 KB a split per CTA, latency-bound)."""
    batch, n_splits = T.dynamic("batch, n_splits")
    chunk = chunk or head_dim
    assert head_dim % chunk == 0
    chunks = head_dim // chunk
    threads = max(32, chunk // 2)

    def part_o(o_part, b, i, h, first, s, d):
        return o_part[first + s, i, h, d] if planned else o_part[b, i, h, s, d]

    def part_lse(lse_part, b, i, h, first, s):
        return lse_part[first + s, i, h] if planned else lse_part[b, i, h, s]

    @T.macro
    def merge(o_part, lse_part, o, lse, b, i, h, d0, first, n_splits):
        acc = T.alloc_fragment((chunk,), "float")
        top = T.alloc_var("float")
        total = T.alloc_var("float")
        weight = T.alloc_var("float")
        top = -T.infinity("float")
        for s in T.serial(n_splits):
            top = T.max(top, part_lse(lse_part, b, i, h, first, s))
        total = 0.0
        T.clear(acc)
        for s in T.serial(n_splits):
            # -inf partials (empty splits) weigh 0; all -inf: top is -inf, skip them all
            weight = T.if_then_else(top == -T.infinity("float"), 0.0,
                                    T.exp2((part_lse(lse_part, b, i, h, first, s) - top)
                                           * LOG2E))
            total += weight
            for d in T.Parallel(chunk):
                acc[d] += weight * part_o(o_part, b, i, h, first, s, d0 + d)
        for d in T.Parallel(chunk):
            o[b, i, h, d0 + d] = T.if_then_else(total > 0, acc[d] / total, 0.0)
        if d0 == 0:
            lse[b, h, i] = T.if_then_else(total > 0, top + T.log(total),
                                          -T.infinity("float"))

    if planned:
        n_slots = T.dynamic("n_slots")

        @T.prim_func
        def decode_combine_planned(
                o_part: T.Tensor((n_slots, q_len, heads, head_dim), "float"),
                lse_part: T.Tensor((n_slots, q_len, heads), "float"),
                slot_table: T.Tensor((n_slots, 4), "int32"),
                split_ends: T.Tensor((batch,), "int32"),
                o: T.Tensor((batch, q_len, heads, head_dim), dtype),
                lse: T.Tensor((batch, heads, q_len), "float")):
            with T.Kernel(batch * q_len * heads * chunks, threads=threads) as bx:
                h = bx // chunks % heads
                i = bx // (chunks * heads) % q_len
                b = bx // (chunks * heads * q_len)
                splits = slot_table[split_ends[b] - 1, 3]
                if splits > 1:
                    merge(o_part, lse_part, o, lse, b, i, h, bx % chunks * chunk,
                          split_ends[b] - splits, splits)

        return decode_combine_planned

    @T.prim_func
    def decode_combine(o_part: T.Tensor((batch, q_len, heads, n_splits, head_dim), "float"),
                       lse_part: T.Tensor((batch, q_len, heads, n_splits), "float"),
                       o: T.Tensor((batch, q_len, heads, head_dim), dtype),
                       lse: T.Tensor((batch, heads, q_len), "float")):
        # one flat grid: a CTA per (request, token, head, chunk), chunks then heads fastest
        with T.Kernel(batch * q_len * heads * chunks, threads=threads) as bx:
            h = bx // chunks % heads
            i = bx // (chunks * heads) % q_len
            b = bx // (chunks * heads * q_len)
            merge(o_part, lse_part, o, lse, b, i, h, bx % chunks * chunk, 0, n_splits)

    return decode_combine


def split_class(split_tiles, target, total_tiles, ops=TIR_OPS):
    """0 for a split of >= P/2 tiles (P = total_tiles / target), 1 for >= P/4, 2 for >= P/8,
    3 for shorter ones: the schedule lays slots out by class, longest first."""
    return sum(ops.select(split_tiles * (2 << k) * target < total_tiles, 1, 0)
               for k in range(SIZE_CLASSES - 1))


# Per-split cost in the makespan estimate of a `fit_waves` schedule, in key tiles: the
# split's setup and first loads, its partials written and read back by the combine.
SPLIT_COST_TILES = 1


def candidate_count(tiles, total_tiles, wave, k, ops=TIR_OPS):
    """Splits of a request of `tiles` key tiles under the schedule's candidate rule k: its
    share tiles * target / total_tiles of target = wave * max(k, 1) slots, rounded down
    for k = 1 and up otherwise (k = 0: one wave rounded up, the rule without fitting; 1: one
    wave rounded down; k >= 2: k waves rounded up), at least 1 and at most tiles //
    MIN_TILES_PER_SPLIT."""
    share, total = tiles * wave * ops.max(k, 1), ops.max(total_tiles, 1)
    rounded = ops.select(k == 1, ops.floordiv(share, total), ops.ceildiv(share, total))
    return ops.max(1, ops.min(rounded, ops.floordiv(tiles, MIN_TILES_PER_SPLIT)))


def candidate_splits(tiles, total_tiles, wave, k, ops=TIR_OPS):
    """(splits, tiles of each but the last, long splits) of a request under rule k: a long
    split holds at least half the rule's share, total_tiles / (wave * max(k, 1)) tiles."""
    count = candidate_count(tiles, total_tiles, wave, k, ops)
    per = ops.ceildiv(tiles, count)
    last = tiles - (count - 1) * per
    share = ops.ceildiv(total_tiles, wave * ops.max(k, 1))
    return count, per, ((count - 1) * ops.select(2 * per >= share, 1, 0)
                        + ops.select(2 * last >= share, 1, 0))


def makespan_score(long_slots, longest, total_tiles, wave, ops=TIR_OPS):
    """A candidate's estimated makespan in 1/wave key tiles (`wave` slots run at once; lower
    is better): its long splits (>= half its share) take ceil(long_slots / wave) waves of
    its longest split (exact for equal splits), the short ones fill the lanes the last wave
    leaves, so never less than the keys spread evenly; plus SPLIT_COST_TILES a wave. A few
    short or empty requests change nothing (the shortest split, or the average over all
    slots, misjudged those). 64-bit: waves x wave x tiles outgrows int32 at a few thousand
    128K requests."""
    waves = ops.ceildiv(long_slots, wave)
    return (ops.max(ops.wide(waves) * wave * longest, ops.wide(total_tiles))
            + SPLIT_COST_TILES * wave * ops.max(waves, 1))


@T.macro
def fill_slot(slot_table, n_slots, slot, request, i, count, per, first_tile):
    """slot_table[slot] = split i of the request's `count`: runs [start_i, start_i+1) of
    `per` tiles from its first visible tile, start_0 = 0 and the last open-ended (see
    schedule_program)."""
    if slot < n_slots:
        slot_table[slot, 0] = request
        slot_table[slot, 1] = T.if_then_else(i == 0, 0, first_tile + i * per)
        slot_table[slot, 2] = T.if_then_else(
            i == count - 1, OPEN_RUN,
            first_tile + (i + 1) * per - T.if_then_else(i == 0, 0, first_tile + i * per))
        slot_table[slot, 3] = count


@T.macro
def pick_candidate(scan, request_tiles, all_tiles, target_slots, n_slots, n_candidates: int, best,
                   stats, warp_stats, score):
    """best[0] = the candidate rule (see `candidate_count`) of the lowest `makespan_score`
    among 0 .. n_candidates - 1 whose slots fit the n_slots the buffers hold (rule 0
    always does; target_slots: one wave), ties to the lower: each thread totals its
    requests' slots, longest split and long splits per rule, then shuffles and one barrier
    reduce them over the CTA."""
    batch, threads, tx = scan[0], scan[1], scan[2]
    for j, k in T.grid(3, n_candidates):
        stats[j, k] = 0
    for c in T.serial(T.ceildiv(batch, threads)):
        if c * threads + tx < batch:
            for k in T.unroll(n_candidates):
                count, per, long_splits = candidate_splits(request_tiles(c * threads + tx),
                                                           all_tiles[0], target_slots, k)
                stats[0, k] = stats[0, k] + count
                stats[1, k] = T.max(stats[1, k], per)
                stats[2, k] = stats[2, k] + long_splits
    for k, o in T.grid(n_candidates, 5):
        stats[0, k] = stats[0, k] + T.shfl_xor(stats[0, k], 1 << o)
        stats[1, k] = T.max(stats[1, k], T.shfl_xor(stats[1, k], 1 << o))
        stats[2, k] = stats[2, k] + T.shfl_xor(stats[2, k], 1 << o)
    if tx % 32 == 0:
        for j, k in T.grid(3, n_candidates):
            warp_stats[tx // 32, j, k] = stats[j, k]
    T.sync_threads()
    for j, k in T.grid(3, n_candidates):
        stats[j, k] = 0
    for k, w in T.grid(n_candidates, threads // 32):
        stats[0, k] = stats[0, k] + warp_stats[w, 0, k]
        stats[1, k] = T.max(stats[1, k], warp_stats[w, 1, k])
        stats[2, k] = stats[2, k] + warp_stats[w, 2, k]
    best[0] = 0
    score[0] = makespan_score(stats[2, 0], stats[1, 0], all_tiles[0], target_slots)
    for k in T.unroll(1, n_candidates):
        score[1] = makespan_score(stats[2, k], stats[1, k], all_tiles[0], target_slots)
        if stats[0, k] <= n_slots and score[1] < score[0]:
            best[0] = k
            score[0] = score[1]


def schedule_program(q_len: int, block_n: int, window_left: int, causal: bool,
                     fit_waves: int = 0):
    """The per-request split counts of the planned decode, on the GPU from cache_seqlens (nothing
    read on the host): request b's t_b visible key tiles get max(1, min(ceil(t_b * target /
    sum(t)), t_b // MIN_TILES_PER_SPLIT)) splits, so no split holds more than a target's
    share of the keys (P = sum(t) / target tiles) and the splits of all requests add up to
    at most `target_slots` (waves of CTAs: the caller's SMs / (KV heads x row blocks) each,
    see GATHERED_SPLIT_WAVES) plus one per request, however the keys are spread: a long
    request among many short ones still splits, a batch of equal requests splits evenly.

    Slots are laid out longest split first (`SIZE_CLASSES` classes of split size: >= P/2,
    >= P/4, >= P/8, shorter; request order within a class), since the CTAs start in slot
    order and a long split that starts last finishes last. A request's slots are
    consecutive: split_ends[b] is the end of request b's slots (exclusive) and slot_table
    [slot] = (request, first tile, tiles, the request's split count); (-1, 0, 0, 0) past the
    last. A request's first run starts at tile 0 and its last one is open-ended (OPEN_RUN
    tiles): the attention cuts the runs to the tiles a request sees when it runs, so a stale
    schedule (lengths grown or shrunk since, not rescheduled) still covers every key once;
    closed runs missed the tiles a request had gained (the H200's stale-schedule test). One
    CTA; the batch is walked in chunks of its threads, once per size class.

    `fit_waves` = J > 0 (programs of one CTA an SM whose `target_slots` is one wave, the
    MLA decode): the counts come from the best of J + 1 candidate rules by an estimate of
    the makespan (`pick_candidate`): the rule above, one wave rounded down, and 2 .. J
    waves rounded up. Rounding up alone lets 32 equal requests at a share of 2.06 slots
    each take 3 (96 slots: a second wave 45% full) where 2 fit one wave, and gives 80
    requests of 8K one split each (80 slots: 66 in one wave, 14 in a second of the same
    length) where 4 waves of quarter splits take 0.65x the time."""
    batch, n_slots = T.dynamic("batch, n_slots")
    threads = SCHEDULE_THREADS
    n_candidates = fit_waves + 1

    def tiles(cache_seqlens, b):
        seqlen = cache_seqlens[b]
        return block_tiles(seqlen - q_len, seqlen - 1, seqlen, block_n, window_left, causal)

    @T.prim_func
    def decode_schedule(cache_seqlens: T.Tensor((batch,), "int32"),
                        slot_table: T.Tensor((n_slots, 4), "int32"),
                        split_ends: T.Tensor((batch,), "int32"),
                        target_slots: T.int32):
        with T.Kernel(1, threads=threads) as _:
            tx = T.get_thread_binding()
            warp_sums = T.alloc_shared((threads // 32,), "int32")
            count = T.alloc_local((1,), "int32")
            first = T.alloc_local((1,), "int32")
            total = T.alloc_local((1,), "int32")
            all_tiles = T.alloc_local((1,), "int32")
            carry = T.alloc_local((1,), "int32")
            per = T.alloc_local((1,), "int32")
            rule = T.alloc_local((1,), "int32")
            owner = T.alloc_local((1,), "int32")
            # each thread's request in a chunk: its first slot (in the chunk), slots, tiles a
            # split, first visible tile
            runs = T.alloc_shared((4, threads), "int32")
            all_tiles[0] = 0
            for c in T.serial(T.ceildiv(batch, threads)):
                count[0] = 0
                if c * threads + tx < batch:
                    count[0] = tiles(cache_seqlens, c * threads + tx)[1]
                exclusive_offsets(count, tx, threads, warp_sums, first, total)
                all_tiles[0] = all_tiles[0] + total[0]
                T.sync_threads()  # warp_sums is rewritten by the next chunk
            rule[0] = 0
            if fit_waves > 0:
                stats = T.alloc_local((3, n_candidates), "int32")
                warp_stats = T.alloc_shared((threads // 32, 3, n_candidates), "int32")
                score = T.alloc_local((2,), "int64")
                pick_candidate((batch, threads, tx),
                               lambda b: tiles(cache_seqlens, b)[1], all_tiles,
                               target_slots, n_slots, n_candidates, rule, stats, warp_stats,
                               score)
            carry[0] = 0
            for size_class in T.serial(SIZE_CLASSES):
                for c in T.serial(T.ceildiv(batch, threads)):
                    count[0] = 0
                    per[0] = 0
                    if c * threads + tx < batch:
                        count[0] = candidate_count(tiles(cache_seqlens, c * threads + tx)[1],
                                                   all_tiles[0], target_slots, rule[0])
                        per[0] = T.ceildiv(tiles(cache_seqlens, c * threads + tx)[1], count[0])
                        if split_class(per[0], target_slots * T.max(rule[0], 1),
                                       all_tiles[0]) != size_class:
                            count[0] = 0
                    exclusive_offsets(count, tx, threads, warp_sums, first, total)
                    if count[0] > 0:
                        split_ends[c * threads + tx] = carry[0] + first[0] + count[0]
                    # the chunk's slots written by all threads, each finding its slot's
                    # request by a binary search of the runs' starts (a request of 66
                    # splits written by its one thread took ~2 us at batch 1)
                    runs[0, tx] = first[0]
                    runs[1, tx] = count[0]
                    runs[2, tx] = per[0]
                    runs[3, tx] = tiles(cache_seqlens, T.min(c * threads + tx, batch - 1))[0]
                    T.sync_threads()
                    for r in T.serial(T.ceildiv(total[0], threads)):
                        if r * threads + tx < total[0]:
                            # the request: the last thread whose runs start at or
                            # before this slot (its count > 0: those after start later)
                            owner[0] = 0
                            for step in T.unroll(threads.bit_length() - 1):
                                if runs[0, owner[0] + (threads >> (step + 1))] <= r * threads + tx:
                                    owner[0] = owner[0] + (threads >> (step + 1))
                            fill_slot(slot_table, n_slots, carry[0] + r * threads + tx,
                                      c * threads + owner[0],
                                      r * threads + tx - runs[0, owner[0]], runs[1, owner[0]],
                                      runs[2, owner[0]], runs[3, owner[0]])
                    carry[0] = carry[0] + total[0]
                    T.sync_threads()
            for r, j in T.grid(T.ceildiv(n_slots, threads), 4):
                if r * threads + tx < n_slots and r * threads + tx >= carry[0]:
                    slot_table[r * threads + tx, j] = T.if_then_else(j == 0, -1, 0)

    return decode_schedule


# Waves of CTAs the planned schedule spreads a gathered-page program's splits over. Those
# programs hold 2-3 CTAs an SM, each streaming its keys at about an SM's share of HBM, so
# a long request split for one wave still finishes long after the rest (H200, Llama-3.1-8B
# page 16: 64 mixed lengths 512-16K 461.6 -> 352.9 us with 4 waves, 63 x 2K + one 128K
# 500.1 -> 263.7; uniform batches unchanged, 8 waves split them: 257.5 -> 263.9). The TMA
# programs keep one wave: with 4, batch 1 x 128K at page 64 went 139.2 -> 160.2 us.
GATHERED_SPLIT_WAVES = 4


def split_waves(config: DecodeConfig) -> int:
    """Waves of CTAs the planned schedule spreads `config`'s splits over (a wave: one CTA
    an SM)."""
    return GATHERED_SPLIT_WAVES if config.gather else config.ctas_per_sm


def target_slots(kv_heads: int, blocks: int, sms: int = SMS) -> int:
    """Splits the schedule spreads over a batch per wave: one wave of (KV head, row block)
    CTAs at one CTA an SM (a gathered program's schedule takes `split_waves` of them)."""
    return max(1, sms // (kv_heads * blocks))


def slot_count(batch: int, kv_heads: int, blocks: int, sms: int = SMS, waves: int = 1) -> int:
    """Slots a planned batch can use: `waves` waves of the schedule's target plus one per
    request."""
    return batch + waves * target_slots(kv_heads, blocks, sms)


class DecodeAttentionKernel(Kernel):
    """key: dtype, heads, kv_heads, head_dim, q_len, page_size (0: contiguous), window_left
    (-1: none), softcap (0: none), causal, kv_dtype for an fp8 cache only (absent: the
    cache is in q's dtype) and kv_layout "HND" for a heads-first cache only (absent: NHD).
    Bucket: "direct" (one split) or "split"."""

    name = "decode_attention"
    Config = DecodeConfig

    def program(self, config: DecodeConfig, bucket: str):
        k = self.key
        split = bucket == "split"
        main = decode_program(k["heads"], k["kv_heads"], k["head_dim"], k["q_len"],
                              k["page_size"], k["dtype"], k["window_left"], k["softcap"],
                              k["causal"], split, config, kv_dtype=k.get("kv_dtype"),
                              heads_first=k.get("kv_layout") == "HND")
        if not split:
            return main
        # packed queries: the partials are [T, 1, H, splits, D], the one-token layout
        return main, combine_program(k["heads"], k["head_dim"], max(k["q_len"], 1), k["dtype"])

    def bucket_of(self, n_splits: int) -> str:
        return "split" if n_splits > 1 else "direct"

    def pass_configs(self, config: DecodeConfig, program_index: int) -> dict:
        # gathered pages: a cp.async pipeline of all threads (TileLang's warp specialization
        # would hand the gather to a producer of 24 registers a thread)
        if program_index == 0 and config.producer_gather:
            # its own warp specialization; the tile-range lets kept (as below)
            return {"tl.Simplify": {"enable_simplify_let_inline": False}}
        if config.gather and program_index == 0:  # (the attention program)
            # TileLang's simplifier would inline the tile-range lets into every gathered
            # index: each cp.async then re-derived its row from three dependent global loads
            # (slot_table -> cache_seqlens -> block_table), and with a window it ground on
            # them for 4-5 minutes a program (26 s with the lets kept)
            return {"tl.disable_warp_specialized": True,
                    "tl.Simplify": {"enable_simplify_let_inline": False}}
        return {}

    def heuristic_config(self, bucket: str, arch: str) -> DecodeConfig:
        # 64 KiB of K and V per stage at head_dim 128 (one CTA per SM, two stages in
        # flight); head_dim 256 halves the tile to stay within shared memory
        block_n = tile_keys(self.key["head_dim"])
        page = self.key["page_size"]
        if 0 < page < 32 and "kv_dtype" not in self.key:
            # Pages of 16 keys as one TMA copy (and barrier) per page and 64 columns cost a
            # 128-key tile 16 waits (64-key tiles were faster: 582.1 -> 491.9 us, Llama-3.1-8B
            # batch 64 x 4K). Gathered row by row by cp.async instead (all threads, one
            # stage), 128-key tiles win: 435.2 -> 426.2 us against the 64-key hoisted tile
            # (8B batch 64 x 4K); chunked prefill (packed queries) 11035 -> 8766 with 64-key
            # tiles. With the tile-range lets kept (each cp.async had re-derived its row
            # from three dependent global loads): 426.2 -> 256.5 us (96% of HBM), 256 x 1K
            # 447.4 -> 278.4, Qwen3-32B 64 x 8K 825.1 -> 496.0. Sliding windows too (their
            # gathered programs passed the H200 tests with these lets). fp8 caches keep the
            # TMA tiles (not measured gathered).
            return DecodeConfig(block_n=block_n if self.key["q_len"] > 0 else 64,
                                stages=1, gather=True)
        if "kv_dtype" in self.key:
            # fp8: a producer warpgroup fetches and widens each tile, the consumers attend
            # as over fp16 (H200, bf16 queries, head_dim 128, where `producer_tested`):
            # 8B 64 x 4K page 16 271.2 -> 232.7 us, 8B 1 x 128K 133.6 -> 130.3, 70B 16 x 32K
            # 472.9 -> 460.1 (1.11x, 1.07x, 1.09x the 16-bit cache)
            config = DecodeConfig(block_n=64, stages=3, producer_gather=True, ctas_per_sm=2)
            if self.producer_tested() and self.fitting([config]):
                return config
            # Before it the key loop was bound by its consumer warpgroup (widening, wgmmas,
            # softmax), not HBM, so two CTAs an SM on 64-key tiles overlap two of them: 70B
            # 16 x 32K 590.3 -> 463.7 us, 8B 64 x 4K page 16 391.9 -> 269.8, 8B 1 x 128K
            # 172.3 -> 132.6 (1.05x, 0.94x, 1.03x the 16-bit cache; key-major 520.9,
            # 296.2, 143.2)
            config = DecodeConfig(block_n=64, stages=3, hoist_pages=0 < page < 64,
                                  ctas_per_sm=2)
            if not self.fitting([config]):  # head_dim 256: one CTA an SM
                config = DecodeConfig(block_n=64, stages=2, hoist_pages=0 < page < 64)
            return config
        # a tile of several pages binds its page ids once, ahead of the producer's waits:
        # 487.0 -> 431.6 us (8B batch 64 x 4K, page 16), 960.2 -> 848.1 (Qwen3-32B 64 x 8K)
        return DecodeConfig(block_n=block_n, stages=2, hoist_pages=0 < page < block_n)

    def config_space(self, bucket: str) -> list[DecodeConfig]:
        space = [self.heuristic_config(bucket, "sm_90a")]
        for block_n in (64, 128):
            for stages in (2, 3, 4):
                space.append(DecodeConfig(block_n, stages))
        if "kv_dtype" in self.key:  # two CTAs an SM (64-key tiles fit them), key-major
            space += [DecodeConfig(64, stages, ctas_per_sm=2, key_major=major)
                      for stages in (2, 3) for major in (False, True)]
            space.append(DecodeConfig(64, 2, ctas_per_sm=3, key_major=True))
        page = self.key["page_size"]
        # tiles of several pages again with the page ids hoisted (the default's choice)
        space += [dataclasses.replace(c, hoist_pages=True) for c in space
                  if 0 < page < c.block_n]
        if "kv_dtype" in self.key:  # widened by a producer warpgroup (no hoisting to do)
            space += [DecodeConfig(64, stages, producer_gather=True, ctas_per_sm=ctas)
                      for stages in (2, 3, 4) for ctas in (1, 2)]
            # key-major consumers: the group's rows padded to 16, not 64 (a quarter of the
            # wgmma work at 4 query heads a KV head), now that they no longer widen
            space += [DecodeConfig(64, stages, producer_gather=True, ctas_per_sm=ctas,
                                   key_major=True) for stages in (2, 3) for ctas in (2, 3)]
            # V fetched with K: twice the bytes in flight a producer
            space += [dataclasses.replace(c, fetch_both=True) for c in space
                      if c.producer_gather]
            # the fp8 tiles landing by TMA in a ring, land_stages - 1 tiles ahead of the
            # widening (its loads no longer wait for a free stage)
            space += [DecodeConfig(64, stages, producer_gather=True, ctas_per_sm=ctas,
                                   key_major=major, land_stages=land)
                      for major, land, stages, ctas in (
                          (True, 4, 2, 1), (True, 3, 1, 2), (True, 2, 2, 2), (True, 4, 1, 2),
                          (False, 3, 2, 1), (False, 2, 2, 2))]
        if 0 < page < 64 and "kv_dtype" not in self.key:
            # gathered pages (the page-16 default); one stage: with more, TileLang 0.1.15's
            # software pipeline over the symbolic tile count fails in codegen
            space += [DecodeConfig(block_n, 1, gather=True) for block_n in (64, 128)]
        return self.fitting(space)

    def producer_tested(self) -> bool:
        """Whether the key lies where producer_gather's programs have passed the H200 tests
        and been measured (thirty-seventh session: head_dim 128, one query token a request
        or packed chunks, no window, no soft cap, NHD caches), so it may be the default.
        Elsewhere they stay in the space until tests/ops/test_decode_attention.py runs
        them by default (.gpu plan: the fp8 and chunk tests with these defaults)."""
        k = self.key
        return (k["head_dim"] == 128 and k["q_len"] <= 1 and k["window_left"] < 0
                and k["softcap"] == 0 and k.get("kv_layout") != "HND")

    def fitting(self, space: list[DecodeConfig]) -> list[DecodeConfig]:
        """`space` without repeats, shared-memory overflows, tiles that cut pages and
        key-major programs of packed queries."""
        page = self.key["page_size"]
        if self.key["q_len"] == 0:
            space = [c for c in space if not c.key_major]
        # (key-major 128-key tiles: TileLang 0.1.15's reduce cannot lower the column
        # reduction over two m64 wgmma tiles)
        space = [c for c in space if not c.key_major or c.block_n == 64]
        group = self.key["heads"] // self.key["kv_heads"]

        def smem(c: DecodeConfig) -> int:
            rows = key_major_rows(group, self.key["q_len"], c.block_m) if c.key_major else None
            return c.smem_bytes(self.key["head_dim"], fp8="kv_dtype" in self.key, rows=rows)

        return [c for c in dict.fromkeys(space) if c.ctas_per_sm * smem(c) <= SMEM_LIMIT
                and (page == 0 or page >= c.block_n or c.block_n % page == 0)]

    def run(self, config: DecodeConfig, compiled: tuple, q, k, v, block_table, cache_seqlens,
            cu_seqlens_q, k_scale, v_scale, o, lse, o_part, lse_part, row_blocks: int,
            scale: float) -> None:
        if len(compiled) == 1:
            compiled[0](q, k, v, block_table, cache_seqlens, cu_seqlens_q, k_scale, v_scale, o,
                        lse, row_blocks, scale)
        else:
            compiled[0](q, k, v, block_table, cache_seqlens, cu_seqlens_q, k_scale, v_scale,
                        o_part, lse_part, row_blocks, scale)
            compiled[1](o_part, lse_part, o, lse)


LONG_CHUNK = 64  # packed chunks from this many tokens take ChunkedPrefillKernel


class ChunkedPrefillKernel(DecodeAttentionKernel):
    """Packed queries (q_len 0 in the key) when the longest chunk has LONG_CHUNK tokens or
    more: then the key loop is compute-bound, so each CTA takes 128 (token, head) rows on
    two consumer warpgroups, as the dense forward does. K/V tiles arrive by TMA from a
    producer warpgroup (a copy per page and 64 columns, the page ids hoisted), except for
    16-bit caches with pages under 32 keys and fp8 caches, whose default (where
    `producer_tested`) is `producer_gather`: the hand-written producer gathers by cp.async
    (or widens fp8) into 2-3 stages, overlapping the wgmmas; elsewhere pages under 32 keys
    gather by cp.async from all threads (faster than 32 TMA copies a tile).
    Same key, buckets and program as DecodeAttentionKernel; the op passes row blocks of
    ROWS rows (`row_blocks`)."""

    name = "chunked_prefill_attention"

    def heuristic_config(self, bucket: str, arch: str) -> DecodeConfig:
        block_n = tile_keys(self.key["head_dim"])
        page = self.key["page_size"]
        fp8 = "kv_dtype" in self.key
        # A producer warpgroup gathering (16-bit pages) or widening (fp8) into 2-3 stages,
        # H200, bf16 queries, head_dim 128 (where `producer_tested`):
        # 16-bit page 16, Qwen3-32B 4 x 2K chunks over 8K 6914 -> 3886 us (3 stages), the
        # Llama-8B mixed step 879 -> 558; fp8 page 16 (Qwen3-32B) 7119 -> 4081 (2 stages),
        # fp8 page 64 (8B, 512 tokens over 32K) 838 -> 591
        if self.producer_tested() and (fp8 or 0 < page < 32):
            config = DecodeConfig(block_n=block_n, stages=2 if fp8 else 3,
                                  producer_gather=True, block_m=2 * ROWS)
            if self.fitting([config]):
                return config
        if 0 < page < 32 and not fp8:
            # H200, bf16, against the TMA tiles (32 copies and barriers per 128-key K/V
            # tile at page 16): Qwen3-32B 4 x 2K chunks over 8K 7073 -> 6875 us; the
            # Llama-8B mixed step (3 chunks, 8 decode tokens) 1308 -> 880 (64-row gathered
            # tiles: 8691 and 917)
            return DecodeConfig(block_n=block_n, stages=1, gather=True, block_m=2 * ROWS)
        # page 64: Llama-8B 512 tokens over 32K 528 us, 0.90x the dense varlen forward
        return DecodeConfig(block_n=block_n, stages=2, hoist_pages=0 < page < block_n,
                            block_m=2 * ROWS)

    def config_space(self, bucket: str) -> list[DecodeConfig]:
        page = self.key["page_size"]
        space = [self.heuristic_config(bucket, "sm_90a")]
        space += [DecodeConfig(block_n, stages, hoist_pages=0 < page < block_n,
                               block_m=2 * ROWS)
                  for block_n in (64, 128) for stages in (1, 2, 3)]
        if 0 < page < 64 and "kv_dtype" not in self.key:
            space += [DecodeConfig(block_n, 1, gather=True, block_m=2 * ROWS)
                      for block_n in (64, 128)]
        # the producer's gather (16-bit pages shorter than a tile) or widening (fp8)
        space += [DecodeConfig(block_n, stages, producer_gather=True, block_m=2 * ROWS)
                  for block_n in (64, 128) for stages in (2, 3)
                  if "kv_dtype" in self.key or 0 < page < min(block_n, 64)]
        if 0 < page < 64 and "kv_dtype" not in self.key:  # the producer's pages by TMA
            space += [DecodeConfig(128, stages, producer_gather=True, producer_tma=True,
                                   block_m=2 * ROWS) for stages in (2, 3)]
        return self.fitting(space)

    def run(self, config: DecodeConfig, compiled: tuple, q, k, v, block_table, cache_seqlens,
            cu_seqlens_q, k_scale, v_scale, o, lse, o_part, lse_part, row_blocks: int,
            scale: float) -> None:
        # ceil(ceil(x / ROWS) / m) = ceil(x / (ROWS m)): the op's ROWS-row blocks in ours
        super().run(config, compiled, q, k, v, block_table, cache_seqlens, cu_seqlens_q,
                    k_scale, v_scale, o, lse, o_part, lse_part,
                    -(-row_blocks * ROWS // config.block_m), scale)


class PlannedDecodeKernel(DecodeAttentionKernel):
    """The planned decode (q [B, q_len, H, D]): the schedule, the attention over per-request
    splits and the combine. Same key and configs as DecodeAttentionKernel (q_len >= 1);
    one bucket."""

    name = "decode_attention_planned"
    workspace_args = frozenset({6, 7, 12, 13})  # slot_table, split_ends, o_part, lse_part

    def program(self, config: DecodeConfig, bucket: str):
        k = self.key
        return (schedule_program(k["q_len"], config.block_n, k["window_left"], k["causal"]),
                decode_program(k["heads"], k["kv_heads"], k["head_dim"], k["q_len"],
                               k["page_size"], k["dtype"], k["window_left"], k["softcap"],
                               k["causal"], True, config, planned=True,
                               kv_dtype=k.get("kv_dtype"),
                               heads_first=k.get("kv_layout") == "HND"),
                combine_program(k["heads"], k["head_dim"], k["q_len"], k["dtype"],
                                planned=True))

    def bucket_of(self, size: int) -> str:
        return "planned"

    def pass_configs(self, config: DecodeConfig, program_index: int) -> dict:
        # (the attention is program 1 here, after the schedule)
        return super().pass_configs(config, program_index - 1)

    def run(self, config: DecodeConfig, compiled: tuple, schedule: bool, q, k, v, block_table,
            cache_seqlens, slot_table, split_ends, k_scale, v_scale, o, lse, o_part, lse_part,
            row_blocks: int, target: int, scale: float) -> None:
        """With `schedule`, recomputes the split counts from cache_seqlens first; q None:
        the schedule only."""
        if schedule:  # `target`: one wave; the buffers hold GATHERED_SPLIT_WAVES of them
            compiled[0](cache_seqlens, slot_table, split_ends, target * split_waves(config))
        if q is None:
            return
        compiled[1](q, k, v, block_table, cache_seqlens, slot_table, k_scale, v_scale, o, lse,
                    o_part, lse_part, row_blocks, scale)
        compiled[2](o_part, lse_part, slot_table, split_ends, o, lse)
