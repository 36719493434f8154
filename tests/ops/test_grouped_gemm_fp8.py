"""grouped_gemm_fp8 on the GPU: against an fp32 GEMM of the dequantized inputs, per expert,
under the bound of tileops.ops.grouped_gemm_fp8 (gemm_fp8's block-scaled bound: wgmma's
~14-bit fp8 accumulation promoted every 128 K, plus the output rounding): test_fp8's
`check_gemm` with scaling "block"."""

import pytest
import torch

import tileops
from tileops import GroupedGemmFp8FwdOp
from tileops.kernels.base import Kernel

from ..helpers import poison, randn
from . import moe_reference as ref
from .test_fp8 import check_gemm, quantized

pytestmark = pytest.mark.gpu

E4M3 = torch.float8_e4m3fn
I32 = torch.int32


def group_offsets(sizes):
    return torch.tensor(sizes, device="cuda").cumsum(0).to(I32)


def experts(n_experts, n, k):
    """b e4m3 [E, N, K], its 128x128 block scales [E, N/128, K/128], dequantized fp32."""
    qs, ss, ds = zip(*(quantized(n, k, "weight_block", std=k ** -0.5)
                       for _ in range(n_experts)), strict=True)
    return torch.stack(qs), torch.stack(ss), torch.stack(ds)


def reference(da, db, offsets):
    """(fp32 per-expert GEMM of the dequantized inputs, magnitude of its terms); rows past
    offsets[-1] are zeros (never compared)."""
    out = torch.zeros(da.shape[0], db.shape[1], device="cuda")
    mag = torch.zeros_like(out)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        out[start:end] = da[start:end] @ db[e].t()
        mag[start:end] = da[start:end].abs() @ db[e].abs().t()
        start = end
    return out, mag


def check(out, want, offsets, k, what="output"):
    end = int(offsets[-1])
    check_gemm(out[:end], (want[0][:end], want[1][:end]), "block", k, what=what)


def zipf_sizes(tokens, n_experts, top_k=8):
    ids = ref.zipf_ids(tokens, n_experts, top_k, skew=1.2)
    return torch.bincount(ids.flatten().long(), minlength=n_experts).tolist()


# (group sizes, N, K): every size also gets 17 rows past the last group (never written)
CASES = [
    ([0, 1, 200, 0, 129, 64, 1000, 3], 256, 512),  # empty experts, tails, a lone row
    ([2] * 64, 384, 1024),                          # decode bucket: 64-row tiles
    ("zipf", 512, 1024),                            # skewed routing, 64 experts
    ([300, 0, 0, 555], 128, 2048),                  # one n tile, long K
]


@pytest.mark.smoke
@pytest.mark.parametrize("sizes, n, k", CASES)
def test_grouped_gemm_fp8_matches_dequantized_reference(sizes, n, k):
    if sizes == "zipf":
        sizes = zipf_sizes(512, 64)
    offsets = group_offsets(sizes)
    m = int(offsets[-1]) + 17
    a, sa, da = quantized(m, k, "block")  # rows and K blocks of very different magnitudes
    b, sb, db = experts(len(sizes), n, k)
    want = reference(da, db, offsets)
    check(tileops.grouped_gemm_fp8(a, b, offsets, sa, sb), want, offsets, k)
    out16 = tileops.grouped_gemm_fp8(a, b, offsets, sa, sb, out_dtype=torch.float16)
    assert out16.dtype == torch.float16
    check(out16, want, offsets, k, what="float16 output")


def test_m_major_scales_from_quantize_fp8():
    """The serving path: activations quantized by quantize_fp8 (M-major 1x128 scales, read
    in place) times 128x128 block-scaled experts."""
    k, n = 1024, 256
    for sizes in ([3, 0, 100, 40], [200] * 4):
        offsets = group_offsets(sizes)
        m = int(offsets[-1]) + 5
        a, sa = tileops.quantize_fp8(randn(m, k, dtype=torch.bfloat16), "group")
        assert sa.stride() == (1, m)
        b, sb, db = experts(len(sizes), n, k)
        want = reference(a.float() * sa.repeat_interleave(128, -1), db, offsets)
        check(tileops.grouped_gemm_fp8(a, b, offsets, sa, sb), want, offsets, k)


@pytest.mark.parametrize("m_major", [True, False])
def test_every_owned_row_written_and_no_other(m_major):
    """Kernel-level launches into NaN-poisoned outputs (decode and prefill buckets): every
    row of a group is written, rows past offsets[-1] are left alone."""
    n, k, sizes = 384, 1024, [0, 130, 1, 0, 64, 257, 0, 2]
    offsets = group_offsets(sizes)
    b, sb, db = experts(len(sizes), n, k)
    op = GroupedGemmFp8FwdOp()
    kernel = op.get_kernel("grouped_gemm_fp8", b.device,
                           **op._kernel_key(n, k, len(sizes), m_major))
    for extra in (3, 5000):  # 457 rows (decode bucket: <= 64 per expert), 5454 (prefill)
        m = int(offsets[-1]) + extra
        a, sa, da = quantized(m, k, "block")
        sa_k = sa.t().contiguous() if m_major else sa
        out = poison(torch.empty(m, n, dtype=torch.bfloat16, device="cuda"))
        kernel(m, a, b, sa_k, sb, offsets, out)
        check(out, reference(da, db, offsets), offsets, k, what=f"M={m}")
        assert torch.isnan(out[int(offsets[-1]):].float()).all(), "a row past the groups"


def test_empty_and_all_rows_in_empty_experts():
    b, sb, _ = experts(4, 128, 256)
    zero = torch.zeros((4,), dtype=I32, device="cuda")
    a0, sa0, _ = quantized(0, 256, "block", loud=False)
    assert tileops.grouped_gemm_fp8(a0, b, zero, sa0, sb).shape == (0, 128)
    a, sa, _ = quantized(50, 256, "block")  # no expert owns a row: nothing written, no fault
    tileops.grouped_gemm_fp8(a, b, zero, sa, sb)
    torch.cuda.synchronize()


def test_non_contiguous_inputs():
    sizes, n, k = [100, 0, 77], 256, 512
    offsets = group_offsets(sizes)
    m = int(offsets[-1])
    a, sa, da = quantized(m, k, "block")
    b, sb, db = experts(len(sizes), n, k)
    wide = torch.empty(m, 2 * k, dtype=E4M3, device="cuda")
    wide[:, ::2] = a
    sb_t = sb.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    out = tileops.grouped_gemm_fp8(wide[:, ::2], b, offsets, sa, sb_t)
    check(out, reference(da, db, offsets), offsets, k)


def test_cuda_graph_and_no_recompile():
    """The group sizes are read on the device: a captured launch replays for new sizes;
    new token counts reuse their bucket's program."""
    n, k, n_experts = 256, 512, 16
    b, sb, db = experts(n_experts, n, k)
    a, sa, da = quantized(1024, k, "block")
    offsets = group_offsets([64] * 16)
    tileops.grouped_gemm_fp8(a, b, offsets, sa, sb)  # decode bucket (64 rows per expert)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tileops.grouped_gemm_fp8(a, b, offsets, sa, sb)
    offsets.copy_(group_offsets([0, 300, 0, 0, 200, 100, 0, 0, 0, 50, 50, 50, 50, 100, 100,
                                 24]))
    graph.replay()
    torch.cuda.synchronize()
    check(out, reference(da, db, offsets), offsets, k, what="replay")
    a, sa, _ = quantized(4097, k, "block")
    tileops.grouped_gemm_fp8(a, b, group_offsets([256] * 16), sa, sb)  # prefill bucket
    before = Kernel.compile_count
    for m in (1, 7, 100, 1025, 4097):
        a, sa, da = quantized(m, k, "block")
        offsets = group_offsets([m // 16] * 15 + [m - 15 * (m // 16)])
        check(tileops.grouped_gemm_fp8(a, b, offsets, sa, sb), reference(da, db, offsets),
              offsets, k, what=f"M={m}")
    assert Kernel.compile_count == before


def test_torch_compile():
    n, k, sizes = 256, 512, [10, 0, 300, 2]
    offsets = group_offsets(sizes)
    a, sa, da = quantized(int(offsets[-1]), k, "block")
    b, sb, db = experts(len(sizes), n, k)
    f = torch.compile(lambda *t: tileops.grouped_gemm_fp8(*t) * 2, fullgraph=True)
    want, mag = reference(da, db, offsets)
    check(f(a, b, offsets, sa, sb), (want * 2, mag * 2), offsets, k)


def test_close_to_the_bf16_grouped_gemm_on_dequantized_inputs():
    """The bench's baseline computes the same product."""
    n, k, sizes = 512, 1024, [128] * 8
    offsets = group_offsets(sizes)
    a, sa, da = quantized(1024, k, "block")
    b, sb, db = experts(len(sizes), n, k)
    base = tileops.grouped_gemm(da.to(torch.bfloat16), db.to(torch.bfloat16), offsets)
    out = tileops.grouped_gemm_fp8(a, b, offsets, sa, sb)
    rel = ((out.float() - base.float()).norm() / base.float().norm()).item()
    assert rel < 2e-2, rel


@pytest.mark.full
@pytest.mark.parametrize("bucket_rows", [2, 200])  # mean rows per expert: decode, prefill
def test_every_config_of_the_space(bucket_rows):
    """The tuner may ship any config of the space: each must be right on tails."""
    from tileops.kernels.fp8 import GroupedGemmFp8Kernel

    n, k = 384, 1024
    sizes = [bucket_rows + 1, 0, bucket_rows * 2 + 3, 1]
    offsets = group_offsets(sizes)
    a, sa, da = quantized(int(offsets[-1]) + 9, k, "block")
    b, sb, db = experts(len(sizes), n, k)
    want = reference(da, db, offsets)
    kernel = GroupedGemmFp8Kernel(n=n, k=k, n_experts=len(sizes), out_dtype="bfloat16",
                                  scale_a_m_major=False)
    for config in kernel.config_space(kernel.bucket_of(a.shape[0])):
        op = GroupedGemmFp8FwdOp()
        op.pin_config(config, a, b, offsets, sa, sb)
        check(op(a, b, offsets, sa, sb), want, offsets, k, what=str(config))
