"""The AdamW op and tileops.optim.AdamW without a GPU: argument checks, meta calls, the
optimizer's torch-compatible surface, and (marker `compile`) the kernel's generated CUDA run
thread by thread on the CPU against a float64 reference."""

import inspect

import pytest
import torch

from tileops import (
    AdamwStepFwdOp,
    TileOpsError,
    TileOpsTypeError,
    TileOpsUnsupportedError,
    TileOpsValueError,
)
from tileops.kernels.optimizer import AdamWConfig, AdamWKernel
from tileops.optim import AdamW

from ..helpers import meta
from .adamw_reference import adamw_reference


def _state(*shape, dtype=torch.bfloat16):
    return [meta(*shape, dtype=dtype) for _ in range(4)]


@pytest.mark.smoke
@pytest.mark.parametrize("call, err, pattern", [
    (lambda: AdamwStepFwdOp()(*_state(64, dtype=torch.float64)), TileOpsTypeError,
     r"AdamwStepFwdOp: argument 'param': expected dtype float16 \| bfloat16 \| float32"),
    (lambda: AdamwStepFwdOp()(meta(64), meta(64), meta(64, dtype=torch.float32), meta(64)),
     TileOpsTypeError, r"AdamwStepFwdOp: argument 'exp_avg': expected dtype torch.bfloat16 "
     r"\(same as 'param'\), got torch.float32"),
    (lambda: AdamwStepFwdOp()(meta(64), meta(65), meta(64), meta(64)), TileOpsValueError,
     r"AdamwStepFwdOp: argument 'grad': expected shapes satisfying "
     r"`tuple\(grad.shape\) == tuple\(param.shape\)`"),
    (lambda: AdamwStepFwdOp(step=0)(*_state(64)), TileOpsValueError,
     r"AdamwStepFwdOp: argument 'step': expected a value satisfying `step >= 1`, got step=0"),
    (lambda: AdamwStepFwdOp(beta2=1.0)(*_state(64)), TileOpsValueError,
     r"AdamwStepFwdOp: argument 'beta2': expected a value satisfying `0.0 <= beta2 < 1.0`"),
    (lambda: AdamwStepFwdOp()(*(torch.zeros(8) for _ in range(4))), TileOpsValueError,
     r"AdamwStepFwdOp: argument 'param': expected a CUDA tensor"),
    (lambda: AdamW([torch.nn.Parameter(torch.zeros(4))], amsgrad=True),
     TileOpsUnsupportedError, r"tileops.optim.AdamW: argument 'amsgrad': expected False"),
    (lambda: AdamW([torch.nn.Parameter(torch.zeros(4))], lr=-1.0), TileOpsValueError,
     r"tileops.optim.AdamW: argument 'lr': expected a value >= 0, got -1.0"),
    (lambda: AdamW([torch.nn.Parameter(torch.zeros(4))], betas=(0.9, 1.0)),
     TileOpsValueError, r"tileops.optim.AdamW: argument 'betas': expected two values in "
     r"\[0, 1\), got \(0.9, 1.0\)"),
    (lambda: AdamW([torch.nn.Parameter(torch.zeros(4))], eps=-1e-8), TileOpsValueError,
     r"tileops.optim.AdamW: argument 'eps'"),
    (lambda: AdamW([torch.nn.Parameter(torch.zeros(4))], weight_decay=-0.1),
     TileOpsValueError, r"tileops.optim.AdamW: argument 'weight_decay'"),
])
def test_bad_input(call, err, pattern):
    with pytest.raises(err, match=pattern):
        call()
    assert issubclass(err, TileOpsError)


@pytest.mark.smoke
def test_meta_calls_return_the_three_updated_tensors():
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        out = AdamwStepFwdOp()(*_state(3, 5, dtype=dtype))
        assert [(t.shape, t.dtype) for t in out] == [((3, 5), dtype)] * 3
        AdamwStepFwdOp().update_(*_state(7, dtype=dtype), lr=0.1, step=3)  # checked only
    out = torch.ops.tileops.adamw_step_fwd(*_state(6), 0.1, 0.9, 0.99, 1e-8, 0.0, 2, False)
    assert [t.shape for t in out] == [(6,)] * 3


def test_optimizer_defaults_and_state_names_match_torch():
    """The constructor's defaults are torch.optim.AdamW's, and the state a step creates has
    torch's names, so state dicts load either way (the values: the GPU tests)."""
    ours = inspect.signature(AdamW).parameters
    theirs = inspect.signature(torch.optim.AdamW).parameters
    for name in ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize"):
        assert ours[name].default == theirs[name].default, name
    param = torch.nn.Parameter(torch.zeros(4))
    assert AdamW([param]).defaults == {k: v for k, v in torch.optim.AdamW([param]).defaults.items()
                                       if k in AdamW([param]).defaults}


def test_stepping_inside_a_cuda_graph_capture_is_refused(monkeypatch):
    """A replay would repeat the captured step's learning rate and bias corrections."""
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.zeros(4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(TileOpsUnsupportedError, match=r"step\(\) inside CUDA graph capture"):
        AdamW([p]).step()


def _replicated(t):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    return torch.nn.Parameter(distribute_tensor(t, init_device_mesh("cpu", (1,)), [Replicate()]))


def test_refusals_of_a_device_learning_rate_dtensors_and_sparse_gradients():
    p = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(TileOpsValueError, match=r"argument 'lr': expected a float or a "
                       r"one-element CPU tensor .*, got a tensor of shape \(\) on meta"):
        AdamW([p], lr=torch.tensor(0.1, device="meta"))
    opt = AdamW([p], lr=0.1)
    opt.param_groups[0]["lr"] = torch.tensor(0.1, device="meta")  # a scheduler's doing
    p.grad = torch.zeros(4)
    with pytest.raises(TileOpsValueError, match=r"argument 'lr'"):
        opt.step()
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:  # a DTensor parameter on a one-process CPU mesh (what FSDP2 hands an optimizer)
        dtensor = _replicated(torch.zeros(4, 4))
        dtensor.grad = torch.zeros_like(dtensor)
        with pytest.raises(TileOpsUnsupportedError, match=r"argument 'params': expected "
                           r"plain tensors \(DTensor .*, got a DTensor"):
            AdamW([dtensor]).step()
    finally:  # other tests (and transformers) read whether a process group exists
        dist.destroy_process_group()
    sparse = torch.nn.Parameter(torch.zeros(4))
    sparse.grad = torch.zeros(4).to_sparse()
    with pytest.raises(TileOpsTypeError, match=r"argument 'params': expected dense gradients"):
        AdamW([sparse]).step()


@pytest.mark.compile
@pytest.mark.smoke
@pytest.mark.parametrize("dtype, vec, n, config", [
    (torch.bfloat16, 8, 8 * 128 * 3 + 5, AdamWConfig(128, 2)),  # a partial last vector
    (torch.bfloat16, 1, 300, AdamWConfig(128, 2)),  # misaligned: one element a vector
    (torch.float32, 4, 4 * 256 * 2 * 2 + 4, AdamWConfig(128, 2)),  # a partial last CTA
    (torch.float16, 4, 1000, AdamWConfig(128, 2)),
    (torch.bfloat16, 8, 8 * 256 * 2 + 9, AdamWConfig(256, 1, fast_rcp=True)),  # the default
])
def test_kernel_matches_the_reference_thread_by_thread(dtype, vec, n, config):
    from ..cuda_emulation import run

    name = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
    kernel = AdamWKernel(dtype=name[dtype], vec=vec)
    compiled = kernel.compile(config, "large")[0]
    gen = torch.Generator().manual_seed(n)
    p, g, m = (torch.randn(n, generator=gen).to(dtype) for _ in range(3))
    v = torch.rand(n, generator=gen).to(dtype)
    lr, beta1, beta2, eps, wd, step = 0.1, 0.8, 0.95, 1e-6, 0.1, 3
    want = adamw_reference(p, g, m, v, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                           weight_decay=wd, step=step, maximize=True)
    tensors = dict(param=p.clone(), grad=g, exp_avg=m.clone(), exp_avg_sq=v.clone())
    scalars = dict(n=n, grad_scale=-1.0, decay=1 - lr * wd, beta1=beta1, beta2=beta2,
                   eps=eps, step_size=lr / (1 - beta1 ** step),
                   bc2_rsqrt=(1 - beta2 ** step) ** -0.5)
    per_cta = config.threads * config.vecs * vec
    run(compiled, -(-n // per_cta), config.threads, tensors, scalars)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for got, ref, what in zip((tensors["param"], tensors["exp_avg"], tensors["exp_avg_sq"]),
                              want, ("param", "exp_avg", "exp_avg_sq"), strict=True):
        torch.testing.assert_close(got.double(), ref.to(dtype).double(), atol=tol, rtol=tol,
                                   msg=lambda s, w=what: f"{w}: {s}")
    if vec > 1:  # one access a vector: 16 bytes as uint4 / float4, 8 as uint2
        width = vec * p.element_size()
        assert any(f"*({t}*)" in compiled.get_kernel_source()
                   for t in {16: ("uint4", "float4"), 8: ("uint2", "float2")}[width])


@pytest.mark.compile
@pytest.mark.full  # 76 programs: minutes on CI's two cores
def test_every_config_compiles():
    for dtype, vec in (("bfloat16", 8), ("float32", 4)):
        kernel = AdamWKernel(dtype=dtype, vec=vec)
        for bucket in ("small", "large"):
            for config in kernel.config_space(bucket):
                kernel.compile(config, bucket)
