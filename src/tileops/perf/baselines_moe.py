"""Baselines of the MoE ops: what a PyTorch user writes (the Hugging Face routers, a stable
argsort for the permutation, index ops for the combine), eager and under torch.compile.
Independent of TileOPs' code; `baselines.baselines_for` serves them."""

from __future__ import annotations

import functools
from typing import Any

import torch

Baseline = Any


def route_eager(logits, correction_bias=None, top_k=1, scoring="softmax", renormalize=True,
                n_group=None, topk_group=None, routed_scaling_factor=1.0):
    """Mixtral / Qwen3-MoE (softmax top-k) and DeepSeek-V3 (sigmoid, bias, groups)."""
    x = logits.float()
    scores = torch.softmax(x, dim=-1) if scoring == "softmax" else torch.sigmoid(x)
    choice = scores if correction_bias is None else scores + correction_bias
    if n_group is not None and n_group > 1:
        tokens, experts = choice.shape
        grouped = choice.view(tokens, n_group, experts // n_group)
        if correction_bias is None:
            group_scores = grouped.amax(dim=-1)
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        group_idx = group_scores.topk(topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        choice = choice.masked_fill(~keep.repeat_interleave(experts // n_group, dim=1),
                                    float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * routed_scaling_factor, ids.to(torch.int32)


def permute_eager(hidden_states, topk_ids, expert_map=None, num_experts=1):
    """A stable argsort of the slots by local expert, then one gather of the rows."""
    tokens, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1).long()
    local = flat if expert_map is None else expert_map.long()[flat]
    bucket = torch.where((local >= 0) & (local < num_experts), local, num_experts)
    order = torch.argsort(bucket, stable=True)
    counts = torch.bincount(bucket, minlength=num_experts + 1)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])[:num_experts + 1]
    row_of = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(),
                                                                     device=order.device))
    row_index = torch.where(bucket < num_experts, row_of, -1).view(tokens, top_k)
    source = torch.where(bucket[order] < num_experts, order, -1)
    permuted = hidden_states[order // top_k]
    return permuted, offsets.to(torch.int32), row_index.to(torch.int32), source.to(torch.int32)


def unpermute_eager(expert_output, topk_weights, row_index):
    """Gather each token's k rows, weight them in fp32, sum."""
    rows = row_index.long()
    picked = expert_output[rows.clamp(min=0)].float()
    weights = torch.where(rows >= 0, topk_weights, 0.0)
    return (picked * weights[..., None]).sum(dim=1).to(expert_output.dtype)


def grouped_mm(a, b, offsets):
    """torch._grouped_mm (CUTLASS grouped GEMM in torch >= 2.8) on the same layouts."""
    return torch._grouped_mm(a, b.transpose(-2, -1), offs=offsets)


def grouped_gemm_loop(a, b, offsets):
    """One cuBLAS GEMM per expert; reads the offsets on the host (a synchronization)."""
    out = torch.empty(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            torch.matmul(a[start:end], b[e].t(), out=out[start:end])
        start = end
    return out


@functools.cache
def _compiled(fn: Baseline) -> Baseline:
    return torch.compile(fn, dynamic=False)


_EAGER = {"MoeRouteFwdOp": route_eager, "MoePermuteFwdOp": permute_eager,
          "MoeUnpermuteFwdOp": unpermute_eager}


def moe_baselines(op_name: str) -> dict[str, Baseline] | None:
    """{name: fn(*inputs, **params)} for an MoE op, None for any other op."""
    if op_name == "GroupedGemmFwdOp":
        table = {"torch-loop": grouped_gemm_loop}
        if hasattr(torch, "_grouped_mm"):
            table = {"torch-grouped-mm": grouped_mm, **table}
        return table
    eager = _EAGER.get(op_name)
    if eager is None:
        return None
    return {"torch-eager": eager,
            "torch-compile": lambda *a, **k: _compiled(eager)(*a, **k)}
