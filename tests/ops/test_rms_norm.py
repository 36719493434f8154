"""RMSNormFwdOp and RMSNormBwdOp on the GPU against fp32 torch.nn.functional.rms_norm."""

import pytest
import torch
import torch.nn.functional as F

import tileops
from tileops import RMSNormBwdOp, RMSNormFwdOp, TileOpsError
from tileops.kernels.base import Kernel
from tileops.kernels.normalization import RMSNormBwdKernel, RMSNormKernel

from ..helpers import assert_close, poison, poison_allocator, randn

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]


def reference(x, normalized_shape, weight=None, eps=None):
    """torch's own RMSNorm in fp32: what F.rms_norm computes for fp16/bf16 rows (its
    eps=None is float32's epsilon there), before the final rounding."""
    return F.rms_norm(x.float(), list(normalized_shape),
                      None if weight is None else weight.float(), eps)


@pytest.mark.smoke
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hidden", [
    (4099, 4096),    # llama3.1-8b hidden, rows not a multiple of anything
    (1, 8192),       # decode batch 1
    (1000, 7168),    # deepseek-v3: 7 vectors per thread
    (777, 16384),    # llama3.1-405b
    (333, 128),      # per-head qk-norm: several rows per CTA, row tail inside a CTA
    (1000, 199),     # hidden not a multiple of the vector width
    (3, 4097),
    (4097, 2560),    # the persistent lane ring (prefill rows of 1536 / 2560)
    (5001, 1536),
])
def test_matches_reference(rows, hidden, dtype):
    x = randn(rows, hidden, dtype=dtype)
    w = randn(hidden, dtype=dtype)
    assert_close(tileops.rms_norm(x, [hidden], w, 1e-5), reference(x, [hidden], w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_element_written(dtype):
    op = RMSNormFwdOp(normalized_shape=[128])
    for rows, hidden in ((333, 128), (1000, 199)):
        x = randn(rows, hidden, dtype=dtype)
        kernel = op.get_kernel("rms_norm", x.device,
                               **op._kernel_key(dtype, hidden, has_weight=False))
        y = torch.full_like(x, float("nan"))
        kernel(rows, x, None, y, 1e-6)
        assert_close(y, reference(x, [hidden], None, 1e-6))


def space_cases():
    """(hidden, has_weight, config) for every config of each space: the manifest's hidden
    sizes, the lane map's (2560, 6144, 13824), and a short one with several rows per CTA."""
    cases = []
    for hidden in (128, 2560, 4096, 5120, 6144, 7168, 8192, 13824, 16384):
        # the lane map's sizes off the powers of two (and the tuned ones) with a weight only
        for has_weight in (True,) if hidden in (2560, 6144, 13824) else (True, False):
            kernel = RMSNormKernel(dtype="bfloat16", n=hidden, has_weight=has_weight)
            for config in kernel.config_space("all"):
                cases.append(pytest.param(hidden, has_weight, config,
                                          id=f"{hidden}-{'w' if has_weight else 'no_w'}-"
                                             f"{config}"))
    return cases


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden, has_weight, config", space_cases())
def test_every_config_of_the_space(hidden, has_weight, config, dtype):
    """The tuner may ship any config of the space, so each must be right on row counts off
    every block size, from 1 row to several waves of CTAs; outputs are poisoned so every
    element must be written."""
    op = RMSNormFwdOp(normalized_shape=[hidden])
    w = randn(hidden, dtype=dtype) if has_weight else None
    x = randn(1, hidden, dtype=dtype)
    op.pin_config(config, x, w)
    kernel = op.get_kernel("rms_norm", x.device,
                           **op._kernel_key(dtype, hidden, has_weight=has_weight))
    for bucket in ("few", "all"):  # the decode and the prefill bucket both run `config`
        kernel.use(config, bucket)
    for rows in (1, 7, 1000, 4099, 12289):
        x = randn(rows, hidden, dtype=dtype)
        y = poison(torch.empty_like(x))
        kernel(rows, x, w, y, 1e-5)
        assert_close(y, reference(x, [hidden], w, 1e-5), what=f"rows={rows}")
    x = randn(3, 5, hidden, dtype=dtype)  # through the op, on the pinned config
    assert_close(op(x, w), reference(x, [hidden], w, op.eps), what="op")


@pytest.mark.parametrize("dtype", DTYPES)
def test_3d_input_no_weight_default_eps(dtype):
    x = randn(4, 37, 2048, dtype=dtype)
    assert_close(tileops.rms_norm(x, 2048), reference(x, [2048]))


def test_multi_dim_normalized_shape():
    x = randn(100, 8, 128, dtype=torch.bfloat16)
    w = randn(8, 128, dtype=torch.bfloat16)
    assert_close(tileops.rms_norm(x, [8, 128], w), reference(x, [8, 128], w))


def test_large_magnitudes_do_not_overflow_fp16():
    # x^2 summed over 8192 elements reaches ~1e9, far past fp16's 65504.
    x = randn(64, 8192, dtype=torch.float16, std=300.0)
    out = tileops.rms_norm(x, [8192], randn(8192, dtype=torch.float16), 1e-5)
    assert torch.isfinite(out).all()
    x2 = randn(64, 8192, dtype=torch.float16, std=300.0)
    w = randn(8192, dtype=torch.float16)
    assert_close(tileops.rms_norm(x2, [8192], w, 1e-5), reference(x2, [8192], w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_input(dtype):
    x = randn(4096, 300, dtype=dtype).t()          # [300, 4096], transposed view
    w = randn(8192, dtype=dtype)[::2]              # strided weight
    assert_close(tileops.rms_norm(x, [4096], w), reference(x, [4096], w))


@pytest.mark.parametrize("dtype", DTYPES)
def test_repeated_signatures_through_the_planned_launch(dtype):
    """A signature seen before runs the op's planned launch (validation cached, the kernel
    bound); inputs of that signature it does not serve as they are (a misaligned or strided
    input or weight) go to forward, which copies them. Outputs land in NaN-poisoned blocks."""
    op = RMSNormFwdOp(normalized_shape=[4096], eps=1e-5)
    w = randn(4096, dtype=dtype)
    flat = randn(64 * 4096 + 1, dtype=dtype)
    cases = [(randn(64, 4096, dtype=dtype), w),           # first call: validated, planned
             (randn(64, 4096, dtype=dtype), w),           # the plan's launch
             (flat[1:].view(64, 4096), w),                # 2-byte offset: not TMA-aligned
             (randn(4096, 64, dtype=dtype).t(), w),       # strided rows
             (randn(64, 4096, dtype=dtype), randn(4097, dtype=dtype)[1:]),  # unaligned weight
             (randn(64, 4096, dtype=dtype), w)]
    for i, (x, weight) in enumerate(cases):
        poison_allocator()
        assert_close(op(x, weight), reference(x, [4096], weight, 1e-5), what=f"case {i}")
        assert_close(tileops.rms_norm(x, [4096], weight, 1e-5),
                     reference(x, [4096], weight, 1e-5), what=f"functional, case {i}")
        assert_close(torch.ops.tileops.rms_norm_fwd(x, [4096], weight, 1e-5),
                     reference(x, [4096], weight, 1e-5), what=f"custom op, case {i}")


def test_runtime_rows_do_not_recompile():
    """Rows are symbolic: one program per row bucket (decode-sized and large), none per size."""
    w = randn(4096, dtype=torch.bfloat16)
    for rows in (5, 8192):  # one call in each bucket
        tileops.rms_norm(randn(rows, 4096, dtype=torch.bfloat16), [4096], w)
    before = Kernel.compile_count
    for rows in list(range(1, 200, 13)) + [1024, 4097, 8192]:
        x = randn(rows, 4096, dtype=torch.bfloat16)
        assert_close(tileops.rms_norm(x, [4096], w), reference(x, [4096], w), what=f"rows={rows}")
    assert Kernel.compile_count == before


def test_torch_compile_fullgraph():
    x = randn(300, 4096, dtype=torch.bfloat16)
    w = randn(4096, dtype=torch.bfloat16)

    @torch.compile(fullgraph=True)
    def f(t):
        return tileops.rms_norm(t + 1, [4096], w, 1e-6)

    assert_close(f(x), reference(x + 1, [4096], w, 1e-6))


def test_cuda_graph_capture():
    x = randn(64, 4096, dtype=torch.float16)
    w = randn(4096, dtype=torch.float16)
    tileops.rms_norm(x, [4096], w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tileops.rms_norm(x, [4096], w)
    x.copy_(randn(64, 4096, dtype=torch.float16))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, reference(x, [4096], w))


def test_weight_on_other_device_is_rejected():
    x = randn(4, 256, dtype=torch.bfloat16)
    with pytest.raises(TileOpsError, match="argument 'weight'"):
        tileops.rms_norm(x, [256], torch.ones(256, dtype=torch.bfloat16))


# -- backward ---------------------------------------------------------------------------
def reference_grads(x, normalized_shape, weight, eps, dy):
    """(dx, dw) of fp32 torch autograd through F.rms_norm."""
    xf = x.float().requires_grad_()
    wf = None if weight is None else weight.float().requires_grad_()
    F.rms_norm(xf, list(normalized_shape), wf, eps).backward(dy.float())
    return xf.grad, None if wf is None else wf.grad


def check_grads(x, normalized_shape, weight, eps, what=""):
    dy = randn(*x.shape, dtype=x.dtype)
    xt = x.detach().clone().requires_grad_()
    wt = None if weight is None else weight.detach().clone().requires_grad_()
    tileops.rms_norm(xt, normalized_shape, wt, eps).backward(dy)
    dx_ref, dw_ref = reference_grads(x, normalized_shape, weight, eps, dy)
    assert_close(xt.grad, dx_ref, what=f"dx {what}")
    if weight is not None:
        rows = x.numel() // weight.numel()
        assert_close(wt.grad, dw_ref, scale=rows ** 0.5, what=f"dw {what}")


@pytest.mark.smoke
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hidden", [(4099, 4096), (1, 8192), (1000, 7168), (333, 128),
                                          (1000, 199), (3, 4097), (9000, 5120),
                                          (4500, 8192), (4099, 16384), (7, 12288)])
def test_gradients_match_autograd(rows, hidden, dtype):
    check_grads(randn(rows, hidden, dtype=dtype), [hidden], randn(hidden, dtype=dtype), 1e-5,
                f"{rows}x{hidden}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_without_weight_3d_default_eps(dtype):
    check_grads(randn(4, 37, 2048, dtype=dtype), [2048], None, None)
    check_grads(randn(100, 8, 128, dtype=dtype), [8, 128], randn(8, 128, dtype=dtype), None)


def test_gradients_of_non_contiguous_input_and_large_fp16_magnitudes():
    x = randn(4096, 300, dtype=torch.bfloat16).t()
    check_grads(x, [4096], randn(8192, dtype=torch.bfloat16)[::2], 1e-6, "transposed")
    check_grads(randn(64, 8192, dtype=torch.float16, std=300.0), [8192],
                randn(8192, dtype=torch.float16), 1e-5, "std 300")


def bwd_space_cases():
    cases = []
    for hidden in (128, 4096, 8192, 16384, 199):
        kernel = RMSNormBwdKernel(dtype="bfloat16", n=hidden, has_weight=True)
        for bucket in ("few", "many"):
            for config in kernel.config_space(bucket):
                cases.append(pytest.param(hidden, bucket, config,
                                          id=f"{hidden}-{bucket}-{config}"))
    return cases


@pytest.mark.parametrize("hidden, bucket, config", bwd_space_cases())
def test_every_backward_config_of_the_space(hidden, bucket, config):
    """Row counts off every CTA-grid multiple, one row to several passes of the grid; dx
    poisoned so every element must be written."""
    op = RMSNormBwdOp(normalized_shape=[hidden], eps=1e-5)
    w = randn(hidden, dtype=torch.bfloat16)
    rows_list = (1, 7, 1000, 4096) if bucket == "few" else (4097, 12289)
    x = randn(rows_list[0], hidden, dtype=torch.bfloat16)
    op.pin_config(config, x, x, w)
    for rows in rows_list:
        x, dy = (randn(rows, hidden, dtype=torch.bfloat16) for _ in range(2))
        dx, dw = op(dy, x, w)
        dx_ref, dw_ref = reference_grads(x, [hidden], w, 1e-5, dy)
        assert_close(dx, dx_ref, what=f"dx rows={rows}")
        assert_close(dw, dw_ref, scale=rows ** 0.5, what=f"dw rows={rows}")


def test_dynamic_deal_keeps_torchs_deterministic_mode():
    """Rows dealt as the CTAs go (`dynamic`) put different rows in each CTA's dW share from
    run to run; under torch.use_deterministic_algorithms(True) the same ring runs its static
    deal: dW bitwise equal over runs and to the static config's."""
    import dataclasses

    from tileops.kernels.normalization.row_norm_bwd import NormBwdConfig

    dynamic = NormBwdConfig(1, 256, 132, False, 3, lanes=True, dynamic=True)
    x, dy = (randn(12289, 4096, dtype=torch.bfloat16) for _ in range(2))
    w = randn(4096, dtype=torch.bfloat16)

    def dw_of(config):
        op = RMSNormBwdOp(normalized_shape=[4096], eps=1e-5)
        op.pin_config(config, dy, x, w)
        return op(dy, x, w)[1]

    static_dw = dw_of(dataclasses.replace(dynamic, dynamic=False))
    assert_close(dw_of(dynamic), reference_grads(x, [4096], w, 1e-5, dy)[1],
                 scale=12289 ** 0.5, what="dw, dynamic deal")
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = [dw_of(dynamic) for _ in range(3)]
    finally:
        torch.use_deterministic_algorithms(before)
    for dw in runs:
        assert torch.equal(dw, static_dw)


@pytest.mark.parametrize("rows, hidden", [(517, 1000), (333, 128), (5000, 4096)])
def test_backward_writes_every_element(rows, hidden):
    """dx, dw and every partial row of dw start as NaN: each must be written. The kernel
    allocates its partial rows; a NaN block of their size freed just before is what the
    caching allocator hands it."""
    op = RMSNormBwdOp(normalized_shape=[hidden])
    kernel = op.get_kernel("rms_norm_bwd", torch.device("cuda"),
                           **op._kernel_key(torch.float16, hidden, has_weight=True))
    config, _ = kernel.select(rows)
    x, dy = randn(rows, hidden, dtype=torch.float16), randn(rows, hidden, dtype=torch.float16)
    w = randn(hidden, dtype=torch.float16)
    dx, dw = poison(torch.empty_like(x)), poison(torch.empty_like(w))
    poison(torch.empty(config.ctas, hidden, device="cuda"))  # freed at once, NaN inside
    kernel(rows, dy, x, w, None, dx, dw, None, 1e-5)
    dx_ref, dw_ref = reference_grads(x, [hidden], w, 1e-5, dy)
    assert_close(dx, dx_ref, what="dx")
    assert_close(dw, dw_ref, scale=rows ** 0.5, what="dw")


def test_torch_compile_forward_and_backward():
    x = randn(300, 4096, dtype=torch.bfloat16).requires_grad_()
    w = randn(4096, dtype=torch.bfloat16).requires_grad_()
    dy = randn(300, 4096, dtype=torch.bfloat16)

    @torch.compile(fullgraph=True)
    def step(t, weight):
        return tileops.rms_norm(t * 2, [4096], weight, 1e-6)

    step(x, w).backward(dy)
    dx_ref, dw_ref = reference_grads(x.detach() * 2, [4096], w.detach(), 1e-6, dy)
    assert_close(x.grad, 2 * dx_ref.to(torch.bfloat16).float(), what="dx")
    assert_close(w.grad, dw_ref, scale=300 ** 0.5, what="dw")


def test_backward_runtime_rows_do_not_recompile():
    w = randn(4096, dtype=torch.bfloat16)
    op = RMSNormBwdOp(normalized_shape=[4096])
    op(randn(5, 4096, dtype=torch.bfloat16), randn(5, 4096, dtype=torch.bfloat16), w)
    op(randn(5000, 4096, dtype=torch.bfloat16), randn(5000, 4096, dtype=torch.bfloat16), w)
    before = Kernel.compile_count
    for rows in (1, 17, 300, 4096, 4097, 9999):
        op(randn(rows, 4096, dtype=torch.bfloat16), randn(rows, 4096, dtype=torch.bfloat16), w)
    assert Kernel.compile_count == before
