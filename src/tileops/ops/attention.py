"""Attention family: grouped-query attention forward, varlen forward and backward (BSHD)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..errors import TileOpsValueError, op_error
from ..kernels.attention import AttentionBwdKernel, AttentionFwdKernel, AttentionVarlenFwdKernel
from ..kernels.base import Kernel
from ..manifest.spec import DTYPE_NAMES
from ..perf.formulas import effective_window
from .base import Op
from .layout import tma_ready
from .varlen_backward import varlen_backward


class GroupedQueryAttentionFwdOp(Op):
    """softmax(q k^T * scale [+ mask]) v with H % Hkv == 0; returns (o, lse).

    is_causal and window_size=(left, right) (-1 = unbounded) align bottom-right when
    Sq != Skv; softcap > 0 applies Gemma-2 style tanh capping to the scaled logits.
    """

    kernel_map = {"attention_fwd": AttentionFwdKernel}

    def __init__(self, *, is_causal: bool = False, scale: float | None = None,
                 window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                 kernel_map: Mapping[str, type[Kernel]] | None = None, tune: bool = False):
        super().__init__(is_causal=is_causal, scale=scale, window_size=list(window_size),
                         softcap=float(softcap), kernel_map=kernel_map, tune=tune)

    def forward(self, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, seq_q, heads, head_dim = q.shape
        o = torch.empty((batch, seq_q, heads, v.shape[-1]), dtype=q.dtype, device=q.device)
        lse = torch.empty((batch, heads, seq_q), dtype=torch.float32, device=q.device)
        if o.numel() == 0:
            return o, lse
        if k.shape[1] == 0:  # no keys: every row attends to nothing
            return o.zero_(), lse.fill_(-math.inf)
        kernel = self.get_kernel("attention_fwd", q.device,
                                 **self._kernel_key(q.dtype, heads, k.shape[2], head_dim,
                                                    v.shape[-1]))
        scale = self.scale if self.scale is not None else head_dim ** -0.5
        # the key count picks the config bucket: it sets how long each CTA's key loop runs
        kernel(k.shape[1], tma_ready(q), tma_ready(k), tma_ready(v), o, lse, float(scale))
        return o, lse

    def _kernel_key(self, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                    head_dim_v: int | None = None) -> dict[str, Any]:
        left, right = effective_window(self.is_causal, self.window_size)
        key = {"dtype": DTYPE_NAMES[dtype], "heads": heads, "kv_heads": kv_heads,
               "head_dim": head_dim, "window_left": left, "window_right": right,
               "softcap": self.softcap}
        if head_dim_v is not None and head_dim_v != head_dim:  # only then: keys unchanged
            key["head_dim_v"] = head_dim_v
        return key

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        key = self._kernel_key(ns["q"].dtype, ns["H"], ns["Hkv"], ns["D"], ns.get("Dv"))
        return [("attention_fwd", key, ns["Skv"])]


class GroupedQueryAttentionBwdOp(GroupedQueryAttentionFwdOp):
    """dq, dk, dv of GroupedQueryAttentionFwdOp from do, q, k, v, o and its lse.

    With GQA, dk and dv sum over the query heads of each group.
    """

    kernel_map = {"attention_bwd": AttentionBwdKernel}

    def forward(self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, ...]:
        batch, seq_q, heads, head_dim = q.shape
        dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
        if q.numel() == 0 or k.numel() == 0:  # no pairs: every gradient is zero
            return dq.zero_(), dk.zero_(), dv.zero_()
        kernel = self.get_kernel("attention_bwd", q.device,
                                 **self._kernel_key(q.dtype, heads, k.shape[2], head_dim))
        scale = self.scale if self.scale is not None else head_dim ** -0.5
        kernel(seq_q, tma_ready(q), tma_ready(k), tma_ready(v), tma_ready(o), tma_ready(do),
               lse.contiguous(), dq, dk, dv, float(scale))
        return dq, dk, dv

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        key = self._kernel_key(ns["q"].dtype, ns["H"], ns["Hkv"], ns["D"])
        return [("attention_bwd", key, ns["Sq"])]


def _save_for_backward(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, *params = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.params = params
    ctx.mark_non_differentiable(lse)  # a statistic for the backward, not a model output


BACKWARD_HEAD_DIMS = (64, 96, 128, 192, 256)  # the backward kernel's (the manifest's shape rule)
# where `scale` sits among the params the autograd formulas get (the forward's, in order)
_SCALE_SLOT = [p.name for p in GroupedQueryAttentionFwdOp.spec.params].index("scale")


def _backward_at_kernel_width(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                              v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                              *params: Any) -> tuple:
    """GroupedQueryAttentionBwdOp's (dq, dk, dv), for head dims it lacks (DeepSeek-V3's q/k
    192 with v 128, Phi-2's 80) run at the narrowest width it takes (192, 96) on zero-padded
    q, k, v, o and dO, the scale pinned to the unpadded head dim's: zero columns change no
    score, no rowsum(dO * O) and no real column of a gradient. It costs the padded copies
    and the wider products."""
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    width = next((d for d in BACKWARD_HEAD_DIMS if d >= max(head_dim, head_dim_v)), None)
    if width is None or (head_dim, head_dim_v) == (width, width):
        return GroupedQueryAttentionBwdOp.torch_op(grad_o, q, k, v, o, lse, *params)
    params = list(params)
    if params[_SCALE_SLOT] is None:
        params[_SCALE_SLOT] = head_dim ** -0.5

    def padded(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[-1]))

    dq, dk, dv = GroupedQueryAttentionBwdOp.torch_op(
        padded(grad_o), padded(q), padded(k), padded(v), padded(o), lse, *params)
    return dq[..., :head_dim], dk[..., :head_dim], dv[..., :head_dim_v]


def _attention_backward(ctx: Any, grad_o: torch.Tensor, grad_lse: Any) -> tuple:
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = _backward_at_kernel_width(grad_o, q, k, v, o, lse, *ctx.params)
    return (dq, dk, dv) + (None,) * len(ctx.params)


GroupedQueryAttentionFwdOp.register_autograd(_attention_backward, setup_context=_save_for_backward)


class GroupedQueryAttentionVarlenFwdOp(GroupedQueryAttentionFwdOp):
    """Attention over packed sequences (flash_attn_varlen_func layout).

    q [Tq, H, D], k/v [Tkv, Hkv, D]; sequence b owns rows cu_seqlens[b]:cu_seqlens[b + 1].
    The cu_seqlens are checked (start at 0, non-decreasing, end at the row count, lengths
    within max_seqlen) with one small device-to-host read per call, skipped while a CUDA
    graph is being captured.
    """

    kernel_map = {"attention_varlen_fwd": AttentionVarlenFwdKernel}

    def __init__(self, *, max_seqlen_q: int, max_seqlen_kv: int, is_causal: bool = False,
                 scale: float | None = None, window_size: Sequence[int] = (-1, -1),
                 softcap: float = 0.0, kernel_map: Mapping[str, type[Kernel]] | None = None,
                 tune: bool = False):
        Op.__init__(self, max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv,
                    is_causal=is_causal, scale=scale, window_size=list(window_size),
                    softcap=float(softcap), kernel_map=kernel_map, tune=tune)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cu_seqlens_q: torch.Tensor,
                cu_seqlens_kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        total_q, heads, head_dim = q.shape
        o = torch.empty((total_q, heads, v.shape[-1]), dtype=q.dtype, device=q.device)
        lse = torch.empty((heads, total_q), dtype=torch.float32, device=q.device)
        if not torch.cuda.is_current_stream_capturing():
            self._check_seqlens(cu_seqlens_q, total_q, self.max_seqlen_q, "cu_seqlens_q")
            self._check_seqlens(cu_seqlens_kv, k.shape[0], self.max_seqlen_kv, "cu_seqlens_kv")
        if total_q == 0 or k.shape[0] == 0:
            return o.zero_(), lse.fill_(-math.inf)  # nothing visible, as the kernel would write
        kernel = self.get_kernel("attention_varlen_fwd", q.device,
                                 **self._kernel_key(q.dtype, heads, k.shape[1], head_dim,
                                                    v.shape[-1]))
        scale = self.scale if self.scale is not None else head_dim ** -0.5
        # the longest key sequence picks the config bucket, as the key count does when dense
        kernel(self.max_seqlen_kv, tma_ready(q), tma_ready(k), tma_ready(v),
               cu_seqlens_q.contiguous(), cu_seqlens_kv.contiguous(), o, lse,
               self.max_seqlen_q, float(scale))
        return o, lse

    def _check_seqlens(self, cu: torch.Tensor, total: int, max_len: int, arg: str) -> None:
        lengths = cu.diff()
        bad = torch.stack([cu[0] != 0, cu[-1] != total, (lengths < 0).any(),
                           (lengths > max_len).any()])
        problems = bad.tolist()  # the one host sync of a varlen call
        if any(problems):
            what = ["to start at 0", f"to end at the row count {total}",
                    "to be non-decreasing", f"no sequence longer than max_seqlen = {max_len}"]
            failed = [w for w, p in zip(what, problems, strict=True) if p]
            raise op_error(TileOpsValueError, self.spec.op_name, arg, " and ".join(failed),
                           cu.tolist())

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        key = self._kernel_key(ns["q"].dtype, ns["H"], ns["Hkv"], ns["D"], ns.get("Dv"))
        return [("attention_varlen_fwd", key, self.max_seqlen_kv)]


def _save_varlen_for_backward(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, *params = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, cu_seqlens_q, cu_seqlens_kv, o, lse)
    ctx.max_seqlens = (max_seqlen_q, max_seqlen_kv)
    ctx.params = params
    ctx.mark_non_differentiable(lse)


def _varlen_attention_backward(ctx: Any, grad_o: torch.Tensor, grad_lse: Any) -> tuple:
    q, k, v, cu_seqlens_q, cu_seqlens_kv, o, lse = ctx.saved_tensors
    dq, dk, dv = varlen_backward(grad_o, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_kv,
                                 *ctx.max_seqlens, ctx.params, _backward_at_kernel_width)
    return (dq, dk, dv) + (None,) * (4 + len(ctx.params))  # cu_seqlens, max_seqlens, params


GroupedQueryAttentionVarlenFwdOp.register_autograd(_varlen_attention_backward,
                                                   setup_context=_save_varlen_for_backward)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
              scale: float | None = None, window_size: Sequence[int] = (-1, -1),
              softcap: float = 0.0) -> torch.Tensor:
    """Attention over BSHD tensors (q [B, Sq, H, D], k [B, Skv, Hkv, D], v [B, Skv, Hkv,
    Dv]; Dv = D, or 128 with D = 192 as in DeepSeek-V3's prefill); returns o [B, Sq, H, Dv].
    The backward of head dims its kernel lacks (192/128, 80) runs zero-padded to one it has."""
    o, _ = GroupedQueryAttentionFwdOp.apply(q, k, v, is_causal=is_causal, scale=scale,
                                            window_size=list(window_size),
                                            softcap=float(softcap))
    return o


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, cu_seqlens_kv: torch.Tensor, max_seqlen_q: int,
                     max_seqlen_kv: int, is_causal: bool = False, scale: float | None = None,
                     window_size: Sequence[int] = (-1, -1), softcap: float = 0.0) -> torch.Tensor:
    """Attention over packed sequences q [Tq, H, D], k [Tkv, Hkv, D], v [Tkv, Hkv, Dv]
    (Dv as `attention`); returns o [Tq, H, Dv]."""
    o, _ = GroupedQueryAttentionVarlenFwdOp.apply(
        q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q=max_seqlen_q,
        max_seqlen_kv=max_seqlen_kv, is_causal=is_causal, scale=scale,
        window_size=list(window_size), softcap=float(softcap))
    return o
