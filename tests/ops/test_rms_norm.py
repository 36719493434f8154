"""RMSNormFwdOp on the GPU against an fp32 reference of torch.nn.functional.rms_norm."""

import pytest
import torch

import tileops
from tileops import RMSNormFwdOp, TileOpsError
from tileops.kernels.base import Kernel
from tileops.kernels.normalization import RMSNormKernel

from ..helpers import assert_close, poison, randn

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]


def reference(x, normalized_shape, weight=None, eps=None):
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    dims = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=dims, keepdim=True) + eps)
    return y * weight.float() if weight is not None else y


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
        kernel = op.get_kernel("rms_norm", x.device, **op._kernel_key(dtype, hidden, False))
        y = torch.full_like(x, float("nan"))
        kernel(rows, x, None, y, 1e-6)
        assert_close(y, reference(x, [hidden], None, 1e-6))


def space_cases():
    """(hidden, has_weight, config) for every config of each space: the manifest's hidden
    sizes and a short one with several rows per CTA."""
    cases = []
    for hidden in (128, 4096, 5120, 7168, 8192, 16384):
        for has_weight in (True, False):
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
    kernel = op.get_kernel("rms_norm", x.device, **op._kernel_key(dtype, hidden, has_weight))
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


def test_runtime_rows_do_not_recompile():
    w = randn(4096, dtype=torch.bfloat16)
    tileops.rms_norm(randn(5, 4096, dtype=torch.bfloat16), [4096], w)
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
