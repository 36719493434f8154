"""Defaults are part of the contract: every op that names a reference API is called with
every parameter left at its default, next to the reference called the same way, and the
results must agree (values, dtype, shape). Backward ops are checked through autograd of
their forward's functional form.

Inputs are small in magnitude where a default could hide (an eps that differs changes
a norm of rows whose mean square is near the eps).
"""

import pytest
import torch
import torch.nn.functional as F

import tileops
from tileops.manifest import load_manifest

from ..helpers import assert_close, randn


def _rms_norm(dtype):
    x = randn(64, 1024, dtype=dtype, std=1e-3)
    return tileops.rms_norm(x, [1024]), F.rms_norm(x, [1024])


def _input_grads(ours, reference, dtype):
    """The input's gradient through `ours(x)` and `reference(x)` (small rows, random dy)."""
    x = randn(64, 1024, dtype=dtype, std=1e-3)
    dy = randn(64, 1024, dtype=dtype)
    grads = []
    for fn in (ours, reference):
        leaf = x.clone().requires_grad_()
        fn(leaf).backward(dy)
        grads.append(leaf.grad)
    return tuple(grads)


def _rms_norm_grad(dtype):
    return _input_grads(lambda x: tileops.rms_norm(x, [1024]),
                        lambda x: F.rms_norm(x, [1024]), dtype)


def _layer_norm(dtype):
    x = randn(64, 1024, dtype=dtype, std=1e-3)
    return tileops.layer_norm(x, [1024]), F.layer_norm(x, [1024])


def _layer_norm_grad(dtype):
    return _input_grads(lambda x: tileops.layer_norm(x, [1024]),
                        lambda x: F.layer_norm(x, [1024]), dtype)


def _gemm(dtype):  # the Linear convention: b is a weight [N, K]
    a, b = randn(256, 512, dtype=dtype), randn(384, 512, dtype=dtype)
    return tileops.gemm(a, b), F.linear(a, b)


def _attention(dtype):  # SDPA's defaults: no mask, scale 1/sqrt(D), equal head counts
    q, k, v = (randn(2, 300, 8, 128, dtype=dtype) for _ in range(3))
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                         v.transpose(1, 2)).transpose(1, 2)
    return tileops.attention(q, k, v), ref


def _attention_grad(dtype):
    q, k, v = (randn(2, 300, 8, 128, dtype=dtype) for _ in range(3))
    do = randn(2, 300, 8, 128, dtype=dtype)
    ours = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    tileops.attention(*ours).backward(do)
    F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in ref)).transpose(1, 2).backward(
        do)
    return torch.cat([t.grad for t in ours]), torch.cat([t.grad for t in ref])


def _attention_varlen(dtype):  # flash_attn_varlen_func's defaults: not causal, 1/sqrt(D)
    lens = [100, 37, 300]
    q, k, v = (randn(sum(lens), 8, 128, dtype=dtype) for _ in range(3))
    cu = torch.tensor([0, 100, 137, 437], dtype=torch.int32, device="cuda")
    ours = tileops.attention_varlen(q, k, v, cu, cu, max(lens), max(lens))
    parts = []
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        parts.append(F.scaled_dot_product_attention(
            *(t[s:e].transpose(0, 1)[None] for t in (q, k, v)))[0].transpose(0, 1))
    return ours, torch.cat(parts)


def _silu_and_mul(dtype):  # vLLM SiluAndMul.forward_native
    x = randn(64, 2 * 1000, dtype=dtype)
    return tileops.silu_and_mul(x), F.silu(x[..., :1000]) * x[..., 1000:]


def _gelu_and_mul(dtype):  # vLLM GeluAndMul: approximate="none", as F.gelu
    x = randn(64, 2 * 1000, dtype=dtype)
    return tileops.gelu_and_mul(x), F.gelu(x[..., :1000]) * x[..., 1000:]


def _swiglu(dtype):
    gate, up = randn(64, 1000, dtype=dtype), randn(64, 1000, dtype=dtype)
    return tileops.swiglu(gate, up), F.silu(gate) * up


def _geglu(dtype):  # approximate defaults to 'none', as F.gelu
    gate, up = randn(64, 1000, dtype=dtype), randn(64, 1000, dtype=dtype)
    return tileops.geglu(gate, up), F.gelu(gate) * up


def _gated_grad(ours_fn, ref_fn, *shapes):
    def case(dtype):
        inputs = [randn(*s, dtype=dtype) for s in shapes]
        ours = [t.clone().requires_grad_() for t in inputs]
        ref = [t.clone().requires_grad_() for t in inputs]
        out = ours_fn(*ours)
        dy = randn(*out.shape, dtype=dtype)
        out.backward(dy)
        ref_fn(*ref).backward(dy)
        return torch.cat([t.grad for t in ours], -1), torch.cat([t.grad for t in ref], -1)
    return case


def _hf_rotary(q, k, cos, sin):  # transformers' apply_rotary_pos_emb, unsqueeze_dim=1
    def rotate_half(x):
        return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _rotary_inputs(dtype):  # Llama: q/k [B, H, S, D], cos/sin [B, S, D]
    return (randn(2, 32, 100, 128, dtype=dtype), randn(2, 8, 100, 128, dtype=dtype),
            randn(2, 100, 128, dtype=dtype), randn(2, 100, 128, dtype=dtype))


def _apply_rotary(dtype):  # the reference on float32 copies, rounded once like ours
    q, k, cos, sin = _rotary_inputs(dtype)
    ref = _hf_rotary(*(t.float() for t in (q, k, cos, sin)))
    ours = tileops.apply_rotary(q, k, cos, sin)
    return (torch.cat([t.flatten() for t in ours]),
            torch.cat([t.flatten() for t in ref]).to(dtype))


def _apply_rotary_grad(dtype):
    q, k, cos, sin = _rotary_inputs(dtype)
    dq, dk = randn(*q.shape, dtype=dtype), randn(*k.shape, dtype=dtype)
    ours = [t.clone().requires_grad_() for t in (q, k)]
    ref = [t.float().requires_grad_() for t in (q, k)]
    torch.autograd.backward(tileops.apply_rotary(*ours, cos, sin), (dq, dk))
    torch.autograd.backward(_hf_rotary(*ref, cos.float(), sin.float()), (dq.float(), dk.float()))
    return (torch.cat([t.grad.flatten() for t in ours]),
            torch.cat([t.grad.flatten() for t in ref]).to(dtype))


def _apply_rotary_with_cache(dtype):  # vLLM's rotary_embedding, is_neox=True (in place)
    positions = torch.randint(0, 4096, (100,), device="cuda")
    q, k, cache = (randn(100, 32, 128, dtype=dtype), randn(100, 8, 128, dtype=dtype),
                   randn(4096, 128, dtype=dtype))
    cos, sin = cache.float()[positions].unsqueeze(1).chunk(2, dim=-1)
    ref = []
    for x in (q.float(), k.float()):
        x1, x2 = x.chunk(2, dim=-1)
        ref.append(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten())
    tileops.apply_rotary_with_cache(positions, q, k, cache)
    return torch.cat([q.flatten(), k.flatten()]), torch.cat(ref).to(dtype)


def _row_fn(ours, ref):
    def case(dtype):
        x = randn(64, 1000, dtype=dtype, std=3.0)
        return ours(x), ref(x, -1)
    return case


def _row_grad(ours, ref):
    def case(dtype):
        x = randn(64, 1000, dtype=dtype, std=3.0)
        leaf = x.clone().requires_grad_()
        out = ours(leaf)
        dy = randn(*out.shape, dtype=dtype)
        out.backward(dy)
        # The reference runs in fp32 (then rounds once): torch's bf16 logsumexp backward
        # reuses its bf16-rounded result, off by up to ~3% in exp(x - lse).
        ref_leaf = x.float().requires_grad_()
        ref(ref_leaf, -1).backward(dy.float())
        return leaf.grad, ref_leaf.grad.to(dtype)
    return case


def _cross_entropy(dtype):  # F.cross_entropy's defaults: mean, ignore_index -100, no smoothing
    x = randn(64, 1000, dtype=dtype, std=3.0)
    target = torch.randint(0, 1000, (64,), device="cuda")
    target[::5] = -100
    return tileops.cross_entropy(x, target), F.cross_entropy(x, target)


def _cross_entropy_grad(dtype):
    x = randn(64, 1000, dtype=dtype, std=3.0)
    target = torch.randint(0, 1000, (64,), device="cuda")
    target[::5] = -100
    leaf, ref_leaf = x.clone().requires_grad_(), x.clone().requires_grad_()
    tileops.cross_entropy(leaf, target).backward()
    F.cross_entropy(ref_leaf, target).backward()
    return leaf.grad, ref_leaf.grad


def _argmax(dtype):  # torch's default dim=None: the index into the flattened tensor
    x = randn(64, 1000, dtype=dtype)
    ours, ref = tileops.argmax(x), torch.argmax(x)
    assert ours.shape == ref.shape and torch.equal(ours, ref), (ours, ref)
    return x.flatten()[ours], x.flatten()[ref]


def _topk(dtype):  # k has no default; values sorted, indices point at them
    x = randn(64, 1000, dtype=dtype)
    (values, indices), ref = tileops.topk(x, 50), torch.topk(x, 50)
    assert torch.equal(x.gather(-1, indices), values)
    return values, ref.values


def _linear(dtype):  # F.linear's defaults: no bias
    x, w = randn(64, 512, dtype=dtype), randn(384, 512, dtype=dtype, std=512 ** -0.5)
    return tileops.linear(x, w), F.linear(x, w)


def _linear_grad(dtype):
    x, w = randn(64, 512, dtype=dtype), randn(384, 512, dtype=dtype, std=512 ** -0.5)
    ours, ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    dy = randn(64, 384, dtype=dtype)
    tileops.linear(ours, w).backward(dy)
    F.linear(ref, w).backward(dy)
    return ours.grad, ref.grad


def _linear_group(dtype):  # no biases: F.linear's default
    x = randn(8, 512, dtype=dtype)
    ws = [randn(n, 512, dtype=dtype, std=512 ** -0.5) for n in (384, 128)]
    return (torch.cat(tileops.linear_group(x, ws), -1),
            torch.cat([F.linear(x, w) for w in ws], -1))


def _adamw(dtype):
    """tileops.optim.AdamW(params) against torch.optim.AdamW(params), three steps of the same
    gradients. In float32 whatever `dtype` (defaults do not depend on it, and a 16-bit
    parameter's rounding would hide a weight decay of lr * 0.01): the parameters' change and
    the two moments, so lr, weight_decay and betas all show."""
    from tileops.optim import AdamW

    start = randn(1000, dtype=torch.float32)
    grads = [randn(1000, dtype=torch.float32) for _ in range(3)]
    results = []
    for make in (AdamW, torch.optim.AdamW):
        param = torch.nn.Parameter(start.clone())
        opt = make([param])
        for g in grads:
            param.grad = g.clone()
            opt.step()
        state = opt.state[param]
        results.append(torch.cat([param.detach() - start, state["exp_avg"],
                                  state["exp_avg_sq"]]))
    return tuple(results)


# op name -> a function of the dtype returning (ours, reference), both with defaults only
DEFAULT_CASES = {
    "RMSNormFwdOp": _rms_norm,
    "RMSNormBwdOp": _rms_norm_grad,
    "LayerNormFwdOp": _layer_norm,
    "LayerNormBwdOp": _layer_norm_grad,
    "GemmFwdOp": _gemm,
    "GroupedQueryAttentionFwdOp": _attention,
    "GroupedQueryAttentionBwdOp": _attention_grad,
    "GroupedQueryAttentionVarlenFwdOp": _attention_varlen,
    "SiluAndMulFwdOp": _silu_and_mul,
    "SiluAndMulBwdOp": _gated_grad(tileops.silu_and_mul,
                                   lambda x: F.silu(x[..., :1000]) * x[..., 1000:], (64, 2000)),
    "GeluAndMulFwdOp": _gelu_and_mul,
    "GeluAndMulBwdOp": _gated_grad(tileops.gelu_and_mul,
                                   lambda x: F.gelu(x[..., :1000]) * x[..., 1000:], (64, 2000)),
    "SwigluFwdOp": _swiglu,
    "SwigluBwdOp": _gated_grad(tileops.swiglu, lambda g, u: F.silu(g) * u, (64, 1000),
                               (64, 1000)),
    "GegluFwdOp": _geglu,
    "GegluBwdOp": _gated_grad(tileops.geglu, lambda g, u: F.gelu(g) * u, (64, 1000),
                              (64, 1000)),
    "RotaryFwdOp": _apply_rotary,
    "RotaryBwdOp": _apply_rotary_grad,
    "RotaryWithCacheFwdOp": _apply_rotary_with_cache,
    "ArgmaxFwdOp": _argmax,
    "TopkFwdOp": _topk,
    "SoftmaxFwdOp": _row_fn(tileops.softmax, torch.softmax),
    "SoftmaxBwdOp": _row_grad(tileops.softmax, torch.softmax),
    "LogSoftmaxFwdOp": _row_fn(tileops.log_softmax, torch.log_softmax),
    "LogSoftmaxBwdOp": _row_grad(tileops.log_softmax, torch.log_softmax),
    "LogsumexpFwdOp": _row_fn(tileops.logsumexp, torch.logsumexp),
    "LogsumexpBwdOp": _row_grad(tileops.logsumexp, torch.logsumexp),
    "CrossEntropyFwdOp": _cross_entropy,
    "CrossEntropyBwdOp": _cross_entropy_grad,
    "LinearFwdOp": _linear,
    "LinearBwdOp": _linear_grad,
    "LinearGroupFwdOp": _linear_group,
    "AdamwStepFwdOp": _adamw,
}


def test_every_op_with_a_reference_api_has_a_defaults_case():
    """Runs on the CPU: a new op that names a ref_api cannot skip this file."""
    missing = [name for name, entry in load_manifest().items()
               if entry["status"] == "implemented" and entry["ref_api"] != "none"
               and name not in DEFAULT_CASES]
    assert not missing, f"add a defaults case for {missing}"


@pytest.mark.gpu
@pytest.mark.smoke
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(DEFAULT_CASES))
def test_defaults_match_the_reference_api(name, dtype):
    ours, ref = DEFAULT_CASES[name](dtype)
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    assert_close(ours, ref.float(), what=name)
