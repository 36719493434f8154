"""PyTorch references of the MoE ops (CPU or GPU tensors), written from the model code's
formulas (Hugging Face Mixtral / Qwen3-MoE / DeepSeek-V3, vLLM's grouped_topk), with the
tie rule and the exclusion of dropped groups that the ops document, and checkers that say
where a result is off."""

from __future__ import annotations

import torch


def scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """The routing scores in fp32, as the models compute them."""
    x = logits.float()
    return torch.softmax(x, dim=-1) if scoring == "softmax" else torch.sigmoid(x)


def ranked_values(logits: torch.Tensor, scoring: str, bias: torch.Tensor | None) -> torch.Tensor:
    """What selection ranks (fp32): score + bias with a bias, else the logit (which ranks
    exactly as the exact score)."""
    return logits.float() if bias is None else scores(logits, scoring) + bias.float()


def allowed_experts(values: torch.Tensor, n_group: int | None, topk_group: int | None,
                    has_bias: bool) -> torch.Tensor:
    """bool [T, E]: the experts of each token's topk_group best groups (all without groups).

    A group scores the fp32 sum of its two best values with a bias, its best without; ties
    between groups go to the lower group (a stable descending sort)."""
    tokens, n_experts = values.shape
    if n_group is None or n_group == 1:
        return torch.ones_like(values, dtype=torch.bool)
    grouped = values.view(tokens, n_group, n_experts // n_group)
    top = grouped.topk(2 if has_bias else 1, dim=-1).values
    group_score = top[..., 0] + top[..., 1] if has_bias else top[..., 0]  # fp32 add
    order = torch.sort(group_score, dim=-1, descending=True, stable=True).indices
    keep = torch.zeros(tokens, n_group, dtype=torch.bool, device=values.device)
    keep.scatter_(1, order[:, :topk_group], True)
    return keep.repeat_interleave(n_experts // n_group, dim=1)


def route_reference(logits, top_k, scoring="softmax", renormalize=True, n_group=None,
                    topk_group=None, bias=None, scale=1.0):
    """(weights float64 [T, k], ids int64 [T, k], ranked values [T, E] with excluded experts
    at -inf): ties to the lower index, sorted by ranked value, descending."""
    values = ranked_values(logits, scoring, bias)
    values = values.masked_fill(~allowed_experts(values, n_group, topk_group, bias is not None),
                                float("-inf"))
    ids = torch.sort(values, dim=-1, descending=True, stable=True).indices[:, :top_k]
    return route_weights(logits, ids, scoring, renormalize, scale), ids, values


def route_weights(logits, ids, scoring, renormalize, scale):
    """float64 weights of the given experts: their unbiased scores, renormalized, scaled."""
    x = logits.double()
    s = torch.softmax(x, dim=-1) if scoring == "softmax" else torch.sigmoid(x)
    w = s.gather(1, ids.long())
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w * scale


def check_route(weights, ids, logits, top_k, scoring="softmax", renormalize=True,
                n_group=None, topk_group=None, bias=None, scale=1.0, tie_tol=1e-6):
    """Asserts the kernel's routing equals the reference's.

    Ids must match exactly on every row, except, with a correction bias (whose ranked
    values the kernel computes with its own fp32 exp, which may differ from torch's in the
    last bit and so flip a near-tie), rows the reference decides by at most `tie_tol`: there
    the kernel's experts must be allowed and within `tie_tol` of the reference's k-th
    value. Weights are compared, at the kernel's ids, with
    the float64 formula.
    """
    want_w, want_ids, values = route_reference(logits, top_k, scoring, renormalize, n_group,
                                               topk_group, bias, scale)
    ids, weights = ids.cpu().long(), weights.cpu()
    want_ids, values = want_ids.cpu(), values.cpu().double()
    assert ids.shape == want_ids.shape and weights.dtype == torch.float32
    ranked = torch.sort(values, dim=-1, descending=True).values
    kth = ranked[:, top_k - 1]
    nxt = ranked[:, top_k] if values.shape[1] > top_k else torch.full_like(kth, -torch.inf)
    # Without a bias the ranked values are the logits themselves, exact on both sides (ties
    # included: both take the lower index), so every row must match.
    near_tie = torch.zeros_like(kth, dtype=torch.bool)
    if bias is not None:
        near_tie = (kth - nxt) <= tie_tol * kth.abs().clamp(min=1)
        if n_group is not None and n_group > 1:
            near_tie |= _near_group_tie(logits, scoring, bias, n_group, topk_group, tie_tol)
    exact = ~near_tie
    bad = (ids[exact] != want_ids[exact]).any(dim=-1)
    if bad.any():
        row = int(torch.nonzero(exact).flatten()[torch.nonzero(bad).flatten()[0]])
        raise AssertionError(f"ids of {int(bad.sum())} rows differ; row {row}: got "
                             f"{ids[row].tolist()}, expected {want_ids[row].tolist()}")
    got_values = values.gather(1, ids)
    assert torch.isfinite(got_values).all(), "an excluded or repeated expert was chosen"
    assert (got_values >= kth[:, None] - tie_tol * kth.abs().clamp(min=1)[:, None]).all()
    assert (got_values[:, :-1] >= got_values[:, 1:]).all(), "not sorted by ranked value"
    assert all(len(set(r)) == top_k for r in ids.tolist()), "an expert chosen twice"
    torch.testing.assert_close(weights.double(),
                               route_weights(logits.cpu(), ids, scoring, renormalize, scale),
                               atol=1e-6, rtol=2e-5)
    return int(exact.sum())


def _near_group_tie(logits, scoring, bias, n_group, topk_group, tol):
    values = ranked_values(logits, scoring, bias).double().cpu()
    grouped = values.view(values.shape[0], n_group, -1)
    top = grouped.topk(2, dim=-1).values.sum(-1)
    ranked = torch.sort(top, dim=-1, descending=True).values
    if topk_group >= n_group:
        return torch.zeros(values.shape[0], dtype=torch.bool)
    return (ranked[:, topk_group - 1] - ranked[:, topk_group]) <= tol * 4


def buckets(topk_ids, num_experts, expert_map=None):
    """int64 [T*K]: each slot's local expert, or num_experts when it is dropped."""
    flat = topk_ids.reshape(-1).long()
    if expert_map is None:
        return torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    n_global = expert_map.shape[0]
    local = expert_map.long()[flat.clamp(0, n_global - 1)]
    ok = (flat >= 0) & (flat < n_global) & (local >= 0) & (local < num_experts)
    return torch.where(ok, local, num_experts)


def permute_reference(hidden, topk_ids, num_experts, expert_map=None):
    """(permuted rows [local, H], offsets [E+1], row_index [T, K], source [T*K]) of a stable
    sort of the slots by bucket; only the local rows of `permuted` are defined."""
    tokens, top_k = topk_ids.shape
    b = buckets(topk_ids, num_experts, expert_map)
    order = torch.sort(b, stable=True).indices
    row_of = torch.empty_like(order)
    row_of[order] = torch.arange(order.numel(), device=order.device)
    counts = torch.bincount(b, minlength=num_experts + 1)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])[:num_experts + 1]
    row_index = torch.where(b < num_experts, row_of, -1).view(tokens, top_k)
    source = torch.where(b[order] < num_experts, order, -1)
    n_local = int(offsets[-1])
    return hidden[order[:n_local] // top_k], offsets, row_index, source


def combine_reference(expert_output, weights, row_index):
    """float64 [T, H]: sum over k of weights * expert_output[row], rows of -1 skipped."""
    rows = row_index.long()
    picked = expert_output.double()[rows.clamp(min=0)]  # [T, K, H]
    w = torch.where(rows >= 0, weights.double(), 0.0)
    return (w[..., None] * picked).sum(1)


def zipf_ids(tokens, n_experts, top_k, skew=1.2, generator=None, device="cpu"):
    """int32 [T, k] distinct experts per token, drawn with Zipf-like popularity (expert e's
    weight 1 / (e + 1)^skew, experts shuffled), as skewed real routers produce."""
    popularity = 1.0 / torch.arange(1, n_experts + 1, dtype=torch.float64) ** skew
    popularity = popularity[torch.randperm(n_experts, generator=generator)]
    ids = torch.multinomial(popularity.expand(tokens, -1), top_k, replacement=False,
                            generator=generator)
    return ids.to(torch.int32).to(device)


def expert_layer(x, w_gate_up, w_down, weights, ids, dtype=torch.float32,
                 round_gate_up=True):
    """Loop over experts: each expert's tokens through its gated MLP, weighted, summed per
    token (differentiable w.r.t. every float input).

    dtype float32: the reference, fp32 end to end. dtype bf16/fp16: the baseline of
    `assert_no_worse_than`, what PyTorch computes in that dtype, rounded where fused_moe's
    training path rounds: the gate-up product, h = silu(gate) * up (fp32 math, one
    rounding), each expert's output (GEMMs accumulate in fp32), the weighted sum in fp32
    rounded once; backward alike (the hidden states' gradient summed over experts in fp32
    and rounded once, as moe_permute's backward does). round_gate_up=False: the inference
    path's rounding (silu(gate) * up in the gate-up GEMM's epilogue, from the fp32
    product)."""
    f = w_gate_up.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    xf = x.float()
    experts = zip(w_gate_up.unbind(0), w_down.unbind(0), strict=True)
    for e, (gate_up, down) in enumerate(experts):
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        if round_gate_up:
            gu = (xf[tok].to(dtype) @ gate_up.to(dtype).t()).float()
        else:
            gu = xf[tok] @ gate_up.float().t()
        h = (torch.nn.functional.silu(gu[:, :f]) * gu[:, f:]).to(dtype)
        y = h @ down.to(dtype).t()
        out = out.index_add(0, tok, weights[tok, slot, None].float() * y.float())
    return out.to(dtype)
