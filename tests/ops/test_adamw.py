"""The AdamW op and tileops.optim.AdamW on the GPU: the update against a float64 reference
(tails, misaligned tensors, every dtype, maximize, slices of a large tensor), and the
optimizer step by step against torch.optim.AdamW's fused update on a small model."""

import copy

import pytest
import torch

from tileops import AdamwStepFwdOp, TileOpsValueError
from tileops.ops import optimizer as optimizer_ops
from tileops.optim import AdamW

from ..helpers import assert_close, randn
from .adamw_reference import adamw_reference

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _state(n, dtype, offset=0):
    """param, grad, exp_avg, exp_avg_sq of n elements starting `offset` elements into their
    storage (an offset breaks 16-byte alignment)."""
    tensors = [randn(n + offset, dtype=dtype)[offset:] for _ in range(3)]
    tensors.append(torch.rand(n + offset, device="cuda").to(dtype)[offset:])
    return [tensors[0], tensors[1], tensors[2], tensors[3]]


def _check(got, want, what):
    for g, w, name in zip(got, want, ("param", "exp_avg", "exp_avg_sq"), strict=True):
        assert_close(g, w.to(g.dtype).float(), what=f"{what}: {name}")


@pytest.mark.smoke
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, offset", [(1, 0), (7, 0), (4097, 0), (1_000_003, 0),
                                       (5000, 1), (5000, 2), (300_000, 4)])
def test_update_matches_the_reference(dtype, n, offset):
    param, grad, m, v = _state(n, dtype, offset)
    params = dict(lr=0.1, beta1=0.85, beta2=0.99, eps=1e-6, weight_decay=0.05, step=4)
    want = adamw_reference(param, grad, m, v, **params)
    out = AdamwStepFwdOp(**params)(param, grad, m, v)
    assert all(a is b for a, b in zip(out, (param, m, v), strict=True))  # in place
    # exp_avg moves by 0.15 (grad - exp_avg), far above the tolerance for nearly every
    # element: an element left unwritten fails this
    _check(out, want, f"n={n} offset={offset}")


def test_maximize_no_decay_and_the_pure_custom_op():
    param, grad, m, v = _state(70_000, torch.bfloat16)
    want = adamw_reference(param, grad, m, v, lr=0.05, weight_decay=0.0, step=1,
                           maximize=True)
    copies = [t.clone() for t in (param, grad, m, v)]
    out = torch.ops.tileops.adamw_step_fwd(param, grad, m, v, 0.05, 0.9, 0.999, 1e-8, 0.0, 1,
                                           True)
    assert all(torch.equal(a, b) for a, b in zip((param, grad, m, v), copies, strict=True))
    _check(out, want, "pure custom op")


def test_a_tensor_over_one_launch_takes_slices(monkeypatch):
    monkeypatch.setattr(optimizer_ops, "LAUNCH_ELEMENTS", 1 << 16)
    param, grad, m, v = _state((1 << 18) + 333, torch.bfloat16)
    want = adamw_reference(param, grad, m, v, lr=0.1, step=2)
    AdamwStepFwdOp(lr=0.1, step=2)(param, grad, m, v)
    _check((param, m, v), want, "sliced")


def test_non_contiguous_tensors_are_refused_by_name():
    param, grad, m, v = _state(64 * 64, torch.bfloat16)
    with pytest.raises(TileOpsValueError, match=r"AdamwStepFwdOp: argument 'grad': expected "
                       r"a contiguous tensor, got strides \(1, 64\)"):
        AdamwStepFwdOp()(param.view(64, 64), grad.view(64, 64).t(), m.view(64, 64),
                         v.view(64, 64))


def _model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 1000), torch.nn.LayerNorm(1000),
                               torch.nn.Linear(1000, 77)).to("cuda", dtype)


@pytest.mark.smoke
@pytest.mark.parametrize("dtype", DTYPES)
def test_optimizer_follows_torch_fused_adamw(dtype):
    """Five steps of the same gradients, with a learning-rate change and two param groups,
    against torch.optim.AdamW(fused=True): parameters and state agree."""
    ours, theirs = _model(dtype), _model(dtype)
    groups = lambda m: [{"params": m[0].parameters()},  # noqa: E731
                        {"params": [*m[1].parameters(), *m[2].parameters()],
                         "weight_decay": 0.0, "betas": (0.8, 0.95)}]
    opt_ours = AdamW(groups(ours), lr=0.01)
    opt_theirs = torch.optim.AdamW(groups(theirs), lr=0.01, fused=True)
    for step in range(5):
        x = randn(32, 256, dtype=dtype)
        for model in (ours, theirs):
            model.zero_grad()
            (model(x).float().square().mean() * 100).backward()  # grads ~0.1
        for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
            a.grad.copy_(b.grad)  # the same gradients: only the update is compared
        if step == 3:
            for opt in (opt_ours, opt_theirs):
                opt.param_groups[0]["lr"] = 0.003
        opt_ours.step()
        opt_theirs.step()
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert_close(a, b.float(), what=name)
        sa, sb = opt_ours.state[a], opt_theirs.state[b]
        assert float(sa["step"]) == float(sb["step"]) == 5.0
        assert_close(sa["exp_avg"], sb["exp_avg"].float(), what=f"{name} exp_avg")
        assert_close(sa["exp_avg_sq"], sb["exp_avg_sq"].float(), what=f"{name} exp_avg_sq")


def test_state_dicts_load_both_ways():
    """A run of torch's fused AdamW resumes on ours (its CUDA step count moved to the CPU
    once) and steps as torch would; ours loads back into torch's."""
    ours, theirs = _model(torch.bfloat16), _model(torch.bfloat16)
    opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=0.01, fused=True)
    theirs(randn(8, 256, dtype=torch.bfloat16)).float().sum().backward()
    opt_theirs.step()
    ours.load_state_dict(theirs.state_dict())
    opt_ours = AdamW(ours.parameters(), lr=0.01)
    # a copy: load_state_dict keeps the saved tensors themselves where no cast is needed
    opt_ours.load_state_dict(copy.deepcopy(opt_theirs.state_dict()))
    x = randn(8, 256, dtype=torch.bfloat16)
    for model in (ours, theirs):
        model.zero_grad()
        model(x).float().sum().backward()
    opt_ours.step()
    opt_theirs.step()
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert float(opt_ours.state[a]["step"]) == 2.0
        assert_close(a, b.float(), what="resumed param")
        assert_close(opt_ours.state[a]["exp_avg_sq"], opt_theirs.state[b]["exp_avg_sq"].float(),
                     what="resumed exp_avg_sq")
    torch.optim.AdamW(theirs.parameters(), fused=True).load_state_dict(opt_ours.state_dict())
