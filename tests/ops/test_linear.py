"""tileops.linear on the GPU against float32 references: forward with and without bias
(epilogue and split-K reduce), leading dims, decode and odd token counts, both dtypes,
gradients of input, weight and bias, torch.compile, and the backward's refusals."""

import pytest
import torch
import torch.nn.functional as F

import tileops
from tileops.errors import TileOpsError

from ..helpers import assert_close, poison_allocator, randn

pytestmark = pytest.mark.gpu

BF16, FP16 = torch.bfloat16, torch.float16
# (input shape, out features, bias, dtype): each a kernel path or a size boundary
CASES = [
    ((4096, 3584), 4608, True, BF16),      # Qwen2.5-7B qkv: bias in the epilogue
    ((16, 3584), 4608, True, FP16),        # decode: split-K, the bias in the reduce
    ((1, 4096), 4096, False, BF16),        # one token
    ((2, 1000, 512), 1536, True, BF16),    # leading dims, a token count off the tiles
    ((777, 256), 264, False, FP16),        # N not a multiple of the tile
]


def _ids(cases):
    return [f"{'x'.join(map(str, s))}-N{n}-{'bias' if b else 'nobias'}-{str(d)[6:]}"
            for s, n, b, d in cases]


@pytest.mark.parametrize("shape, n, with_bias, dtype", CASES, ids=_ids(CASES))
def test_forward_matches_float32(shape, n, with_bias, dtype):
    x = randn(*shape, dtype=dtype)
    w = randn(n, shape[-1], dtype=dtype, std=shape[-1] ** -0.5)
    b = randn(n, dtype=dtype) if with_bias else None
    y = tileops.linear(x, w, b)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert y.dtype == dtype and y.shape == ref.shape
    assert_close(y, ref, scale=2.0, what="linear")


@pytest.mark.parametrize("shape, n, with_bias, dtype", CASES, ids=_ids(CASES))
def test_gradients_match_float32(shape, n, with_bias, dtype):
    x = randn(*shape, dtype=dtype)
    w = randn(n, shape[-1], dtype=dtype, std=shape[-1] ** -0.5)
    b = randn(n, dtype=dtype) if with_bias else None
    dy = randn(*shape[:-1], n, dtype=dtype)
    ours = [t.clone().requires_grad_() if t is not None else None for t in (x, w, b)]
    refs = [t.float().requires_grad_() if t is not None else None for t in (x, w, b)]
    tileops.linear(*ours).backward(dy)
    F.linear(*refs).backward(dy.float())
    tokens = x.numel() // shape[-1]
    for name, got, want, terms in (("input", ours[0], refs[0], n),
                                   ("weight", ours[1], refs[1], tokens),
                                   ("bias", ours[2], refs[2], tokens)):
        if got is not None:
            # a gradient sums `terms` products: widen the absolute tolerance with sqrt(terms)
            assert got.grad.dtype == dtype
            assert_close(got.grad, want.grad, scale=max(1.0, terms ** 0.5 / 8),
                         what=f"grad {name}")


def test_token_counts_share_one_weight_gradient_program():
    """dW's reduction runs over the tokens, a symbolic K: new token counts compile nothing.
    (The forward and dX GEMMs have one program per token bucket; these counts share the
    1025-2048 bucket, so any new program would be a dW recompile.)"""
    from tileops.kernels.base import Kernel

    w = randn(1024, 512, dtype=BF16, std=512 ** -0.5).requires_grad_()
    for tokens in (1100, 1537, 2048):
        x = randn(tokens, 512, dtype=BF16).requires_grad_()
        tileops.linear(x, w).sum().backward()
        if tokens == 1100:
            before = Kernel.compile_count
    assert Kernel.compile_count == before


def test_backward_refuses_unaligned_sizes():
    x = randn(64, 256, dtype=BF16).requires_grad_()
    w = randn(264 + 3, 256, dtype=BF16).requires_grad_()
    y = tileops.linear(x, w)  # the forward takes any N
    with pytest.raises(TileOpsError, match="N % 8"):
        y.sum().backward()


def test_torch_compile_fullgraph():
    x = randn(256, 512, dtype=BF16)
    w = randn(768, 512, dtype=BF16, std=512 ** -0.5)
    b = randn(768, dtype=BF16)
    ours = [t.clone().requires_grad_() for t in (x, w, b)]
    refs = [t.float().requires_grad_() for t in (x, w, b)]
    eager = [t.clone().requires_grad_() for t in (x, w, b)]
    fn = torch.compile(lambda x, w, b: tileops.linear(x, w, b).square().sum(), fullgraph=True)
    fn(*ours).backward()
    tileops.linear(*eager).square().sum().backward()
    F.linear(*refs).square().sum().backward()
    for got, same, want in zip(ours, eager, refs, strict=True):
        # The compiled graph runs the same kernels as eager: equal up to summation order.
        assert_close(got.grad, same.grad, what="compiled grad vs eager")
        # Against fp32, the upstream 2*y carries y's bf16 rounding (2^-9 relative) into
        # sums over 256-768 terms: ~0.1 absolute at these magnitudes, hence the scale.
        assert_close(got.grad, want.grad, scale=32.0, what="compiled grad vs fp32")


@pytest.mark.parametrize("with_bias", [False, True])
def test_repeated_signatures_through_the_planned_launch(with_bias):
    """A seen signature runs the op's planned launch; inputs of that signature it does not
    serve as they are (a strided input or weight, a misaligned bias) go to forward.
    Outputs land in NaN-poisoned blocks."""
    from tileops import LinearFwdOp

    op = LinearFwdOp()
    w = randn(96, 64, dtype=torch.bfloat16)
    b = randn(96, dtype=torch.bfloat16) if with_bias else None
    cases = [(randn(24, 64, dtype=torch.bfloat16), w, b),
             (randn(24, 64, dtype=torch.bfloat16), w, b),               # the plan's launch
             (randn(64, 24, dtype=torch.bfloat16).t(), w, b),           # strided input
             (randn(24, 64, dtype=torch.bfloat16), randn(64, 96, dtype=torch.bfloat16).t(), b),
             (randn(24, 64, dtype=torch.bfloat16), w,
              randn(97, dtype=torch.bfloat16)[1:] if with_bias else None),  # 2-byte offset
             (randn(24, 64, dtype=torch.bfloat16), w, b)]
    for i, (x, weight, bias) in enumerate(cases):
        poison_allocator()
        want = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        assert_close(op(x, weight, bias), want, what=f"case {i}")
        assert_close(tileops.linear(x, weight, bias), want, what=f"functional, case {i}")
