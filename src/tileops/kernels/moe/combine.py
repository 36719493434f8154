"""MoE combine (unpermute): out[t] = sum_j weights[t, j] * expert_out[row_index[t, j]].

Each thread owns 16-byte vectors of a few tokens' output rows and walks the token's top_k
rows in order, accumulating in fp32, so the sum is deterministic (no atomics) and rounded
once. A row index of -1 (an expert that is not local) adds nothing; a token whose experts
are all dropped gets zeros.

The combine's gradient w.r.t. the weights, grad_w[t, j] = <grad_out[t], expert_out[row
index[t, j]]>, is `weight_grad_program`: the same row walk, an fp32 product per element
and one CTA-wide sum per slot (0 for a dropped slot).
"""

from dataclasses import dataclass

import tilelang.language as T

from ..base import Kernel
from ..vectors import vector_width


@dataclass(frozen=True)
class CombineConfig:
    block_rows: int = 1  # tokens per CTA
    threads: int = 128


def combine_program(hidden: int, top_k: int, dtype: str, config: CombineConfig):
    """out [tokens, hidden] from expert_out [rows, hidden]; tokens and rows are symbolic."""
    tokens, rows = T.dynamic("tokens, rows")
    block_rows = config.block_rows
    # The accumulator spans whole rounds of 16-byte vectors over the threads (layout
    # inference needs that); columns past `hidden` are computed from nothing and dropped.
    span = config.threads * vector_width(hidden, dtype)
    width = -(-hidden // span) * span

    @T.prim_func
    def combine(expert_out: T.Tensor((rows, hidden), dtype),
                weights: T.Tensor((tokens, top_k), "float32"),
                row_index: T.Tensor((tokens, top_k), "int32"),
                out: T.Tensor((tokens, hidden), dtype)):
        with T.Kernel(T.ceildiv(tokens, block_rows), threads=config.threads) as bx:
            acc = T.alloc_fragment((block_rows, width), "float32")
            T.clear(acc)
            for j in T.serial(top_k):
                for i, h in T.Parallel(block_rows, width):
                    if bx * block_rows + i < tokens and h < hidden:
                        if row_index[bx * block_rows + i, j] >= 0:
                            acc[i, h] += weights[bx * block_rows + i, j] * T.cast(
                                expert_out[row_index[bx * block_rows + i, j], h], "float32")
            for i, h in T.Parallel(block_rows, width):
                if bx * block_rows + i < tokens and h < hidden:
                    out[bx * block_rows + i, h] = T.cast(acc[i, h], dtype)

    return combine


def weight_grad_program(hidden: int, top_k: int, dtype: str, config: CombineConfig):
    """grad_w [tokens, top_k] fp32 from grad_out [tokens, hidden] and expert_out."""
    tokens, rows = T.dynamic("tokens, rows")
    block_rows = config.block_rows
    span = config.threads * vector_width(hidden, dtype)
    width = -(-hidden // span) * span

    @T.prim_func
    def combine_weight_grad(grad_out: T.Tensor((tokens, hidden), dtype),
                            expert_out: T.Tensor((rows, hidden), dtype),
                            row_index: T.Tensor((tokens, top_k), "int32"),
                            grad_w: T.Tensor((tokens, top_k), "float32")):
        with T.Kernel(T.ceildiv(tokens, block_rows), threads=config.threads) as bx:
            g = T.alloc_fragment((block_rows, width), "float32")
            prod = T.alloc_fragment((block_rows, width), "float32")
            dots = T.alloc_fragment((block_rows,), "float32")
            for i, h in T.Parallel(block_rows, width):
                g[i, h] = T.if_then_else(bx * block_rows + i < tokens and h < hidden,
                                         T.cast(grad_out[bx * block_rows + i, h], "float32"),
                                         0.0)
            for j in T.serial(top_k):
                for i, h in T.Parallel(block_rows, width):
                    prod[i, h] = 0.0
                    if bx * block_rows + i < tokens and h < hidden:
                        if row_index[bx * block_rows + i, j] >= 0:
                            prod[i, h] = g[i, h] * T.cast(
                                expert_out[row_index[bx * block_rows + i, j], h], "float32")
                T.reduce_sum(prod, dots, dim=1)
                for i in T.Parallel(block_rows):
                    if bx * block_rows + i < tokens:
                        grad_w[bx * block_rows + i, j] = dots[i]

    return combine_weight_grad


class _RowsOfTopK(Kernel):
    """The combine's kernels: one program of (hidden, top_k, dtype) over blocks of token
    rows, every buffer passed in order; subclasses name the builder."""

    Config = CombineConfig
    builder = staticmethod(combine_program)

    def program(self, config: CombineConfig, bucket: str):
        k = self.key
        return self.builder(k["hidden"], k["top_k"], k["dtype"], config)

    def heuristic_config(self, bucket: str, arch: str) -> CombineConfig:
        return CombineConfig()

    def config_space(self, bucket: str) -> list[CombineConfig]:
        return [CombineConfig(rows, threads) for rows in (1, 2) for threads in (128, 256)]

    def run(self, config: CombineConfig, compiled: tuple, *buffers) -> None:
        compiled[0](*buffers)


class MoeCombineWeightGradKernel(_RowsOfTopK):
    """key: dtype, hidden, top_k: the combine's gradient w.r.t. its weights; run with
    (grad_out, expert_out, row_index, grad_w)."""

    name = "moe_combine_weight_grad"
    builder = staticmethod(weight_grad_program)

    def heuristic_config(self, bucket: str, arch: str) -> CombineConfig:
        return CombineConfig(block_rows=1, threads=256)


class MoeCombineKernel(_RowsOfTopK):
    """key: dtype, hidden, top_k; run with (expert_out, weights, row_index, out). A
    7168-wide bf16 row is 896 vectors: 7 per thread of 128, each read top_k times."""

    name = "moe_combine"
