"""GEMM config selection for shapes the tuned table does not hold: an explicit cost model.

The dense GEMM compiles N and K in and keeps M (tokens) symbolic, bucketed by powers of two
up to 16K rows (`M_BUCKETS`, then "large"). A (key, bucket) the autotuner measured takes the
tuned table's winner; every other one takes `choose()`'s pick, evaluated at the bucket's
largest M (the bench token counts 1, 8, 64, 512, 4K and 16K are those upper bounds). The
pick depends on the bucket, N and K only, so one program serves every M of a bucket.

The model, for one candidate (tile block_m x block_n x block_k, pipeline stages, split-K):

    CTAs      = ceil(M / block_m) * ceil(N / block_n) * split_k
    per SM    = CTAs resident at once (shared memory: one for every tile here but the
                smallest), so a wave is 132 * per-SM CTAs
    waves     = ceil(CTAs / wave)
    per CTA   = (K steps + FILL_STEPS) x one K step's wgmma time at an SM's share of the
                calibrated peak (perf/profiles/<gpu>.yaml), divided by the tile's
                efficiency (TILE_EFFICIENCY: how close each tile shape gets to the peak),
                + CTA_US for the prologue and epilogue (launch, barrier init, TMA store);
                CTAs sharing an SM share its tensor cores
    compute   = waves x per CTA
    memory    = (M*K + N*K + M*N) x element bytes / min(HBM bandwidth, busy CTAs x
                a CTA's rate), a CTA's rate being the weight-tile bytes its pipeline
                stages hold in flight per LATENCY_US (Little's law; at most
                SM_BYTES_PER_S): the floor small M runs into, where few CTAs cannot pull
                all of HBM's bandwidth
    split-K   = the fp32 partials written and read back (2 x split x M x N x 4 bytes at
                SPLIT_BYTES_PER_S x the HBM bandwidth) + REDUCE_US for the reduce kernel
    estimate  = (compute^p + memory^p)^(1/p) + split-K, p = OVERLAP_P = 2: the K loop and
                the operand stream overlap only partly with one CTA per SM (p = inf would be
                max(compute, memory), p = 1 their sum)

Buckets above 128 rows use constants fitted to 218 H200 timings (2026-12-02: 109 models-tier
shapes at 512, 4K and 16K rows, each with the pre-model default and the first model's pick,
128 x 256 and 128 x 128 tiles, split 1-16; docs/performance/h200-gemm-selection-2026-12-02.md).
Fitted on the 512- and 16K-row points, checked on the 4K-row ones: median |log(est/measured)|
0.060 -> 0.024 on the fitted points, 0.043 -> 0.034 on the held-out ones; the worst, 0.50
(16K rows, N <= 256: activation-streaming shapes the memory term underestimates), was 0.67.
Buckets up to 128 rows have no measured timings: they keep the first calibration below
(DECODE_DEFAULTS) and max(compute, memory).

The candidates (`candidates()`) are the kernel's own config space: 64-row tiles up to 64
rows, 128-row ones up to 128, and 128 x 256, 128 x 128 (whole-row warp groups,
FULL_ROW_TILE, 6 stages) or 256 x 128 above, then whole-row 128-row tiles of the widths
that let a few row tiles fill whole waves (FITTED_WIDTHS, 80-224 columns, as many stages
up to 6 as fit); each with every split that keeps 4 K steps per split. With those two
(2026-12-03), 66 models-tier shapes whose pick changed (every second of 132) measured
1.159x over the picks before (geomean; worst 0.983x, best 1.603x), 0.796x -> 0.922x
cuBLAS (docs/performance/h200-gemm-widths-2026-12-03.md). Among those within
TIE of the fastest estimate the first in that list wins (the list is ordered by what the
autotuner has preferred: the widest tile, the fewest splits), so near ties resolve the way
tuning resolved them rather than by noise in the model. Last come the wave-filled 128 x 256
and 128 x 128 tiles (wave_fill.py; above 128 rows, static splittable K): whole waves, then
the left-over tiles in K pieces merged in the same launch, priced as one short wave of
pieces plus MERGE_US per tile. Fitted on 18 H200 shapes (2026-12-03), the model picks the
faster of wave fill and its plain pick on 15 of 15 distinct ones; its 50 wave-fill picks
on the models tier measured 1.094x over the plain pick (geomean; worst 0.969x;
docs/performance/h200-gemm-wave-fill-2026-12-03.md).

The decode constants are physical estimates checked against the shipped H200 table
(`python3 scripts/gemm_selection.py agreement`): the model picked the autotuner's tile and
split for 20 of its 22 plain GEMM entries (the two misses: 16 rows, N 6144, K 4096, where
tuning kept 48 CTAs of 64 x 128 and the model prefers 96 of 64 x 64; those two and the
other two 16-row entries left the table when that bucket went to the weight-streaming
form, weight_stream.py, which leaves 18 of 18); a grid over the
constants (tile efficiency 0.85-0.95, fill 0.5-2 steps, 0.5-3 us per CTA, 2-8 us per reduce,
1-3 us latency, 60-200 GB/s per CTA) finds no setting that matches more, and two thirds of
its 2160 points match as many: the table does not pin the constants further.
The whole config (block_k, stages, raster too) matches on 13: those three change a tuned
config's time by a few percent, which the model does not resolve.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from .wave_fill import partition

NUM_SMS = 132
SMEM_PER_SM = 228 * 1024  # an SM's shared memory; each CTA also reserves 1 KB
# Fraction of the profile's tensor-core peak (perf/profiles: the best cuBLAS rate, 790 TFLOP/s
# on the H200) each tile shape sustains in its K loop. Buckets above 128 rows use constants
# fitted to the measured H200 runs of 2026-12-02 (docs/performance/
# h200-gemm-selection-2026-12-02.md: 218 timings of 128 x 256 and 128 x 128 tiles, with and
# without split-K, at 512, 4K and 16K rows): a wave of 128 x 256 tiles runs at 1.12x that
# peak (~885 TFLOP/s), 128 x 128 at 0.95x (0.85 of the wider tile: it re-reads more operand
# bytes from shared memory per FLOP); 256 x 128, never measured, keeps its ratio to 128 x 256.
TILE_EFFICIENCY = {(128, 256): 1.12, (256, 128): 1.09, (128, 128): 0.95}
FILL_STEPS = 6.0          # a CTA's prologue (the first loads' latency), fill, drain, epilogue
CTA_US = 0.0              # a CTA's fixed cost beyond FILL_STEPS (the fit leaves none)
REDUCE_US = 2.0           # the split-K reduce launch
SPLIT_BYTES_PER_S = 1.2   # x HBM bandwidth: the fp32 partials' round trip (partly L2 hits)
MERGE_US = 12.0           # wave fill: the pieces' fp32 partials stored, the wait for a tile's
                          # last piece, the stripes summed: for a 128 x 256 tile (128 KB of
                          # fp32), in proportion to the tile's area (fitted, see the doc)
# The 128 x 128 tile with whole-row warp groups (GemmConfig.full_row): one m64n128 wgmma a
# K slice per warp group instead of two m64n64; on the 57 models-tier shapes the model gave
# a 128 x 128 tile, 1.013x the square split (geomean; 0.972x .. 1.057x; 2026-12-03,
# docs/performance/h200-gemm-pipeline-2026-12-03.md). 128 x 256 keeps the square split
# (two m64n128 a warp group already): 1.008x / 0.999x in two runs, 0.87x .. 1.04x.
FULL_ROW_TILE = (128, 128)
# Its pipeline depth: 4 -> 6 stages took 512 x 4096 x 4096 from 30.4 to 25.8 us (cuBLAS
# 25.7, whose kernel there is a 128 x 128 tile of 6 stages; 5 stages 27.4), 2026-12-03.
DEEP_STAGES = 6
# Whole-row 128-row tiles of other widths (a wgmma width in steps of 16), so that the tiles
# of a few-row-tile GEMM fill whole waves the way cuBLAS's widths do: at 512 rows, width
# 96 for N 3072 (128 tiles; 1.066x the 128 x 128 pick), 112 for 3584 (1.026x), 160 for
# 5120 (1.308x over the wave-filled 128 x 128 pick), 192 for 6144 (1.103x over 128 x 256),
# 80 for 2560 (1.106x) (2026-12-03). Their efficiency is interpolated between the 128- and
# 256-wide tiles' (`tile_efficiency`).
FITTED_WIDTHS = (80, 96, 112, 160, 192, 224)
OVERLAP_P = 2.0           # estimate = (compute^p + memory^p)^(1/p); None: max(compute, memory)
# Buckets up to 128 rows (64-row tiles, decode) have no measured timings yet: they keep the
# first calibration against the tuned table (see the module doc), and max(compute, memory).
DECODE_ROWS = 128
DECODE_TILE_EFFICIENCY = {(128, 256): 1.0, (256, 128): 0.97, (128, 128): 0.9,
                          (64, 256): 0.85, (64, 128): 0.8, (64, 64): 0.65}
SM_BYTES_PER_S = 100e9    # at most this many HBM bytes per second into one CTA
LATENCY_US = 2.5          # HBM latency under load: a CTA's bytes in flight per LATENCY_US
TIE = 0.03                # estimates within 3% of the best count as a tie
SYMBOLIC_K = 8192         # K assumed for a symbolic-K GEMM (a weight gradient's tokens)
ELEM_BYTES = {"float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class Shape:
    """One GEMM call: d[m, n] = a[m, k] @ b[k, n]; k None is a symbolic K."""

    m: int
    n: int
    k: int | None
    dtype: str = "bfloat16"
    splittable: bool = True  # False: accumulate / symbolic K take split_k = 1


@dataclass(frozen=True)
class Device:
    flops_per_s: float
    bytes_per_s: float


@functools.cache
def device(gpu: str | None, dtype: str) -> Device:
    """The H200's calibrated peaks, whatever `gpu` is: the model's constants were fitted
    on H200 timings together with those peaks, and another GPU's peaks without a fit of
    its own would move picks that no measurement checked (an H100 profile exists for SOL
    numbers, from its datasheet)."""
    from ...perf.profiles import load_profile

    profile = load_profile("h200")
    return Device(profile.flops_per_s.get(dtype, profile.flops_per_s["float16"]),
                  profile.bytes_per_s)


def as_config(fields: dict[str, Any]) -> Any:
    from .gemm import GemmConfig

    return GemmConfig(**fields)


def smem_bytes(config: Any) -> int:
    return config.smem_bytes()


def ctas_per_sm(config: Any) -> int:
    return max(1, min(2, SMEM_PER_SM // (smem_bytes(config) + 1024)))


def tile_efficiency(table: dict, bm: int, bn: int) -> float:
    """`table`'s efficiency of a bm x bn tile; 128-row widths it lacks lie on the line
    through its 128 x 128 and 128 x 256 tiles (wgmma work per operand byte grows with the
    width)."""
    if (bm, bn) in table:
        return table[(bm, bn)]
    if bm == 128 and (128, 128) in table and (128, 256) in table:
        narrow, wide = table[(128, 128)], table[(128, 256)]
        return narrow + (bn - 128) * (wide - narrow) / 128
    return 0.6


def deepest(bm: int, bn: int, most: int = DEEP_STAGES) -> int:
    """The most stages, up to `most`, whose whole-row bm x bn tile fits shared memory."""
    from .gemm import GemmConfig

    return next(s for s in range(most, 1, -1)
                if GemmConfig(bm, bn, 64, s, 256, 1, 8, full_row=True).valid())


def estimate_us(shape: Shape, config: Any, gpu: str | None = None,
                consts: dict[str, Any] | None = None) -> float:
    """The model's time for `config` on `shape`, in microseconds (see the module doc)."""
    c = {**(DECODE_DEFAULTS if shape.m <= DECODE_ROWS else DEFAULTS), **(consts or {})}
    dev = device(gpu, shape.dtype)
    k = shape.k if shape.k is not None else SYMBOLIC_K
    eb = ELEM_BYTES.get(shape.dtype, 2)
    bm, bn, bk, split = config.block_m, config.block_n, config.block_k, config.split_k
    ctas = -(-shape.m // bm) * -(-shape.n // bn) * split
    per_sm = ctas_per_sm(config)
    waves = -(-ctas // (NUM_SMS * per_sm))
    k_tiles = -(-k // bk)
    k_steps = -(-k_tiles // split)
    step_us = 2 * bm * bn * bk / (dev.flops_per_s / NUM_SMS) * 1e6
    step_us /= tile_efficiency(c["tile_efficiency"], bm, bn)
    cta_us = per_sm * (k_steps + c["fill_steps"]) * step_us + c["cta_us"]
    compute_us = waves * cta_us
    fill_us = 0.0
    if getattr(config, "wave_fill", False):
        # whole waves, then one short wave of pieces and their in-kernel merge
        whole, pieces = partition(ctas, k_tiles, NUM_SMS * per_sm)
        if pieces > 1:
            ctas = whole + (ctas - whole) * pieces
            piece_us = per_sm * (-(-k_tiles // pieces) + c["fill_steps"]) * step_us
            compute_us = whole // (NUM_SMS * per_sm) * cta_us + piece_us
            fill_us = c["merge_us"] * bm * bn / (128 * 256)
    # Little's law: a CTA streams the weight bytes its pipeline keeps in flight once per HBM
    # latency (the activation rows are few where this bound matters, and L2-resident)
    in_flight = config.stages * bn * bk * eb
    cta_bytes_per_s = min(c["sm_bytes_per_s"], in_flight / (c["latency_us"] * 1e-6))
    busy = min(ctas, NUM_SMS * per_sm)
    bandwidth = min(dev.bytes_per_s, busy * cta_bytes_per_s)
    memory_us = (shape.m * k + shape.n * k + shape.m * shape.n) * eb / bandwidth * 1e6
    split_us = 0.0
    if split > 1:
        split_us = (2 * split * shape.m * shape.n * 4 / (c["split_bytes_per_s"] * dev.bytes_per_s)
                    * 1e6 + c["reduce_us"])
    p = c["overlap_p"]
    if p is None:
        return max(compute_us, memory_us) + split_us + fill_us
    return (compute_us ** p + memory_us ** p) ** (1 / p) + split_us + fill_us


DEFAULTS: dict[str, Any] = {"tile_efficiency": TILE_EFFICIENCY, "fill_steps": FILL_STEPS,
                            "cta_us": CTA_US, "reduce_us": REDUCE_US,
                            "sm_bytes_per_s": SM_BYTES_PER_S, "latency_us": LATENCY_US,
                            "split_bytes_per_s": SPLIT_BYTES_PER_S, "overlap_p": OVERLAP_P,
                            "merge_us": MERGE_US, "tie": TIE}
DECODE_DEFAULTS: dict[str, Any] = {**DEFAULTS, "tile_efficiency": DECODE_TILE_EFFICIENCY,
                                   "fill_steps": 0.5, "cta_us": 1.0, "reduce_us": 4.0,
                                   "split_bytes_per_s": 1.0, "overlap_p": None}


def splits(k: int | None, block_k: int, splittable: bool) -> list[int]:
    """1, 2, 4, ... while each split keeps >= 4 K steps (the kernel's split-K rule)."""
    if not splittable or k is None:
        return [1]
    k_tiles = -(-k // block_k)
    out, split = [1], 2
    while split <= 16 and k_tiles // split >= 4:
        out.append(split)
        split *= 2
    return out


def candidates(rows: int, k: int | None, splittable: bool) -> list[Any]:
    """The configs the model chooses among for a bucket of `rows`, in preference order."""
    from .gemm import GemmConfig

    out = []
    if rows <= 128:
        block_m, threads = (64, 128) if rows <= 64 else (128, 256)
        for bn in (128, 64, 256):
            for bk, stages in ((128, 4), (64, 6), (128, 6), (256, 2)):
                for split in splits(k, bk, splittable):
                    out.append(GemmConfig(block_m, bn, bk, stages, threads, split, 8))
    else:
        tiles = ((128, 256, 3), (128, 128, DEEP_STAGES), (256, 128, 3))
        for bm, bn, stages in tiles:
            for split in splits(k, 64, splittable):
                out.append(GemmConfig(bm, bn, 64, stages, 256, split, 8,
                                      full_row=(bm, bn) == FULL_ROW_TILE))
        for bn in FITTED_WIDTHS:  # after the square-ish tiles: they must win by TIE
            for split in splits(k, 64, splittable):
                out.append(GemmConfig(128, bn, 64, deepest(128, bn), 256, split, 8,
                                      full_row=True))
        if splittable and k is not None:  # last: a wave fill must beat the rest by TIE
            out += [GemmConfig(bm, bn, 64, stages, 256, 1, 8, wave_fill=True,
                               full_row=(bm, bn) == FULL_ROW_TILE)
                    for bm, bn, stages in tiles[:2]]
    return [c for c in out if c.valid()]


def pickable_forms() -> list[tuple[str, Any]]:
    """(bucket, config): one config per form the model can pick (tile, block_k, stages,
    threads, raster; split-K or not), for compile and GPU checks of every form."""
    forms: dict[Any, str] = {}
    for rows in (16, 128, 4096):
        for config in candidates(rows, 1 << 14, True):
            forms.setdefault(dataclasses.replace(config, split_k=min(config.split_k, 2)),
                             f"m{rows}")
    return [(bucket, form) for form, bucket in forms.items()]


def ranked(shape: Shape, rows: int, gpu: str | None = None,
           consts: dict[str, Any] | None = None,
           wave_fill: bool = True) -> list[tuple[float, Any]]:
    """(estimate us, config) of every candidate at M = rows, in preference order;
    wave_fill=False leaves the wave-fill ones out (what the plain grids would pick)."""
    at = dataclasses.replace(shape, m=rows)
    return [(estimate_us(at, cfg, gpu, consts), cfg)
            for cfg in candidates(rows, shape.k, shape.splittable)
            if wave_fill or not cfg.wave_fill]


def choose(shape: Shape, rows: int, gpu: str | None = None,
           consts: dict[str, Any] | None = None, wave_fill: bool = True) -> Any:
    """The first candidate (preference order) within TIE of the fastest estimate."""
    tie = (consts or {}).get("tie", TIE)
    scored = ranked(shape, rows, gpu, consts, wave_fill)
    best = min(t for t, _ in scored)
    return next(cfg for t, cfg in scored if t <= best * (1 + tie))


def agreement(gpu: str = "h200") -> list[tuple[str, Any, Any]]:
    """(tuned-table entry, tuned config, model's pick) for every plain GEMM entry of `gpu`'s
    tuned table: how well the model reproduces what the autotuner measured."""
    from ..base import tuned_table
    from .gemm import GemmConfig, GemmKernel

    out = []
    for entry, fields in sorted(tuned_table(gpu).entries.items()):
        name, key_text, bucket = entry.split("|")
        key = dict(item.split("=") for item in key_text.split(","))
        if name != "gemm" or set(key) != {"dtype", "n", "k", "trans_a", "trans_b"}:
            continue
        kernel = GemmKernel(gpu=gpu, dtype=key["dtype"], n=int(key["n"]), k=int(key["k"]),
                            trans_a=key["trans_a"] == "True", trans_b=key["trans_b"] == "True")
        pick = choose(kernel.model_shape(), kernel.bucket_rows(bucket), gpu)
        out.append((entry, GemmConfig(**fields), pick))
    return out


def same_tile(a: Any, b: Any) -> bool:
    return (a.block_m, a.block_n, a.split_k) == (b.block_m, b.block_n, b.split_k)


def source_of(key: dict[str, Any], bucket: str, gpu: str = "h200") -> str:
    """'tuned' when the (key, bucket) has a tuned entry, else 'model'."""
    from ..base import tuned_table
    from .gemm import GemmKernel

    kernel = GemmKernel(gpu=gpu, **key)
    return "tuned" if tuned_table(gpu).get(kernel.key_string(bucket)) is not None else "model"
