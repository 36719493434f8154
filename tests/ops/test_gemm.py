"""GemmFwdOp on the GPU against an fp32 torch.matmul reference."""

import dataclasses

import pytest
import torch

import tileops
from tileops import GemmFwdOp, TileOpsError
from tileops.kernels.base import Kernel, sm_count
from tileops.kernels.gemm import GemmConfig, GemmKernel, select, weight_stream
from tileops.kernels.gemm.gemm import (
    EARLY_ACCUMULATE,
    SHORT_ACCUMULATE_K,
    SHORT_K_PINGPONG,
    TWO_CTA_ACCUMULATE,
)
from tileops.kernels.gemm.wave_fill import partition

from ..helpers import assert_close, poison_allocator, randn

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]


def make_inputs(m, n, k, dtype, trans_a=False, trans_b=True):
    """a, b in the layouts the flags say, scaled so outputs are ~N(0, 1)."""
    a = randn(m, k, dtype=dtype)
    b = randn(n, k, dtype=dtype, std=k ** -0.5)
    return (a.t().contiguous() if trans_a else a), (b if trans_b else b.t().contiguous())


def reference(a, b, trans_a=False, trans_b=True):
    a = a.float().t() if trans_a else a.float()
    b = b.float().t() if trans_b else b.float()
    return a @ b


@pytest.mark.smoke
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, k", [
    (1000, 3000, 777),    # no dimension a multiple of any tile; K breaks TMA alignment
    (1000, 3000, 4097),   # K one past a tile boundary
    (4096, 6144, 4096),   # llama3.1-8b qkv_proj prefill
    (1, 4096, 14336),     # decode batch 1: split-K path
    (16, 6144, 4096),     # decode batch 16
    (32, 2112, 7168),     # deepseek-v3 fused q_a/kv_a decode: N not a multiple of 128
    (200, 1024, 512),     # m256 bucket
    (129, 768, 4096),     # one row past the m128 bucket
    (2049, 512, 4096),    # m4096 bucket: the cost model's 128 x 128, no split
    (5000, 1152, 896),    # m8192 bucket, K a few tiles
    (16385, 512, 2048),   # one row past m16384: "large"
])
def test_matches_reference(m, n, k, dtype):
    a, b = make_inputs(m, n, k, dtype)
    assert_close(tileops.gemm(a, b), reference(a, b))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("trans_a, trans_b", [(False, False), (True, True), (True, False)])
@pytest.mark.parametrize("m", [1000, 999, 16])  # 999, 16 with trans_a: M as a row stride
def test_transpose_flags(trans_a, trans_b, m, dtype):
    a, b = make_inputs(m, 3000, 777, dtype, trans_a, trans_b)
    out = GemmFwdOp(trans_a=trans_a, trans_b=trans_b)(a, b)
    assert_close(out, reference(a, b, trans_a, trans_b))


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_element_written(dtype):
    """Kernel-level launch into a NaN-poisoned output, on tails in M, N and K."""
    m, n, k = 1001, 3000, 777
    a, b = make_inputs(m, n, k, dtype)
    op = GemmFwdOp()
    for size in (m, 7):  # a prefill bucket and a split-K decode bucket
        kernel = op.get_kernel("gemm", a.device, **op._kernel_key(dtype, n, k, False, True))
        d = torch.full((size, n), float("nan"), dtype=dtype, device="cuda")
        kernel(size, a[:size].contiguous(), b, d)
        assert_close(d, reference(a[:size], b))


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_inputs(dtype):
    m, n, k = 640, 1024, 512
    base_a = randn(m, 2 * k, dtype=dtype)
    a = base_a[:, ::2]                               # strided: copied
    b_t = randn(k, n, dtype=dtype, std=k ** -0.5)
    b = b_t.t()                                      # transposed view: served by trans flag
    assert not a.is_contiguous() and not b.is_contiguous()
    assert_close(tileops.gemm(a, b), reference(a, b))
    unaligned = randn(m * k + 1, dtype=dtype)[1:].view(m, k)  # base address off by 2 bytes
    assert_close(tileops.gemm(unaligned, b), reference(unaligned, b))


@pytest.mark.parametrize("flags", [{}, {"has_bias": True}])
def test_every_config_the_model_can_pick(flags):
    """Each config form the cost model may choose for an untuned bucket (select.py), on
    tails in M, N and K, into a NaN-poisoned output; with a bias through the epilogue or the
    split-K reduce."""
    dtype = torch.bfloat16
    n, k = 3000, 4192
    a, b = make_inputs(3001, n, k, dtype)
    bias = randn(n, dtype=dtype)
    kernel = GemmKernel(dtype="bfloat16", n=n, k=k, trans_a=False, trans_b=True, **flags)
    forms = select.pickable_forms()
    for bucket in {where for where, _ in forms}:  # in parallel
        kernel.compile_many([c for where, c in forms if where == bucket], bucket)
    for bucket, config in forms:
        m = {"m16": 7, "m128": 100, "m4096": 3001}[bucket]
        assert kernel.bucket_of(m) == bucket
        kernel.use(config, bucket)  # pinned: the call below runs this config
        d = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
        want = reference(a[:m], b)
        if flags:
            kernel(m, a[:m].contiguous(), b, bias, d)
            want = want + bias.float()
        else:
            kernel(m, a[:m].contiguous(), b, d)
        assert_close(d, want, what=f"{bucket} {config}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("flags", [{"trans_b": True}, {"trans_b": True, "has_bias": True},
                                   {"trans_b": False}])
def test_wave_fill(flags, dtype):
    """The wave-fill form (wave_fill.py) on grids under one wave (every tile in pieces), with
    a left-over wave (whole tiles, then pieces) and on whole waves, with tails in M, N and
    K, into a NaN-poisoned output; each size twice, so the second call finds the counts
    the first one reset."""
    n, k = 3000, 4192  # 12 column tiles of 256, 24 of 128; 66 K tiles, the last partial
    trans_b = flags["trans_b"]
    a, b = make_inputs(3001, n, k, dtype, trans_b=trans_b)
    bias = randn(n, dtype=dtype)
    key = {"dtype": str(dtype).split(".")[1], "n": n, "k": k, "trans_a": False, **flags}
    for config in (GemmConfig(128, 256, 64, 3, 256, 1, 8, wave_fill=True),
                   GemmConfig(128, 128, 64, 4, 256, 1, 8, wave_fill=True)):
        kernel = GemmKernel(**key)
        for m in (100, 1500, 1408, 3001):
            tiles = -(-m // config.block_m) * -(-n // config.block_n)
            bucket = kernel.bucket_of(m)
            kernel.use(config, bucket)
            want = reference(a[:m], b, trans_b=trans_b)
            if flags.get("has_bias"):
                want = want + bias.float()
            for _ in range(2):
                d = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
                args = (a[:m].contiguous(), b) + ((bias,) if flags.get("has_bias") else ())
                kernel(m, *args, d)
                assert_close(d, want, what=f"{config} M={m} ({tiles} tiles, "
                             f"{partition(tiles, 66, sm_count(d.device))})")


ROWS_AND_ASYNC = {
    "128x128-full-row": GemmConfig(128, 128, 64, 4, 256, 1, 8, full_row=True),
    "128x256-full-row": GemmConfig(128, 256, 64, 3, 256, 1, 8, full_row=True),
    "128x96-full-row": GemmConfig(128, 96, 64, 4, 256, 1, 8, full_row=True),
    "128x160-full-row": GemmConfig(128, 160, 64, 4, 256, 1, 8, full_row=True),
    "128x128-full-row-6-stages": GemmConfig(128, 128, 64, 6, 256, 1, 8, full_row=True),
    "128x128-full-row-split2": GemmConfig(128, 128, 64, 4, 256, 2, 8, full_row=True),
    "128x128-full-row-wave-fill": GemmConfig(128, 128, 64, 4, 256, 1, 8, wave_fill=True,
                                             full_row=True),
    "128x128-async": GemmConfig(128, 128, 64, 4, 256, 1, 8, full_row=True, async_mma=True),
    "128x256-async": GemmConfig(128, 256, 64, 3, 256, 1, 8, full_row=True, async_mma=True),
    "128x128-async-split4": GemmConfig(128, 128, 64, 4, 256, 4, 8, full_row=True,
                                       async_mma=True),
    "128x128-async-square": GemmConfig(128, 128, 64, 4, 256, 1, 8, async_mma=True),
    "64x128-async": GemmConfig(64, 128, 128, 4, 128, 1, 0, async_mma=True),
    "128x128-persistent": GemmConfig(128, 128, 64, 4, 256, 1, 8, full_row=True,
                                     async_mma=True, persistent=True),
    "128x256-persistent": GemmConfig(128, 256, 64, 3, 256, 1, 8, full_row=True,
                                     async_mma=True, persistent=True),
    "64x128-persistent-row-major": GemmConfig(64, 128, 128, 4, 128, 1, 0, async_mma=True,
                                              persistent=True),
    "128x128-cluster": GemmConfig(128, 128, 64, 4, 256, 1, 8, full_row=True, async_mma=True,
                                  cluster_m=2),
    "128x128-cluster-row-major": GemmConfig(128, 128, 64, 4, 256, 1, 0, full_row=True,
                                            async_mma=True, cluster_m=2),
    "128x256-cluster": GemmConfig(128, 256, 64, 3, 256, 1, 0, full_row=True, async_mma=True,
                                  cluster_m=2),
    "128x128-cluster-split2": GemmConfig(128, 128, 64, 4, 256, 2, 0, full_row=True,
                                         async_mma=True, cluster_m=2),
    "64x128-cluster": GemmConfig(64, 128, 128, 4, 128, 1, 0, async_mma=True, cluster_m=2),
    "128x128-2-an-sm": GemmConfig(128, 128, 32, 4, 128, 1, 8, full_row=True, async_mma=True,
                                  ctas_per_sm=2),
    "128x128-2-an-sm-persistent": GemmConfig(128, 128, 64, 2, 128, 1, 8, full_row=True,
                                             async_mma=True, persistent=True, ctas_per_sm=2),
    "128x128-pingpong": GemmConfig(128, 128, 64, 4, 256, 1, 8, full_row=True, async_mma=True,
                                   persistent=True, pingpong=True),
    "128x192-pingpong": GemmConfig(128, 192, 64, 3, 256, 1, 8, full_row=True, async_mma=True,
                                   persistent=True, pingpong=True),
    "64x256-pingpong-row-major": GemmConfig(64, 256, 64, 4, 256, 1, 0, full_row=True,
                                            async_mma=True, persistent=True, pingpong=True),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(ROWS_AND_ASYNC))
@pytest.mark.parametrize("flags", [{}, {"has_bias": True}, {"trans_b": False},
                                   {"trans_a": True}])
def test_full_row_and_async_pipeline(name, flags, dtype):
    """Whole-row warp groups (GemmConfig.full_row), the hand-written pipeline (async_mma),
    its persistent walk and its 2-CTA clusters in each tile form and layout, with tails in
    M, N and K (a partial last K tile, stages reused many times over; 288 tiles of 128 x
    128 walked by 132 CTAs, 24 by 24; 11 row tiles, the cluster's twelfth all past M), into
    a NaN-poisoned output."""
    config = ROWS_AND_ASYNC[name]
    m, n, k = 1504, 3000, 4192  # M a multiple of 8 (trans_a strides), 66 K tiles of 64
    trans_a, trans_b = flags.get("trans_a", False), flags.get("trans_b", True)
    a, b = make_inputs(m, n, k, dtype, trans_a=trans_a, trans_b=trans_b)
    bias = randn(n, dtype=dtype)
    kernel = GemmKernel(dtype=str(dtype).split(".")[1], n=n, k=k, trans_a=trans_a,
                        trans_b=trans_b, **({"has_bias": True} if "has_bias" in flags else {}))
    for rows in (m, 1400, 1):
        if config.block_m == 128 and rows == 1:
            continue  # a 128-row tile never serves the m16 bucket
        kernel.use(config, kernel.bucket_of(rows))
        a_rows = a[:, :rows].contiguous() if trans_a else a[:rows].contiguous()
        if trans_a and rows % 8:
            continue
        d = torch.full((rows, n), float("nan"), dtype=dtype, device="cuda")
        kernel(rows, a_rows, b, *((bias,) if "has_bias" in flags else ()), d)
        want = reference(a_rows, b, trans_a=trans_a, trans_b=trans_b)
        if "has_bias" in flags:
            want = want + bias.float()
        assert_close(d, want, what=f"{name} M={rows}")


WEIGHT_ROWS = {f"{bm}x{bn}x{bk}-split{sp}": weight_stream.deepest(bm, bn, bk, sp)
               for bm, bn, bk, sp in [(16, 64, 128, 1), (16, 64, 128, 2), (16, 64, 128, 4),
                                      (16, 128, 256, 2), (16, 128, 128, 8), (32, 64, 256, 1),
                                      (32, 128, 128, 4), (64, 64, 128, 2), (64, 128, 256, 1)]}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(WEIGHT_ROWS))
@pytest.mark.parametrize("has_bias", [False, True])
def test_weight_rows(name, has_bias, dtype):
    """The weight-streaming form (weight_stream.py) in each token tile, weight tile and
    cluster split, with tails in every dimension: M below the token tile (1 row, an odd
    count), N not a multiple of the weight tile, K 33 tiles of 128 (the last partial) cut in
    uneven pieces; into a NaN-poisoned output."""
    config = WEIGHT_ROWS[name]
    n, k = 1000, 4104
    a, b = make_inputs(config.block_m, n, k, dtype)
    bias = randn(n, dtype=dtype)
    kernel = GemmKernel(dtype=str(dtype).split(".")[1], n=n, k=k, trans_a=False, trans_b=True,
                        **({"has_bias": True} if has_bias else {}))
    for rows in sorted({config.block_m, config.block_m // 2 + 1, 1}):
        kernel.use(config, kernel.bucket_of(rows))
        d = torch.full((rows, n), float("nan"), dtype=dtype, device="cuda")
        kernel(rows, a[:rows].contiguous(), b, *((bias,) if has_bias else ()), d)
        want = reference(a[:rows], b) + (bias.float() if has_bias else 0)
        assert_close(d, want, what=f"{name} M={rows}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k", [(1024, 4096), (4096, 4096), (1000, 4104), (96, 512)])
def test_weight_stream_default_through_linear(n, k, dtype):
    """tileops.linear at decode sizes takes the weight-streaming default (split 4 on 16
    weight tiles, none on 64; a 2-tile weight with 4 K tiles), bias and all, and writes
    every element of a poisoned output."""
    x, w = make_inputs(16, n, k, dtype)
    bias = randn(n, dtype=dtype)
    kernel = GemmKernel(dtype=str(dtype).split(".")[1], n=n, k=k, trans_a=False, trans_b=True)
    assert kernel.config_for("m16").weight_rows
    for rows in (1, 7, 16):
        poison_allocator()
        out = tileops.linear(x[:rows], w, bias)
        assert_close(out, reference(x[:rows], w) + bias.float(), what=f"M={rows}")


ACCUMULATING = GemmConfig(128, 128, 64, 4, 256, 1, 8, full_row=True, async_mma=True)
TWO_AN_SM = dataclasses.replace(ACCUMULATING, stages=2, threads=128, ctas_per_sm=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", [
    ACCUMULATING, dataclasses.replace(ACCUMULATING, persistent=True),
    dataclasses.replace(ACCUMULATING, early_out=True),
    dataclasses.replace(ACCUMULATING, early_out=True, persistent=True),
    dataclasses.replace(TWO_AN_SM, early_out=True),
    dataclasses.replace(TWO_AN_SM, early_out=True, persistent=True),
    dataclasses.replace(ACCUMULATING, persistent=True, pingpong=True)],
    ids=["plain", "persistent", "early_out", "persistent-early_out", "2-an-sm-early_out",
         "2-an-sm-persistent-early_out", "pingpong"])
def test_async_pipeline_accumulates_over_symbolic_k(config, dtype):
    """The accumulating, symbolic-K form (a weight gradient: d += a^T b over tokens) on the
    hand-written pipeline, at token counts that are and are not multiples of the K tile,
    fewer K tiles than stages among them; with early_out the old tile comes by TMA; two
    CTAs an SM of one consumer warp group each."""
    n, m_out = 3000, 1000
    kernel = GemmKernel(dtype=str(dtype).split(".")[1], n=n, k=None, trans_a=True,
                        trans_b=False, accumulate=True)
    for tokens in (64, 4100):
        a = randn(tokens, m_out, dtype=dtype)           # [K, M]: trans_a
        b = randn(tokens, n, dtype=dtype, std=tokens ** -0.5)  # [K, N]
        kernel.use(config, kernel.bucket_of(m_out))
        d = randn(m_out, n, dtype=dtype)
        want = d.float() + a.float().t() @ b.float()
        kernel(m_out, a, b, d)
        assert_close(d, want, what=f"K={tokens}")

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [72, 512, 1000])
def test_accumulating_defaults_over_static_k(k, dtype):
    """The defaults of an accumulating GEMM with a static K (the fused loss's grad_weight:
    TWO_CTA_ACCUMULATE up to K 512, EARLY_ACCUMULATE past it), with partial tiles in M and
    N and K not a multiple of the K tile (72: fewer K tiles than stages)."""
    n, m_out = 3000, 1000
    kernel = GemmKernel(dtype=str(dtype).split(".")[1], n=n, k=k, trans_a=True,
                        trans_b=False, accumulate=True)
    assert kernel.config_for(kernel.bucket_of(m_out)) == (
        TWO_CTA_ACCUMULATE if k <= SHORT_ACCUMULATE_K else EARLY_ACCUMULATE)
    a = randn(k, m_out, dtype=dtype)                 # [K, M]: trans_a
    b = randn(k, n, dtype=dtype, std=k ** -0.5)      # [K, N]
    d = randn(m_out, n, dtype=dtype)
    want = d.float() + a.float().t() @ b.float()
    kernel(m_out, a, b, d)
    assert_close(d, want, what=f"K={k}")



@pytest.mark.parametrize("dtype", DTYPES)
def test_short_k_linear_takes_the_pingpong_default(dtype):
    """tileops.linear with K 512 past 256 rows runs SHORT_K_PINGPONG (DeepSeek-V3's
    kv_b_proj): partial row and column tiles, an odd number of tiles per CTA (one warp group
    one tile more than the other), into poisoned outputs."""
    n, k = 3000, 512
    x, w = make_inputs(4100, n, k, dtype)
    kernel = GemmKernel(dtype=str(dtype).split(".")[1], n=n, k=k, trans_a=False, trans_b=True)
    for rows in (300, 1000, 4100):
        assert kernel.config_for(kernel.bucket_of(rows)) == SHORT_K_PINGPONG
        poison_allocator()
        out = tileops.linear(x[:rows], w)
        assert_close(out, reference(x[:rows], w), what=f"M={rows}")

def test_wave_fill_is_reproducible():
    """The pieces' partials are summed in piece order: the same bits on every call."""
    n, k, m = 3000, 4192, 1500  # 144 tiles of 128 x 256: 132 whole, 12 in 8 pieces each
    a, b = make_inputs(m, n, k, torch.bfloat16)
    kernel = GemmKernel(dtype="bfloat16", n=n, k=k, trans_a=False, trans_b=True)
    kernel.use(GemmConfig(128, 256, 64, 3, 256, 1, 8, wave_fill=True), kernel.bucket_of(m))
    outs = []
    for _ in range(3):
        outs.append(torch.empty(m, n, dtype=torch.bfloat16, device="cuda"))
        kernel(m, a, b, outs[-1])
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert_close(outs[0], reference(a, b))


def test_empty_and_zero_k():
    b = randn(256, 64, dtype=torch.bfloat16)
    assert tileops.gemm(randn(0, 64, dtype=torch.bfloat16), b).shape == (0, 256)
    out = tileops.gemm(randn(5, 0, dtype=torch.bfloat16), randn(256, 0, dtype=torch.bfloat16))
    assert out.shape == (5, 256) and bool((out == 0).all())


def test_runtime_m_does_not_recompile():
    """A serving loop: every token count reuses the bucket programs."""
    n, k = 1024, 2048
    b = randn(n, k, dtype=torch.bfloat16, std=k ** -0.5)
    tileops.gemm(randn(3000, k, dtype=torch.bfloat16), b)
    before = Kernel.compile_count
    sizes = list(range(1, 300, 7)) + [511, 777, 1000, 1500, 2048, 3001, 4096, 8191]
    for m in sizes:
        a = randn(m, k, dtype=torch.bfloat16)
        assert_close(tileops.gemm(a, b), reference(a, b), what=f"M={m}")
    # one program per M bucket (and a split-K reduce where a bucket splits), never per size
    buckets = {GemmKernel(dtype="bfloat16", n=n, k=k, trans_a=False,
                          trans_b=True).bucket_of(m) for m in sizes + [3000]}
    assert Kernel.compile_count - before <= 2 * len(buckets)


def test_torch_compile_fullgraph():
    a, b = make_inputs(300, 1024, 512, torch.bfloat16)

    @torch.compile(fullgraph=True)
    def f(x, w):
        return tileops.gemm(x, w) * 2

    assert_close(f(a, b), reference(a, b) * 2)
    op = GemmFwdOp()
    assert_close(torch.compile(lambda x, w: op(x, w), fullgraph=True)(a, b), reference(a, b))


def test_cuda_graph_capture():
    a, b = make_inputs(16, 6144, 4096, torch.float16)  # split-K: two kernels and a workspace
    tileops.gemm(a, b)  # load the modules before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tileops.gemm(a, b)
    a.copy_(randn(16, 4096, dtype=torch.float16))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, reference(a, b))


def test_device_mismatch_is_rejected():
    a, b = make_inputs(16, 256, 64, torch.bfloat16)
    with pytest.raises(TileOpsError,
                       match="argument 'b': expected a CUDA tensor, got a tensor on cpu"):
        tileops.gemm(a, b.cpu())


@pytest.mark.parametrize("trans_a, trans_b", [(False, True), (False, False), (True, True)])
def test_repeated_signatures_through_the_planned_launch(trans_a, trans_b):
    """A seen signature runs the op's planned launch; inputs of that signature it does not
    serve as they are (a transposed view, a misaligned base) go to forward. Outputs land in
    NaN-poisoned blocks."""
    op = GemmFwdOp(trans_a=trans_a, trans_b=trans_b)
    shape_a, shape_b = ((64, 40) if trans_a else (40, 64)), ((72, 64) if trans_b else (64, 72))
    flat = randn(shape_a[0] * shape_a[1] + 1, dtype=torch.bfloat16)
    b = randn(*shape_b, dtype=torch.bfloat16)
    cases = [(randn(*shape_a, dtype=torch.bfloat16), b),
             (randn(*shape_a, dtype=torch.bfloat16), b),                 # the plan's launch
             (flat[1:].view(*shape_a), b),                                # 2-byte offset
             (randn(*reversed(shape_a), dtype=torch.bfloat16).t(), b),    # transposed view
             (randn(*shape_a, dtype=torch.bfloat16), randn(*reversed(shape_b),
                                                            dtype=torch.bfloat16).t()),
             (randn(*shape_a, dtype=torch.bfloat16), b)]
    for i, (a, b_) in enumerate(cases):
        poison_allocator()
        assert_close(op(a, b_), reference(a, b_, trans_a, trans_b), what=f"case {i}")
        assert_close(tileops.gemm(a, b_, trans_a, trans_b), reference(a, b_, trans_a, trans_b),
                     what=f"functional, case {i}")
