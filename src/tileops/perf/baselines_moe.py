"""Baselines of the MoE ops: what a PyTorch user writes (the Hugging Face routers, a stable
argsort for the permutation, index ops for the combine, torch._grouped_mm or a per-expert
cuBLAS loop for the expert GEMMs, and the whole layer from those), eager and under
torch.compile.
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


def grouped_mm_backward(grad_output, a, b, offsets):
    """(grad_a, grad_b) by torch._grouped_mm, as its autograd formula computes them."""
    return (torch._grouped_mm(grad_output, b, offs=offsets),
            torch._grouped_mm(grad_output.t(), a, offs=offsets))


def grouped_gemm_backward_loop(grad_output, a, b, offsets):
    """Two cuBLAS GEMMs per expert; reads the offsets on the host (a synchronization)."""
    grad_a = torch.zeros_like(a)
    grad_b = torch.zeros_like(b)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            torch.matmul(grad_output[start:end], b[e], out=grad_a[start:end])
            torch.matmul(grad_output[start:end].t(), a[start:end], out=grad_b[e])
        start = end
    return grad_a, grad_b


def grouped_mm_silu_and_mul(a, w_gate_up, offsets):
    """torch._grouped_mm, then silu(gate) * up on the [M, 2F] product."""
    gate, up = torch._grouped_mm(a, w_gate_up.transpose(-2, -1), offs=offsets).chunk(2, -1)
    return torch.nn.functional.silu(gate) * up


def grouped_loop_silu_and_mul(a, w_gate_up, offsets):
    gate, up = grouped_gemm_loop(a, w_gate_up, offsets).chunk(2, -1)
    return torch.nn.functional.silu(gate) * up


def unpermute_backward_eager(grad_output, expert_output, topk_weights, row_index,
                             grad_weights=True):
    """Index ops: each slot's weighted gradient row put at its row; the weights' gradient
    as dot products of the gathered rows."""
    valid = row_index >= 0
    rows = row_index.long().clamp(min=0)
    w = torch.where(valid, topk_weights, 0.0)
    grad_rows = torch.zeros_like(expert_output)
    scaled = (grad_output.float()[:, None, :] * w[..., None]).to(grad_output.dtype)
    grad_rows.index_put_((rows.flatten(),), scaled.flatten(0, 1), accumulate=True)
    grad_w = torch.zeros_like(topk_weights)
    if grad_weights:
        dots = (expert_output[rows].float() * grad_output.float()[:, None, :]).sum(-1)
        grad_w = torch.where(valid, dots, 0.0)
    return grad_rows, grad_w


def fused_moe_torch(hidden_states, w_gate_up, w_down, router_logits=None, topk_weights=None,
                    topk_ids=None, correction_bias=None, top_k=None, scoring="softmax",
                    renormalize=True, n_group=None, topk_group=None,
                    routed_scaling_factor=1.0, grouped=None):
    """The layer in pure PyTorch: the routers' code, a stable argsort permutation,
    torch._grouped_mm (or a per-expert loop) for both projections, index ops to combine."""
    n_experts = w_gate_up.shape[0]
    if router_logits is not None:
        topk_weights, topk_ids = route_eager(router_logits, correction_bias, top_k, scoring,
                                             renormalize, n_group, topk_group,
                                             routed_scaling_factor)
    permuted, offsets, row_index, _ = permute_eager(hidden_states, topk_ids,
                                                    num_experts=n_experts)
    mm = grouped or (grouped_mm if hasattr(torch, "_grouped_mm") else grouped_gemm_loop)
    gate, up = mm(permuted, w_gate_up, offsets[1:]).chunk(2, -1)
    y = mm(torch.nn.functional.silu(gate) * up, w_down, offsets[1:])
    return unpermute_eager(y, topk_weights, row_index)


def fused_moe_loop(*inputs, **params):
    return fused_moe_torch(*inputs, grouped=grouped_gemm_loop, **params)


@functools.cache
def _compiled(fn: Baseline) -> Baseline:
    return torch.compile(fn, dynamic=False)


_GROUPED = {  # op -> (torch._grouped_mm form, per-expert loop)
    "GroupedGemmFwdOp": (grouped_mm, grouped_gemm_loop),
    "GroupedGemmBwdOp": (grouped_mm_backward, grouped_gemm_backward_loop),
    "GroupedGemmSiluAndMulFwdOp": (grouped_mm_silu_and_mul, grouped_loop_silu_and_mul),
}
_EAGER = {"MoeRouteFwdOp": route_eager, "MoePermuteFwdOp": permute_eager,
          "MoeUnpermuteFwdOp": unpermute_eager}


def moe_baselines(op_name: str) -> dict[str, Baseline] | None:
    """{name: fn(*inputs, **params)} for an MoE op, None for any other op."""
    has_grouped_mm = hasattr(torch, "_grouped_mm")
    if op_name in _GROUPED:
        grouped, loop = _GROUPED[op_name]
        return {"torch-grouped-mm": grouped, "torch-loop": loop} if has_grouped_mm \
            else {"torch-loop": loop}
    if op_name == "FusedMoeFwdOp":
        table = {"torch-eager": fused_moe_torch,
                 "torch-compile": lambda *a, **k: _compiled(fused_moe_torch)(*a, **k)}
        if has_grouped_mm:
            table["torch-loop"] = fused_moe_loop
        return table
    if op_name == "MoeUnpermuteBwdOp":
        return {"torch-eager": unpermute_backward_eager}
    eager = _EAGER.get(op_name)
    if eager is None:
        return None
    return {"torch-eager": eager,
            "torch-compile": lambda *a, **k: _compiled(eager)(*a, **k)}
