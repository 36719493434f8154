"""MoE routing: scores, (grouped) top-k selection and the combine weights of each token.

One warp owns one token's row of router logits (E <= 384 experts, so a lane holds at most
12 of them, expert `i * 32 + lane` in its slot i: the loads are coalesced). The warp talks
only through shuffles, never shared memory, so warps of a CTA never wait for each other.

Selection ranks experts by one unsigned 64-bit key per expert (`selection.order`): the
value's order in the high bits and the inverted expert index in the low bits, so keys are
distinct and ties go to the lower index. The ranked value is
- the logit itself without a correction bias: softmax and sigmoid are increasing, so the
  logits rank exactly as the exact scores do (no rounding can merge two of them);
- score + bias with a correction bias (DeepSeek-V3: the bias steers selection only).
Grouped selection (n_group > 1) first keeps the topk_group groups with the highest group
score (the sum of a group's two best ranked values with a bias, its best value without,
as vLLM's grouped_topk), ties to the lower group; other groups' experts are excluded.
Each of the top_k rounds takes the warp's largest key and clears it; lane r keeps round r's
winner, recomputes its score from the logit (the same fp32 formula, so the same bits),
and writes slot r: outputs are sorted by the ranked value, descending.
"""

from dataclasses import dataclass

import tilelang.language as T

from ..base import Kernel
from ..selection.order import EMPTY, index_of, key_of, larger

MAX_EXPERTS = 384
MAX_TOP_K = 32  # one output slot per lane


@dataclass(frozen=True)
class RouteConfig:
    warps: int = 4  # tokens per CTA


def value_of(key):
    """The fp32 value a float32 key was built from (the inverse of `order`'s map)."""
    bits = T.cast(key >> T.uint64(32), "uint32")
    sign = T.uint32(0x80000000)
    return T.reinterpret(T.if_then_else((bits & sign) != T.uint32(0), bits & ~sign, ~bits),
                         "float32")


@T.macro
def warp_max_key(val, other):
    for o in T.unroll(5):
        other[0] = T.shfl_xor(val[0], 16 >> o)
        val[0] = larger(val[0], other[0])


@T.macro
def warp_max_f32(val, other):
    for o in T.unroll(5):
        other[0] = T.shfl_xor(val[0], 16 >> o)
        val[0] = T.max(val[0], other[0])


@T.macro
def warp_sum_f32(val, other):
    for o in T.unroll(5):
        other[0] = T.shfl_xor(val[0], 16 >> o)
        val[0] = val[0] + other[0]


def route_program(n_experts: int, dtype: str, top_k: int, scoring: str, renormalize: bool,
                  n_group: int, topk_group: int, has_bias: bool, warps: int):
    """The routing prim_func; tokens are symbolic, everything else is compiled in."""
    tokens = T.dynamic("tokens")
    per_lane = -(-n_experts // 32)
    group_size = n_experts // n_group

    def score_of(x, row_max, inv_sum):
        if scoring == "softmax":
            return T.exp(x - row_max) * inv_sum
        return T.float32(1) / (T.float32(1) + T.exp(-x))

    @T.macro
    def route_row(logits, bias, weights, ids, scale, t, lane):
        x = T.alloc_local((per_lane,), "float32")
        keys = T.alloc_local((per_lane,), "uint64")
        group_keys = T.alloc_local((max(n_group, 1),), "uint64")
        row_max = T.alloc_local((1,), "float32")
        inv_sum = T.alloc_local((1,), "float32")
        f_other = T.alloc_local((1,), "float32")
        f_tmp = T.alloc_local((1,), "float32")
        best = T.alloc_local((1,), "uint64")
        second = T.alloc_local((1,), "uint64")
        k_other = T.alloc_local((1,), "uint64")
        mine = T.alloc_local((1,), "uint64")
        group_bits = T.alloc_local((1,), "int32")
        s_mine = T.alloc_local((1,), "float32")
        for i in T.unroll(per_lane):
            x[i] = T.if_then_else(i * 32 + lane < n_experts,
                                  T.cast(logits[t, T.min(i * 32 + lane, n_experts - 1)],
                                         "float32"), -T.infinity("float32"))
        row_max[0] = x[0]
        inv_sum[0] = T.float32(1)
        if scoring == "softmax":
            for i in T.unroll(1, per_lane):
                row_max[0] = T.max(row_max[0], x[i])
            warp_max_f32(row_max, f_other)
            inv_sum[0] = T.float32(0)
            for i in T.unroll(per_lane):  # exp(-inf) of the padding lanes adds 0
                inv_sum[0] = inv_sum[0] + T.exp(x[i] - row_max[0])
            warp_sum_f32(inv_sum, f_other)
            inv_sum[0] = T.float32(1) / inv_sum[0]
        for i in T.unroll(per_lane):
            if has_bias:
                keys[i] = T.if_then_else(
                    i * 32 + lane < n_experts,
                    key_of(score_of(x[i], row_max[0], inv_sum[0])
                           + bias[T.min(i * 32 + lane, n_experts - 1)],
                           i * 32 + lane, "float32", n_experts), T.uint64(EMPTY))
            else:
                keys[i] = T.if_then_else(i * 32 + lane < n_experts,
                                         key_of(x[i], i * 32 + lane, "float32", n_experts),
                                         T.uint64(EMPTY))
        if n_group > 1:
            for g in T.unroll(n_group):
                best[0] = T.uint64(EMPTY)
                for i in T.unroll(per_lane):
                    if (i * 32 + lane) // group_size == g:
                        best[0] = larger(best[0], keys[i])
                warp_max_key(best, k_other)
                if has_bias:  # the group's two best values, summed
                    second[0] = T.uint64(EMPTY)
                    for i in T.unroll(per_lane):
                        if (i * 32 + lane) // group_size == g and keys[i] != best[0]:
                            second[0] = larger(second[0], keys[i])
                    warp_max_key(second, k_other)
                    group_keys[g] = key_of(value_of(best[0]) + value_of(second[0]), g,
                                           "float32", n_group)
                else:
                    group_keys[g] = key_of(value_of(best[0]), g, "float32", n_group)
            group_bits[0] = 0
            for _r in T.unroll(topk_group):
                best[0] = group_keys[0]
                for g in T.unroll(1, n_group):
                    best[0] = larger(best[0], group_keys[g])
                for g in T.unroll(n_group):
                    if group_keys[g] == best[0]:
                        group_bits[0] = group_bits[0] | (1 << g)
                        group_keys[g] = T.uint64(EMPTY)
            for i in T.unroll(per_lane):
                if ((group_bits[0] >> ((i * 32 + lane) // group_size)) & 1) == 0:
                    keys[i] = T.uint64(EMPTY)
        mine[0] = T.uint64(EMPTY)
        for r in T.unroll(top_k):
            best[0] = keys[0]
            for i in T.unroll(1, per_lane):
                best[0] = larger(best[0], keys[i])
            warp_max_key(best, k_other)
            for i in T.unroll(per_lane):
                if keys[i] == best[0]:
                    keys[i] = T.uint64(EMPTY)
            if lane == r:
                mine[0] = best[0]
        # lane r < top_k: slot r's expert; its score from the logit, the same formula
        s_mine[0] = T.float32(0)
        if lane < top_k:
            s_mine[0] = score_of(T.cast(logits[t, T.cast(index_of(mine[0], n_experts),
                                                         "int32")], "float32"),
                                 row_max[0], inv_sum[0])
        f_other[0] = s_mine[0]
        if renormalize:
            warp_sum_f32(f_other, f_tmp)
        if lane < top_k:
            if renormalize:
                weights[t, lane] = s_mine[0] / f_other[0] * scale
            else:
                weights[t, lane] = s_mine[0] * scale
            ids[t, lane] = T.cast(index_of(mine[0], n_experts), "int32")

    if has_bias:
        @T.prim_func
        def route_biased(logits: T.Tensor((tokens, n_experts), dtype),
                         bias: T.Tensor((n_experts,), "float32"),
                         weights: T.Tensor((tokens, top_k), "float32"),
                         ids: T.Tensor((tokens, top_k), "int32"),
                         scale: T.float32):
            with T.Kernel(T.ceildiv(tokens, warps), threads=warps * 32) as bx:
                tx = T.get_thread_binding()
                if bx * warps + tx // 32 < tokens:
                    route_row(logits, bias, weights, ids, scale, bx * warps + tx // 32,
                              tx % 32)
        return route_biased

    @T.prim_func
    def route(logits: T.Tensor((tokens, n_experts), dtype),
              weights: T.Tensor((tokens, top_k), "float32"),
              ids: T.Tensor((tokens, top_k), "int32"),
              scale: T.float32):
        with T.Kernel(T.ceildiv(tokens, warps), threads=warps * 32) as bx:
            tx = T.get_thread_binding()
            if bx * warps + tx // 32 < tokens:
                route_row(logits, None, weights, ids, scale, bx * warps + tx // 32, tx % 32)
    return route


class MoeRouteKernel(Kernel):
    """key: dtype, n_experts, top_k, scoring, renormalize, n_group, topk_group, has_bias.

    One bucket: a token's work does not depend on how many tokens there are.
    """

    name = "moe_route"
    Config = RouteConfig

    def program(self, config: RouteConfig, bucket: str):
        k = self.key
        return route_program(k["n_experts"], k["dtype"], k["top_k"], k["scoring"],
                             k["renormalize"], k["n_group"], k["topk_group"], k["has_bias"],
                             config.warps)

    def run(self, config: RouteConfig, compiled: tuple, logits, bias, weights, ids,
            scale: float) -> None:
        if bias is None:
            compiled[0](logits, weights, ids, scale)
        else:
            compiled[0](logits, bias, weights, ids, scale)

    def heuristic_config(self, bucket: str, arch: str) -> RouteConfig:
        return RouteConfig()

    def config_space(self, bucket: str) -> list[RouteConfig]:
        return [RouteConfig(warps) for warps in (4, 2, 8)]
