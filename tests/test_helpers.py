"""The correctness helpers themselves, on the CPU: assert_no_worse_than (the MoE tests'
criterion) accepts a bf16 result that rounds where a PyTorch bf16 layer rounds and rejects
wrong ones (an expert's contribution dropped, a 5% bias, a bias below the elementwise
bound, NaN)."""

import pytest
import torch

from .helpers import assert_close, assert_no_worse_than
from .ops import moe_reference as ref

BF16, FP32 = torch.bfloat16, torch.float32
TOKENS, EXPERTS, HIDDEN, FFN, TOP_K = 48, 8, 128, 64, 2


@pytest.fixture(scope="module")
def layer():
    """(inputs, fp32 reference, bf16 eager baseline) of a small routed expert layer, with
    gradients (w.r.t. the hidden states, both weights and the routing weights)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN, generator=gen).to(BF16)
    w_gate_up = (torch.randn(EXPERTS, 2 * FFN, HIDDEN, generator=gen) * 2 / HIDDEN ** 0.5
                 ).to(BF16)
    w_down = (torch.randn(EXPERTS, HIDDEN, FFN, generator=gen) / FFN ** 0.5).to(BF16)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K]
                       for _ in range(TOKENS)]).to(torch.int32)
    weights = torch.rand(TOKENS, TOP_K, generator=gen)
    g = torch.randn(TOKENS, HIDDEN, generator=gen).to(BF16)
    inputs = (x, w_gate_up, w_down, weights, ids)

    def autograd_of_loop(dtype):
        leaves = [t.detach().to(dtype if i < 3 else FP32).requires_grad_()
                  for i, t in enumerate(inputs[:4])]
        out = ref.expert_layer(*leaves, ids, dtype=dtype)
        out.backward(g.to(dtype))
        return [out.detach()] + [t.grad for t in leaves]

    return inputs, autograd_of_loop(FP32), autograd_of_loop(BF16)


def test_accepts_results_that_round_like_the_bf16_baseline(layer):
    inputs, want, eager = layer
    for what, w, e in zip(("out", "hidden", "w_gate_up", "w_down", "weights"), want, eager,
                          strict=True):
        assert_no_worse_than(e, e, w, what)  # the baseline itself
    # the inference path's rounding (one rounding fewer): no worse than the baseline
    assert_no_worse_than(ref.expert_layer(*inputs, dtype=BF16, round_gate_up=False),
                         eager[0], want[0])
    # the baseline's errors, in another order
    err = (eager[0].double() - want[0].double()).flatten()
    shuffled = err[torch.randperm(err.numel(), generator=torch.Generator().manual_seed(1))]
    assert_no_worse_than(want[0].double() + shuffled.view(want[0].shape), eager[0].double(),
                         want[0])


def test_accepts_a_cancelling_sum_of_large_terms(layer):
    """Outputs that cancel to near zero keep an absolute error of an ulp of their terms:
    every expert's output large (w_down x 64), the baseline's error grows with them, and
    a fixed (atol, rtol) pair rejects a result that rounds no worse than PyTorch does."""
    (x, w_gate_up, w_down, weights, ids), _, _ = layer
    big = (w_down.float() * 64).to(BF16)
    want = ref.expert_layer(x, w_gate_up, big, weights, ids)
    eager = ref.expert_layer(x, w_gate_up, big, weights, ids, dtype=BF16)
    ours = ref.expert_layer(x, w_gate_up, big, weights, ids, dtype=BF16, round_gate_up=False)
    assert (ours.double() - want.double()).abs().max() > 0.1  # far above bf16's atol 0.016
    with pytest.raises(AssertionError, match="elements off"):
        assert_close(ours, want, scale=2.0)
    assert_no_worse_than(ours, eager, want)


def test_rejects_a_dropped_expert(layer):
    (x, w_gate_up, w_down, weights, ids), want, eager = layer
    dropped = weights * (ids != 3)  # expert 3's contribution missing
    with pytest.raises(AssertionError, match="max error"):
        assert_no_worse_than(ref.expert_layer(x, w_gate_up, w_down, dropped, ids, dtype=BF16),
                             eager[0], want[0])
    grad = eager[3].clone()
    grad[3] = 0  # its w_down gradient missing
    with pytest.raises(AssertionError, match="max error"):
        assert_no_worse_than(grad, eager[3], want[3], "grad w_down")


def test_rejects_a_bias(layer):
    _, want, eager = layer
    for what, w, e in zip(("out", "hidden", "w_gate_up", "w_down", "weights"), want, eager,
                          strict=True):
        with pytest.raises(AssertionError):
            assert_no_worse_than((e.double() * 1.05).to(e.dtype), e, w, what)  # 5% too large
    # a constant offset below the elementwise bound: the relative L2 criterion catches it
    out, base = want[0], eager[0]
    base_max = (base.double() - out.double()).abs().max().item()
    shifted = base.double() + base_max / 2
    assert ((shifted - out.double()).abs().max() <= 2 * base_max).item()
    with pytest.raises(AssertionError, match="relative L2"):
        assert_no_worse_than(shifted, base.double(), out)


def test_nan_and_a_broken_baseline(layer):
    _, want, eager = layer
    out, base = want[0], eager[0]
    poisoned = base.clone()
    poisoned[5, 7] = float("nan")
    with pytest.raises(AssertionError, match="max error inf"):
        assert_no_worse_than(poisoned, base, out)
    with pytest.raises(AssertionError, match="baseline holds NaN"):
        assert_no_worse_than(base, poisoned, out)
    with pytest.raises(AssertionError, match="baseline itself is off"):
        assert_no_worse_than(base, base * 1.2, out)  # a vacuous bound is an error


@pytest.mark.gpu
def test_poison_allocator_reaches_the_free_tail_of_a_live_segment():
    """An output that fits in the free tail of a segment holding a live tensor (the block
    best fit picks) comes out NaN after poison_allocator, in every float dtype."""
    from .helpers import poison_allocator

    live = torch.zeros(3 << 20, dtype=torch.uint8, device="cuda")  # 3 MiB of a 20 MiB segment
    stale = torch.ones(5 << 20, dtype=torch.uint8, device="cuda")  # freed: a stale tail
    del stale
    poison_allocator(nbytes=64 << 20)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = torch.empty((4 << 20) // dtype.itemsize, dtype=dtype, device="cuda")
        assert torch.isnan(out.float()).all(), dtype
        del out
    assert live.eq(0).all()  # live tensors untouched
