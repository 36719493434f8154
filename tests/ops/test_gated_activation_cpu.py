"""Gated activations without a GPU: op-layer errors, meta outputs and autograd wiring,
rooflines, the layout helpers, and (marker `compile`) the kernels' generated CUDA."""

import re

import pytest
import torch

import tileops
from tileops import (
    GegluBwdOp,
    GegluFwdOp,
    GeluAndMulBwdOp,
    GeluAndMulFwdOp,
    SiluAndMulBwdOp,
    SiluAndMulFwdOp,
    SwigluBwdOp,
    SwigluFwdOp,
    TileOpsError,
    TileOpsTypeError,
    TileOpsUnsupportedError,
    TileOpsValueError,
)
from tileops.kernels.activation import GatedActivationKernel
from tileops.kernels.activation.gated_activation import vector_width
from tileops.ops.activation import _halves_of_one_tensor, _launch
from tileops.prebuild import build_plan

OP_NAMES = ["SiluAndMulFwdOp", "SiluAndMulBwdOp", "GeluAndMulFwdOp", "GeluAndMulBwdOp",
            "SwigluFwdOp", "SwigluBwdOp", "GegluFwdOp", "GegluBwdOp"]


def meta(*shape, dtype=torch.bfloat16, grad=False):
    return torch.empty(*shape, dtype=dtype, device="meta", requires_grad=grad)


@pytest.mark.smoke
@pytest.mark.parametrize("call, err, pattern", [
    (lambda: tileops.silu_and_mul(meta(4, 64, dtype=torch.float64)), TileOpsTypeError,
     r"SiluAndMulFwdOp: argument 'x': expected dtype float16 \| bfloat16 \| float32, "
     r"got torch.float64"),
    (lambda: tileops.gelu_and_mul(meta(4, 64, dtype=torch.int32)), TileOpsTypeError,
     r"GeluAndMulFwdOp: argument 'x': expected dtype float16 \| bfloat16 \| float32"),
    (lambda: tileops.silu_and_mul(meta(4, 63)), TileOpsValueError,
     r"SiluAndMulFwdOp: argument 'x': expected shapes satisfying `x.shape\[-1\] % 2 == 0`, "
     r"got x.shape=\(4, 63\)"),
    (lambda: tileops.gelu_and_mul(meta(3, 5, 7), "tanh"), TileOpsValueError,
     r"GeluAndMulFwdOp: argument 'x': expected shapes satisfying `x.shape\[-1\] % 2 == 0`"),
    (lambda: tileops.silu_and_mul(meta(())), TileOpsValueError,
     r"SiluAndMulFwdOp: argument 'x': expected shapes satisfying `x.ndim >= 1`"),
    (lambda: tileops.swiglu(meta(4, 64), meta(4, 32)), TileOpsValueError,
     r"SwigluFwdOp: argument 'up': expected shapes satisfying "
     r"`tuple\(up.shape\) == tuple\(gate.shape\)`, got up.shape=\(4, 32\), "
     r"gate.shape=\(4, 64\)"),
    (lambda: tileops.swiglu(meta(4, 64), meta(4, 64, dtype=torch.float16)), TileOpsTypeError,
     r"SwigluFwdOp: argument 'up': expected dtype torch.bfloat16 \(same as 'gate'\), "
     r"got torch.float16"),
    (lambda: tileops.gelu_and_mul(meta(4, 64), "fast"), TileOpsValueError,
     r"GeluAndMulFwdOp: argument 'approximate': expected 'none' or 'tanh' .*, got 'fast'"),
    (lambda: tileops.gelu_and_mul(meta(4, 64), None), TileOpsTypeError,
     r"GeluAndMulFwdOp: argument 'approximate': expected str, got None"),
    (lambda: SiluAndMulBwdOp()(meta(4, 31), meta(4, 64)), TileOpsValueError,
     r"SiluAndMulBwdOp: argument 'x': expected shapes satisfying "
     r"`tuple\(grad_out.shape\) == tuple\(x.shape\[:-1\]\) \+ \(N,\)`, got x.shape=\(4, 64\), "
     r"grad_out.shape=\(4, 31\)"),
    (lambda: SwigluBwdOp()(meta(4, 64), meta(4, 64), meta(5, 64)), TileOpsValueError,
     r"SwigluBwdOp: argument 'up': expected shapes satisfying"),
    (lambda: SwigluBwdOp()(meta(4, 64, dtype=torch.float16), meta(4, 64), meta(4, 64)),
     TileOpsTypeError, r"SwigluBwdOp: argument 'gate': expected dtype torch.float16"),
    (lambda: tileops.geglu(meta(4, 64), meta(4, 64), "sigmoid"), TileOpsValueError,
     r"GegluFwdOp: argument 'approximate': expected 'none' or 'tanh' .*, got 'sigmoid'"),
    (lambda: tileops.geglu(meta(4, 64), meta(4, 63), "tanh"), TileOpsValueError,
     r"GegluFwdOp: argument 'up': expected shapes satisfying "
     r"`tuple\(up.shape\) == tuple\(gate.shape\)`"),
    (lambda: GegluBwdOp(approximate="tanh")(meta(4, 64), meta(4, 64, dtype=torch.float16),
                                            meta(4, 64)),
     TileOpsTypeError, r"GegluBwdOp: argument 'gate': expected dtype torch.bfloat16"),
    (lambda: tileops.silu_and_mul(torch.randn(4, 64).half()), TileOpsValueError,
     r"SiluAndMulFwdOp: argument 'x': expected a CUDA tensor"),
])
def test_bad_input(call, err, pattern):
    with pytest.raises(err, match=pattern):
        call()
    assert issubclass(err, TileOpsError)


@pytest.mark.smoke
def test_meta_outputs_and_autograd_wiring():
    """On meta tensors the fake implementations run: forward, then the backward op."""
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        x = meta(2, 7, 2 * 640, dtype=dtype, grad=True)
        for out in (tileops.silu_and_mul(x), tileops.gelu_and_mul(x, approximate="tanh")):
            assert out.shape == (2, 7, 640) and out.dtype == dtype and out.requires_grad
            out.sum().backward()
            assert x.grad.shape == x.shape and x.grad.dtype == dtype
            x.grad = None
        gate, up = meta(3, 640, dtype=dtype, grad=True), meta(3, 640, dtype=dtype, grad=True)
        for fn in (tileops.swiglu, lambda g, u: tileops.geglu(g, u, approximate="tanh")):
            out = fn(gate, up)
            assert out.shape == gate.shape and out.dtype == dtype and out.requires_grad
            out.sum().backward()
            assert gate.grad.shape == gate.shape and up.grad.shape == up.shape
            assert gate.grad.dtype == up.grad.dtype == dtype
            gate.grad = up.grad = None


@pytest.mark.smoke
@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_traces_forward_and_backward(dynamic):
    """fullgraph tracing through the custom ops and their autograd, on meta tensors."""
    x = meta(4, 300, 2 * 512, grad=True)
    gate, up = meta(4, 300, 512, grad=True), meta(4, 300, 512, grad=True)

    @torch.compile(fullgraph=True, backend="aot_eager", dynamic=dynamic)
    def step(x, gate, up):
        return (tileops.silu_and_mul(x * 2) + tileops.gelu_and_mul(x, approximate="tanh")
                + tileops.swiglu(gate, up) + tileops.geglu(gate, up, approximate="tanh"))

    step(x, gate, up).sum().backward()
    assert x.grad.shape == x.shape and gate.grad.shape == up.grad.shape == gate.shape


@pytest.mark.smoke
def test_custom_op_schemas():
    assert str(torch.ops.tileops.silu_and_mul_fwd.default._schema) == (
        "tileops::silu_and_mul_fwd(Tensor x) -> Tensor")
    assert str(torch.ops.tileops.gelu_and_mul_bwd.default._schema) == (
        "tileops::gelu_and_mul_bwd(Tensor grad_out, Tensor x, str approximate) -> Tensor")
    assert str(torch.ops.tileops.swiglu_bwd.default._schema) == (
        "tileops::swiglu_bwd(Tensor grad_out, Tensor gate, Tensor up) -> (Tensor, Tensor)")
    assert str(torch.ops.tileops.geglu_bwd.default._schema) == (
        "tileops::geglu_bwd(Tensor grad_out, Tensor gate, Tensor up, str approximate) -> "
        "(Tensor, Tensor)")


@pytest.mark.smoke
def test_roofline_matches_hand_counts():
    t, n = 8192, 14336
    for dtype, size in ((torch.bfloat16, 2), (torch.float32, 4)):
        x, g = meta(t, 2 * n, dtype=dtype), meta(t, n, dtype=dtype)
        assert SiluAndMulFwdOp().eval_roofline(x) == (5 * t * n, 3 * t * n * size)
        assert SwigluFwdOp().eval_roofline(g, g) == (5 * t * n, 3 * t * n * size)
        assert SiluAndMulBwdOp().eval_roofline(g, x) == (11 * t * n, 5 * t * n * size)
        assert SwigluBwdOp().eval_roofline(g, g, g) == (11 * t * n, 5 * t * n * size)
        assert GeluAndMulFwdOp().eval_roofline(x) == (6 * t * n, 3 * t * n * size)
        assert GeluAndMulBwdOp(approximate="tanh").eval_roofline(g, x) == (
            15 * t * n, 5 * t * n * size)
        assert GegluFwdOp(approximate="tanh").eval_roofline(g, g) == (
            9 * t * n, 3 * t * n * size)
        assert GegluBwdOp().eval_roofline(g, g, g) == (12 * t * n, 5 * t * n * size)
    x3 = meta(4, 4096, 2 * n)  # 3-D: rows are every leading dim
    assert SiluAndMulFwdOp().eval_roofline(x3)[1] == 3 * 4 * 4096 * n * 2


@pytest.mark.smoke
def test_vector_width_and_buckets():
    assert [vector_width(n, "bfloat16") for n in (14336, 1000, 1004, 1002, 1001)] == [8, 8, 4,
                                                                                     2, 1]
    assert vector_width(14336, "float32") == 4 and vector_width(1002, "float32") == 2
    kernel = GatedActivationKernel(dtype="bfloat16", n=14336, activation="silu",
                                   backward=False, fused=True)
    assert kernel.bucket_of(1) == kernel.bucket_of(146) == "small"
    assert kernel.bucket_of(147) == kernel.bucket_of(1 << 17) == "large"
    for bucket in ("small", "large"):
        space = kernel.config_space(bucket)
        assert space[0] == kernel.heuristic_config(bucket, "sm_90a") and len(set(space)) == 12


@pytest.mark.smoke
def test_split_backward_takes_one_vector_a_thread():
    """The split backward's five tensors one 16-byte vector each (H200, 2026-12-04: two ran
    1.3-1.8% slower); the fused layout and the forward keep two."""
    def default(backward, fused):
        return GatedActivationKernel(dtype="bfloat16", n=14336, activation="silu",
                                     backward=backward, fused=fused).heuristic_config(
                                         "large", "sm_90a")

    assert (default(True, False).threads, default(True, False).vecs) == (256, 1)
    assert [default(b, f).vecs for b, f in ((True, True), (False, False), (False, True))] \
        == [2, 2, 2]


@pytest.mark.smoke
def test_halves_of_one_tensor_are_found():
    x = torch.randn(4, 6, 2 * 64)
    gate, up = x.chunk(2, -1)
    base = _halves_of_one_tensor(gate, up, 24, 64)
    assert base is not None and base.shape == (24, 128) and base.data_ptr() == x.data_ptr()
    assert torch.equal(base, x.view(24, 128))
    assert _halves_of_one_tensor(up, gate, 24, 64) is None  # swapped halves
    y = torch.randn(4, 6, 3 * 64)  # gate and up 64 apart, rows 192 apart
    assert _halves_of_one_tensor(y[..., :64], y[..., 64:128], 24, 64) is None
    z = torch.randn(8, 2 * 64)[::2]  # every other row
    assert _halves_of_one_tensor(*z.chunk(2, -1), 4, 64) is None


@pytest.mark.smoke
def test_too_many_vectors_are_refused():
    """Vector indices are int32; a call past 2^31 vectors says so instead of overflowing."""
    rows, n = 1 << 22, 1001  # odd N: one element per vector, 4.2e9 vectors
    dy, x, dx = meta(rows, n), meta(rows, 2 * n), meta(rows, 2 * n)
    with pytest.raises(TileOpsUnsupportedError, match=r"SiluAndMulBwdOp: argument 'shapes'"):
        _launch(SiluAndMulBwdOp(), "silu", True, True, rows, n, dy, x, dx)


# -- compile-only ---------------------------------------------------------------------------
PLAN = build_plan(OP_NAMES, tier="smoke")


@pytest.mark.smoke
def test_one_smoke_workload_per_op():
    assert sorted(item.op_name for item in PLAN) == sorted(OP_NAMES)


# a global buffer indexed element by element (vectorized accesses cast the address instead)
SCALAR_ACCESS = re.compile(r"\b(?:x|y|gate|up|dy|dx|dgate|dup)\[")


@pytest.mark.compile
@pytest.mark.parametrize("item", PLAN, ids=[i.describe() for i in PLAN])
def test_smoke_kernels_use_16_byte_accesses(item):
    """One compile per op (the same programs as the CI compile sweep): every global access
    is a 16-byte vector."""
    source = item.kernel.compile(item.config, item.bucket)[0].get_kernel_source()
    assert "uint4" in source and not SCALAR_ACCESS.search(source), source


@pytest.mark.compile
@pytest.mark.full
@pytest.mark.parametrize("dtype, n, needle", [("float32", 14336, "float4"),
                                               ("bfloat16", 1004, "uint2"),
                                               ("float16", 1001, SCALAR_ACCESS)])
def test_narrow_rows_compile_to_narrower_accesses(dtype, n, needle):
    kernel = GatedActivationKernel(dtype=dtype, n=n, activation="gelu", backward=True,
                                   fused=True)
    source = kernel.compile(kernel.heuristic_config("large", "sm_90a"), "large")[0]
    source = source.get_kernel_source()
    assert needle.search(source) if isinstance(needle, re.Pattern) else needle in source
