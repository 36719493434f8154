"""Wave fill: whole waves of output tiles as usual, the last partial wave's tiles split over K.

A grid of T output tiles on 132 SMs takes ceil(T / 132) waves; when the last wave is
nearly empty (T = 140: 8 tiles in a second wave) most of the GPU idles through it. Here
the first W = 132 * floor(T / 132) tiles run whole, one CTA each, and each of the T - W
left over is cut into `split` pieces along K, so the tail is short and fills the SMs.
A piece adds its fp32 partial tile into a zeroed slot by vector atomics (red.add), then
counts itself in with an acquire-release atomic; the piece that arrives last reads the
slot's sum, stores the output tile, and zeroes the slot and its count again (the buffers
come from `workspace.zeroed_scratch`, one per stream). So the whole GEMM is one launch: no
fp32 partials of the full output and no reduce kernel, as the plain split-K needs.

The partition depends on M (symbolic), so the host computes it per call
(`partition`) and passes it as two scalars; the grid is the kernel's own expression of
them. CTAs run in launch order, so the pieces run as the whole tiles drain.
"""

import functools

import tilelang.language as T
import torch

from ..workspace import zeroed_scratch

MIN_PIECE_STEPS = 4  # K tiles a piece keeps: fewer spend more on the pipeline fill than the loop
MAX_SPLIT = 8        # pieces of one tile: more would queue their atomics on the same slot


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
    """The zeroed merge slots fp32 [sms // 2, block_m, block_n] and counts int32 [sms // 2]
    of the current stream: pieces exist only when each left-over tile gets >= 2 of them
    within one wave, so at most sms // 2 tiles are merged at once. The views are built once
    per buffer (a view costs host time on every call)."""
    used = max(sms // 2, 1)
    flat = zeroed_scratch(device, used, block_m * block_n, torch.float32)
    counts = zeroed_scratch(device, 1, used, torch.int32)
    key = (flat.data_ptr(), counts.data_ptr(), block_m, block_n, used)
    views = _merge_views.get(key)
    if views is None:
        views = _merge_views[key] = (
            flat.view(-1)[:used * block_m * block_n].view(used, block_m, block_n),
            counts[0, :used])
    return views


def wave_fill_program(n: int, k: int, dtype: str, trans_a: bool, trans_b: bool,
                      block_m: int, block_n: int, block_k: int, stages: int, threads: int,
                      raster: int, stage_out: bool, has_bias: bool, k_loop, tile_store):
    """The one-launch program: (a, b[, bias], d, slots, counts, whole, split). slots is
    fp32 [>= left-over tiles, block_m, block_n] and counts int32 [>= left-over tiles]
    (`merge_buffers`), both zero before the launch and after it. Tiles are taken in panels
    of `raster` row tiles (L2 reuse of the weight columns), whole tiles first."""
    m = T.dynamic("m")
    used = T.dynamic("used")
    k_tiles = -(-k // block_k)
    tiles_n = -(-n // block_n)
    a_shape = (k, m) if trans_a else (m, k)
    b_shape = (n, k) if trans_b else (k, n)
    a_tile = (block_k, block_m) if trans_a else (block_m, block_k)
    b_tile = (block_n, block_k) if trans_b else (block_k, block_n)
    panel = max(raster, 1)
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
            arrived = T.alloc_shared((1,), "int32")
            tx = T.get_thread_binding()
            is_piece = cta >= whole
            piece = T.max(cta - whole, 0)
            slot = piece // split
            tile = T.if_then_else(is_piece, whole + slot, cta)
            part = T.if_then_else(is_piece, piece % split, 0)
            steps = T.if_then_else(is_piece, T.ceildiv(k_tiles, split), k_tiles)
            k0 = part * steps
            # tile -> (row tile, column tile), panel by panel of `panel` row tiles
            tiles_m = T.ceildiv(m, block_m)
            first = tile // (panel * tiles_n) * panel
            rows = T.min(panel, tiles_m - first)
            tm = first + tile % (panel * tiles_n) % rows
            tn = tile % (panel * tiles_n) // rows
            T.clear(acc)
            main_loop(a, b, a_shared, b_shared, acc, tm, tn, k0, T.min(steps, k_tiles - k0))
            arrived[0] = 0
            if is_piece:
                for i, j in T.Parallel(block_m, block_n):
                    T.atomic_add(slots[slot, i, j], acc[i, j])
                T.sync_threads(1, threads)  # every thread's adds precede the count
                if tx == 0:
                    # release: the adds are in before we count; acquire: the last sees all
                    arrived[0] = T.atomic_add(counts[slot], 1, memory_order="acq_rel",
                                              return_prev=True) + 1
                T.sync_threads(1, threads)
                if arrived[0] == split:
                    for i, j in T.Parallel(block_m, block_n):
                        acc[i, j] = slots[slot, i, j]
                        slots[slot, i, j] = T.float32(0)
                    if tx == 0:
                        counts[slot] = 0
            if arrived[0] == split or not is_piece:
                store(acc, d_shared, bias, tn, d[tm * block_m, tn * block_n])

    if has_bias:
        @T.prim_func
        def gemm_wave_fill_bias(a: T.Tensor(a_shape, dtype), b: T.Tensor(b_shape, dtype),
                                bias: T.Tensor((n,), dtype), d: T.Tensor((m, n), dtype),
                                slots: T.Tensor((used, block_m, block_n), "float"),
                                counts: T.Tensor((used,), "int32"), whole: T.int32,
                                split: T.int32):
            body(a, b, bias, d, slots, counts, whole, split)
        return gemm_wave_fill_bias

    @T.prim_func
    def gemm_wave_fill(a: T.Tensor(a_shape, dtype), b: T.Tensor(b_shape, dtype),
                       d: T.Tensor((m, n), dtype),
                       slots: T.Tensor((used, block_m, block_n), "float"),
                       counts: T.Tensor((used,), "int32"), whole: T.int32, split: T.int32):
        body(a, b, None, d, slots, counts, whole, split)
    return gemm_wave_fill
