"""Gated activations on the GPU (silu_and_mul, gelu_and_mul, swiglu, geglu; forward and
backward) against fp32 references: act(x[..., :N]) * x[..., N:], silu(gate) * up and
gelu(gate) * up."""

import functools
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

import tileops
from tileops import (
    GegluBwdOp,
    GegluFwdOp,
    GeluAndMulBwdOp,
    SiluAndMulBwdOp,
    SwigluBwdOp,
    SwigluFwdOp,
)
from tileops.kernels.activation import GatedActivationKernel
from tileops.kernels.base import Kernel

from ..helpers import assert_close, poison, randn

pytestmark = pytest.mark.gpu

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
ACTS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}
# name -> (functional API, activation, fused layout)
OPS = {"silu_and_mul": (tileops.silu_and_mul, "silu", True),
       "gelu_and_mul": (tileops.gelu_and_mul, "gelu", True),
       "gelu_and_mul_tanh": (functools.partial(tileops.gelu_and_mul, approximate="tanh"),
                             "gelu_tanh", True),
       "swiglu": (tileops.swiglu, "silu", False),
       "geglu": (tileops.geglu, "gelu", False),
       "geglu_tanh": (functools.partial(tileops.geglu, approximate="tanh"), "gelu_tanh",
                      False)}

# (op, rows, N, dtype): each a kernel branch or a size boundary, every dtype and activation
FORWARD_CASES = [
    ("silu_and_mul", 257, 14336, BF16),     # llama3.1-8b intermediate; large bucket
    ("silu_and_mul", 1, 18432, FP16),       # decode batch 1 (small bucket), deepseek-v3
    ("silu_and_mul", 1000, 13824, FP32),    # fp32: 4-element (16-byte) vectors
    ("silu_and_mul", 33, 1001, BF16),       # odd N: scalar accesses
    ("gelu_and_mul", 300, 12288, FP16),
    ("gelu_and_mul", 3, 1000, BF16),        # vectors per row not a multiple of the threads
    ("gelu_and_mul_tanh", 4099, 1000, BF16),
    ("gelu_and_mul_tanh", 77, 1004, FP16),  # N % 8 == 4: 8-byte accesses
    ("swiglu", 257, 14336, BF16),
    ("swiglu", 5, 2, FP32),
    ("swiglu", 300, 1001, FP16),
    ("geglu_tanh", 257, 14336, BF16),       # gemma-2-9b intermediate
    ("geglu_tanh", 1, 6912, FP16),          # gemma-3-1b decode batch 1 (small bucket)
    ("geglu_tanh", 33, 1004, FP32),         # N % 4 == 0 but not 8 in fp32
    ("geglu", 300, 1001, BF16),             # exact gelu, odd N
]
GRAD_CASES = [
    ("silu_and_mul", 257, 14336, BF16),
    ("silu_and_mul", 3, 1001, FP32),
    ("gelu_and_mul", 300, 1000, FP16),
    ("gelu_and_mul_tanh", 64, 4096, BF16),
    ("swiglu", 257, 14336, FP16),
    ("swiglu", 7, 1000, FP32),
    ("geglu_tanh", 257, 14336, BF16),
    ("geglu_tanh", 5, 1001, FP16),
    ("geglu", 7, 1000, FP32),
]
# (activation, backward, fused): the 12 programs
PROGRAMS = [(a, b, f) for a in ACTS for b in (False, True) for f in (True, False)]


def kernel_for(act, backward, fused, n, dtype):
    return GatedActivationKernel(dtype=str(dtype).removeprefix("torch."), n=n, activation=act,
                                 backward=backward, fused=fused)


@pytest.fixture(scope="module", autouse=True)
def prebuilt():
    """Compiles the programs this module runs in parallel first (nvcc runs outside the GIL);
    the calls below then find them in the in-memory cache."""
    wanted = set()
    for name, rows, n, dtype in FORWARD_CASES + GRAD_CASES:
        _, act, fused = OPS[name]
        for backward in (False, True):
            wanted.add((act, backward, fused, n, dtype, rows))
    for act, backward, fused in PROGRAMS:
        wanted.add((act, backward, fused, 1000, BF16, 4099))
    for act, _, fused in OPS.values():  # the N = 4096 tests below, both buckets
        for backward in (False, True):
            for dtype in (BF16, FP16):
                wanted |= {(act, backward, fused, 4096, dtype, 1),
                           (act, backward, fused, 4096, dtype, 4096)}

    def build(item):
        act, backward, fused, n, dtype, rows = item
        kernel = kernel_for(act, backward, fused, n, dtype)
        bucket = kernel.bucket_of(rows)
        kernel.compile(kernel.heuristic_config(bucket, "sm_90a"), bucket)

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(build, sorted(wanted, key=str)))


def reference(act, gate, up):
    """act(gate) * up in fp32."""
    return ACTS[act](gate.float()) * up.float()


def halves(x):
    n = x.shape[-1] // 2
    return x[..., :n], x[..., n:]


def reference_grads(act, gate, up, grad_out):
    """(grad_gate, grad_up) from fp32 autograd of the reference."""
    g, u = (t.detach().float().requires_grad_() for t in (gate, up))
    reference(act, g, u).backward(grad_out.float())
    return g.grad, u.grad


def call(name, gate, up):
    """The op on (gate, up): two tensors for swiglu, their concatenation otherwise."""
    fn, _, fused = OPS[name]
    return fn(torch.cat([gate, up], -1)) if fused else fn(gate, up)


@pytest.mark.smoke
@pytest.mark.parametrize("name, rows, n, dtype", FORWARD_CASES)
def test_forward_matches_reference(name, rows, n, dtype):
    gate, up = randn(rows, n, dtype=dtype), randn(rows, n, dtype=dtype)
    assert_close(call(name, gate, up), reference(OPS[name][1], gate, up))


@pytest.mark.smoke
@pytest.mark.parametrize("name, rows, n, dtype", GRAD_CASES)
def test_gradients_match_autograd(name, rows, n, dtype):
    fn, act, fused = OPS[name]
    gate, up, dy = (randn(rows, n, dtype=dtype) for _ in range(3))
    want = reference_grads(act, gate, up, dy)
    if fused:
        x = torch.cat([gate, up], -1).requires_grad_()
        fn(x).backward(dy)
        assert_close(x.grad, torch.cat(want, -1), what="grad_x")
    else:
        gate, up = gate.requires_grad_(), up.requires_grad_()
        fn(gate, up).backward(dy)
        assert_close(gate.grad, want[0], what="grad_gate")
        assert_close(up.grad, want[1], what="grad_up")


def run_kernel(kernel, rows, n, dtype, backward, fused, act):
    """One direct launch with NaN-poisoned outputs; returns (outputs, expected)."""
    gate, up, dy = (randn(rows, n, dtype=dtype) for _ in range(3))
    if fused:
        x = torch.cat([gate, up], -1)
        gate, up = halves(x)
    if not backward:
        y = poison(torch.empty(rows, n, dtype=dtype, device="cuda"))
        kernel(rows, *((x,) if fused else (gate, up)), y)
        return [y], [reference(act, gate, up)]
    want = reference_grads(act, gate, up, dy)
    if fused:
        dx = poison(torch.empty(rows, 2 * n, dtype=dtype, device="cuda"))
        kernel(rows, dy, x, dx)
        return [dx], [torch.cat(want, -1)]
    dgate, dup = (poison(torch.empty(rows, n, dtype=dtype, device="cuda")) for _ in range(2))
    kernel(rows, dy, gate, up, dgate, dup)
    return [dgate, dup], list(want)


@pytest.mark.parametrize("act, backward, fused", PROGRAMS)
def test_every_element_written(act, backward, fused):
    kernel = kernel_for(act, backward, fused, 1000, BF16)
    outs = run_kernel(kernel, 4099, 1000, BF16, backward, fused, act)
    for got, want in zip(*outs, strict=True):
        assert_close(got, want)


def space_cases():
    """Every config of the space, on a fused forward and a split backward program."""
    cases = {}
    for act, backward, fused in (("silu", False, True), ("gelu_tanh", True, False)):
        kernel = kernel_for(act, backward, fused, 1000, BF16)
        for bucket in ("small", "large"):
            for config in kernel.config_space(bucket):
                tag = f"{act}-{'bwd' if backward else 'fwd'}-{config}"
                cases[tag] = pytest.param(act, backward, fused, config, id=tag)
    return list(cases.values())


@pytest.mark.full
@pytest.mark.parametrize("act, backward, fused, config", space_cases())
def test_every_config_of_the_space(act, backward, fused, config):
    """The tuner may ship any config, so each must be right from 1 row to many CTAs."""
    kernel = kernel_for(act, backward, fused, 1000, BF16)
    kernel.use(config, "small")
    kernel.use(config, "large")
    for rows in (1, 7, 1000, 4099):
        outs = run_kernel(kernel, rows, 1000, BF16, backward, fused, act)
        for got, want in zip(*outs, strict=True):
            assert_close(got, want, what=f"rows={rows}")


def test_3d_1d_and_empty_inputs():
    x = randn(2, 37, 2 * 4096, dtype=FP16)
    assert_close(tileops.gelu_and_mul(x, "tanh"), reference("gelu_tanh", *halves(x)))
    gate, up = randn(3, 5, 7, 4096, dtype=BF16), randn(3, 5, 7, 4096, dtype=BF16)
    assert_close(tileops.swiglu(gate, up), reference("silu", gate, up))
    x = randn(2 * 4096, dtype=BF16)
    assert_close(tileops.silu_and_mul(x), reference("silu", *halves(x)))
    assert tileops.silu_and_mul(randn(0, 64, dtype=BF16)).shape == (0, 32)
    assert tileops.swiglu(randn(4, 0, dtype=BF16), randn(4, 0, dtype=BF16)).shape == (4, 0)


def test_100k_rows():
    x = randn(100_000, 2 * 1000, dtype=BF16)
    assert_close(tileops.gelu_and_mul(x, "tanh"), reference("gelu_tanh", *halves(x)))
    gate, up = randn(100_000, 1001, dtype=FP16), randn(100_000, 1001, dtype=FP16)
    assert_close(tileops.swiglu(gate, up), reference("silu", gate, up))


def test_non_contiguous_and_unaligned_inputs():
    x = randn(2 * 4096, 300, dtype=BF16).t()  # [300, 8192], transposed view
    assert_close(tileops.silu_and_mul(x), reference("silu", *halves(x)))
    x = randn(64, 3 * 4096, dtype=BF16)[:, 100:100 + 2 * 4096]  # rows 12288 apart
    assert_close(tileops.gelu_and_mul(x), reference("gelu", *halves(x)))
    x = randn(64 * 8192 + 1, dtype=BF16)[1:].view(64, 8192)  # 2-byte-aligned base
    assert_close(tileops.silu_and_mul(x), reference("silu", *halves(x)))
    # gate/up as the halves of one tensor (x.chunk): the fused kernel reads them in place
    gate, up = randn(4, 100, 2 * 4096, dtype=BF16).chunk(2, -1)
    assert_close(tileops.swiglu(gate, up), reference("silu", gate, up))
    gate, up = randn(4096, 512, dtype=BF16).t(), randn(512, 8192, dtype=BF16)[:, ::2]
    assert_close(tileops.swiglu(gate, up), reference("silu", gate, up))
    # gradients of non-contiguous inputs and of a non-contiguous grad_out
    x = randn(2 * 4096, 300, dtype=BF16).t().requires_grad_()
    dy = randn(4096, 300, dtype=BF16).t()
    tileops.silu_and_mul(x).backward(dy)
    assert_close(x.grad, torch.cat(reference_grads("silu", *halves(x), dy), -1))
    base = randn(64, 2 * 4096, dtype=BF16).requires_grad_()
    gate, up = base.chunk(2, -1)
    dy = randn(64, 4096, dtype=BF16)
    tileops.swiglu(gate, up).backward(dy)
    assert_close(base.grad, torch.cat(reference_grads("silu", gate, up, dy), -1))


@pytest.mark.parametrize("name", OPS)
def test_extreme_magnitudes(name):
    """exp(-z) overflows fp32 for z < -88 (and the tanh form's z grows as g^3): the sigmoid
    must go to 0, not NaN, in the forward and the backward."""
    values = torch.tensor([-1e3, -100.0, -88.8, -30.0, -1e-3, 0.0, 1e-3, 30.0, 100.0, 1e3],
                          device="cuda")
    gate = values.repeat(64, 410)[:, :4096].to(FP16)
    up, dy = randn(64, 4096, dtype=FP16), randn(64, 4096, dtype=FP16)
    fn, act, fused = OPS[name]
    want_out = reference(act, gate, up)
    want_grads = torch.cat(reference_grads(act, gate, up, dy), -1)
    if fused:
        x = torch.cat([gate, up], -1).requires_grad_()
        out = fn(x)
        out.backward(dy)
        got_grads = x.grad
    else:
        g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
        out = fn(g, u)
        out.backward(dy)
        got_grads = torch.cat([g.grad, u.grad], -1)
    assert torch.isfinite(out).all() and torch.isfinite(got_grads).all()
    assert_close(out, want_out)
    assert_close(got_grads, want_grads, what="grads")


def test_runtime_rows_do_not_recompile():
    n = 4096
    for rows in (1, 4096):  # one call per bucket: small and large
        tileops.silu_and_mul(randn(rows, 2 * n, dtype=BF16))
        tileops.swiglu(randn(rows, n, dtype=BF16), randn(rows, n, dtype=BF16))
    before = Kernel.compile_count
    for rows in [*range(2, 300, 17), 511, 512, 513, 1000, 4097, 8192]:
        gate, up = randn(rows, n, dtype=BF16), randn(rows, n, dtype=BF16)
        assert_close(tileops.silu_and_mul(torch.cat([gate, up], -1)),
                     reference("silu", gate, up), what=f"rows={rows}")
        assert_close(tileops.swiglu(gate, up), reference("silu", gate, up), what=f"rows={rows}")
    assert Kernel.compile_count == before


@pytest.mark.parametrize("name", OPS)
def test_torch_compile_forward_and_backward(name):
    fn, act, fused = OPS[name]
    n = 4096
    dy = randn(4, 300, n, dtype=BF16)
    shapes = [(4, 300, 2 * n)] if fused else [(4, 300, n)] * 2
    inputs = [randn(*s, dtype=BF16).requires_grad_() for s in shapes]

    @torch.compile(fullgraph=True)
    def step(*ts):
        return fn(*[t * 2 for t in ts])

    out = step(*inputs)
    out.backward(dy)
    doubled = [t.detach() * 2 for t in inputs]
    gate, up = halves(doubled[0]) if fused else doubled
    assert_close(out, reference(act, gate, up))
    # x * 2 scales the gradient exactly: 2 * (the op's gradient, rounded to bf16)
    want = [2 * w.to(BF16).float() for w in reference_grads(act, gate, up, dy)]
    for got, w in zip([t.grad for t in inputs], [torch.cat(want, -1)] if fused else want,
                      strict=True):
        assert_close(got, w)


def test_cuda_graph_capture():
    x = randn(64, 2 * 4096, dtype=FP16)
    dy = randn(64, 4096, dtype=FP16)
    gate, up = randn(64, 4096, dtype=FP16), randn(64, 4096, dtype=FP16)
    gelu_bwd, swiglu_bwd = GeluAndMulBwdOp(approximate="tanh"), SwigluBwdOp()

    def calls():
        return (tileops.silu_and_mul(x), gelu_bwd(dy, x), tileops.swiglu(gate, up),
                swiglu_bwd(dy, gate, up))

    calls()  # loads the kernels before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, grad_x, out2, (dgate, dup) = calls()
    for t in (x, dy, gate, up):
        t.copy_(randn(*t.shape, dtype=t.dtype))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, reference("silu", *halves(x)))
    assert_close(grad_x, torch.cat(reference_grads("gelu_tanh", *halves(x), dy), -1))
    assert_close(out2, reference("silu", gate, up))
    want = reference_grads("silu", gate, up, dy)
    assert_close(dgate, want[0])
    assert_close(dup, want[1])


def test_op_objects_match_the_functional_api():
    x = randn(100, 2 * 4096, dtype=BF16)
    dy = randn(100, 4096, dtype=BF16)
    assert torch.equal(SwigluFwdOp()(*halves(x)), tileops.swiglu(*halves(x)))
    assert torch.equal(SwigluFwdOp()(*halves(x)), tileops.silu_and_mul(x))  # one kernel
    assert_close(SiluAndMulBwdOp()(dy, x),
                 torch.cat(reference_grads("silu", *halves(x), dy), -1))


def test_geglu_op_objects_halves_and_cuda_graph():
    """GegluFwdOp/BwdOp objects equal the functional API; halves of one tensor run the fused
    program (bit-equal to gelu_and_mul); a captured graph replays on new inputs."""
    x = randn(100, 2 * 4096, dtype=BF16)
    dy = randn(100, 4096, dtype=BF16)
    fwd, bwd = GegluFwdOp(approximate="tanh"), GegluBwdOp(approximate="tanh")
    assert torch.equal(fwd(*halves(x)), tileops.geglu(*halves(x), approximate="tanh"))
    assert torch.equal(fwd(*halves(x)), tileops.gelu_and_mul(x, "tanh"))  # one kernel
    gate, up = (t.contiguous() for t in halves(x))
    assert torch.equal(fwd(gate, up), tileops.gelu_and_mul(x, "tanh"))  # same math, split
    want = reference_grads("gelu_tanh", gate, up, dy)
    got = bwd(dy, gate, up)
    assert_close(got[0], want[0], what="grad_gate")
    assert_close(got[1], want[1], what="grad_up")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, (dgate, dup) = fwd(gate, up), bwd(dy, gate, up)
    for t in (gate, up, dy):
        t.copy_(randn(*t.shape, dtype=t.dtype))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, reference("gelu_tanh", gate, up))
    want = reference_grads("gelu_tanh", gate, up, dy)
    assert_close(dgate, want[0])
    assert_close(dup, want[1])


@pytest.mark.smoke
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_reuse_inputs_writes_the_gradients_over_gate_and_up(act, dtype):
    """An MLP's projections as gate and up (outputs of a matmul, as in the Hugging Face
    patch): the gradients match the reference and are the projections' own storage;
    reading them again through a retained graph fails loudly."""
    fn = tileops.swiglu if act == "silu" else functools.partial(
        tileops.geglu, approximate="tanh" if act == "gelu_tanh" else "none")
    x = randn(3, 700, 256, dtype=dtype).requires_grad_()
    w_gate, w_up = (randn(1536, 256, dtype=dtype, std=256 ** -0.5) for _ in range(2))
    gate, up = x @ w_gate.t(), x @ w_up.t()
    dy = randn(3, 700, 1536, dtype=dtype)
    want = reference_grads(act, gate, up, dy)
    out = fn(gate, up, reuse_inputs=True)
    assert_close(out, reference(act, gate, up))
    grads = torch.autograd.grad(out, (gate, up), dy, retain_graph=True)
    assert_close(grads[0], want[0], what="grad_gate")
    assert_close(grads[1], want[1], what="grad_up")
    assert grads[0].data_ptr() == gate.data_ptr() and grads[1].data_ptr() == up.data_ptr()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(out, (gate, up), dy)


def test_reuse_inputs_on_halves_and_without_grad_leaves_the_inputs():
    """Halves of one tensor (not contiguous) get fresh gradients; a call needing no
    gradient is the plain op."""
    x = randn(64, 2 * 1000, dtype=BF16)
    gate, up = (t.requires_grad_() for t in (x[:, :1000].clone(), x[:, 1000:].clone()))
    pair = torch.cat([gate, up], -1).detach().requires_grad_()
    g_half, u_half = halves(pair)
    dy = randn(64, 1000, dtype=BF16)
    want = reference_grads("silu", gate, up, dy)
    tileops.swiglu(g_half, u_half, reuse_inputs=True).backward(dy)
    assert_close(pair.grad, torch.cat(want, -1), what="grad of the pair")
    before = gate.detach().clone()
    with torch.no_grad():
        tileops.swiglu(gate, up, reuse_inputs=True)
    assert torch.equal(gate.detach(), before)
