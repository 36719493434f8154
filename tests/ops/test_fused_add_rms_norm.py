"""FusedAddRMSNormFwdOp / BwdOp on the GPU against the unfused fp32 composition."""

import pytest
import torch
import torch.nn.functional as F

import tileops
from tileops import FusedAddRMSNormBwdOp, FusedAddRMSNormFwdOp, TileOpsError
from tileops.kernels.normalization import FusedAddRMSNormKernel

from ..helpers import assert_close, poison, poison_allocator, randn

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]


def reference(x, residual, weight, eps=None):
    """The unfused pair a Llama layer runs: the add rounds to the input dtype, the norm
    runs in fp32 on the rounded sum."""
    h = x + residual
    return F.rms_norm(h.float(), [h.shape[-1]], weight.float(), eps), h


@pytest.mark.smoke
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4099, 4096), (1, 8192), (2, 1000, 7168), (777, 1000),
                                   (64, 5120)])
def test_matches_the_unfused_pair(shape, dtype):
    x, r = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype)
    w = randn(shape[-1], dtype=dtype)
    y, h = tileops.fused_add_rms_norm(x, r, w, 1e-6)
    y_ref, h_ref = reference(x, r, w, 1e-6)
    assert torch.equal(h, h_ref)  # the same rounded add, bit for bit
    assert_close(y, y_ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_in_place_writes_both_results_into_the_inputs(dtype):
    x, r = randn(300, 4096, dtype=dtype), randn(300, 4096, dtype=dtype)
    w = randn(4096, dtype=dtype)
    y_ref, h_ref = reference(x, r, w)
    x_ptr, r_ptr = x.data_ptr(), r.data_ptr()
    out, res = tileops.fused_add_rms_norm_(x, r, w)
    assert out is x and res is r and x.data_ptr() == x_ptr and r.data_ptr() == r_ptr
    assert torch.equal(r, h_ref)
    assert_close(x, y_ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_repeated_signatures_through_the_planned_launch(dtype):
    """A seen signature runs the op's planned launch; inputs of that signature it does not
    serve as they are (misaligned, strided) go to forward. Outputs land in NaN-poisoned
    blocks; the in-place form of a 3-D pair and of a 2-D one (no views) alike."""
    op = FusedAddRMSNormFwdOp(eps=1e-6)
    w = randn(4096, dtype=dtype)
    flat = randn(64 * 4096 + 1, dtype=dtype)
    cases = [(randn(64, 4096, dtype=dtype), randn(64, 4096, dtype=dtype), w),
             (randn(64, 4096, dtype=dtype), randn(64, 4096, dtype=dtype), w),
             (flat[1:].view(64, 4096), randn(64, 4096, dtype=dtype), w),
             (randn(64, 4096, dtype=dtype), randn(4096, 64, dtype=dtype).t(), w),
             (randn(64, 4096, dtype=dtype), randn(64, 4096, dtype=dtype),
              randn(4097, dtype=dtype)[1:]),
             (randn(64, 4096, dtype=dtype), randn(64, 4096, dtype=dtype), w)]
    for i, (x, r, weight) in enumerate(cases):
        poison_allocator()
        y_ref, h_ref = reference(x, r, weight, 1e-6)
        y, h = op(x, r, weight)
        assert torch.equal(h, h_ref), f"case {i}"
        assert_close(y, y_ref, what=f"case {i}")
    for shape in ((64, 4096), (2, 32, 4096), (64, 4096)):
        x, r = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype)
        y_ref, h_ref = reference(x, r, w, 1e-6)
        tileops.fused_add_rms_norm_(x, r, w, 1e-6)
        assert torch.equal(r, h_ref), shape
        assert_close(x, y_ref, what=f"in place {shape}")


def test_in_place_refuses_non_contiguous_input():
    x = randn(4096, 64, dtype=torch.bfloat16).t()
    with pytest.raises(TileOpsError, match="argument 'input'.*contiguous"):
        tileops.fused_add_rms_norm_(x, randn(64, 4096, dtype=torch.bfloat16),
                                    randn(4096, dtype=torch.bfloat16))


def test_non_contiguous_inputs_out_of_place():
    x = randn(4096, 300, dtype=torch.bfloat16).t()
    r = randn(300, 8192, dtype=torch.bfloat16)[:, ::2]
    w = randn(4096, dtype=torch.bfloat16)
    y, h = tileops.fused_add_rms_norm(x, r, w)
    y_ref, h_ref = reference(x, r, w)
    assert torch.equal(h, h_ref)
    assert_close(y, y_ref)


def space_cases():
    """(hidden, config) for every config at Qwen3-32B's 5120 and DeepSeek-V3's 7168 columns
    (lane maps of 160-896 threads next to the tile map's 128), Phi-2's 2560 and Llama-70B's
    8192 (the tile map, with and without fused row sums)."""
    return [pytest.param(hidden, config, id=f"{hidden}-{config}")
            for hidden in (2560, 5120, 7168, 8192)
            for config in FusedAddRMSNormKernel(dtype="bfloat16", n=hidden).config_space("all")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden, config", space_cases())
def test_every_config_of_the_space(hidden, config, dtype):
    """Any config the tuner may ship: row counts off every block size into poisoned outputs,
    then in place (y over x, h over the residual), then a strided input through the op."""
    op = FusedAddRMSNormFwdOp()
    w = randn(hidden, dtype=dtype)
    op.pin_config(config, randn(1, hidden, dtype=dtype), randn(1, hidden, dtype=dtype), w)
    kernel = op.get_kernel("fused_add_rms_norm", w.device, **op._kernel_key(dtype, hidden))
    for bucket in ("few", "all"):
        kernel.use(config, bucket)
    for rows in (1, 7, 1000, 4099, 12289):
        x, r = randn(rows, hidden, dtype=dtype), randn(rows, hidden, dtype=dtype)
        y, h = poison(torch.empty_like(x)), poison(torch.empty_like(x))
        kernel(rows, x, r, w, y, h, 1e-6)
        y_ref, h_ref = reference(x, r, w, 1e-6)
        assert torch.equal(h, h_ref), f"rows={rows}"
        assert_close(y, y_ref, what=f"rows={rows}")
        kernel(rows, x, r, w, x, r, 1e-6)  # in place
        assert torch.equal(r, h_ref), f"in place, rows={rows}"
        assert_close(x, y_ref, what=f"in place, rows={rows}")
    x = randn(3, 2 * hidden, dtype=dtype)[:, ::2]
    r = randn(3, hidden, dtype=dtype)
    y, h = op(x, r, w)
    y_ref, h_ref = reference(x, r, w)
    assert torch.equal(h, h_ref)
    assert_close(y, y_ref, what="op, strided")


def grads(x, r, w, eps, dy, dh, fn):
    xt, rt, wt = (t.detach().clone().requires_grad_() for t in (x, r, w))
    y, h = fn(xt, rt, wt, eps)
    torch.autograd.backward([y, h], [dy, dh])
    return xt.grad, rt.grad, wt.grad


def reference_grads(x, r, w, eps, dy, dh):
    return grads(x.float(), r.float(), w.float(), eps, dy.float(), dh.float(),
                 lambda a, b, c, e: (F.rms_norm(a + b, [a.shape[-1]], c, e), a + b))


@pytest.mark.smoke
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hidden", [(4099, 4096), (1, 8192), (777, 1000), (9000, 5120),
                                          (4099, 16384)])
def test_gradients_match_autograd(rows, hidden, dtype):
    x, r, dy, dh = (randn(rows, hidden, dtype=dtype) for _ in range(4))
    w = randn(hidden, dtype=dtype)
    dx, dr, dw = grads(x, r, w, 1e-5, dy, dh, tileops.fused_add_rms_norm)
    dx_ref, dr_ref, dw_ref = reference_grads(x, r, w, 1e-5, dy, dh)
    assert_close(dx, dx_ref, what="dx")
    assert_close(dr, dr_ref, what="dresidual")
    assert_close(dw, dw_ref, scale=rows ** 0.5, what="dw")


def test_gradient_when_only_the_normed_output_is_used():
    x, r, dy = (randn(300, 4096, dtype=torch.bfloat16) for _ in range(3))
    w = randn(4096, dtype=torch.bfloat16)
    xt = x.clone().requires_grad_()
    y, _ = tileops.fused_add_rms_norm(xt, r, w)
    y.backward(dy)
    dx_ref = reference_grads(x, r, w, None, dy, torch.zeros_like(dy))[0]
    assert_close(xt.grad, dx_ref)


def test_backward_op_every_row_count_on_one_kernel():
    op = FusedAddRMSNormBwdOp(eps=1e-6)
    w = randn(7168, dtype=torch.bfloat16)
    for rows in (1, 263, 264, 4096, 5000):
        h, dy, dh = (randn(rows, 7168, dtype=torch.bfloat16) for _ in range(3))
        dx, dw = op(dy, dh, h, w)
        hf = h.float().requires_grad_()
        wf = w.float().requires_grad_()
        F.rms_norm(hf, [7168], wf, 1e-6).backward(dy.float())
        assert_close(dx, hf.grad + dh.float(), what=f"dx rows={rows}")
        assert_close(dw, wf.grad, scale=rows ** 0.5, what=f"dw rows={rows}")


def test_torch_compile_forward_and_backward():
    x, r, dy, dh = (randn(256, 4096, dtype=torch.bfloat16) for _ in range(4))
    w = randn(4096, dtype=torch.bfloat16)

    @torch.compile(fullgraph=True)
    def step(a, res, weight, e):
        return tileops.fused_add_rms_norm(a, res, weight, e)

    dx, dr, dw = grads(x, r, w, 1e-5, dy, dh, step)
    dx_ref, dr_ref, dw_ref = reference_grads(x, r, w, 1e-5, dy, dh)
    assert_close(dx, dx_ref, what="dx")
    assert_close(dr, dr_ref, what="dresidual")
    assert_close(dw, dw_ref, scale=256 ** 0.5, what="dw")


def test_cuda_graph_capture_in_place():
    x, r = randn(64, 4096, dtype=torch.float16), randn(64, 4096, dtype=torch.float16)
    w = randn(4096, dtype=torch.float16)
    tileops.fused_add_rms_norm_(x.clone(), r.clone(), w)
    graph = torch.cuda.CUDAGraph()
    xs, rs = x.clone(), r.clone()
    with torch.cuda.graph(graph):
        tileops.fused_add_rms_norm_(xs, rs, w)
    xs.copy_(x), rs.copy_(r)
    graph.replay()
    torch.cuda.synchronize()
    y_ref, h_ref = reference(x, r, w)
    assert torch.equal(rs, h_ref)
    assert_close(xs, y_ref)


def test_residual_of_another_shape_is_rejected():
    x = randn(4, 256, dtype=torch.bfloat16)
    with pytest.raises(TileOpsError, match="residual"):
        tileops.fused_add_rms_norm(x, randn(4, 128, dtype=torch.bfloat16),
                                   randn(256, dtype=torch.bfloat16))
