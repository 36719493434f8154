"""The wave-fill GEMM (kernels/gemm/wave_fill.py) on the CPU: its partition, its cost-model
term, and its programs compiled for sm_90a."""

import dataclasses

import pytest

from tileops.kernels.gemm import GemmConfig, GemmKernel, select
from tileops.kernels.gemm.wave_fill import MAX_SPLIT, MIN_PIECE_STEPS, partition

from ..helpers import assert_no_spills_or_serialized_wgmma

WAVE_FILL = GemmConfig(128, 256, 64, 3, 256, 1, 8, wave_fill=True)


@pytest.mark.parametrize("sms", [132, 114, 78])
def test_partition_fills_the_last_wave(sms):
    for k_tiles in (1, 3, 4, 7, 9, 16, 66, 256):
        for tiles in range(1, 5 * sms):
            whole, split = partition(tiles, k_tiles, sms)
            assert 0 <= whole <= tiles and 1 <= split <= MAX_SPLIT
            if split == 1:
                assert whole == tiles  # nothing split: every tile whole
                continue
            left = tiles - whole
            assert whole % sms == 0 and 0 < left * split <= sms  # one short wave of pieces
            steps = -(-k_tiles // split)
            assert steps >= min(MIN_PIECE_STEPS, k_tiles) and steps * (split - 1) < k_tiles


def test_partition_leaves_full_waves_and_short_k_alone():
    assert partition(264, 64, 132) == (264, 1)        # two full waves
    assert partition(140, 64, 132) == (132, 8)        # 8 tiles left: 8 pieces each
    assert partition(288, 64, 132) == (264, 5)        # 24 left: 120 pieces
    assert partition(40, 7, 132) == (40, 1)           # 7 K tiles: too short to split
    assert partition(32, 64, 132) == (0, 4)           # under a wave: all pieces (split-K)


def test_the_config_is_split_free_and_the_model_prices_it():
    assert WAVE_FILL.valid() and not dataclasses.replace(WAVE_FILL, split_k=2).valid()
    # 512 x 18432 x 16384 (llama3.1-405b qkv_proj, 512 tokens): 288 tiles of 128 x 256 are
    # 2.2 waves; filling the third beats both the plain grid and split-K
    shape = select.Shape(m=512, n=18432, k=16384)
    plain = select.estimate_us(shape, dataclasses.replace(WAVE_FILL, wave_fill=False))
    split = select.estimate_us(shape, dataclasses.replace(WAVE_FILL, wave_fill=False, split_k=2))
    assert select.estimate_us(shape, WAVE_FILL) < min(plain, split)


def test_accumulating_and_symbolic_k_gemms_refuse_it():
    for key in ({"accumulate": True}, {"k": None}):
        kernel = GemmKernel(**{"dtype": "bfloat16", "n": 1024, "k": 4096, "trans_a": False,
                               "trans_b": False, **key})
        with pytest.raises(ValueError, match="cannot fill waves"):
            kernel.program(WAVE_FILL, "m4096")


CASES = [
    ({"dtype": "bfloat16", "trans_b": True, "has_bias": True}, WAVE_FILL),
    ({"dtype": "float16", "trans_b": False},
     GemmConfig(128, 128, 64, 4, 256, 1, 8, wave_fill=True)),
    ({"dtype": "bfloat16", "trans_b": True},
     GemmConfig(128, 256, 64, 4, 256, 1, 8, stage_out=False, wave_fill=True)),
]


@pytest.mark.compile
@pytest.mark.parametrize("flags, config", [
    pytest.param(*CASES[0], marks=pytest.mark.smoke, id="128x256-bias"),
    pytest.param(*CASES[1], marks=pytest.mark.full, id="128x128-fp16-b-kn"),
    pytest.param(*CASES[2], marks=pytest.mark.full, id="128x256-regs-out"),
])
def test_programs_compile_to_the_fast_path(flags, config, tmp_path):
    """Tails in N and K; TMA loads, wgmma, the atomics of the merge, no spills."""
    kernel = GemmKernel(n=3000, k=4192, trans_a=False, **flags)
    compiled = kernel.compile(config, "m4096")
    assert len(compiled) == 1  # one launch: no reduce program
    source = compiled[0].get_kernel_source()
    assert "wgmma" in source and "tma_load" in source and "AtomicAdd" in source
    if config.stage_out:
        assert "tma_store" in source
    assert_no_spills_or_serialized_wgmma(compiled[0], tmp_path)
