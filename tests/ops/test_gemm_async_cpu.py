"""The hand-written GEMM pipeline (kernels/gemm/async_pipeline.py) on the CPU: the persistent
walk's tile order, which configs may take the pipeline, and the two-CTAs-an-SM program's
registers."""

import dataclasses
import re

import pytest

from tileops.kernels.gemm import GemmConfig, GemmKernel
from tileops.kernels.gemm.async_pipeline import register_budgets, tile_order
from tileops.kernels.gemm.gemm import SHORT_K_PINGPONG, TWO_CTA_ACCUMULATE

from ..helpers import assert_no_spills_or_serialized_wgmma

ASYNC = GemmConfig(128, 128, 64, 4, 256, 1, 8, full_row=True, async_mma=True)


@pytest.mark.parametrize("raster", [0, 1, 8, 16])
def test_tile_order_visits_every_tile_once(raster):
    for tiles_n in (1, 3, 8, 24, 29):
        for tiles_m in (1, 2, 12, 13):
            tile_of = tile_order(tiles_n, raster, minimum=min)
            seen = [tile_of(t, tiles_m) for t in range(tiles_m * tiles_n)]
            assert sorted(seen) == [(i, j) for i in range(tiles_m) for j in range(tiles_n)]


def test_tile_order_walks_panels_of_raster_columns():
    tile_of = tile_order(tiles_n=20, raster=8, minimum=min)
    # the first panel: columns 0-7 of row 0, then of row 1, ...
    assert [tile_of(t, 3) for t in range(10)] == [(0, c) for c in range(8)] + [(1, 0), (1, 1)]
    # the last panel is 4 columns wide
    assert tile_of(48, 3) == (0, 16) and tile_of(52, 3) == (1, 16)


def test_pipeline_config_rules():
    assert ASYNC.valid()
    # the output staging tile no longer shares the pipeline's shared memory
    assert ASYNC.smem_bytes() == 4 * (128 + 128) * 64 * 2 + 128 * 128 * 2
    assert not GemmConfig(128, 256, 64, 4, 256, 1, 8, async_mma=True).valid()  # 256 KB
    assert not GemmConfig(128, 128, 64, 4, 256, 1, 8, wave_fill=True, async_mma=True).valid()
    assert not GemmConfig(128, 128, 64, 4, 256, 1, 8, persistent=True).valid()
    # whole-row warp groups take wgmma widths in steps of 16; the square split, of 64
    assert GemmConfig(128, 160, 64, 4, 256, 1, 8, full_row=True).valid()
    assert not GemmConfig(128, 160, 64, 4, 256, 1, 8).valid()
    assert not GemmConfig(128, 128, 64, 4, 256, 2, 8, async_mma=True, persistent=True).valid()
    assert GemmConfig(128, 128, 64, 4, 256, 1, 8, async_mma=True, persistent=True).valid()
    # clusters: the hand-written pipeline, pairs only, not persistent
    assert GemmConfig(128, 128, 64, 4, 256, 1, 0, async_mma=True, cluster_m=2).valid()
    assert GemmConfig(128, 128, 64, 4, 256, 1, 8, async_mma=True, cluster_m=2).valid()
    assert not GemmConfig(128, 128, 64, 4, 256, 1, 0, cluster_m=2).valid()
    assert not GemmConfig(128, 128, 64, 4, 256, 1, 0, async_mma=True, cluster_m=4).valid()


def test_early_out_and_two_ctas_an_sm_rules():
    early = dataclasses.replace(ASYNC, early_out=True)
    assert early.valid() and dataclasses.replace(early, persistent=True).valid()
    assert not dataclasses.replace(early, async_mma=False).valid()  # the producer loads it
    assert not dataclasses.replace(early, stage_out=False).valid()  # it lands there
    two = dataclasses.replace(early, stages=2, threads=128, ctas_per_sm=2)
    assert two.valid() and two.smem_bytes() == 2 * 256 * 64 * 2 + 128 * 128 * 2
    assert not dataclasses.replace(two, stages=3).valid()  # 2 x 128 KB of shared memory
    assert not dataclasses.replace(two, async_mma=False, early_out=False).valid()
    assert register_budgets(256) == (40, 232)
    assert register_budgets(128, ctas_per_sm=2) == (40, 216)  # 2 x (128 x 40 + 128 x 216)


TWO_AN_SM = GemmConfig(128, 128, 64, 2, 128, 1, 8, full_row=True, async_mma=True,
                       early_out=True, ctas_per_sm=2)


@pytest.mark.parametrize("config", [TWO_AN_SM, dataclasses.replace(TWO_AN_SM, persistent=True),
                                    TWO_CTA_ACCUMULATE],
                         ids=["k64x2", "k64x2-persistent", "default-k32x4"])
def test_two_ctas_an_sm_program_fits_its_registers(config, tmp_path):
    """The accumulating GEMM at two CTAs an SM (the K <= 512 default among them): launch-
    bounded for two, no spill at the consumers' 216-register budget, no serialized wgmma
    (ptxas)."""
    kernel = GemmKernel(dtype="bfloat16", n=4096, k=512, trans_a=True, trans_b=False,
                        accumulate=True)
    assert kernel.config_for("large") == TWO_CTA_ACCUMULATE
    compiled = kernel.compile(config, "large")[0]
    assert "__launch_bounds__(256, 2)" in compiled.get_kernel_source()
    assert_no_spills_or_serialized_wgmma(compiled, tmp_path)


PINGPONG = dataclasses.replace(ASYNC, persistent=True, pingpong=True)


def test_pingpong_rules():
    """Ping-pong: a persistent walk of two consumer warp groups, each with its own output
    staging tile; nothing it does not implement (one CTA an SM, no early_out)."""
    assert PINGPONG.valid()
    assert PINGPONG.smem_bytes() == 4 * (128 + 128) * 64 * 2 + 2 * 128 * 128 * 2
    assert not dataclasses.replace(PINGPONG, persistent=False).valid()
    assert not dataclasses.replace(PINGPONG, threads=128).valid()
    assert not dataclasses.replace(PINGPONG, early_out=True).valid()
    assert not dataclasses.replace(PINGPONG, stage_out=False).valid()
    assert not dataclasses.replace(PINGPONG, block_n=192).valid()  # 4 x 40 + 96 KB
    assert dataclasses.replace(PINGPONG, block_n=192, stages=3).valid()


@pytest.mark.parametrize("config", [PINGPONG, dataclasses.replace(PINGPONG, block_m=64,
                                                                   block_n=256)],
                         ids=["128x128", "64x256"])
def test_pingpong_program_gives_each_warp_group_its_tile(config, tmp_path):
    """Each consumer warp group syncs its own epilogue (named barriers of 128 threads, two
    ids), the pair hands the tensor cores over by mbarriers, and no consumer spills or
    serializes its wgmmas at 232 registers (ptxas)."""
    kernel = GemmKernel(dtype="bfloat16", n=32768, k=512, trans_a=False, trans_b=True)
    compiled = kernel.compile(config, "m16384")[0]
    source = compiled.get_kernel_source()
    assert "__launch_bounds__(384, 1)" in source
    syncs = set(re.findall(r"__sync_thread_partial\((\d+), (\d+)\)", source))
    assert len(syncs) == 2 and {count for _, count in syncs} == {"128"}
    assert "turn[0].wait" in source and "turn[1].wait" in source
    assert_no_spills_or_serialized_wgmma(compiled, tmp_path)


def test_pingpong_default_serves_short_k_linear_layouts_only():
    """SHORT_K_PINGPONG: a [M, K] x b [N, K] with a static K of 256-512, no bias, no
    accumulation, past 256 rows; every other key keeps its default."""
    def pick(bucket="m4096", **key):
        key = {"dtype": "bfloat16", "n": 32768, "k": 512, "trans_a": False, "trans_b": True,
               **key}
        return GemmKernel(**key).config_for(bucket)

    assert pick() == SHORT_K_PINGPONG and pick(k=256) == SHORT_K_PINGPONG
    assert pick(bucket="m512") == SHORT_K_PINGPONG and pick(dtype="float16").pingpong
    assert not pick(bucket="m256").pingpong
    for key in ({"k": 1024}, {"k": 128}, {"k": 516}, {"trans_a": True},
                {"trans_b": False}, {"has_bias": True}):
        assert not pick(**key).pingpong, key
    assert not pick(accumulate=True, trans_a=True, trans_b=False, n=4096).pingpong
    # the tuner tries it on plain GEMMs only (accumulating: far slower; bias: minutes of ptxas)
    plain = GemmKernel(dtype="bfloat16", n=4096, k=4096, trans_a=False, trans_b=True)
    assert any(c.pingpong for c in plain.config_space("m4096"))
    for flags in ({"has_bias": True}, {"accumulate": True}):
        kernel = GemmKernel(dtype="bfloat16", n=4096, k=4096, trans_a=False, trans_b=True,
                            **flags)
        assert not any(c.pingpong for c in kernel.config_space("m4096")), flags


def test_192_row_tiles_take_the_square_split_of_the_hand_written_pipeline():
    """A 192-row tile: each of two consumer warp groups takes all 192 rows and half the
    columns (m64 n96 wgmmas for 192 x 192), 3 stages in 227 KB; not whole-row warp groups
    (96 rows each), not TileLang's own pipeline."""
    wide = GemmConfig(192, 192, 64, 3, 256, 1, 8, async_mma=True)
    assert wide.valid() and dataclasses.replace(wide, persistent=True).valid()
    assert wide.smem_bytes() == 3 * (192 + 192) * 64 * 2 + 192 * 192 * 2
    assert not dataclasses.replace(wide, stages=4).valid()
    assert not dataclasses.replace(wide, full_row=True).valid()
    assert not dataclasses.replace(wide, async_mma=False).valid()
    kernel = GemmKernel(dtype="bfloat16", n=32768, k=512, trans_a=False, trans_b=True)
    source = kernel.compile(wide, "m4096")[0].get_kernel_source()
    assert set(re.findall(r"wgmma_ss<[^>]*, 64, (\d+), 16,", source)) == {"96"}
