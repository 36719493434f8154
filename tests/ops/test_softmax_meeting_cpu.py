"""The one-pass statistics on slices that meet through global memory
(kernels/softmax/meeting_slices.py: logsumexp and cross-entropy's loss) run on the CPU
(tests/cuda_emulation_threads.py, atomics under a lock, the blocks in launch order) against
float64 references: short last slices, a slice of -inf only, a fully masked row, +inf, every
loss term; the counts are zero again after the launch; scratch larger than needed."""

import pytest
import torch
import torch.nn.functional as F

from tileops.kernels.softmax import RowConfig, SoftmaxKernel
from tileops.kernels.softmax.cross_entropy import CrossEntropyConfig, CrossEntropyKernel
from tileops.kernels.softmax.softmax import meeting_configs

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
NAMES = {BF16: "bfloat16", FP16: "float16", FP32: "float32"}


def _scratch(rows, slices, values):
    """Partials and counts as workspace.scratch / zeroed_scratch hand them out: at least the
    launch's size (here more), the partials holding garbage, the counts zero."""
    part = torch.full((slices * values + 3, rows + 5), float("nan"))
    count = torch.zeros(rows + 5, dtype=torch.int32)
    return part, count


def _run(compiled, config, rows, tensors, scalars):
    from ..cuda_emulation_threads import run

    run(compiled, rows * config.cluster, config.threads, tensors,
        dict(rows=rows, slots=tensors["count"].shape[0], width=tensors["part"].shape[0],
             **scalars))
    assert not tensors["count"].any()  # set back for the next launch


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
    out = torch.full((rows,), float("nan"), dtype=dtype)
    part, count = _scratch(rows, slices, 2)
    _run(compiled, config, rows, dict(x=x, out=out, part=part, count=count), {})
    want = torch.logsumexp(x.double(), -1)
    tol = {BF16: 1e-2, FP16: 1e-3, FP32: 1e-5}[dtype]
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol, equal_nan=True)


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
    """The meeting slices join the spaces of logsumexp and the loss mode (not the defaults:
    unmeasured), never those of the two-pass kinds; slices of <= 16 vectors a thread."""
    configs = meeting_configs(n, dtype)
    assert configs and all(c.meet and 2 <= c.cluster <= 8 for c in configs)
    key = dict(n=n, dtype=dtype)
    lse = SoftmaxKernel(kind="logsumexp", **key)
    assert set(configs) <= set(lse.config_space("many"))
    assert not lse.heuristic_config("many", "sm_90a").meet
    assert not any(c.meet for c in SoftmaxKernel(kind="softmax", **key).config_space("many"))
    ce = dict(softcap=False, smoothing=False, dloss_per_row=False, **key)
    loss_space = CrossEntropyKernel(mode="loss", **ce).config_space("many")
    assert sum(c.meet for c in loss_space) == len(configs)
    assert not any(c.meet for c in CrossEntropyKernel(mode="loss_and_grad", **ce).config_space(
        "many"))


def test_meet_is_refused_outside_the_one_pass_statistics():
    with pytest.raises(ValueError, match="meet"):
        SoftmaxKernel(kind="softmax", n=5000, dtype="bfloat16").program(
            RowConfig(64, 64, 1, 1, 3, meet=True), "many")
    with pytest.raises(ValueError, match="meet"):
        CrossEntropyKernel(mode="loss_and_grad", n=5000, dtype="bfloat16", softcap=False,
                           smoothing=False, dloss_per_row=False).program(
            CrossEntropyConfig(64, 64, 1, 1, 3, meet=True), "many")
