"""Baselines: what a user would run instead of TileOPs, independent of TileOPs' code.

Each entry maps an op name to {baseline name: fn(*inputs, **params)}. External libraries are
added only when importable; which ones were present is part of every benchmark result.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .baselines_moe import moe_baselines

Baseline = Callable[..., Any]

EXTERNAL_LIBRARIES = ("flashinfer", "flash_attn", "liger_kernel", "quack")


def available_libraries() -> dict[str, bool]:
    return {name: importlib.util.find_spec(name) is not None for name in EXTERNAL_LIBRARIES}


def _cublas(a, b, trans_a=False, trans_b=True):
    return torch.matmul(a.t() if trans_a else a, b.t() if trans_b else b)


def _rms_norm_eager(x, w, normalized_shape, eps):
    return F.rms_norm(x, normalized_shape, w, eps)


@functools.cache
def _compiled(fn: Baseline) -> Baseline:
    return torch.compile(fn, dynamic=False)


def _rms_norm_compiled(x, w, normalized_shape, eps):
    return _compiled(_rms_norm_eager)(x, w, normalized_shape, eps)


def _rms_norm_liger(x, w, normalized_shape, eps):
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    if w is None:
        raise NotImplementedError("Liger's RMSNorm needs a weight")
    return LigerRMSNormFunction.apply(x, w, eps if eps is not None else 1e-6)


def _liger_function(module: str, name: str) -> Any:
    return getattr(importlib.import_module(f"liger_kernel.ops.{module}"), name)


def _graph_backward(forward: Baseline, grad_inputs: tuple[int, ...]) -> Baseline:
    """Times torch's backward alone: `forward(*inputs, **params)` is recorded once per input
    set, then each call differentiates it w.r.t. the inputs at `grad_inputs` (the positions
    of tensors; the first argument of the returned baseline is the output's gradient, or a
    tuple of them)."""
    graphs: dict[tuple, tuple] = {}

    def run(grads, *inputs, **params):
        key = tuple(t.data_ptr() for t in inputs if t is not None)
        if key not in graphs:
            leaves = [None if t is None else t.detach().requires_grad_(i in grad_inputs)
                      for i, t in enumerate(inputs)]
            out = forward(*leaves, **params)
            graphs[key] = (out, [leaves[i] for i in grad_inputs if leaves[i] is not None])
        out, leaves = graphs[key]
        return torch.autograd.grad(out, leaves, grads, retain_graph=True)

    return run


def _fused_add_rms_norm_eager(x, residual, w, eps=None):
    h = x + residual
    return F.rms_norm(h, [h.shape[-1]], w, eps), h


def _fused_add_rms_norm_liger(x, residual, w, eps=None):
    fn = _liger_function("fused_add_rms_norm", "LigerFusedAddRMSNormFunction")
    return fn.apply(x, residual, w, eps if eps is not None else 1e-6)


def _layer_norm_eager(x, w, b, normalized_shape, eps=1e-5):
    return F.layer_norm(x, normalized_shape, w, b, eps)


def _layer_norm_liger(x, w, b, normalized_shape, eps=1e-5):
    if w is None or b is None or len(normalized_shape) != 1:
        raise NotImplementedError("Liger's LayerNorm needs a weight, a bias and one dim")
    return _liger_function("layer_norm", "LigerLayerNormFunction").apply(x, w, b, eps)


def _norm_baselines(libs: dict[str, bool], eager: Baseline, liger: Baseline) -> dict:
    table = {"torch-eager": eager, "torch-compile": lambda *a, **k: _compiled(eager)(*a, **k)}
    if libs["liger_kernel"]:
        table["liger"] = liger
    return table


def _norm_backward_baselines(libs: dict[str, bool], eager: Baseline, liger: Baseline,
                             grad_inputs: tuple[int, ...], n_grads: int = 1) -> dict:
    """Backward baselines of a norm whose backward op takes (grad(s), *forward inputs)."""
    def split(fn):
        backward = _graph_backward(fn, grad_inputs)
        return lambda *a, **k: backward(tuple(a[:n_grads]) if n_grads > 1 else a[0],
                                        *a[n_grads:], **k)
    return {name: split(fn) for name, fn in _norm_baselines(libs, eager, liger).items()}


_window_masks: dict[tuple, torch.Tensor] = {}


def _window_mask(seq_q: int, seq_kv: int, left: int, right: int, device: Any) -> torch.Tensor:
    """Boolean [Sq, Skv] mask of the bottom-right aligned window (True = attend), cached."""
    key = (seq_q, seq_kv, left, right, str(device))
    if key not in _window_masks:
        rel = (torch.arange(seq_kv, device=device)[None, :]
               - torch.arange(seq_q, device=device)[:, None] - (seq_kv - seq_q))
        mask = torch.ones_like(rel, dtype=torch.bool)
        if left >= 0:
            mask &= rel >= -left
        if right >= 0:
            mask &= rel <= right
        _window_masks[key] = mask
    return _window_masks[key]


def _sdpa(backend: Any) -> Baseline:
    def run(q, k, v, is_causal=False, scale=None, window_size=(-1, -1), softcap=0.0):
        from torch.nn.attention import sdpa_kernel

        from .formulas import effective_window

        if softcap:
            raise NotImplementedError("SDPA has no logit softcap")
        left, right = effective_window(is_causal, window_size)
        seq_q, seq_kv = q.shape[1], k.shape[1]
        # SDPA's is_causal aligns top-left; only Sq == Skv matches our bottom-right causal.
        causal = (left, right) == (-1, 0) and seq_q == seq_kv
        mask = None if causal or (left, right) == (-1, -1) else _window_mask(
            seq_q, seq_kv, left, right, q.device)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                is_causal=causal, scale=scale, enable_gqa=True).transpose(1, 2)

    return run


def _flash_attn(q, k, v, is_causal=False, scale=None, window_size=(-1, -1), softcap=0.0):
    from flash_attn import flash_attn_func

    return flash_attn_func(q, k, v, softmax_scale=scale, causal=is_causal,
                           window_size=tuple(window_size), softcap=softcap)


def _sdpa_backward(backend: Any) -> Baseline:
    """Times SDPA's backward alone: the forward graph is built once per input set."""
    forward = _sdpa(backend)
    graphs: dict[tuple, tuple] = {}

    def run(do, q, k, v, o, lse, **params):
        key = (q.data_ptr(), k.data_ptr(), v.data_ptr())
        if key not in graphs:
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            graphs[key] = (forward(*leaves, **params), leaves)
        out, leaves = graphs[key]
        return torch.autograd.grad(out, leaves, do, retain_graph=True)

    return run


def _flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
                       is_causal=False, scale=None, window_size=(-1, -1), softcap=0.0):
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q,
                                  max_seqlen_kv, softmax_scale=scale, causal=is_causal,
                                  window_size=tuple(window_size), softcap=softcap)


def _attention_baselines(libs: dict[str, bool]) -> dict[str, Baseline]:
    from torch.nn.attention import SDPBackend

    table = {f"sdpa-{name}": _sdpa(backend) for name, backend in (
        ("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION))}
    if libs["flash_attn"]:
        table["flash-attn"] = _flash_attn
    return table


def _silu_and_mul_eager(x):
    n = x.shape[-1] // 2
    return F.silu(x[..., :n]) * x[..., n:]


def _gelu_and_mul_eager(x, approximate="none"):
    n = x.shape[-1] // 2
    return F.gelu(x[..., :n], approximate=approximate) * x[..., n:]


def _swiglu_eager(gate, up):
    return F.silu(gate) * up


def _geglu_eager(gate, up, approximate="none"):
    return F.gelu(gate, approximate=approximate) * up


# Liger takes gate and up as two tensors (it copies the halves of a fused x contiguous);
# its GEGLU is the tanh approximation only.
def _silu_and_mul_liger(x):
    a, b = x.chunk(2, -1)  # Liger takes two tensors; it copies these halves contiguous
    return _liger_function("swiglu", "LigerSiLUMulFunction").apply(a, b)


def _gelu_and_mul_liger(x, approximate="none"):
    if approximate != "tanh":
        raise NotImplementedError("Liger's GEGLU has only the tanh approximation")
    a, b = x.chunk(2, -1)
    return _liger_function("geglu", "LigerGELUMulFunction").apply(a, b)


def _swiglu_liger(gate, up):
    return _liger_function("swiglu", "LigerSiLUMulFunction").apply(gate, up)


def _geglu_liger(gate, up, approximate="none"):
    if approximate != "tanh":
        raise NotImplementedError("Liger's GEGLU has only the tanh approximation")
    return _liger_function("geglu", "LigerGELUMulFunction").apply(gate, up)


def _silu_and_mul_flashinfer(x):
    from flashinfer.activation import silu_and_mul

    return silu_and_mul(x)


def _gelu_and_mul_flashinfer(x, approximate="none"):
    from flashinfer.activation import gelu_and_mul, gelu_tanh_and_mul

    return (gelu_tanh_and_mul if approximate == "tanh" else gelu_and_mul)(x)


_GATED_ACTIVATIONS = {  # forward op name -> (eager, liger, flashinfer or None)
    "SiluAndMul": (_silu_and_mul_eager, _silu_and_mul_liger, _silu_and_mul_flashinfer),
    "GeluAndMul": (_gelu_and_mul_eager, _gelu_and_mul_liger, _gelu_and_mul_flashinfer),
    "Swiglu": (_swiglu_eager, _swiglu_liger, None),
    "Geglu": (_geglu_eager, _geglu_liger, None),
}


def _gated_activation_baselines(op_name: str, libs: dict[str, bool]) -> dict[str, Baseline]:
    """torch eager, torch.compile, Liger and FlashInfer (when importable) for the gated
    activations; a backward op's baselines time autograd's backward of the forward's."""
    stem, direction = op_name[:-5], op_name[-5:-2]
    eager, liger, flashinfer = _GATED_ACTIVATIONS[stem]
    table = {"torch-eager": eager, "torch-compile": lambda *a, **k: _compiled(eager)(*a, **k)}
    if libs["liger_kernel"]:
        table["liger"] = liger
    if direction == "Fwd":
        if flashinfer is not None and libs["flashinfer"]:
            table["flashinfer"] = flashinfer
        return table
    if "liger" in table:  # its backward overwrites the saved inputs: give it copies
        table["liger"] = lambda *a, **k: liger(*(t.clone() for t in a), **k)
    # backward op: (grad_out, *inputs); the two-tensor forms differentiate gate and up
    grad_inputs = (0, 1) if stem in ("Swiglu", "Geglu") else (0,)
    return {name: _graph_backward(fn, grad_inputs) for name, fn in table.items()}


# -- rotary embeddings: the reference formulas, written here independently of TileOPs -------
def _rotate_pairs(x, interleaved):
    """rotate_half (NeoX) or rotate_every_two (GPT-J) over the last dim."""
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotary_eager(q, k, cos, sin, unsqueeze_dim=1, interleaved=False):
    """transformers' apply_rotary_pos_emb, with partial rotary as GPT-NeoX's (the first
    cos.shape[-1] elements rotate) and [S, R] tables broadcast over the batch."""
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    rot = cos.shape[-1]

    def apply(x):
        x_rot = x[..., :rot]
        y = x_rot * cos + _rotate_pairs(x_rot, interleaved) * sin
        return torch.cat((y, x[..., rot:]), dim=-1) if rot < x.shape[-1] else y

    return apply(q), apply(k)


def _rotary_compiled(q, k, cos, sin, unsqueeze_dim=1, interleaved=False):
    return _compiled(_rotary_eager)(q, k, cos, sin, unsqueeze_dim, interleaved)


def _rotary_liger(q, k, cos, sin, unsqueeze_dim=1, interleaved=False):
    from liger_kernel.ops.rope import LigerRopeFunction

    if interleaved or cos.shape[-1] != q.shape[-1]:
        raise NotImplementedError("Liger's RoPE is NeoX-style over the whole head only")
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    if unsqueeze_dim == 2:  # Liger takes [B, H, S, D] views
        q_out, k_out = LigerRopeFunction.apply(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return q_out.transpose(1, 2), k_out.transpose(1, 2)
    return LigerRopeFunction.apply(q, k, cos, sin)


def _rotary_backward(forward):
    """The backward of `forward` alone: its graph is recorded once per input set, then each
    call differentiates it with (dq_out, dk_out)."""
    graphs: dict[tuple, tuple] = {}

    def run(dq_out, dk_out, cos, sin, unsqueeze_dim=1, interleaved=False):
        key = (dq_out.data_ptr(), dk_out.data_ptr(), cos.data_ptr(), sin.data_ptr())
        if key not in graphs:
            leaves = (torch.randn_like(dq_out).requires_grad_(),
                      torch.randn_like(dk_out).requires_grad_())
            graphs[key] = (forward(*leaves, cos, sin, unsqueeze_dim, interleaved), leaves)
        outs, leaves = graphs[key]
        return torch.autograd.grad(outs, leaves, (dq_out, dk_out), retain_graph=True)

    return run


def _rotary_liger_backward(dq_out, dk_out, cos, sin, unsqueeze_dim=1, interleaved=False):
    from liger_kernel.ops.rope import rope_backward

    if interleaved or cos.shape[-1] != dq_out.shape[-1]:
        raise NotImplementedError("Liger's RoPE is NeoX-style over the whole head only")
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    if unsqueeze_dim == 2:
        dq, dk = rope_backward(dq_out.transpose(1, 2), dk_out.transpose(1, 2), cos, sin)
        return dq.transpose(1, 2), dk.transpose(1, 2)
    return rope_backward(dq_out, dk_out, cos, sin)


def _rotary_cache_eager(positions, q, k, cos_sin_cache, interleaved=False):
    """vLLM's RotaryEmbedding.forward_native: rows of [cos | sin] picked by position."""
    cos, sin = cos_sin_cache[positions].unsqueeze(-2).chunk(2, dim=-1)
    rot = cos_sin_cache.shape[-1]

    def apply(x):
        x_rot = x[..., :rot]
        if interleaved:
            x1, x2 = x_rot[..., ::2], x_rot[..., 1::2]
            y = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        else:
            x1, x2 = x_rot.chunk(2, dim=-1)
            y = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return torch.cat((y.to(x.dtype), x[..., rot:]), dim=-1)

    return apply(q), apply(k)


def _rotary_cache_compiled(positions, q, k, cos_sin_cache, interleaved=False):
    return _compiled(_rotary_cache_eager)(positions, q, k, cos_sin_cache, interleaved)


_flashinfer_inputs: dict[tuple, torch.Tensor] = {}


def _rotary_cache_flashinfer(positions, q, k, cos_sin_cache, interleaved=False):
    from flashinfer.rope import apply_rope_with_cos_sin_cache_inplace

    key = (cos_sin_cache.data_ptr(), cos_sin_cache.shape, cos_sin_cache.dtype)
    if key not in _flashinfer_inputs:  # FlashInfer takes a float32 table: converted once
        _flashinfer_inputs[key] = cos_sin_cache.float()
    # FlashInfer does not bound-check positions; the benchmark's random ones may be negative
    # (torch's indexing wraps them): wrapped once per input set, outside the timed calls
    pos_key = (positions.data_ptr(), positions.shape, cos_sin_cache.shape[0])
    if pos_key not in _flashinfer_inputs:
        _flashinfer_inputs[pos_key] = positions.remainder(cos_sin_cache.shape[0])
    tokens, heads, head_dim = q.shape
    apply_rope_with_cos_sin_cache_inplace(
        _flashinfer_inputs[pos_key], q.view(tokens, heads * head_dim), k.view(tokens, -1),
        head_dim, _flashinfer_inputs[key], is_neox=not interleaved)
    return q, k


def _rotary_baselines(op_name: str, libs: dict[str, bool]) -> dict[str, Baseline]:
    if op_name == "RotaryFwdOp":
        table = {"torch-eager": _rotary_eager, "torch-compile": _rotary_compiled}
        if libs["liger_kernel"]:
            table["liger"] = _rotary_liger
        return table
    if op_name == "RotaryBwdOp":  # torch autograd of the forward formula
        table = {"torch-eager": _rotary_backward(_rotary_eager),
                 "torch-compile": _rotary_backward(_rotary_compiled)}
        if libs["liger_kernel"]:
            table["liger"] = _rotary_liger_backward
        return table
    table = {"torch-eager": _rotary_cache_eager, "torch-compile": _rotary_cache_compiled}
    if libs["flashinfer"]:
        table["flashinfer"] = _rotary_cache_flashinfer
    return table


# -- softmax family and cross-entropy -------------------------------------------------------
def _softmax_eager(x, dim=-1):
    return torch.softmax(x, dim)


def _log_softmax_eager(x, dim=-1):
    return torch.log_softmax(x, dim)


def _logsumexp_eager(x, dim=-1, keepdim=False):
    return torch.logsumexp(x, dim, keepdim)


def _softmax_liger(x, dim=-1):
    if dim not in (-1, x.dim() - 1):
        raise NotImplementedError("Liger's softmax is over the last dim")
    return _liger_function("softmax", "LigerSoftmaxFunction").apply(x)


def _softmax_backward_eager(grad_output, output, dim=-1):  # what autograd runs
    return torch._softmax_backward_data(grad_output, output, dim, output.dtype)


def _log_softmax_backward_eager(grad_output, output, dim=-1):
    return torch._log_softmax_backward_data(grad_output, output, dim, output.dtype)


def _logsumexp_backward_eager(grad_output, input, output, dim=-1, keepdim=False):
    if not keepdim:  # autograd's logsumexp_backward
        grad_output, output = grad_output.unsqueeze(-1), output.unsqueeze(-1)
    return grad_output * (input - output).exp()


def _softmax_family_baselines(op_name: str, libs: dict[str, bool]) -> dict[str, Baseline]:
    eager = {"SoftmaxFwdOp": _softmax_eager, "LogSoftmaxFwdOp": _log_softmax_eager,
             "LogsumexpFwdOp": _logsumexp_eager, "SoftmaxBwdOp": _softmax_backward_eager,
             "LogSoftmaxBwdOp": _log_softmax_backward_eager,
             "LogsumexpBwdOp": _logsumexp_backward_eager}[op_name]
    table = {"torch-eager": eager,
             "torch-compile": lambda *a, **k: _compiled(eager)(*a, **k)}
    if libs["liger_kernel"] and op_name == "SoftmaxFwdOp":
        table["liger"] = _softmax_liger
    return table


def _cross_entropy_rows(x, target, ignore_index=-100, label_smoothing=0.0, softcap=None,
                        lse_square_scale=0.0):
    """Per-row loss as torch computes it (fp32 math), plus the z-loss and the soft-capping
    torch has no argument for."""
    z = x.float()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    loss = F.cross_entropy(z, target, ignore_index=ignore_index, reduction="none",
                           label_smoothing=label_smoothing)
    if lse_square_scale:
        lse = torch.logsumexp(z, -1)
        loss = loss + lse_square_scale * lse.square() * (target != ignore_index)
    return loss


def _cross_entropy_eager(x, target, ignore_index=-100, label_smoothing=0.0, softcap=None,
                         lse_square_scale=0.0):
    if softcap is None and not lse_square_scale:  # torch's own kernels, on the input dtype
        return F.cross_entropy(x, target, ignore_index=ignore_index, reduction="none",
                               label_smoothing=label_smoothing)
    return _cross_entropy_rows(x, target, ignore_index, label_smoothing, softcap,
                               lse_square_scale)


def _cross_entropy_liger(x, target, ignore_index=-100, label_smoothing=0.0, softcap=None,
                         lse_square_scale=0.0):
    """Liger's loss pass; when x requires grad it also writes the gradient over x (its
    forward is the loss-and-gradient pass)."""
    fn = _liger_function("cross_entropy", "LigerCrossEntropyFunction")
    return fn.apply(x, target, None, ignore_index, lse_square_scale, label_smoothing,
                    "sum", softcap)


def _with_grad(loss_fn: Baseline) -> Baseline:
    """The loss and the gradient of its sum w.r.t. the logits, as one call."""
    def run(x, target, **params):
        leaf = x.detach().requires_grad_()
        loss = loss_fn(leaf, target, **params)
        grad, = torch.autograd.grad(loss.sum(), leaf)
        return loss, grad
    return run


def _liger_with_grad(x, target, **params):
    # Liger computes the gradient inside its forward when the input requires grad
    return _cross_entropy_liger(x.detach().requires_grad_(), target, **params)


def _cross_entropy_baselines(op_name: str, libs: dict[str, bool]) -> dict[str, Baseline]:
    compiled = lambda *a, **k: _compiled(_cross_entropy_eager)(*a, **k)  # noqa: E731
    if op_name == "CrossEntropyFwdOp":
        table = {"torch-eager": _cross_entropy_eager, "torch-compile": compiled}
        if libs["liger_kernel"]:
            table["liger"] = _cross_entropy_liger
        return table
    if op_name == "CrossEntropyWithGradFwdOp":
        table = {"torch-eager": _with_grad(_cross_entropy_eager),
                 "torch-compile": _with_grad(compiled)}
        if libs["liger_kernel"]:
            table["liger"] = _liger_with_grad
        return table
    # CrossEntropyBwdOp (grad_loss, input, target, lse): torch's backward of the summed loss
    def backward_of(loss_fn: Baseline) -> Baseline:
        backward = _graph_backward(lambda x, target, **p: loss_fn(x, target, **p).sum(), (0,))
        return lambda grad_loss, x, target, lse, **params: backward(grad_loss[0], x, target,
                                                                    **params)
    return {"torch-eager": backward_of(_cross_entropy_eager),
            "torch-compile": backward_of(compiled)}

# -- selection: torch's own argmax / topk, eager and compiled ----------------------------------
def _argmax_eager(x, dim=None, keepdim=False):
    return torch.argmax(x, dim=dim, keepdim=keepdim)


def _topk_eager(x, k, dim=-1, largest=True, sorted=True):
    return torch.topk(x, k, dim=dim, largest=largest, sorted=sorted)


def _selection_baselines(eager: Baseline) -> dict[str, Baseline]:
    return {"torch-eager": eager, "torch-compile": lambda *a, **k: _compiled(eager)(*a, **k)}


def _linear_cross_entropy_eager(hidden, weight, target, bias=None, ignore_index=-100,
                                label_smoothing=0.0, softcap=None, lse_square_scale=0.0,
                                reduction="mean", with_grad=True):
    """What a user writes: the full logits, the loss, and (with_grad) autograd's backward."""
    leaves = [t.detach().requires_grad_(with_grad) if t is not None else None
              for t in (hidden, weight, bias)]
    logits = F.linear(leaves[0], leaves[1], leaves[2])
    rows = _cross_entropy_eager(logits, target, ignore_index, label_smoothing, softcap,
                                lse_square_scale)
    loss = rows.sum() / (target != ignore_index).sum() if reduction == "mean" else rows.sum()
    if with_grad:
        return loss, torch.autograd.grad(loss, [t for t in leaves if t is not None])
    return loss


def _linear_cross_entropy_liger(hidden, weight, target, bias=None, ignore_index=-100,
                                label_smoothing=0.0, softcap=None, lse_square_scale=0.0,
                                reduction="mean", with_grad=True):
    """Liger's fused linear cross-entropy: its forward computes the gradients too."""
    fn = _liger_function("fused_linear_cross_entropy", "LigerFusedLinearCrossEntropyFunction")
    leaves = [t.detach().requires_grad_(with_grad) if t is not None else None
              for t in (hidden, weight, bias)]
    return fn.apply(leaves[0], leaves[1], target, leaves[2], None, ignore_index,
                    lse_square_scale, label_smoothing, reduction, softcap)


def _linear_cross_entropy_baselines(libs: dict[str, bool]) -> dict[str, Baseline]:
    table = {"torch-eager": _linear_cross_entropy_eager,
             "torch-compile": lambda *a, **k: _compiled(_linear_cross_entropy_eager)(*a, **k)}
    if libs["liger_kernel"]:
        table["liger"] = _linear_cross_entropy_liger
    return table


def _linear_group_baselines() -> dict[str, Baseline]:
    """F.linear a weight (what a Hugging Face layer runs), and one F.linear on the weights
    concatenated beforehand (a serving engine's fused q/k/v and gate/up layers), split into
    views; the concatenation is made once a weight set, outside the timed calls after it."""
    fused: dict[tuple, tuple] = {}

    def per_weight(x, *weights_and_biases):
        weights, biases = weights_and_biases[:3], weights_and_biases[3:]
        return tuple(F.linear(x, w, b) for w, b in zip(weights, biases, strict=True)
                     if w is not None)

    def concatenated(x, *weights_and_biases):
        weights = [w for w in weights_and_biases[:3] if w is not None]
        biases = weights_and_biases[3:3 + len(weights)]
        key = tuple(t.data_ptr() for t in weights)
        if key not in fused:
            fused[key] = (torch.cat(weights), None if biases[0] is None else torch.cat(biases))
        w, b = fused[key]
        return F.linear(x, w, b).split([t.shape[0] for t in weights], -1)

    return {"cublas-concatenated": concatenated, "cublas-per-weight": per_weight}


def _adamw_baselines() -> dict[str, Baseline]:
    """torch.optim.AdamW's fused and foreach updates, as users step them: an optimizer over
    the one tensor, made once per tensor with the given moments as its state (the step
    count then advances by one a call, as in training)."""
    optimizers: dict[tuple, Any] = {}

    def make(kind: str) -> Baseline:
        def step(param, grad, exp_avg, exp_avg_sq, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                 weight_decay=1e-2, step=1, maximize=False):
            key = (kind, param.data_ptr(), lr, beta1, beta2, eps, weight_decay, maximize)
            opt = optimizers.get(key)
            if opt is None:
                opt = optimizers[key] = torch.optim.AdamW(
                    [param], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay,
                    maximize=maximize, **{kind: True})
                count = torch.tensor(float(step - 1),
                                     device=param.device if kind == "fused" else "cpu")
                opt.state[param] = {"step": count, "exp_avg": exp_avg,
                                    "exp_avg_sq": exp_avg_sq}
            param.grad = grad
            opt.step()
            return param, exp_avg, exp_avg_sq
        return step

    return {"torch-fused": make("fused"), "torch-foreach": make("foreach")}


def select_baselines(op_name: str, names: list[str] | None) -> dict[str, Baseline]:
    """`baselines_for(op_name)`, or only those of them in `names` (None: all); ValueError
    naming the op's baselines where a name is not one of them."""
    baselines = baselines_for(op_name)
    if names is None:
        return baselines
    unknown = set(names) - set(baselines)
    if unknown:
        raise ValueError(f"baselines {sorted(unknown)}: {op_name}'s baselines are "
                         f"{sorted(baselines)}")
    return {name: fn for name, fn in baselines.items() if name in names}


def baselines_for(op_name: str) -> dict[str, Baseline]:
    """The baselines a benchmark of `op_name` times, best-known first."""
    libs = available_libraries()
    moe = moe_baselines(op_name)
    if moe is not None:
        return moe
    if op_name == "GemmFwdOp":
        return {"cublas": _cublas}
    if op_name == "LinearFwdOp":  # F.linear: cuBLAS with the bias in its epilogue
        return {"cublas": F.linear}
    if op_name == "LinearGroupFwdOp":
        return _linear_group_baselines()
    if op_name == "AdamwStepFwdOp":
        return _adamw_baselines()
    if op_name == "LinearBwdOp":  # (grad_output, input, weight): autograd's cuBLAS GEMMs
        plain, biased = _graph_backward(F.linear, (0, 1)), _graph_backward(F.linear, (0, 1, 2))
        biases: dict[int, torch.Tensor] = {}  # one bias per weight: the graphs stay cached

        def linear_backward(grad_output, x, w, has_bias=False):
            if not has_bias:
                return plain(grad_output, x, w)
            b = biases.get(w.data_ptr())
            if b is None:  # made once, outside the timed calls that follow
                b = biases[w.data_ptr()] = torch.zeros(w.shape[0], dtype=w.dtype,
                                                       device=w.device)
            return biased(grad_output, x, w, b)
        return {"cublas": linear_backward}
    if op_name == "RMSNormFwdOp":
        table = {"torch-eager": _rms_norm_eager, "torch-compile": _rms_norm_compiled}
        if libs["liger_kernel"]:
            table["liger"] = _rms_norm_liger
        return table
    if op_name == "RMSNormBwdOp":  # (grad_output, input, weight)
        return _norm_backward_baselines(libs, _rms_norm_eager, _rms_norm_liger, (0, 1))
    if op_name == "FusedAddRMSNormFwdOp":
        return _norm_baselines(libs, _fused_add_rms_norm_eager, _fused_add_rms_norm_liger)
    if op_name == "FusedAddRMSNormBwdOp":  # (grad_output, grad_residual_out, residual_out, w)
        # torch's graph of the unfused pair, from x = residual_out and a zero residual
        def eager(h, w, eps=None):
            return _fused_add_rms_norm_eager(h, torch.zeros_like(h), w, eps)

        def liger(h, w, eps=None):
            return _fused_add_rms_norm_liger(h, torch.zeros_like(h), w, eps)

        return _norm_backward_baselines(libs, eager, liger, (0, 1), n_grads=2)
    if op_name == "LayerNormFwdOp":
        return _norm_baselines(libs, _layer_norm_eager, _layer_norm_liger)
    if op_name == "LayerNormBwdOp":  # (grad_output, input, weight, bias)
        return _norm_backward_baselines(libs, _layer_norm_eager, _layer_norm_liger, (0, 1, 2))
    if op_name == "GroupedQueryAttentionFwdOp":
        return _attention_baselines(libs)
    if op_name == "GroupedQueryAttentionBwdOp":
        from torch.nn.attention import SDPBackend

        return {f"sdpa-{name}": _sdpa_backward(backend) for name, backend in (
            ("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
            ("efficient", SDPBackend.EFFICIENT_ATTENTION))}
    if op_name == "GroupedQueryAttentionVarlenFwdOp":
        # SDPA has no packed-sequence form; compare with the dense op's TFLOP/s as well.
        return {"flash-attn-varlen": _flash_attn_varlen} if libs["flash_attn"] else {}
    if op_name[:-5] in _GATED_ACTIVATIONS:
        return _gated_activation_baselines(op_name, libs)
    if op_name in ("RotaryFwdOp", "RotaryBwdOp", "RotaryWithCacheFwdOp"):
        return _rotary_baselines(op_name, libs)
    if op_name == "ArgmaxFwdOp":
        return _selection_baselines(_argmax_eager)
    if op_name == "TopkFwdOp":
        return _selection_baselines(_topk_eager)
    if op_name in ("SoftmaxFwdOp", "SoftmaxBwdOp", "LogSoftmaxFwdOp", "LogSoftmaxBwdOp",
                   "LogsumexpFwdOp", "LogsumexpBwdOp"):
        return _softmax_family_baselines(op_name, libs)
    if op_name in ("CrossEntropyFwdOp", "CrossEntropyWithGradFwdOp", "CrossEntropyBwdOp"):
        return _cross_entropy_baselines(op_name, libs)
    if op_name == "FusedLinearCrossEntropyFwdOp":
        return _linear_cross_entropy_baselines(libs)
    if op_name in ("QuantizeFp8FwdOp", "GemmFp8FwdOp", "GroupedGemmFp8FwdOp"):
        from .fp8_baselines import fp8_baselines

        return fp8_baselines(op_name)
    if op_name in ("DecodeAttentionFwdOp", "ChunkedPrefillAttentionFwdOp",
                   "KVCacheAppendFwdOp", "DecodeAttentionFp8FwdOp",
                   "ChunkedPrefillAttentionFp8FwdOp", "KVCacheAppendFp8FwdOp",
                   "MLADecodeFwdOp"):
        from . import serving_baselines

        return {"DecodeAttentionFwdOp": serving_baselines.decode_attention_baselines,
                "ChunkedPrefillAttentionFwdOp": serving_baselines.chunked_prefill_baselines,
                "KVCacheAppendFwdOp": serving_baselines.kv_cache_append_baselines,
                "DecodeAttentionFp8FwdOp": serving_baselines.decode_attention_fp8_baselines,
                "ChunkedPrefillAttentionFp8FwdOp":
                    serving_baselines.chunked_prefill_fp8_baselines,
                "KVCacheAppendFp8FwdOp": serving_baselines.kv_cache_append_fp8_baselines,
                "MLADecodeFwdOp": serving_baselines.mla_decode_baselines,
                }[op_name](libs)
    return {}
