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


def baselines_for(op_name: str) -> dict[str, Baseline]:
    """The baselines a benchmark of `op_name` times, best-known first."""
    libs = available_libraries()
    if op_name == "GemmFwdOp":
        return {"cublas": _cublas}
    if op_name == "RMSNormFwdOp":
        table = {"torch-eager": _rms_norm_eager, "torch-compile": _rms_norm_compiled}
        if libs["liger_kernel"]:
            table["liger"] = _rms_norm_liger
        return table
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
    return {}
