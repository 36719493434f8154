"""`tileops.fused_moe`: a mixture-of-experts MLP layer (routing to combine) on the MoE ops.

fused_moe(hidden_states [T, H], w_gate_up [E, 2F, H], w_down [E, H, F], router_logits
[T, E] or (topk_weights fp32 [T, k], topk_ids int32 [T, k]), top_k, scoring, renormalize,
n_group, topk_group, correction_bias, routed_scaling_factor) -> [T, H]:

    out[t] = sum_j topk_weights[t, j] * expert_{ids[t, j]}(hidden_states[t]),
    expert_e(x) = w_down[e] @ (silu(w_gate_up[e, :F] @ x) * (w_gate_up[e, F:] @ x))

(Hugging Face's fused expert weights of Mixtral / Qwen3-MoE / DeepSeek-V3: gate_up_proj
[E, 2F, H] with the gate first, down_proj [E, H, F].) The routing params go to moe_route
when router_logits is given; otherwise the caller's weights and ids are used as they are.

Two paths, the same kernels, no host synchronization in either:
- inference (no input requires grad): route -> permute -> the gate-up grouped GEMM with
  silu(gate) * up in its epilogue -> the down grouped GEMM -> the weighted combine, one
  custom op (`torch.ops.tileops.fused_moe_fwd`).
- training (an input requires grad): the same chain through the differentiable ops, the
  gate-up product materialized ([T*k, 2F], which the backward needs) and activated by
  silu_and_mul, so autograd differentiates w.r.t. hidden_states, w_gate_up, w_down and
  topk_weights (when given) or router_logits (through moe_route's weights; the expert
  choice itself carries no gradient). The two paths differ by one rounding of the gate-up
  product.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..kernels.base import Kernel
from ..kernels.moe import (
    GroupedGemmKernel,
    MoeCombineKernel,
    MoeGatherKernel,
    MoeRouteKernel,
    MoeSortKernel,
)
from .activation import silu_and_mul
from .base import Op, _needs_autograd
from .grouped_gemm import (
    GroupedGemmFwdOp,
    GroupedGemmSiluAndMulFwdOp,
    grouped_gemm,
)
from .moe import (
    MoePermuteFwdOp,
    MoeRouteFwdOp,
    MoeUnpermuteFwdOp,
    moe_permute,
    moe_route,
    moe_unpermute,
)


class FusedMoeFwdOp(Op):
    """A routed expert-MLP layer, routing to combine, in one custom op (inference path)."""

    kernel_map = {"moe_route": MoeRouteKernel, "moe_sort": MoeSortKernel,
                  "moe_gather": MoeGatherKernel, "grouped_gemm": GroupedGemmKernel,
                  "moe_combine": MoeCombineKernel}

    def __init__(self, *, top_k: int | None = None, scoring: str = "softmax",
                 renormalize: bool = True, n_group: int | None = None,
                 topk_group: int | None = None, routed_scaling_factor: float = 1.0,
                 kernel_map: Mapping[str, type[Kernel]] | None = None, tune: bool = False):
        super().__init__(top_k=top_k, scoring=scoring, renormalize=renormalize,
                         n_group=n_group, topk_group=topk_group,
                         routed_scaling_factor=routed_scaling_factor, kernel_map=kernel_map,
                         tune=tune)
        self._route = None if top_k is None else MoeRouteFwdOp(
            top_k=top_k, scoring=scoring, renormalize=renormalize, n_group=n_group,
            topk_group=topk_group, routed_scaling_factor=routed_scaling_factor, tune=tune)
        self._permute: dict[int, MoePermuteFwdOp] = {}
        self._gate_up = GroupedGemmSiluAndMulFwdOp(tune=tune)
        self._down = GroupedGemmFwdOp(tune=tune)
        self._combine = MoeUnpermuteFwdOp(tune=tune)

    @classmethod
    def index_bounds(cls, inputs: Mapping[str, Any],
                     params: Mapping[str, Any] | None = None) -> dict[str, int]:
        return {"topk_ids": inputs["w_gate_up"].shape[0]}

    def _permute_op(self, n_experts: int) -> MoePermuteFwdOp:
        op = self._permute.get(n_experts)
        if op is None:
            op = self._permute[n_experts] = MoePermuteFwdOp(num_experts=n_experts,
                                                            tune=self.tune)
        return op

    def forward(self, hidden_states: torch.Tensor, w_gate_up: torch.Tensor,
                w_down: torch.Tensor, router_logits: torch.Tensor | None = None,
                topk_weights: torch.Tensor | None = None, topk_ids: torch.Tensor | None = None,
                correction_bias: torch.Tensor | None = None) -> torch.Tensor:
        if router_logits is not None:
            topk_weights, topk_ids = self._route.run(router_logits, correction_bias)
        permuted, offsets, row_index, _ = self._permute_op(w_gate_up.shape[0]).run(
            hidden_states, topk_ids)
        ends = offsets[1:]
        h = self._gate_up.run(permuted, w_gate_up, ends)
        y = self._down.run(h, w_down, ends)
        return self._combine.run(y, topk_weights, row_index)

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        def meta(shape: Any, dtype: Any) -> torch.Tensor:
            return torch.empty(tuple(shape), dtype=dtype, device="meta")

        tokens, n_experts, f = ns["T"], ns["E"], ns["F"]
        hidden = ns["hidden_states"]
        top_k = self.top_k if ns["topk_ids"] is None else ns["topk_ids"].shape[1]
        plan: list[tuple[str, dict[str, Any], int]] = []
        logits, bias = ns["router_logits"], ns["correction_bias"]
        if logits is not None:
            route_args = (meta(logits.shape, logits.dtype),
                          None if bias is None else meta(bias.shape, bias.dtype))
            plan += self._route.kernels_for(self._route.check(route_args))
        ids = meta((tokens, top_k), torch.int32)
        x = meta(hidden.shape, hidden.dtype)
        permute = self._permute_op(n_experts)
        plan += permute.kernels_for(permute.check((x, ids)))
        rows = meta((tokens * top_k, hidden.shape[1]), hidden.dtype)
        ends = meta((n_experts,), torch.int32)
        plan += self._gate_up.kernels_for(self._gate_up.check(
            (rows, meta(ns["w_gate_up"].shape, hidden.dtype), ends)))
        h = meta((tokens * top_k, f), hidden.dtype)
        plan += self._down.kernels_for(self._down.check(
            (h, meta(ns["w_down"].shape, hidden.dtype), ends)))
        plan += self._combine.kernels_for(self._combine.check(
            (rows, meta((tokens, top_k), torch.float32), ids)))
        return plan


def fused_moe(hidden_states: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
              router_logits: torch.Tensor | None = None,
              topk_weights: torch.Tensor | None = None, topk_ids: torch.Tensor | None = None,
              top_k: int | None = None, scoring: str = "softmax", renormalize: bool = True,
              n_group: int | None = None, topk_group: int | None = None,
              correction_bias: torch.Tensor | None = None,
              routed_scaling_factor: float = 1.0) -> torch.Tensor:
    """A routed expert-MLP layer [T, H] (see the module docstring); differentiable."""
    inputs = (hidden_states, w_gate_up, w_down, router_logits, topk_weights, topk_ids,
              correction_bias)
    params = dict(top_k=top_k, scoring=scoring, renormalize=renormalize, n_group=n_group,
                  topk_group=topk_group, routed_scaling_factor=routed_scaling_factor)
    if not _needs_autograd(inputs):
        return FusedMoeFwdOp.apply(*inputs, **params)
    # Training: validate the whole call once, then chain the differentiable ops. Under
    # torch.compile the manifest's checks cannot be traced (they evaluate its expressions);
    # each chained op still checks its own inputs when its custom op runs.
    if not torch.compiler.is_compiling():
        FusedMoeFwdOp.cached(**params).check(inputs)
    if router_logits is not None:
        bias = None if correction_bias is None else correction_bias.detach()
        topk_weights, topk_ids = moe_route(router_logits, top_k, scoring, renormalize,
                                           n_group, topk_group, bias, routed_scaling_factor)
    permuted, offsets, row_index, _ = moe_permute(hidden_states, topk_ids, w_gate_up.shape[0])
    ends = offsets[1:]
    h = silu_and_mul(grouped_gemm(permuted, w_gate_up, ends))
    return moe_unpermute(grouped_gemm(h, w_down, ends), topk_weights, row_index)
