"""grouped_gemm_fp8 without a GPU: meta outputs, errors that name the op and argument, the
kernel a call runs (the M-major scale layout read in place), the roofline, the config
space, and (full) every config compiled for sm_90a: TMA, wgmma, no spills (ptxas)."""

import pytest
import torch

import tileops
from tileops import GroupedGemmFp8FwdOp
from tileops.errors import TileOpsError

from ..helpers import meta

E4M3 = torch.float8_e4m3fn


def fp8(*shape):
    return meta(*shape, dtype=E4M3)


def f32(*shape):
    return torch.empty(shape, dtype=torch.float32, device="meta")


def i32(*shape):
    return torch.empty(shape, dtype=torch.int32, device="meta")


def inputs(m=300, e=8, n=384, k=256):
    return fp8(m, k), fp8(e, n, k), i32(e), f32(m, k // 128), f32(e, n // 128, k // 128)


def test_meta_outputs():
    out = tileops.grouped_gemm_fp8(*inputs())
    assert out.shape == (300, 384) and out.dtype == torch.bfloat16
    out = tileops.grouped_gemm_fp8(*inputs(), out_dtype=torch.float16)
    assert out.dtype == torch.float16
    d = torch.ops.tileops.grouped_gemm_fp8_fwd(*inputs(0), "float16")
    assert d.shape == (0, 384) and d.dtype == torch.float16


@pytest.mark.parametrize("args, match", [
    (inputs(k=200)[:3] + (f32(300, 1), f32(8, 3, 1)), "argument 'a': .*K % 128 == 0"),
    ((fp8(300, 256), fp8(8, 200, 256), i32(8), f32(300, 2), f32(8, 1, 2)),
     "argument 'b': .*N % 128 == 0"),
    (inputs()[:3] + (f32(300, 3), inputs()[4]), "argument 'scale_a'"),
    (inputs()[:3] + (f32(2, 300), inputs()[4]), "argument 'scale_a'"),
    (inputs()[:4] + (f32(8, 3, 3),), "argument 'scale_b'"),
    (inputs()[:4] + (f32(3, 2),), "argument 'scale_b'"),
    ((meta(300, 256),) + inputs()[1:], "argument 'a': expected dtype float8_e4m3fn"),
    (inputs()[:1] + (meta(8, 384, 256),) + inputs()[2:], "argument 'b': expected dtype"),
    (inputs()[:2] + (i32(7),) + inputs()[3:], "argument 'offsets'"),
    (inputs()[:3] + (f32(300, 2).half(), inputs()[4]), "argument 'scale_a': expected dtype"),
])
def test_errors(args, match):
    with pytest.raises(TileOpsError, match="GroupedGemmFp8FwdOp: " + match):
        tileops.grouped_gemm_fp8(*args)


def test_out_dtype_error():
    with pytest.raises(TileOpsError, match="GroupedGemmFp8FwdOp: argument 'out_dtype'"):
        tileops.grouped_gemm_fp8(*inputs(), out_dtype=torch.float32)


def test_kernel_key_reads_m_major_scales_in_place():
    op = GroupedGemmFp8FwdOp()
    a, b, offsets, sa, sb = inputs()
    (name, key, size), = op.kernels_for(op.check([a, b, offsets, sa, sb]))
    assert (name, size) == ("grouped_gemm_fp8", 300) and not key["scale_a_m_major"]
    sa_m = f32(2, 300).t()  # quantize_fp8's group scales: strides (1, M)
    (_, key, _), = op.kernels_for(op.check([a, b, offsets, sa_m, sb]))
    assert key == {"n": 384, "k": 256, "n_experts": 8, "out_dtype": "bfloat16",
                   "scale_a_m_major": True}
    assert op.kernels_for(op.check(list(inputs(0)))) == []


def test_roofline():
    m, e, n, k = 32768, 256, 4096, 7168
    flops, nbytes = GroupedGemmFp8FwdOp().eval_roofline(*inputs(m, e, n, k))
    assert flops == 2 * m * n * k
    assert nbytes == m * k + e * n * k + 2 * m * n + 4 * (m * 56 + e * 32 * 56) + 4 * e


def test_config_space_and_buckets():
    from tileops.kernels.fp8 import GroupedGemmFp8Kernel

    kernel = GroupedGemmFp8Kernel(n=7168, k=2048, n_experts=256, out_dtype="bfloat16",
                                  scale_a_m_major=True)
    assert kernel.bucket_of(512) == "decode" and kernel.bucket_of(32768) == "prefill"
    for bucket in ("decode", "prefill"):
        space = kernel.config_space(bucket)
        assert space[0] == kernel.heuristic_config(bucket, "sm_90a")
        assert all(c.valid() and c.block_n == c.block_k == 128 for c in space)
        assert all(c.stages * (c.block_m + 128) * 128 <= 227 * 1024 for c in space)
    assert kernel.heuristic_config("decode", "sm_90a").block_m == 64


def test_shares_the_schedule_and_the_promotion():
    """The grouped fp8 kernel is built from the bf16 grouped GEMM's tile table and tile
    walk and the dense fp8 GEMM's block promotion, not from copies."""
    from tileops.kernels.fp8 import gemm_fp8, grouped_gemm_fp8
    from tileops.kernels.moe import grouped_gemm

    assert grouped_gemm_fp8.tile_table_program is grouped_gemm.tile_table_program
    assert grouped_gemm_fp8.tile_launch is grouped_gemm.tile_launch
    assert grouped_gemm_fp8.tile_store_macro is grouped_gemm.tile_store_macro
    assert grouped_gemm_fp8.promote_block_prefetched is gemm_fp8.promote_block_prefetched
    assert grouped_gemm_fp8.promote_block is gemm_fp8.promote_block
    assert grouped_gemm_fp8.load_block_factors is gemm_fp8.load_block_factors


@pytest.mark.compile
@pytest.mark.full
@pytest.mark.parametrize("bucket", ["decode", "prefill"])
@pytest.mark.parametrize("m_major", [True, False])
def test_every_config_keeps_the_fast_path(bucket, m_major, tmp_path):
    """Each config of the space: TMA, wgmma, no spills and no serialized wgmma (ptxas)."""
    from tileops.kernels.fp8 import GroupedGemmFp8Kernel

    from ..test_compile import assert_no_spills_or_serialized_wgmma

    kernel = GroupedGemmFp8Kernel(n=4096, k=7168, n_experts=256, out_dtype="bfloat16",
                                  scale_a_m_major=m_major)
    space = kernel.config_space(bucket) if m_major else [kernel.heuristic_config(bucket,
                                                                                  "sm_90a")]
    for config in space:
        gemm = kernel.compile(config, bucket)[1]
        source = gemm.get_kernel_source()
        assert "tma_load" in source and "wgmma" in source, config
        assert_no_spills_or_serialized_wgmma(gemm, tmp_path)
