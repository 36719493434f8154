"""Mixture-of-experts family: routing, token permutation and the weighted combine.

- `moe_route(router_logits, top_k, scoring='softmax', renormalize=True, n_group=None,
  topk_group=None, correction_bias=None, routed_scaling_factor=1.0)` -> (topk_weights fp32
  [T, top_k], topk_ids int32 [T, top_k]). The routers of Hugging Face's Mixtral and
  Qwen3-MoE (softmax over all experts in fp32, top-k, renormalized over the k when
  `renormalize`) and DeepSeek-V3 / Kimi-K2 (sigmoid scores; `correction_bias` is added for
  the selection only; with n_group > 1 only the `topk_group` groups with the largest sum of
  their two best biased scores compete; the weights are the unbiased scores of the chosen
  experts, renormalized, times `routed_scaling_factor`). Without a correction bias a group
  scores its best expert (vLLM's grouped_topk). Differences from the references, stated:
  - Ties go to the lower expert index (torch.topk leaves their order unspecified) and the
    k outputs are sorted by the ranked value, descending (Hugging Face's DeepSeek-V3 asks
    for sorted=False: any order).
  - Without a bias, experts are ranked by their logits, which rank exactly as the exact
    scores do; so two logits whose fp32 scores round to the same value still rank by logit.
  - Excluded groups' experts never win; Hugging Face's DeepSeek-V3 fills them with 0.0,
    which could beat a negative biased score of an allowed expert (vLLM uses -inf, as here).
  - renormalize divides by the plain sum of the k scores (DeepSeek-V3 adds 1e-20 to it).
  E <= 384 experts, top_k <= 32, n_group <= 32; n_group=1 means no grouping.
- `moe_permute(hidden_states, topk_ids, num_experts, expert_map=None)` -> (permuted
  [T*K, H], offsets int32 [num_experts + 1], row_index int32 [T, K], source int32 [T*K]):
  the (token, k) slots grouped by expert without padding, in slot order within an expert
  (a stable sort: deterministic). Expert e's rows are permuted[offsets[e]:offsets[e+1]]
  (offsets[1:] is torch._grouped_mm's `offs`); row_index[t, k] is slot (t, k)'s row, and
  source[r] the slot (t * K + k) of row r. With `expert_map` (int32 [E_global], global
  expert -> local expert or -1; expert parallelism) only local experts get rows. Slots
  whose expert is not local, or whose id is outside [0, E_global) (ids and map entries are
  not range-checked: that would synchronize), are dropped: row_index -1, and they take the
  rows from offsets[num_experts] on, whose source is -1 and whose permuted rows are not
  written. How many rows are local is data: it stays on the device in
  offsets[num_experts], and the kernels downstream read it there (the grouped GEMM reads
  `offsets`); the shapes are always T*K rows, so nothing waits for the host.
- `moe_unpermute(expert_output, topk_weights, row_index)` -> [T, H] in expert_output's
  dtype: out[t] = sum_k topk_weights[t, k] * expert_output[row_index[t, k]], accumulated in
  fp32 in k order; rows of -1 add nothing (a token with no local expert gets zeros).

The grouped GEMMs of the experts are in ops/grouped_gemm.py.

All are custom ops (torch.compile) and capture in CUDA graphs (no host synchronization,
outputs allocated by the op). moe_permute is differentiable in hidden_states (the gradient
sums each token's rows: the combine with unit weights), moe_unpermute in expert_output
and topk_weights (MoeUnpermuteBwdOp), and moe_route's weights in router_logits (through
the scores of the chosen experts: a softmax over the chosen logits when renormalized,
the full softmax otherwise, the sigmoid per expert; the ids and the correction bias only
select, so they carry none).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..kernels.base import Kernel
from ..kernels.moe import (
    MoeCombineKernel,
    MoeCombineWeightGradKernel,
    MoeGatherKernel,
    MoeRouteKernel,
    MoeSortKernel,
)
from ..manifest.spec import DTYPE_NAMES
from .base import Op
from .layout import tma_ready


class MoeRouteFwdOp(Op):
    """Router scores -> the top_k experts of each token and their combine weights."""

    kernel_map = {"moe_route": MoeRouteKernel}

    def __init__(self, *, top_k: int, scoring: str = "softmax", renormalize: bool = True,
                 n_group: int | None = None, topk_group: int | None = None,
                 routed_scaling_factor: float = 1.0,
                 kernel_map: Mapping[str, type[Kernel]] | None = None, tune: bool = False):
        super().__init__(top_k=top_k, scoring=scoring, renormalize=renormalize,
                         n_group=n_group, topk_group=topk_group,
                         routed_scaling_factor=routed_scaling_factor, kernel_map=kernel_map,
                         tune=tune)

    def _key(self, dtype: Any, n_experts: int, has_bias: bool) -> dict[str, Any]:
        grouped = self.n_group is not None and self.n_group > 1
        return {"dtype": DTYPE_NAMES[dtype], "n_experts": n_experts, "top_k": self.top_k,
                "scoring": self.scoring, "renormalize": self.renormalize,
                "n_group": self.n_group if grouped else 1,
                "topk_group": self.topk_group if grouped else 1, "has_bias": has_bias}

    def forward(self, router_logits: torch.Tensor,
                correction_bias: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, n_experts = router_logits.shape
        weights = torch.empty((tokens, self.top_k), dtype=torch.float32,
                              device=router_logits.device)
        ids = torch.empty((tokens, self.top_k), dtype=torch.int32, device=router_logits.device)
        if tokens == 0:
            return weights, ids
        bias = None if correction_bias is None else correction_bias.contiguous()
        kernel = self.get_kernel("moe_route", router_logits.device,
                                 **self._key(router_logits.dtype, n_experts, bias is not None))
        kernel(tokens, router_logits.contiguous(), bias, weights, ids,
               float(self.routed_scaling_factor))
        return weights, ids

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        if ns["T"] == 0:
            return []
        key = self._key(ns["router_logits"].dtype, ns["E"], ns["correction_bias"] is not None)
        return [("moe_route", key, ns["T"])]


class MoePermuteFwdOp(Op):
    """Token rows grouped by expert (no padding), their offsets and both index maps."""

    kernel_map = {"moe_sort": MoeSortKernel, "moe_gather": MoeGatherKernel}

    def __init__(self, *, num_experts: int,
                 kernel_map: Mapping[str, type[Kernel]] | None = None, tune: bool = False):
        super().__init__(num_experts=num_experts, kernel_map=kernel_map, tune=tune)

    @classmethod
    def index_bounds(cls, inputs: Mapping[str, Any],
                     params: Mapping[str, Any] | None = None) -> dict[str, int]:
        # Random ids index the map. (Without a map the bound is the num_experts param, which
        # this hook cannot see: the manifest's workloads all give a map.)
        expert_map = inputs.get("expert_map")
        return {} if expert_map is None else {"topk_ids": expert_map.shape[0]}

    def _keys(self, hidden_states: Any, top_k: int, expert_map: Any) -> tuple[dict, dict]:
        n_global = self.num_experts if expert_map is None else expert_map.shape[0]
        sort = {"n_experts": self.num_experts, "n_global": n_global, "top_k": top_k,
                "has_map": expert_map is not None}
        gather = {"dtype": DTYPE_NAMES[hidden_states.dtype], "hidden": hidden_states.shape[1],
                  "top_k": top_k}
        return sort, gather

    def forward(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                expert_map: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        tokens, hidden = hidden_states.shape
        top_k = topk_ids.shape[1]
        device = hidden_states.device
        permuted = torch.empty((tokens * top_k, hidden), dtype=hidden_states.dtype,
                               device=device)
        offsets = torch.empty((self.num_experts + 1,), dtype=torch.int32, device=device)
        row_index = torch.empty((tokens, top_k), dtype=torch.int32, device=device)
        source = torch.empty((tokens * top_k,), dtype=torch.int32, device=device)
        if tokens == 0:
            offsets.zero_()
            return permuted, offsets, row_index, source
        if expert_map is not None:
            expert_map = expert_map.contiguous()
        sort_key, gather_key = self._keys(hidden_states, top_k, expert_map)
        self.get_kernel("moe_sort", device, **sort_key)(
            tokens, topk_ids.contiguous(), expert_map, offsets, row_index, source)
        self.get_kernel("moe_gather", device, **gather_key)(
            tokens, tma_ready(hidden_states), row_index, permuted)
        return permuted, offsets, row_index, source

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        if ns["T"] == 0:
            return []
        sort_key, gather_key = self._keys(ns["hidden_states"], ns["K"], ns["expert_map"])
        return [("moe_sort", sort_key, ns["T"]), ("moe_gather", gather_key, ns["T"])]


class MoeUnpermuteFwdOp(Op):
    """Expert outputs back in token order, weighted and summed over each token's experts."""

    kernel_map = {"moe_combine": MoeCombineKernel}

    def __init__(self, *, kernel_map: Mapping[str, type[Kernel]] | None = None,
                 tune: bool = False):
        super().__init__(kernel_map=kernel_map, tune=tune)

    @classmethod
    def index_bounds(cls, inputs: Mapping[str, Any],
                     params: Mapping[str, Any] | None = None) -> dict[str, int]:
        return {"row_index": inputs["expert_output"].shape[0]}

    def forward(self, expert_output: torch.Tensor, topk_weights: torch.Tensor,
                row_index: torch.Tensor) -> torch.Tensor:
        tokens, top_k = row_index.shape
        out = torch.empty((tokens, expert_output.shape[1]), dtype=expert_output.dtype,
                          device=expert_output.device)
        if tokens == 0:
            return out
        kernel = self.get_kernel("moe_combine", expert_output.device,
                                 **self._key(expert_output, top_k))
        kernel(tokens, tma_ready(expert_output), topk_weights.contiguous(),
               row_index.contiguous(), out)
        return out

    @staticmethod
    def _key(expert_output: Any, top_k: int) -> dict[str, Any]:
        return {"dtype": DTYPE_NAMES[expert_output.dtype], "hidden": expert_output.shape[1],
                "top_k": top_k}

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        if ns["T"] == 0:
            return []
        return [("moe_combine", self._key(ns["expert_output"], ns["K"]), ns["T"])]


class MoeUnpermuteBwdOp(Op):
    """(grad_expert_output [M, H], grad_topk_weights fp32 [T, K]) of moe_unpermute.

    grad_expert_output[row_index[t, k]] = topk_weights[t, k] * grad_output[t] (a weighted
    gather; rows no slot names are zeros). grad_topk_weights[t, k] = the fp32 dot product
    of grad_output[t] and expert_output[row_index[t, k]] (0 for dropped slots), only with
    `grad_weights` (else zeros, and expert_output is not read: a caller may pass a
    zero-stride stand-in of its shape).
    """

    kernel_map = {"moe_gather": MoeGatherKernel,
                  "moe_combine_weight_grad": MoeCombineWeightGradKernel}

    def __init__(self, *, grad_weights: bool = True,
                 kernel_map: Mapping[str, type[Kernel]] | None = None, tune: bool = False):
        super().__init__(grad_weights=grad_weights, kernel_map=kernel_map, tune=tune)

    @classmethod
    def index_bounds(cls, inputs: Mapping[str, Any],
                     params: Mapping[str, Any] | None = None) -> dict[str, int]:
        return {"row_index": inputs["expert_output"].shape[0]}

    def forward(self, grad_output: torch.Tensor, expert_output: torch.Tensor,
                topk_weights: torch.Tensor, row_index: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, top_k = row_index.shape
        rows, hidden = expert_output.shape
        device = grad_output.device
        grad_rows = torch.zeros((rows, hidden), dtype=grad_output.dtype, device=device)
        grad_weights = torch.empty((tokens, top_k), dtype=torch.float32, device=device)
        if tokens == 0:
            return grad_rows, grad_weights
        row_index, grad_output = row_index.contiguous(), tma_ready(grad_output)
        self.get_kernel("moe_gather", device, **self._key(grad_output, top_k))(
            tokens, grad_output, topk_weights.contiguous(), row_index, grad_rows)
        if self.grad_weights:
            self.get_kernel("moe_combine_weight_grad", device,
                            **self._dot_key(grad_output, top_k))(
                tokens, grad_output, tma_ready(expert_output), row_index, grad_weights)
        else:
            grad_weights.zero_()
        return grad_rows, grad_weights

    @staticmethod
    def _dot_key(grad_output: Any, top_k: int) -> dict[str, Any]:
        return {"dtype": DTYPE_NAMES[grad_output.dtype], "hidden": grad_output.shape[1],
                "top_k": top_k}

    @staticmethod
    def _key(grad_output: Any, top_k: int) -> dict[str, Any]:
        return {"dtype": DTYPE_NAMES[grad_output.dtype], "hidden": grad_output.shape[1],
                "top_k": top_k, "weighted": True}

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        if ns["T"] == 0:
            return []
        plan = [("moe_gather", self._key(ns["grad_output"], ns["K"]), ns["T"])]
        if self.grad_weights:
            plan.append(("moe_combine_weight_grad", self._dot_key(ns["grad_output"], ns["K"]),
                         ns["T"]))
        return plan


# -- autograd: permute and unpermute (fused_moe's training path chains them) -------------
def _permute_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    ctx.save_for_backward(output[2])  # row_index


def _permute_backward(ctx: Any, grad_permuted: torch.Tensor | None, *_: Any) -> tuple:
    (row_index,) = ctx.saved_tensors
    grad = None
    if grad_permuted is not None:
        ones = torch.ones(row_index.shape, dtype=torch.float32, device=row_index.device)
        grad = MoeUnpermuteFwdOp.through_custom_op(grad_permuted, ones, row_index)
    return MoePermuteFwdOp.grads_in_call_order(hidden_states=grad)


def _unpermute_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    expert_output, topk_weights, row_index = inputs
    ctx.rows = expert_output.shape
    ctx.weights_need_grad = topk_weights.requires_grad
    # expert_output only for the weights' gradient
    ctx.save_for_backward(expert_output if ctx.weights_need_grad else None, topk_weights,
                          row_index)


def _unpermute_backward(ctx: Any, grad_output: torch.Tensor) -> tuple:
    expert_output, topk_weights, row_index = ctx.saved_tensors
    if expert_output is None:  # not read: a zero-stride stand-in of its shape
        expert_output = grad_output.new_empty(()).expand(ctx.rows)
    grad_rows, grad_weights = MoeUnpermuteBwdOp.through_custom_op(
        grad_output, expert_output, topk_weights, row_index,
        grad_weights=ctx.weights_need_grad)
    return MoeUnpermuteFwdOp.grads_in_call_order(
        expert_output=grad_rows,
        topk_weights=grad_weights if ctx.weights_need_grad else None)


def _route_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    router_logits, _, scoring, renormalize, *_, scale = inputs
    weights, ids = output
    ctx.scoring, ctx.renormalize, ctx.scale = scoring, renormalize, scale
    ctx.save_for_backward(router_logits, ids)


def _route_backward(ctx: Any, grad_weights: torch.Tensor | None, _: Any) -> tuple:
    """d router_logits from d topk_weights (the ids are a selection: no gradient, and the
    correction bias only selects). Small [T, k] / [T, E] math in fp32 with torch ops."""
    logits, ids = ctx.saved_tensors
    if grad_weights is None:
        return MoeRouteFwdOp.grads_in_call_order()
    x, ids, g = logits.float(), ids.long(), grad_weights.float() * ctx.scale
    chosen = x.gather(1, ids)
    if ctx.scoring == "softmax" and not ctx.renormalize:  # w = softmax(x)[ids]
        s = torch.softmax(x, dim=-1)
        gs = torch.zeros_like(x).scatter_(1, ids, g)
        grad = s * (gs - (gs * s).sum(-1, keepdim=True))
    else:
        if ctx.scoring == "softmax":  # renormalized: a softmax over the chosen logits
            p = torch.softmax(chosen, dim=-1)
            grad_chosen = p * (g - (g * p).sum(-1, keepdim=True))
        else:
            s = torch.sigmoid(chosen)
            if ctx.renormalize:
                total = s.sum(-1, keepdim=True)
                g = (g - (g * s / total).sum(-1, keepdim=True)) / total
            grad_chosen = g * s * (1 - s)
        grad = torch.zeros_like(x).scatter_(1, ids, grad_chosen)
    return MoeRouteFwdOp.grads_in_call_order(router_logits=grad.to(logits.dtype))


MoeRouteFwdOp.register_autograd(_route_backward, setup_context=_route_setup)
MoePermuteFwdOp.register_autograd(_permute_backward, setup_context=_permute_setup)
MoeUnpermuteFwdOp.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)


def moe_route(router_logits: torch.Tensor, top_k: int, scoring: str = "softmax",
              renormalize: bool = True, n_group: int | None = None,
              topk_group: int | None = None, correction_bias: torch.Tensor | None = None,
              routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights fp32 [T, top_k], topk_ids int32 [T, top_k]) of router_logits [T, E]."""
    return MoeRouteFwdOp.apply(router_logits, correction_bias, top_k=top_k, scoring=scoring,
                               renormalize=renormalize, n_group=n_group,
                               topk_group=topk_group,
                               routed_scaling_factor=routed_scaling_factor)


def moe_permute(hidden_states: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                expert_map: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """(permuted [T*K, H], offsets [num_experts + 1], row_index [T, K], source [T*K])."""
    return MoePermuteFwdOp.apply(hidden_states, topk_ids, expert_map,
                                 num_experts=num_experts)


def moe_unpermute(expert_output: torch.Tensor, topk_weights: torch.Tensor,
                  row_index: torch.Tensor) -> torch.Tensor:
    """out [T, H] = sum_k topk_weights[:, k] * expert_output[row_index[:, k]]."""
    return MoeUnpermuteFwdOp.apply(expert_output, topk_weights, row_index)
