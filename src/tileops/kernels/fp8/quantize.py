"""fp8 (e4m3) quantization: x_fp8 = saturate(x / scale), scales in fp32.

Granularities (x is [M, K]; M symbolic, K compiled in):
- "group": one scale per row and `group` consecutive columns (DeepSeek-V3's 1x128 activation
  groups). Scales are stored M-major, a [K / group, M] buffer, which the op returns as the
  [M, K / group] view with strides (1, M): the layout torch._scaled_mm's blockwise path takes
  and the one the block-scaled GEMM reads with coalesced loads.
- "row": one scale per row ([M, 1]).
- "tensor": one scale. Dynamic: a first kernel writes the absmax of each of `PARTIALS`
  row slices, the quantizing kernel reduces those in every CTA (no atomics, no memset, no
  host sync; deterministic).

Dynamic scales are amax / 448 (torch's recipe, computed as torch does on CUDA: amax times
the fp32 reciprocal of 448), floored at AMAX_FLOOR / 448 so an all-zero
group quantizes to zeros rather than 0 / 0. Static scales (given) are used as they come.
Values are divided by the scale in fp32 (IEEE division, as torch) and rounded to nearest
even by the `satfinite` conversion, which is the saturation: finite values and +-inf past
448 become +-448, NaN stays NaN. (An explicit clamp would lose NaN: fminf(NaN, 448) = 448,
and TileLang folds a `v != v` guard away.) So the result equals torch's
`(x.float() / scale).clamp(-448, 448).to(float8_e4m3fn)` bit for bit, NaN included.
"""

import dataclasses
from dataclasses import dataclass

import numpy as np
import tilelang.language as T

from .. import fast_math
from ..base import Kernel

E4M3_MAX = 448.0
INV_E4M3_MAX = float(np.float32(1.0) / np.float32(E4M3_MAX))  # exactly representable in fp32
AMAX_FLOOR = 1e-12
PARTIALS = 256  # row slices of the per-tensor absmax pass (~2 CTAs per H200 SM)
FP8 = "float8_e4m3fn"


@dataclass(frozen=True)
class QuantConfig:
    block_m: int = 32
    block_k: int = 128
    threads: int = 128
    # > 1: that many CTAs made resident on an SM together (__launch_bounds__' minimum
    # blocks: registers capped at 65536 / (ctas_per_sm x threads)), so a whole row of one
    # CTA is in flight while another's is reduced and stored
    ctas_per_sm: int = 1
    # per tensor, dynamic: the quantizing pass takes the row blocks bottom-up, the reverse
    # of the absmax pass's sweep, so it first re-reads the rows that pass read last, still
    # in L2 (x is read twice; over 50 MB only its last-read part can be there)
    reverse_rows: bool = False
    # divide by the scale through its reciprocal, computed once a row, and one fused
    # correction (fast_math.div_by): IEEE's quotient, bit for bit, in three instructions an
    # element instead of CUDA's division (eight and an SFU reciprocal)
    reciprocal: bool = False
    # per tensor, dynamic: the absmax pass keeps a running max per element slot and
    # reduces across the CTA once (absmax_program's in_lanes)
    absmax_in_lanes: bool = False


def _scale_of(amax):
    # torch's `amax / 448` on CUDA multiplies by the fp32 reciprocal (a division by a Python
    # scalar becomes a * (1 / b)); doing the same keeps the scales bit-identical to torch's
    return T.max(amax, AMAX_FLOOR) * INV_E4M3_MAX


def quantize_program(k: int, dtype: str, granularity: str, group: int, dynamic: bool,
                     block_m: int, block_k: int, threads: int, ctas_per_sm: int = 1,
                     reverse_rows: bool = False, reciprocal: bool = False):
    """The quantizing kernel. Parameters by granularity and mode:
    group/row dynamic: (x, y, scale_out[K/group or 1, M]); static: (x, scale, y, scale_out)
    with the given scale in scale_out's layout, copied to it (so the op's scales output is
    always its own tensor); tensor: (x, src, y, scale_out[1]) where src is the absmax
    partials [PARTIALS] (dynamic) or the given scale [1] (static)."""
    m = T.dynamic("m")
    if granularity == "group":
        block_k = group
    n_groups = k // group if granularity == "group" else 1
    k_tiles = k // block_k
    # group: a CTA per (group, row block); row: a CTA per row block, looping over K;
    # tensor: a CTA per (K tile, row block)
    grid_k = 1 if granularity == "row" else k_tiles
    tile = (block_m, block_k)
    # the tile holds each row's whole group: loaded once and kept in registers (a row
    # tile narrower than K reads the row twice, the second time from L2)
    whole = granularity == "group" or (granularity == "row" and k_tiles == 1)

    @T.macro
    def reciprocals(scale_local):
        """The scales' reciprocals for div_by (a fragment), or None without `reciprocal`."""
        if not reciprocal:
            return None
        fast_math.import_source()
        recip_local = T.alloc_fragment((block_m,), "float")
        for i in T.Parallel(block_m):
            recip_local[i] = fast_math.reciprocal_for_div_by(scale_local[i])
        return recip_local

    @T.macro
    def store_quantized(x_local, y, row0, kt, scale_local, recip_local, how):
        """y = saturate(x / scale) for the tile; how: "divide" (CUDA's IEEE division),
        "reciprocal" (div_by: scales known normal, zero or infinite), "checked" (div_by
        falling back to the division where a scale is none of those)."""
        y_local = T.alloc_fragment(tile, FP8)
        if how == "divide":
            for i, j in T.Parallel(block_m, block_k):
                # the cast saturates (satfinite) and keeps NaN: see the module docstring
                y_local[i, j] = T.cast(x_local[i, j], "float") / scale_local[i]
        else:
            # the quotients first, then the cast alone: a loop TileLang vectorizes (two
            # values a conversion), which a call in the same loop would prevent
            q_local = T.alloc_fragment(tile, "float")
            for i, j in T.Parallel(block_m, block_k):
                q_local[i, j] = fast_math.div_by(x_local[i, j], scale_local[i],
                                                 recip_local[i], how == "checked")
            T.copy(q_local, y_local)
        T.copy(y_local, y[row0, kt * block_k])

    @T.macro
    def row_absmax(x_local, amax_local, clear):
        abs_local = T.alloc_fragment(tile, "float")
        for i, j in T.Parallel(block_m, block_k):
            abs_local[i, j] = T.abs(T.cast(x_local[i, j], "float"))
        T.reduce_max(abs_local, amax_local, dim=1, clear=clear)

    @T.macro
    def per_row(x, y, scale_in, scale_out):
        """group and row granularity: a scale per row of the tile."""
        with T.Kernel(grid_k, T.ceildiv(m, block_m), threads=threads) as (bx, by):
            if ctas_per_sm > 1:
                T.annotate_min_blocks_per_sm(ctas_per_sm)
            row0 = by * block_m
            scale_local = T.alloc_fragment((block_m,), "float")
            x_local = T.alloc_fragment(tile, dtype)
            if whole:  # the tile is the group, or the whole row: x is read once
                T.copy(x[row0, bx * block_k], x_local)  # rows past M load as zero
            if dynamic:
                if whole:
                    row_absmax(x_local, scale_local, True)
                else:  # row in chunks: a first pass over K for the amax, the second re-reads
                    T.clear(scale_local)
                    for kt in T.serial(k_tiles):
                        T.copy(x[row0, kt * block_k], x_local)
                        row_absmax(x_local, scale_local, False)
                for i in T.Parallel(block_m):
                    scale_local[i] = _scale_of(scale_local[i])
                    if row0 + i < m:
                        scale_out[bx, row0 + i] = scale_local[i]
            else:
                for i in T.Parallel(block_m):
                    scale_local[i] = scale_in[bx, T.min(row0 + i, m - 1)]
                    if row0 + i < m:
                        scale_out[bx, row0 + i] = scale_local[i]
            recip_local = reciprocals(scale_local)
            # dynamic scales are amax / 448 >= the floor: normal, or infinite; given ones
            # may be anything, checked element by element
            how = "divide" if not reciprocal else "reciprocal" if dynamic else "checked"
            if whole:
                store_quantized(x_local, y, row0, bx, scale_local, recip_local, how)
            else:
                for kt in T.serial(k_tiles):
                    T.copy(x[row0, kt * block_k], x_local)
                    store_quantized(x_local, y, row0, kt, scale_local, recip_local, how)

    @T.macro
    def per_tensor(x, src, y, scale_out):
        with T.Kernel(grid_k, T.ceildiv(m, block_m), threads=threads) as (bx, by):
            if ctas_per_sm > 1:
                T.annotate_min_blocks_per_sm(ctas_per_sm)
            scale_local = T.alloc_fragment((block_m,), "float")
            if dynamic:
                part_local = T.alloc_fragment((PARTIALS,), "float")
                amax_local = T.alloc_fragment((1,), "float")
                T.copy(src, part_local)
                T.reduce_max(part_local, amax_local, dim=0)
                for i in T.Parallel(block_m):
                    scale_local[i] = _scale_of(amax_local[0])
                if bx == 0 and by == 0:
                    scale_out[0] = _scale_of(amax_local[0])
            else:
                for i in T.Parallel(block_m):
                    scale_local[i] = src[0]
                if bx == 0 and by == 0:
                    scale_out[0] = src[0]
            x_local = T.alloc_fragment(tile, dtype)
            row0 = (T.ceildiv(m, block_m) - 1 - by if reverse_rows else by) * block_m
            T.copy(x[row0, bx * block_k], x_local)
            recip_local = reciprocals(scale_local)
            if not reciprocal:
                store_quantized(x_local, y, row0, bx, scale_local, recip_local, "divide")
            elif dynamic:
                store_quantized(x_local, y, row0, bx, scale_local, recip_local, "reciprocal")
            elif fast_math.is_nan(recip_local[0]):  # one given scale: a uniform branch
                store_quantized(x_local, y, row0, bx, scale_local, recip_local, "divide")
            else:
                store_quantized(x_local, y, row0, bx, scale_local, recip_local, "reciprocal")

    X, Y = (m, k), (m, k)
    if granularity == "tensor":
        src_shape = (PARTIALS,) if dynamic else (1,)

        @T.prim_func
        def quantize_tensor(x: T.Tensor(X, dtype), src: T.Tensor(src_shape, "float"),
                            y: T.Tensor(Y, FP8), scale_out: T.Tensor((1,), "float")):
            per_tensor(x, src, y, scale_out)
        return quantize_tensor
    S = (n_groups, m)
    if dynamic:
        @T.prim_func
        def quantize_dynamic(x: T.Tensor(X, dtype), y: T.Tensor(Y, FP8),
                             scale_out: T.Tensor(S, "float")):
            per_row(x, y, None, scale_out)
        return quantize_dynamic

    @T.prim_func
    def quantize_static(x: T.Tensor(X, dtype), scale: T.Tensor(S, "float"),
                        y: T.Tensor(Y, FP8), scale_out: T.Tensor(S, "float")):
        per_row(x, y, scale, scale_out)
    return quantize_static


def absmax_program(k: int, dtype: str, block_m: int, block_k: int, threads: int,
                   in_lanes: bool = False):
    """Per-tensor amax, first pass: partial[p] = max |x| over the row blocks p, p + PARTIALS,
    ... (a fixed grid, so any M runs without a recompile). in_lanes: each thread keeps the
    running max of its own elements over the sweep, reduced across the CTA once at the end
    (else once a tile, whose shuffles and barriers stand between one tile's loads and the
    next's)."""
    m = T.dynamic("m")
    tile = (block_m, block_k)

    @T.prim_func
    def absmax(x: T.Tensor((m, k), dtype), partial: T.Tensor((PARTIALS,), "float")):
        with T.Kernel(PARTIALS, threads=threads) as bx:
            x_local = T.alloc_fragment(tile, dtype)
            abs_local = T.alloc_fragment(tile, "float")
            row_local = T.alloc_fragment((block_m,), "float")
            all_local = T.alloc_fragment((1,), "float")
            if in_lanes:
                T.clear(abs_local)
            else:
                T.clear(row_local)
            for t in T.serial(T.ceildiv(m, block_m * PARTIALS)):
                row0 = (t * PARTIALS + bx) * block_m
                for kt in T.serial(k // block_k):
                    T.copy(x[row0, kt * block_k], x_local)
                    if in_lanes:
                        for i, j in T.Parallel(block_m, block_k):
                            abs_local[i, j] = T.max(abs_local[i, j],
                                                    T.abs(T.cast(x_local[i, j], "float")))
                    else:
                        for i, j in T.Parallel(block_m, block_k):
                            abs_local[i, j] = T.abs(T.cast(x_local[i, j], "float"))
                        T.reduce_max(abs_local, row_local, dim=1, clear=False)
            if in_lanes:
                T.reduce_max(abs_local, row_local, dim=1)
            T.reduce_max(row_local, all_local, dim=0)
            partial[bx] = all_local[0]
    return absmax


def _block_k(k: int, widest: int = 512) -> int:
    """The widest power-of-two chunk (16..widest) dividing K (K % 16 == 0)."""
    bk = widest
    while k % bk:
        bk //= 2
    return bk


def _whole_row_configs(k: int) -> list[QuantConfig]:
    """One row a CTA held whole in registers, an 8-byte vector per thread or more (so
    4 x threads divides K), at most 64 elements a thread; fewest threads first."""
    return [QuantConfig(block_m=1, block_k=k, threads=t, ctas_per_sm=c)
            for t in (128, 256, 512, 1024) if k % (4 * t) == 0 and k // t <= 64
            for c in (1, 2) if c * t <= 1024]


class QuantizeFp8Kernel(Kernel):
    """key: dtype, k, granularity ('tensor' | 'row' | 'group'), group (the group size, 0
    unless 'group'), dynamic. One bucket: rows are symbolic and every size fills the GPU
    alike. Launch with (x, scale or None, y, scale_out)."""

    name = "quantize_fp8"
    Config = QuantConfig

    def program(self, config: QuantConfig, bucket: str):
        key = self.key
        main = quantize_program(key["k"], key["dtype"], key["granularity"], key["group"],
                                key["dynamic"], config.block_m, config.block_k, config.threads,
                                config.ctas_per_sm, config.reverse_rows, config.reciprocal)
        if key["granularity"] == "tensor" and key["dynamic"]:
            return absmax_program(key["k"], key["dtype"], config.block_m, config.block_k,
                                  config.threads, config.absmax_in_lanes), main
        return main

    def run(self, config: QuantConfig, compiled: tuple, x, scale, y, scale_out) -> None:
        key = self.key
        if key["granularity"] != "tensor":
            if key["dynamic"]:
                compiled[0](x, y, scale_out)
            else:
                compiled[0](x, scale, y, scale_out)
            return
        if key["dynamic"]:
            partial = scale_out.new_empty(PARTIALS)
            compiled[0](x, partial)
            compiled[1](x, partial, y, scale_out)
        else:
            compiled[0](x, scale, y, scale_out)

    def heuristic_config(self, bucket: str, arch: str) -> QuantConfig:
        granularity, k = self.key["granularity"], self.key["k"]
        if granularity == "group":  # a [32, group] tile per CTA
            # the division by the reciprocal: on an H100 (2026-12-06) 1.26x at DeepSeek-V3's
            # decode batch of 64 (3.1 -> 2.5 us), 1.01x on its 4K-token rows (32.6 -> 32.1,
            # 78.5 -> 77.9 us); per row it lost without a register cap (0.87-0.96x)
            return QuantConfig(block_m=32, block_k=self.key["group"], threads=128,
                               reciprocal=True)
        if granularity == "row":
            whole = _whole_row_configs(k)
            if whole:
                # the fewest threads holding at most 32 elements each, registers uncapped.
                # H200, 4K rows: Llama-3-70B's 8192, 28.4 us (81% of HBM) against 46.2 for
                # rows in chunks read twice (128 or 512 threads: 30.9, 30.4; 1024: 45.7);
                # its 28672 (1024 threads, 8-byte vectors), 96.3 us (84%) against 150.0
                # (512 threads, one CTA an SM by its 72 registers; two CTAs: 99.9). Where
                # every width holds more than 32, the last (most threads; two CTAs an SM
                # where they fit, the form that beat one CTA at 28672 x 512 threads)
                ok = [c for c in whole if k // c.threads <= 32 and c.ctas_per_sm == 1]
                return ok[0] if ok else whole[-1]
            return QuantConfig(block_m=4, block_k=_block_k(k), threads=128)  # K in chunks
        # per tensor: the reciprocal division; dynamic, also the absmax pass reduced once a
        # CTA and registers capped for 6 CTAs an SM. H100 (2026-12-06), Llama-3.1-70B's 4K
        # hidden rows: static 38.3 -> 36.6 us (1.047x), dynamic 66.2 -> 62.3 us (1.063x)
        tile = QuantConfig(block_m=16, block_k=_block_k(k), threads=128, reciprocal=True)
        if self.key["dynamic"]:
            return dataclasses.replace(tile, absmax_in_lanes=True, ctas_per_sm=6)
        return tile

    def config_space(self, bucket: str) -> list[QuantConfig]:
        granularity, k = self.key["granularity"], self.key["k"]
        default = self.heuristic_config(bucket, "sm_90a")
        # the default's division by the other route (QuantConfig.reciprocal)
        space = [default, dataclasses.replace(default, reciprocal=not default.reciprocal)]
        if granularity == "group":
            space += [QuantConfig(bm, self.key["group"], t)
                      for bm in (8, 16, 32, 64) for t in (64, 128, 256)]
        else:
            space += [QuantConfig(bm, _block_k(k, bk), t) for bm in (1, 2, 4, 8, 16)
                      for bk in (256, 512, 1024) for t in (64, 128, 256)]
            if granularity == "row":
                space += _whole_row_configs(k)
            elif self.key["dynamic"]:  # the quantizing pass bottom-up; the absmax in lanes
                plain = QuantConfig(block_m=16, block_k=_block_k(k), threads=128)
                space += [dataclasses.replace(plain, reverse_rows=True),
                          dataclasses.replace(plain, absmax_in_lanes=True),
                          dataclasses.replace(plain, absmax_in_lanes=True, reciprocal=True)]
        return list(dict.fromkeys(space))
