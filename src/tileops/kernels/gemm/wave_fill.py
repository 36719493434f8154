"""Wave fill: whole waves of output tiles as usual, the last partial wave's tiles split over K.

A grid of T output tiles on 132 SMs takes ceil(T / 132) waves; when the last wave is
nearly empty (T = 140: 8 tiles in a second wave) most of the GPU idles through it. Here
the first W = 132 * floor(T / 132) tiles run whole, one CTA each, and each of the T - W
left over is cut into `split` pieces along K, so the tail is short and fills the SMs.

A piece stores its fp32 partial tile into its own slot and counts itself in (release);
when all `split` pieces of its tile are in (acquire), each sums one stripe of rows over
the tile's slots, in piece order, and stores it. So the whole GEMM is one launch with no
reduce kernel, no atomics on the data and a reproducible sum. The pieces wait for each
other, which needs them resident together: they are the grid's last CTAs, at most one
wave of them (`partition`), and CTAs that do not wait (the whole tiles) free the SMs they
queue for. The last piece to leave resets its tile's counts for the next launch (the
`workspace.zeroed_scratch` protocol).

The partition depends on M (symbolic), so the host computes it per call (`partition`) and
passes it as two scalars; the grid is the kernel's own expression of them.
"""

import functools

import tilelang.language as T
import torch

from ..workspace import scratch, zeroed_scratch

MIN_PIECE_STEPS = 4  # K tiles a piece keeps: fewer spend more on the pipeline fill than the loop
MAX_SPLIT = 8        # pieces of one tile: each stripe is block_m / split rows
# TileLang's pass config for the program: no inserted bounds guards. Its guarded loads of
# the slots serialized the merge (measured: a fixed ~20 us a launch); every access is in
# bounds by construction, the output's edge stores carry their own guards, and whole
# tiles leave by TMA stores (clipped by the hardware) or by guarded register stores.
SAFE_MEMORY_OFF = {"tl.disable_safe_memory_legalize": True}


@functools.lru_cache(maxsize=4096)
def partition(tiles: int, k_tiles: int, sms: int) -> tuple[int, int]:
    """(whole tiles, pieces per left-over tile) for `tiles` output tiles of `k_tiles` K
    steps on `sms` SMs. (tiles, 1) when the last wave is full enough, or K too short."""
    whole = tiles - tiles % sms
    left = tiles - whole
    if left == 0:
        return tiles, 1
    split = min(sms // left, MAX_SPLIT, k_tiles // MIN_PIECE_STEPS)
    # every piece gets >= 1 K step: ceil(k_tiles / split) * (split - 1) < k_tiles
    while split > 1 and -(-k_tiles // split) * (split - 1) >= k_tiles:
        split -= 1
    return (whole, split) if split > 1 else (tiles, 1)


_merge_views: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def merge_buffers(device: torch.device, block_m: int, block_n: int,
                  sms: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The current stream's fp32 partial slots [sms, block_m, block_n] (at most one wave of
    pieces) and zeroed int32 counts [2, sms // 2] (arrivals and departures; a tile splits
    only when it gets >= 2 pieces, so at most sms // 2 tiles merge at once). The views
    are built once per buffer (a view costs host time on every call)."""
    pieces, tiles = sms, max(sms // 2, 1)
    flat = scratch(device, pieces, block_m * block_n, torch.float32)
    counts = zeroed_scratch(device, 2, tiles, torch.int32)
    key = (flat.data_ptr(), counts.data_ptr(), block_m, block_n, sms)
    views = _merge_views.get(key)
    if views is None:
        views = _merge_views[key] = (
            flat.view(-1)[:pieces * block_m * block_n].view(pieces, block_m, block_n),
            counts.view(-1)[:2 * tiles].view(2, tiles))  # (kernels take packed tensors)
    return views


def wave_fill_program(n: int, k: int, dtype: str, trans_a: bool, trans_b: bool,
                      block_m: int, block_n: int, block_k: int, stages: int, threads: int,
                      raster: int, stage_out: bool, has_bias: bool, k_loop, tile_store):
    """The one-launch program: (a, b[, bias], d, slots, counts, whole, split): slots fp32
    [>= pieces, block_m, block_n], counts int32 [2, >= left-over tiles], zero before the
    launch and after it (`merge_buffers`). Tiles are taken in panels of `raster` row tiles
    (L2 reuse of the weight columns), whole tiles first."""
    m = T.dynamic("m")
    pieces, used = T.dynamic("pieces"), T.dynamic("used")
    k_tiles = -(-k // block_k)
    tiles_n = -(-n // block_n)
    a_shape = (k, m) if trans_a else (m, k)
    b_shape = (n, k) if trans_b else (k, n)
    a_tile = (block_k, block_m) if trans_a else (block_m, block_k)
    b_tile = (block_n, block_k) if trans_b else (block_k, block_n)
    panel = max(raster, 1)
    stripe_rows = block_m // 2  # the tallest stripe: a tile splits in >= 2 pieces
    main_loop = k_loop(dtype, trans_a, trans_b, block_m, block_n, block_k, stages)
    store = tile_store(n, block_m, block_n, has_bias, stage_out)

    @T.macro
    def body(a, b, bias, d, slots, counts, whole, split):
        tiles = T.ceildiv(m, block_m) * tiles_n
        with T.Kernel(whole + (tiles - whole) * split, threads=threads) as cta:
            a_shared = T.alloc_shared(a_tile, dtype)
            b_shared = T.alloc_shared(b_tile, dtype)
            acc = T.alloc_fragment((block_m, block_n), "float")
            d_shared = T.alloc_shared((block_m, block_n), dtype) if stage_out else None
            stripe_sum = T.alloc_fragment((stripe_rows, block_n), "float")
            left = T.alloc_shared((1,), "int32")
            # This CTA's tile and K range, computed once by one thread into shared memory:
            # inline, TileLang would recompute the divisions for every TMA copy of the
            # producer's loop (dozens of integer divisions a K step, more than a step's
            # wgmma time). Every operand is non-negative: truncating division is floor.
            where = T.alloc_shared((6,), "int32")
            tx = T.get_thread_binding()
            if tx == 0:
                piece = T.max(cta - whole, 0)
                slot = T.truncdiv(piece, split)
                tile = T.if_then_else(cta >= whole, whole + slot, cta)
                part = T.if_then_else(cta >= whole, T.truncmod(piece, split), 0)
                steps = T.if_then_else(cta >= whole, T.truncdiv(k_tiles + split - 1, split),
                                       k_tiles)
                # tile -> (row tile, column tile), panel by panel of `panel` row tiles
                first = T.truncdiv(tile, panel * tiles_n) * panel
                rows = T.min(panel, T.truncdiv(m + block_m - 1, block_m) - first)
                where[0] = first + T.truncmod(T.truncmod(tile, panel * tiles_n), rows)
                where[1] = T.truncdiv(T.truncmod(tile, panel * tiles_n), rows)
                where[2] = part * steps
                where[3] = T.min(steps, k_tiles - part * steps)
                where[4] = part
                where[5] = slot
            T.sync_threads()
            tm, tn, k0, k_steps, part, slot = (where[0], where[1], where[2], where[3],
                                               where[4], where[5])
            piece = cta - whole
            T.clear(acc)
            main_loop(a, b, a_shared, b_shared, acc, tm, tn, k0, k_steps)
            if cta < whole:
                store(acc, d_shared, bias, tn, d[tm * block_m, tn * block_n])
            else:
                T.copy(acc, slots[piece, 0, 0])
                T.sync_threads(1, threads)  # every thread's partial precedes the count
                if tx == 0:
                    T.atomic_add(counts[0, slot], 1, memory_order="release")
                    while T.atomic_load(counts[0, slot], memory_order="acquire") < split:
                        pass
                T.sync_threads(1, threads)
                # this piece's stripe of rows, summed over the tile's pieces in order
                row0 = part * T.truncdiv(block_m + split - 1, split)
                height = T.min(T.truncdiv(block_m + split - 1, split), block_m - row0)
                T.clear(stripe_sum)
                # unguarded loads (rows past the stripe clamped into the slot; the program
                # is built without TileLang's guards, `SAFE_MEMORY_OFF`): a guard per load
                # made each one wait for the one before it
                for q in T.serial(split):
                    for i, j in T.Parallel(stripe_rows, block_n):
                        stripe_sum[i, j] += slots[piece - part + q,
                                                  T.min(row0 + i, block_m - 1), j]
                for i, j in T.Parallel(stripe_rows, block_n):
                    row = tm * block_m + row0 + i
                    col = tn * block_n + j
                    if i < height and row < m and col < n:
                        if has_bias:
                            d[row, col] = T.cast(stripe_sum[i, j] + T.cast(bias[col], "float"),
                                                 dtype)
                        else:
                            d[row, col] = T.cast(stripe_sum[i, j], dtype)
                T.sync_threads(1, threads)  # the slots are read before we leave
                if tx == 0:
                    left[0] = T.atomic_add(counts[1, slot], 1, memory_order="acq_rel",
                                           return_prev=True)
                    if left[0] == split - 1:  # the last to leave: the counts are free
                        counts[0, slot] = 0
                        counts[1, slot] = 0

    if has_bias:
        @T.prim_func
        def gemm_wave_fill_bias(a: T.Tensor(a_shape, dtype), b: T.Tensor(b_shape, dtype),
                                bias: T.Tensor((n,), dtype), d: T.Tensor((m, n), dtype),
                                slots: T.Tensor((pieces, block_m, block_n), "float"),
                                counts: T.Tensor((2, used), "int32"), whole: T.int32,
                                split: T.int32):
            body(a, b, bias, d, slots, counts, whole, split)
        return gemm_wave_fill_bias

    @T.prim_func
    def gemm_wave_fill(a: T.Tensor(a_shape, dtype), b: T.Tensor(b_shape, dtype),
                       d: T.Tensor((m, n), dtype),
                       slots: T.Tensor((pieces, block_m, block_n), "float"),
                       counts: T.Tensor((2, used), "int32"), whole: T.int32, split: T.int32):
        body(a, b, None, d, slots, counts, whole, split)
    return gemm_wave_fill
