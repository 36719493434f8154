"""Slices that meet through global memory (kernels/softmax/meeting_slices.py) run on the CPU
(tests/cuda_emulation_threads.py, atomics under a lock) against float64 references: the
one-pass statistics (logsumexp, cross-entropy's loss; the blocks in launch order, the last
to arrive merging) and the two-pass kinds (softmax, log_softmax, their backward, the loss
and gradient; each row's blocks run together, as they wait for each other). Short last
slices, a slice of -inf only, a fully masked row, +inf, every loss term; the counts are
zero again after the launch; scratch larger than needed."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tileops.kernels.softmax import RowConfig, SoftmaxKernel
from tileops.kernels.softmax.cross_entropy import CrossEntropyConfig, CrossEntropyKernel
from tileops.kernels.softmax.softmax import meeting_configs

from .softmax_emulated import TOL, check_backward, check_forward

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
NAMES = {BF16: "bfloat16", FP16: "float16", FP32: "float32"}


def _scratch(rows, slices, values):
    """Partials and counts as workspace.scratch / zeroed_scratch hand them out: at least the
    launch's size (here more, each buffer grown on its own), the partials holding garbage,
    the counts zero."""
    part = torch.full((slices * values + 3, rows + 5), float("nan"))
    count = torch.zeros(3, rows + 9, dtype=torch.int32)
    return part, count


def _run(compiled, config, rows, tensors, scalars, together=False):
    """`together`: each row's blocks run concurrently (the two-pass exchange waits)."""
    from ..cuda_emulation_threads import run

    counts = tensors.get("count", tensors.get("counts"))
    part = tensors.get("part", tensors.get("gpart"))
    run(compiled, rows * config.cluster, config.threads, tensors,
        dict(rows=rows, part_rows=part.shape[0], part_slots=part.shape[1],
             count_rows=counts.shape[0], count_slots=counts.shape[1], **scalars),
        cluster=config.cluster if together else 1)
    assert not counts.any()  # set back for the next launch


@pytest.mark.compile
@pytest.mark.parametrize("rows, n, dtype, slices, threads", [
    pytest.param(5, 5000, BF16, 3, 64, marks=pytest.mark.smoke),
    pytest.param(4, 4104, FP16, 8, 32, marks=pytest.mark.full),
    pytest.param(3, 3000, FP32, 2, 128, marks=pytest.mark.full)])
def test_logsumexp_meets_on_the_cpu(rows, n, dtype, slices, threads):
    gen = torch.Generator().manual_seed(rows * n)
    x = (torch.randn(rows, n, generator=gen) * 3).to(dtype)
    x[0, : n // 2] = float("-inf")  # whole slices of -inf
    x[1] = float("-inf")  # -inf, as torch
    x[2, 7] = float("inf")  # +inf, as torch
    config = RowConfig(threads, threads, 1, 1, slices, meet=True)
    kernel = SoftmaxKernel(kind="logsumexp", n=n, dtype=NAMES[dtype])
    compiled = kernel.compile(config, "many")[0]
    assert "AtomicAddRet" in compiled.get_kernel_source()
    part, count = _scratch(rows, slices, 2)
    check_forward("logsumexp", x, lambda tensors: _run(
        compiled, config, rows, dict(tensors, part=part, count=count), {}))


@pytest.mark.compile
@pytest.mark.parametrize("dtype, slices, threads, params", [
    pytest.param(BF16, 3, 64, {}, marks=pytest.mark.smoke),
    pytest.param(FP16, 4, 64, {"eps": 0.1, "zloss": 1e-4, "ignore_index": 7},
                 marks=pytest.mark.full),
    pytest.param(BF16, 8, 32, {"cap": 30.0, "eps": 0.05}, marks=pytest.mark.full),
    pytest.param(FP32, 2, 128, {"cap": 10.0, "zloss": 1e-4}, marks=pytest.mark.full)])
def test_cross_entropy_loss_meets_on_the_cpu(dtype, slices, threads, params):
    rows, n = 5, 4104
    gen = torch.Generator().manual_seed(slices * threads)
    x = (torch.randn(rows, n, generator=gen) * 2).to(dtype)
    ignore_index = params.get("ignore_index", -100)
    target = torch.randint(0, n, (rows,), generator=gen)
    target[1] = ignore_index
    target[3] = n - 1  # the last column, in the last (short) slice
    eps, cap, zloss = params.get("eps", 0.0), params.get("cap"), params.get("zloss", 0.0)
    config = CrossEntropyConfig(threads, threads, 1, 1, slices, meet=True)
    kernel = CrossEntropyKernel(mode="loss", n=n, dtype=NAMES[dtype], softcap=cap is not None,
                                smoothing=eps != 0.0, dloss_per_row=False)
    compiled = kernel.compile(config, "many")[0]
    loss = torch.full((rows,), float("nan"))
    lse = torch.full((rows,), float("nan"))
    part, count = _scratch(rows, slices, 3)
    _run(compiled, config, rows,
         dict(x=x, target=target, loss=loss, lse=lse, lse_out=lse, part=part, count=count),
         dict(ignore_index=ignore_index, cap=1.0 if cap is None else cap, eps=eps,
              zloss=zloss))
    z = x.double() if cap is None else cap * torch.tanh(x.double() / cap)
    want_lse = torch.logsumexp(z, -1)
    want = F.cross_entropy(z, target, ignore_index=ignore_index, reduction="none",
                           label_smoothing=eps) + zloss * want_lse.square() * (
                               target != ignore_index)
    torch.testing.assert_close(loss.double(), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n, dtype", [(128256, "bfloat16"), (256000, "bfloat16"),
                                      (32000, "float16"), (151936, "float32")])
def test_meeting_configs_are_offered_where_they_apply(n, dtype):
    """The one-pass meeting slices join the spaces of logsumexp and the loss mode; the
    two-pass kinds (and loss_and_grad) get each register-held cluster shape also as a
    meeting one; of
    the many-row defaults only softmax_bwd's meets, where its rows outgrow the L2 (measured;
    test_softmax_defaults_cpu.py), and logsumexp_bwd and the gradient pass get none."""
    configs = meeting_configs(n, dtype)
    assert configs and all(c.meet and 2 <= c.cluster <= 8 for c in configs)
    key = dict(n=n, dtype=dtype)
    lse = SoftmaxKernel(kind="logsumexp", **key)
    assert set(configs) <= set(lse.config_space("many"))
    assert not lse.heuristic_config("many", "sm_90a").meet
    ce = dict(softcap=False, smoothing=False, dloss_per_row=False, **key)
    loss_space = CrossEntropyKernel(mode="loss", **ce).config_space("many")
    assert sum(c.meet for c in loss_space) == len(configs)
    for kernel in (SoftmaxKernel(kind="softmax", **key), SoftmaxKernel(kind="softmax_bwd", **key),
                   CrossEntropyKernel(mode="loss_and_grad", **ce)):
        space = kernel.config_space("many")
        # a cluster of one has nothing to meet, a landed one lands the next row of its own
        clustered = {dataclasses.replace(c, meet=True) for c in space
                     if c.cluster > 1 and not c.meet and not c.landed}
        assert clustered and clustered == {c for c in space if c.meet}
        meets = kernel.key.get("kind") == "softmax_bwd" and n != 32000  # 32K: within L2
        assert kernel.heuristic_config("many", "sm_90a").meet == meets
    for kernel in (SoftmaxKernel(kind="logsumexp_bwd", **key),
                   CrossEntropyKernel(mode="grad", **ce)):
        assert not any(c.meet for c in kernel.config_space("many"))


def test_meet_is_refused_without_statistics_to_share():
    with pytest.raises(ValueError, match="meet"):
        SoftmaxKernel(kind="logsumexp_bwd", n=5000, dtype="bfloat16").program(
            RowConfig(64, 64, 1, 1, 3, meet=True), "many")
    with pytest.raises(ValueError, match="meet"):
        SoftmaxKernel(kind="softmax", n=5000, dtype="bfloat16").program(
            RowConfig(64, 64, 1, 1, 0, meet=True), "many")
    with pytest.raises(ValueError, match="meet"):
        CrossEntropyKernel(mode="grad", n=5000, dtype="bfloat16", softcap=False,
                           smoothing=False, dloss_per_row=False).program(
            CrossEntropyConfig(64, 64, 1, 1, 3, meet=True), "many")


def _rows(rows, n, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, n, generator=gen) * 3).to(dtype)
    x[0, : n // 2] = float("-inf")  # whole slices of -inf
    x[2] = float("-inf")  # softmax NaN, as torch
    return x


@pytest.mark.compile
@pytest.mark.parametrize("kind", ["softmax", "log_softmax"])
@pytest.mark.parametrize("rows, n, dtype, slices, threads", [
    pytest.param(4, 5000, BF16, 3, 64, marks=pytest.mark.smoke),
    pytest.param(3, 4104, FP16, 8, 32, marks=pytest.mark.full),
    pytest.param(3, 3000, FP32, 2, 128, marks=pytest.mark.full)])
def test_two_pass_forward_meets_on_the_cpu(kind, rows, n, dtype, slices, threads):
    x = _rows(rows, n, dtype, rows + n)
    config = RowConfig(threads, threads, 4, 1, slices, meet=True)
    compiled = SoftmaxKernel(kind=kind, n=n, dtype=NAMES[dtype]).compile(config, "many")[0]
    assert "AtomicLoad" in compiled.get_kernel_source()
    part, count = _scratch(rows, slices, 2)
    check_forward(kind, x, lambda tensors: _run(
        compiled, config, rows, dict(tensors, gpart=part, counts=count), {}, together=True))


@pytest.mark.compile
@pytest.mark.full
@pytest.mark.parametrize("kind", ["softmax_bwd", "log_softmax_bwd"])
def test_two_pass_backward_meets_on_the_cpu(kind):
    rows, n, dtype, slices, threads = 3, 3000, BF16, 5, 64
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(rows, n, generator=gen, dtype=torch.float64)
    y = (torch.softmax if kind == "softmax_bwd" else torch.log_softmax)(x, -1).to(dtype)
    dy = torch.randn(rows, n, generator=gen).to(dtype)
    config = RowConfig(threads, threads, 4, 1, slices, meet=True)
    compiled = SoftmaxKernel(kind=kind, n=n, dtype="bfloat16").compile(config, "many")[0]
    part, count = _scratch(rows, slices, 1)
    check_backward(kind, y, dy, lambda tensors: _run(
        compiled, config, rows, dict(tensors, gpart=part, counts=count), {}, together=True),
        1e-2, 1e-3)


@pytest.mark.compile
@pytest.mark.parametrize("dtype, slices, threads, params", [
    pytest.param(BF16, 3, 64, {"eps": 0.1, "zloss": 1e-4}, marks=pytest.mark.smoke),
    pytest.param(FP16, 8, 32, {"cap": 30.0, "ignore_index": 7}, marks=pytest.mark.full),
    pytest.param(FP32, 2, 128, {"eps": 0.05, "cap": 10.0}, marks=pytest.mark.full)])
def test_loss_and_gradient_meet_on_the_cpu(dtype, slices, threads, params):
    rows, n = 4, 4104
    gen = torch.Generator().manual_seed(slices + threads)
    x = (torch.randn(rows, n, generator=gen) * 2).to(dtype)
    ignore_index = params.get("ignore_index", -100)
    target = torch.randint(0, n, (rows,), generator=gen)
    target[1] = ignore_index
    target[2] = n - 1
    eps, cap, zloss = params.get("eps", 0.0), params.get("cap"), params.get("zloss", 0.0)
    config = CrossEntropyConfig(threads, threads, 4, 1, slices, meet=True)
    kernel = CrossEntropyKernel(mode="loss_and_grad", n=n, dtype=NAMES[dtype],
                                softcap=cap is not None, smoothing=eps != 0.0,
                                dloss_per_row=False)
    compiled = kernel.compile(config, "many")[0]
    loss = torch.full((rows,), float("nan"))
    lse = torch.full((rows,), float("nan"))
    grad = x.clone()  # written over the logits, as the in-place flavour does
    part, count = _scratch(rows, slices, 3)
    _run(compiled, config, rows,
         dict(x=grad, target=target, loss=loss, lse=lse, grad=grad, gpart=part,
              counts=count),
         dict(ignore_index=ignore_index, cap=1.0 if cap is None else cap, eps=eps,
              zloss=zloss), together=True)
    leaf = x.double().requires_grad_()
    z = leaf if cap is None else cap * torch.tanh(leaf / cap)
    want_lse = torch.logsumexp(z, -1)
    want = F.cross_entropy(z, target, ignore_index=ignore_index, reduction="none",
                           label_smoothing=eps) + zloss * want_lse.square() * (
                               target != ignore_index)
    want.sum().backward()
    torch.testing.assert_close(loss.double(), want.detach(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse.double(), want_lse.detach(), rtol=1e-5, atol=1e-5)
    tol = TOL[dtype]
    torch.testing.assert_close(grad.double(), leaf.grad, rtol=tol, atol=tol * 1e-2)
