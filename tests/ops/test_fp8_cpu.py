"""quantize_fp8 and gemm_fp8 without a GPU: meta outputs (shapes, dtypes, the M-major group
scale layout), errors that name the op and argument, the kernels a call runs, rooflines."""

import dataclasses

import pytest
import torch

import tileops
from tileops import GemmFp8FwdOp, QuantizeFp8FwdOp
from tileops.errors import TileOpsError

from ..helpers import meta

E4M3 = torch.float8_e4m3fn


def fp8(*shape):
    return meta(*shape, dtype=E4M3)


def f32(*shape):
    return torch.empty(shape, dtype=torch.float32, device="meta")


def test_quantize_meta_outputs():
    x = meta(2, 100, 7168)
    y, s = tileops.quantize_fp8(x)
    assert y.shape == x.shape and y.dtype == E4M3 and s.shape == () and s.dtype == torch.float32
    assert tileops.quantize_fp8(x, "row")[1].shape == (2, 100, 1)
    y, s = tileops.quantize_fp8(x, "group")
    assert s.shape == (2, 100, 56)
    assert s.stride() == (100, 1, 200)  # M-major: what torch._scaled_mm's blockwise path takes
    assert tileops.quantize_fp8(meta(64, 256), "group", 64)[1].stride() == (1, 64)


@pytest.mark.parametrize("call, match", [
    (lambda: tileops.quantize_fp8(meta(4, 100)), "QuantizeFp8FwdOp.*'x'.*multiple of 16"),
    (lambda: tileops.quantize_fp8(meta(4, 192), "group"), "'x'.*group_size=128"),
    (lambda: tileops.quantize_fp8(meta(4, 256), "block"), "'granularity'.*one of"),
    (lambda: tileops.quantize_fp8(meta(4, 256), "group", 100), "'group_size'"),
    (lambda: tileops.quantize_fp8(meta(4, 256, dtype=E4M3)), "'x'.*dtype"),
    (lambda: tileops.quantize_fp8(meta(4, 256), "row", 128, f32(4, 2)),
     "'scale'.*\\(4, 1\\).*got \\(4, 2\\)"),
    (lambda: tileops.quantize_fp8(meta(4, 256), "tensor", 128, f32(2)), "'scale'"),
    (lambda: tileops.quantize_fp8(meta(4, 256), "tensor", 128, meta(1)), "'scale'.*dtype"),
])
def test_quantize_errors(call, match):
    with pytest.raises(TileOpsError, match=match):
        call()


def test_gemm_meta_output_and_scalings():
    a, b = fp8(100, 7168), fp8(576, 7168)
    out = tileops.gemm_fp8(a, b, f32(), f32())
    assert out.shape == (100, 576) and out.dtype == torch.bfloat16
    assert tileops.gemm_fp8(a, b, f32(100, 1), f32(576, 1), torch.float16).dtype == torch.float16
    op = GemmFp8FwdOp()
    for sa, sb, scaling in ((f32(1), f32(1), "tensor"), (f32(100, 1), f32(576, 1), "row"),
                            (f32(100, 56), f32(5, 56), "block")):
        ((_, key, m),) = op.kernels_for(op.check([a, b, sa, sb, None]))
        assert (key["scaling"], key["n"], key["k"], m) == (scaling, 576, 7168, 100)
    # quantize_fp8's group scales are M-major: read in place
    m_major = f32(56, 100).t()
    ((_, key, _),) = op.kernels_for(op.check([a, b, m_major, f32(5, 56), None]))
    assert key["scale_a_m_major"]
    ((_, key, _),) = op.kernels_for(op.check([a, b, f32(100, 56), f32(5, 56), meta(576)]))
    assert not key["scale_a_m_major"] and key["has_bias"]


@pytest.mark.parametrize("call, match", [
    (lambda: tileops.gemm_fp8(meta(4, 256), fp8(128, 256), f32(), f32()), "'a'.*dtype"),
    (lambda: tileops.gemm_fp8(fp8(4, 256), meta(128, 256, dtype=torch.float8_e5m2), f32(),
                              f32()), "'b'.*dtype"),
    (lambda: tileops.gemm_fp8(fp8(4, 256), fp8(128, 256), meta(1), f32()), "'scale_a'.*dtype"),
    (lambda: tileops.gemm_fp8(fp8(4, 256), fp8(128, 128), f32(), f32()), "'b'"),
    (lambda: tileops.gemm_fp8(fp8(4, 200), fp8(128, 200), f32(), f32()), "'a'.*multiple of 16"),
    (lambda: tileops.gemm_fp8(fp8(4, 256), fp8(128, 256), f32(4, 1), f32(1, 128)),
     "'scale_b'.*per row: scale_a \\(4, 1\\) and scale_b \\(128, 1\\)"),
    (lambda: tileops.gemm_fp8(fp8(4, 256), fp8(128, 256), f32(4, 3), f32(1, 2)),
     "'scale_a'.*block: scale_a \\(4, 2\\)"),
    (lambda: tileops.gemm_fp8(fp8(4, 208), fp8(128, 208), f32(4, 2), f32(1, 2)),
     "'a'.*multiple of 128 for block scaling"),
    (lambda: tileops.gemm_fp8(fp8(4, 256), fp8(128, 256), f32(), f32(), torch.float32),
     "out_dtype"),
    (lambda: tileops.gemm_fp8(fp8(4, 256), fp8(128, 256), f32(), f32(), torch.bfloat16,
                              meta(128, dtype=torch.float16)), "'bias'.*bfloat16"),
])
def test_gemm_errors(call, match):
    with pytest.raises(TileOpsError, match=match):
        call()


def test_rooflines():
    flops, nbytes = GemmFp8FwdOp().eval_roofline(fp8(4096, 7168), fp8(1536, 7168),
                                                 f32(4096, 56), f32(12, 56))
    assert flops == 2 * 4096 * 1536 * 7168
    assert nbytes == 4096 * 7168 + 1536 * 7168 + 2 * 4096 * 1536 + 4 * (4096 * 56 + 12 * 56)
    _, nbytes = QuantizeFp8FwdOp(granularity="group").eval_roofline(meta(4096, 7168))
    assert nbytes == 4096 * 7168 * 3 + 4 * 4096 * 56
    _, nbytes = QuantizeFp8FwdOp().eval_roofline(meta(4096, 7168), f32(1))
    assert nbytes == 4096 * 7168 * 3 + 8


def test_torch_ops_schema():
    y, s = torch.ops.tileops.quantize_fp8_fwd(meta(8, 256), "row", 128, None)
    assert y.dtype == E4M3 and s.shape == (8, 1)
    d = torch.ops.tileops.gemm_fp8_fwd(fp8(8, 256), fp8(64, 256), f32(), f32(), "float16", None)
    assert d.shape == (8, 64) and d.dtype == torch.float16


def test_decode_split_fills_the_waves():
    """M <= 64 reads the weight once: the K split fills the SMs' waves (M = 1, N = 7168:
    56 tiles x 7 splits = 392 CTAs, 99% of 3 waves), discounted by its fp32 partials, each
    split keeping >= 4 K tiles and none wholly past K; larger M keeps the bf16 GEMM's rule;
    the decode default prefetches block scales and reduces the splits unrolled."""
    from tileops.kernels.fp8 import Fp8GemmKernel

    def split(n, k, m):
        kernel = Fp8GemmKernel(n=n, k=k, scaling="block", out_dtype="bfloat16",
                               has_bias=False, scale_a_m_major=True)
        if m <= 64:  # the 64-row tile's split (where a default streams the weight instead)
            return kernel.split_for(m, 64, 128, 128)
        return kernel.heuristic_config(kernel.bucket_of(m), "sm_90a").split_k

    assert split(7168, 18432, 1) == 7
    # 56 K tiles: 11 splits of 6 leave the last wholly past K; 10 splits of 6 cover them
    assert split(1536, 7168, 32) == 10
    # M = 64 over K = 25600: 13 splits (99% of 4 waves) add 26% of the weight's bytes in
    # fp32 partials; 3 (91% of a wave) add 6% (measured on the H200: 46.8 us against 60.6)
    assert split(5120, 25600, 64) == 3
    assert split(576, 1024, 7) == 2  # 8 K tiles: at most 2 splits of >= 4
    assert split(24576, 1536, 4096) == 1
    kernel = Fp8GemmKernel(n=1536, k=7168, scaling="block", out_dtype="bfloat16",
                           has_bias=False, scale_a_m_major=True)
    default = kernel.heuristic_config("m16", "sm_90a")
    assert default.prefetch_scales and default.reduce_unrolled and not default.weight_rows


def test_weight_stream_default_where_the_weight_tiles_fill_the_gpu():
    """Up to 16 rows, N / 64 >= 80% of the SMs: the weight-streaming form, 64 x 256 tiles,
    no split (its cluster lost where the tiles are few); 32 and 64 rows keep the 64-row
    split-K tile; fewer tiles too (N = 5120: 80 tiles)."""
    from tileops.kernels.fp8 import Fp8GemmKernel

    def default(n, k, bucket, scaling="block"):
        kernel = Fp8GemmKernel(n=n, k=k, scaling=scaling, out_dtype="bfloat16",
                               has_bias=False, scale_a_m_major=True)
        return kernel.heuristic_config(bucket, "sm_90a")

    for n, k, scaling in ((7168, 18432, "block"), (8192, 8192, "tensor"),
                          (8192, 28672, "row")):
        config = default(n, k, "m16", scaling)
        assert config.weight_rows and config.valid(), (n, k)
        assert (config.block_m, config.block_n, config.block_k, config.split_k) == (
            16, 64, 256, 1)
        assert config.stages == 11  # 11 x (16 + 64) x 256 + the 4 KB tile <= 227 KB
        assert not default(n, k, "m32", scaling).weight_rows
    assert not default(5120, 25600, "m16").weight_rows
    assert not default(1536, 7168, "m16").weight_rows


def test_decode_variants_are_valid_and_fit_two_ctas_an_sm():
    """The decode programs beside the default are valid configs of the space; two CTAs an SM
    need one consumer warpgroup and half an SM's shared memory each (4 stages of 64 x 128 +
    128 x 128 fp8 fit, 6 do not)."""
    from tileops.kernels.fp8 import Fp8GemmKernel
    from tileops.kernels.fp8.gemm_fp8 import Fp8GemmConfig

    kernel = Fp8GemmKernel(n=7168, k=18432, scaling="block", out_dtype="bfloat16",
                           has_bias=False, scale_a_m_major=True)
    variants = kernel.decode_variants(16)
    assert all(c.valid() and c in kernel.config_space("m16") for c in variants)
    # 2 an SM: 56 tiles x 9 splits = 504 CTAs, 95% of 2 x 264 slots (14 splits fill 99% of
    # 3 waves but add half again the fp32 partials, which the rule discounts)
    assert [(c.block_k, c.prefetch_scales, c.ctas_per_sm, c.split_k) for c in variants] == [
        (128, True, 1, 7), (128, True, 2, 9), (256, True, 1, 7)]
    two = Fp8GemmConfig(64, 128, 128, 4, 128, 14, 0, ctas_per_sm=2)
    assert two.valid()
    assert not dataclasses.replace(two, stages=6).valid()
    assert not dataclasses.replace(two, block_m=128, threads=256).valid()
    tensor = Fp8GemmKernel(n=8192, k=8192, scaling="tensor", out_dtype="bfloat16",
                           has_bias=False, scale_a_m_major=False)
    assert {c.block_k for c in tensor.decode_variants(16)} == {128, 256}


@pytest.mark.full
@pytest.mark.compile
@pytest.mark.parametrize("scaling", ["tensor", "block"])
def test_decode_variants_compile_to_the_fast_path(scaling, tmp_path):
    """wgmma + TMA, no spills; two CTAs an SM get __launch_bounds__(256, 2) and the 24/224
    register split; the prefetching promotion multiplies the scales only at the promotion;
    a 256-deep block-scaled tile runs one m64n128k32 x 4 wgmma batch per 128-deep half, the
    second from the halves' offsets (8 KB into a's stage, 16 KB into b's)."""
    from tileops.kernels.fp8 import Fp8GemmKernel

    from ..helpers import assert_no_spills_or_serialized_wgmma

    kernel = Fp8GemmKernel(n=7168, k=18432, scaling=scaling, out_dtype="bfloat16",
                           has_bias=False, scale_a_m_major=scaling == "block")
    for config in kernel.decode_variants(16):
        compiled = kernel.compile(config, "m16")
        source = compiled[0].get_kernel_source()
        assert "wgmma" in source and "tma_load" in source, config
        assert_no_spills_or_serialized_wgmma(compiled[0], tmp_path)
        if config.ctas_per_sm == 2:
            assert "__launch_bounds__(256, 2)" in source, config
            assert "warpgroup_reg_alloc<224>" in source, config
        if config.prefetch_scales:
            assert "sb[0] = " in source, config
        if scaling == "block" and config.block_k == 256:
            assert "(h * 8192)" in source and "(h * 16384)" in source, config
            assert "ki < 4" in source and "ki < 8" not in source, config


def test_weight_stream_space_serves_the_decode_buckets():
    """M <= 64: the weight-streaming tiles join the space (token tile = the bucket's rows,
    up to 16 stages of e4m3, splits keeping >= 4 K tiles); none past 64 rows; none holds
    gemm_fp8's own decode options; a bucket wider than the token tile is refused."""
    from tileops.kernels.fp8 import Fp8GemmKernel

    kernel = Fp8GemmKernel(n=7168, k=18432, scaling="block", out_dtype="bfloat16",
                           has_bias=False, scale_a_m_major=True)
    for bucket, rows in (("m16", 16), ("m32", 32), ("m64", 64)):
        space = kernel.weight_stream_space(bucket)
        assert space and all(c.weight_rows and c.valid() and c.block_m == rows for c in space)
        assert set(space) <= set(kernel.config_space(bucket))
    tiles = {(c.block_n, c.block_k, c.stages, c.split_k) for c in kernel.weight_stream_space("m16")}
    assert (64, 128, 16, 1) in tiles and (128, 256, 6, 1) in tiles
    assert kernel.weight_stream_space("m128") == []
    wide = kernel.weight_stream_space("m16")[0]
    assert not dataclasses.replace(wide, prefetch_scales=True).valid()
    assert not dataclasses.replace(wide, block_k=64).valid()
    with pytest.raises(ValueError, match="block_m = 16"):
        kernel.program(wide, "m32")


@pytest.mark.compile
@pytest.mark.parametrize("scaling", ["tensor", "row", "block"])
def test_weight_stream_programs_compile_to_the_fast_path(scaling, tmp_path):
    """wgmma with the weight tile as A and the tokens as B (m64n16k32 on e4m3), TMA loads, a
    split's partials through the cluster's shared memory, no spills; block scaling promotes
    each 128-deep half of a 256-deep stage from its own scales, loaded a block ahead."""
    from tileops.kernels.fp8 import Fp8GemmKernel
    from tileops.kernels.fp8.gemm_fp8 import Fp8GemmConfig
    from tileops.kernels.gemm import weight_stream as ws

    from ..helpers import assert_no_spills_or_serialized_wgmma

    kernel = Fp8GemmKernel(n=1536, k=7168, scaling=scaling, out_dtype="bfloat16",
                           has_bias=True, scale_a_m_major=scaling == "block")
    for block_k, split in ((128, 1), (256, 4)):
        config = ws.deepest(16, 64, block_k, split, Fp8GemmConfig, 16)
        main = kernel.compile(config, "m16")[0]
        source = main.get_kernel_source()
        assert "tma_load" in source and "64, 16, 32" in source, config
        assert ("map_shared_rank" in source) == (split > 1), config
        assert "scale_a" in source and "scale_b" in source
        if scaling == "block" and block_k == 256:
            assert "(h * 8192)" in source and "(h * 2048)" in source, config  # w, x halves
        assert_no_spills_or_serialized_wgmma(main, tmp_path)


@pytest.mark.compile
def test_unrolled_reduce_program_on_the_cpu():
    """The decode variants' split-K reduce (one output row a CTA, the splits unrolled), run
    thread by thread on the CPU (tests/cuda_emulation.py; its grid is 1-D, so M = 1): the
    sum of the splits plus the bias in bf16, N = 576 leaving the second CTA 64 columns."""
    import tilelang

    from tileops.kernels.gemm.gemm import split_k_reduce_program

    from ..cuda_emulation import run

    program = split_k_reduce_program(576, 3, "bfloat16", block_m=1, has_bias=True,
                                     unroll_splits=True)
    compiled = tilelang.compile(program, target={"kind": "cuda", "arch": "sm_90a"})
    assert "#pragma unroll" in compiled.get_kernel_source()
    torch.manual_seed(0)
    w = torch.randn(3, 1, 576)
    bias = torch.randn(576).to(torch.bfloat16)
    d = torch.full((1, 576), float("nan")).to(torch.bfloat16)
    run(compiled, 2, 128, dict(w=w, bias=bias, d=d), dict(m=1))
    want = (w.sum(0) + bias.float()).to(torch.bfloat16)
    torch.testing.assert_close(d, want, atol=0, rtol=0)
