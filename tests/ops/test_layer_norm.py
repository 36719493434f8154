"""LayerNormFwdOp / LayerNormBwdOp on the GPU against fp32 torch.nn.functional.layer_norm."""

import pytest
import torch
import torch.nn.functional as F

import tileops
from tileops import LayerNormBwdOp, LayerNormFwdOp, TileOpsError
from tileops.kernels.normalization import LayerNormBwdKernel, LayerNormKernel

from ..helpers import assert_close, poison, poison_allocator, randn

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]


def reference(x, shape, weight=None, bias=None, eps=1e-5):
    return F.layer_norm(x.float(), list(shape), None if weight is None else weight.float(),
                        None if bias is None else bias.float(), eps)


def grads(fn, x, shape, weight, bias, eps, dy):
    leaves = [None if t is None else t.detach().clone().requires_grad_()
              for t in (x, weight, bias)]
    fn(leaves[0], shape, leaves[1], leaves[2], eps).backward(dy)
    return [None if t is None else t.grad for t in leaves]


def check(x, shape, weight, bias, eps=1e-5, what=""):
    assert_close(tileops.layer_norm(x, shape, weight, bias, eps),
                 reference(x, shape, weight, bias, eps), what=f"y {what}")
    dy = randn(*x.shape, dtype=x.dtype)
    got = grads(tileops.layer_norm, x, shape, weight, bias, eps, dy)
    f32 = [None if t is None else t.float() for t in (x, weight, bias)]
    want = grads(F.layer_norm, f32[0], shape, f32[1], f32[2], eps, dy.float())
    rows = x.numel() // (weight.numel() if weight is not None else x.shape[-1])
    for name, g, r in zip(("dx", "dw", "db"), got, want, strict=True):
        if r is not None:
            assert_close(g, r, scale=1.0 if name == "dx" else rows ** 0.5,
                         what=f"{name} {what}")


@pytest.mark.smoke
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hidden", [(4099, 4096), (1, 8192), (777, 1280), (333, 128),
                                          (1000, 199), (3, 2560), (4097, 2560), (5001, 1536),
                                          (9000, 6144), (4500, 8192)])
def test_forward_and_gradients_match_torch(rows, hidden, dtype):
    check(randn(rows, hidden, dtype=dtype), [hidden], randn(hidden, dtype=dtype),
          randn(hidden, dtype=dtype), 1e-5, f"{rows}x{hidden}")


@pytest.mark.parametrize("with_weight, with_bias", [(False, False), (True, False),
                                                    (False, True)])
def test_optional_weight_and_bias(with_weight, with_bias):
    x = randn(64, 257, 1280, dtype=torch.bfloat16)
    check(x, [1280], randn(1280, dtype=torch.bfloat16) if with_weight else None,
          randn(1280, dtype=torch.bfloat16) if with_bias else None, 1e-6)


def test_large_offsets_keep_the_variance_exact():
    """Rows far from zero mean: a one-pass E[x^2] - E[x]^2 would cancel catastrophically."""
    x = (randn(512, 4096, dtype=torch.float32) + 300.0).to(torch.bfloat16)
    check(x, [4096], randn(4096, dtype=torch.bfloat16), randn(4096, dtype=torch.bfloat16))


def test_multi_dim_normalized_shape_and_non_contiguous_input():
    x = randn(100, 8, 128, dtype=torch.float16)
    check(x, [8, 128], randn(8, 128, dtype=torch.float16), randn(8, 128, dtype=torch.float16))
    check(randn(2048, 300, dtype=torch.bfloat16).t(), [2048], None,
          randn(4096, dtype=torch.bfloat16)[::2])


@pytest.mark.parametrize("dtype", DTYPES)
def test_repeated_signatures_through_the_planned_launch(dtype):
    """As the RMSNorm test: the planned launch of a seen signature, and forward for the
    inputs of that signature it does not serve as they are."""
    op = LayerNormFwdOp(normalized_shape=[2560])
    w, b = randn(2560, dtype=dtype), randn(2560, dtype=dtype)
    flat = randn(33 * 2560 + 1, dtype=dtype)
    cases = [(randn(33, 2560, dtype=dtype), w, b),
             (randn(33, 2560, dtype=dtype), w, b),
             (flat[1:].view(33, 2560), w, b),
             (randn(2560, 33, dtype=dtype).t(), w, b),
             (randn(33, 2560, dtype=dtype), w, randn(2561, dtype=dtype)[1:]),
             (randn(33, 2560, dtype=dtype), w, b)]
    for i, (x, weight, bias) in enumerate(cases):
        poison_allocator()
        assert_close(op(x, weight, bias), reference(x, [2560], weight, bias), what=f"case {i}")
        assert_close(torch.ops.tileops.layer_norm_fwd(x, [2560], weight, bias, 1e-5),
                     reference(x, [2560], weight, bias), what=f"custom op, case {i}")


def forward_space_cases():
    """(hidden, config) for every forward config at the hidden sizes off the powers of two
    (the lane map's sizes: ViT-H 1280, Phi-2 2560, GPT-NeoX-20B 6144) and Falcon-40B's 8192
    (the tile map, with and without fused row sums)."""
    cases = []
    for hidden in (1280, 2560, 6144, 8192):
        kernel = LayerNormKernel(dtype="bfloat16", n=hidden, has_weight=True, has_bias=True)
        for config in kernel.config_space("all"):
            cases.append(pytest.param(hidden, config, id=f"{hidden}-{config}"))
    return cases


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden, config", forward_space_cases())
def test_every_forward_config_of_the_space(hidden, config, dtype):
    """Any config the tuner may ship, on row counts off every block size, poisoned outputs,
    rows far from zero mean, and a non-contiguous input through the op."""
    op = LayerNormFwdOp(normalized_shape=[hidden])
    w, b = randn(hidden, dtype=dtype), randn(hidden, dtype=dtype)
    op.pin_config(config, randn(1, hidden, dtype=dtype), w, b)
    kernel = op.get_kernel("layer_norm", w.device, **op._kernel_key(
        dtype, hidden, has_weight=True, has_bias=True))
    for bucket in ("few", "all"):  # the decode and the prefill bucket both run `config`
        kernel.use(config, bucket)
    for rows, offset in ((1, 0.0), (7, 0.0), (1000, 0.0), (4099, 0.0), (12289, 0.0),
                         (333, 300.0)):
        x = (randn(rows, hidden, dtype=torch.float32) + offset).to(dtype)
        y = poison(torch.empty_like(x))
        kernel(rows, x, w, b, y, 1e-5)
        assert_close(y, reference(x, [hidden], w, b), what=f"rows={rows} offset={offset}")
    x = randn(3, 5, 2 * hidden, dtype=dtype)[..., ::2]  # through the op, on the pinned config
    assert_close(op(x, w, b), reference(x, [hidden], w, b), what="op, strided")


def test_every_backward_config_of_the_space():
    w, b = randn(1280, dtype=torch.bfloat16), randn(1280, dtype=torch.bfloat16)
    kernel = LayerNormBwdKernel(dtype="bfloat16", n=1280, has_weight=True, has_bias=True)
    for bucket, rows in (("few", 1001), ("many", 12289)):
        for config in kernel.config_space(bucket):
            op = LayerNormBwdOp(normalized_shape=[1280])
            x, dy = randn(rows, 1280, dtype=torch.bfloat16), randn(rows, 1280,
                                                                    dtype=torch.bfloat16)
            op.pin_config(config, dy, x, w, b)
            dx, dw, db = op(dy, x, w, b)
            want = grads(F.layer_norm, x.float(), [1280], w.float(), b.float(), 1e-5,
                         dy.float())
            assert_close(dx, want[0], what=f"dx {config}")
            assert_close(dw, want[1], scale=rows ** 0.5, what=f"dw {config}")
            assert_close(db, want[2], scale=rows ** 0.5, what=f"db {config}")


def test_torch_compile_forward_and_backward():
    x, dy = randn(300, 4096, dtype=torch.bfloat16), randn(300, 4096, dtype=torch.bfloat16)
    w, b = randn(4096, dtype=torch.bfloat16), randn(4096, dtype=torch.bfloat16)
    compiled = torch.compile(tileops.layer_norm, fullgraph=True)
    got = grads(compiled, x, [4096], w, b, 1e-5, dy)
    want = grads(F.layer_norm, x.float(), [4096], w.float(), b.float(), 1e-5, dy.float())
    for name, g, r in zip(("dx", "dw", "db"), got, want, strict=True):
        assert_close(g, r, scale=1.0 if name == "dx" else 300 ** 0.5, what=name)


def test_cuda_graph_capture():
    x = randn(64, 8192, dtype=torch.float16)
    w, b = randn(8192, dtype=torch.float16), randn(8192, dtype=torch.float16)
    tileops.layer_norm(x, [8192], w, b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tileops.layer_norm(x, [8192], w, b)
    x.copy_(randn(64, 8192, dtype=torch.float16))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, reference(x, [8192], w, b))


def test_bias_of_another_shape_is_rejected():
    x = randn(4, 256, dtype=torch.bfloat16)
    with pytest.raises(TileOpsError, match="bias"):
        tileops.layer_norm(x, [256], None, randn(128, dtype=torch.bfloat16))
