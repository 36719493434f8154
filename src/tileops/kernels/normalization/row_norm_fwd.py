"""Row normalization forward: RMSNorm and LayerNorm over the last dimension, optionally
after adding a residual (the pre-norm residual stream of a Llama-style layer).

    h = x (+ residual, rounded to the input dtype, which is also written out)
    y = (h - mean(h) if centered) * rsqrt(mean((h - mean)^2) + eps) (* w) (+ b)

Memory-bound: every CTA owns `block_rows` whole rows, held in registers between the row
sums and the scaling, so each input is read from HBM once and each output written once.
The row count is symbolic; the hidden size is compiled in (it decides the vector width and
the thread map). Math in fp32, cast at the store. The backward recomputes the row
statistics from h, so the forward saves nothing.
"""

from dataclasses import dataclass

import tilelang.language as T

from ..base import Kernel
from .rows import RowTile, row_configs, vector_map_ok

FEW_ROWS = 1024


@dataclass(frozen=True)
class NormConfig:
    block_rows: int = 1
    threads: int = 256


def norm_fwd_program(n: int, dtype: str, centered: bool, has_weight: bool, has_bias: bool,
                     has_residual: bool, block_rows: int, threads: int):
    rows = T.dynamic("rows")
    tile = RowTile(n, block_rows, threads)
    load, store = tile.macros(rows)
    n_tile = tile.n_tile

    def value(x_local, mean_local, i, j):  # h in fp32, centered for LayerNorm
        h = T.cast(x_local[i, j], "float")
        return h - mean_local[i] if centered else h

    @T.macro
    def body(x, residual, w, b, y, residual_out, eps):
        with T.Kernel(T.ceildiv(rows, block_rows), threads=threads) as bx:
            row0 = bx * block_rows
            x_local = T.alloc_fragment(tile.shape, dtype)
            sq_local = T.alloc_fragment(tile.shape, "float")
            mean_local = T.alloc_fragment((block_rows,), "float") if centered else None
            rstd_local = T.alloc_fragment((block_rows,), "float")
            y_local = T.alloc_fragment(tile.shape, dtype)
            load(x, x_local, row0)
            if has_residual:
                r_local = T.alloc_fragment(tile.shape, dtype)
                load(residual, r_local, row0)
                for i, j in T.Parallel(block_rows, n_tile):
                    x_local[i, j] = x_local[i, j] + r_local[i, j]  # rounded, as torch's add
                store(x_local, residual_out, row0)
            if centered:
                for i, j in T.Parallel(block_rows, n_tile):
                    sq_local[i, j] = T.cast(x_local[i, j], "float")
                T.reduce_sum(sq_local, mean_local, dim=1)
                for i in T.Parallel(block_rows):
                    mean_local[i] = mean_local[i] / n
            for i, j in T.Parallel(block_rows, n_tile):
                # centered padding is -mean: it must stay out of the variance
                sq_local[i, j] = T.if_then_else(
                    j < n, value(x_local, mean_local, i, j) * value(x_local, mean_local, i, j),
                    0.0)
            T.reduce_sum(sq_local, rstd_local, dim=1)
            for i in T.Parallel(block_rows):
                rstd_local[i] = T.rsqrt(rstd_local[i] / n + eps)
            for i, j in T.Parallel(block_rows, n_tile):
                col = T.min(j, n - 1)  # padded columns read a valid weight, never stored
                v = value(x_local, mean_local, i, j) * rstd_local[i]
                if has_weight:
                    v = v * T.cast(w[col], "float")
                if has_bias:
                    v = v + T.cast(b[col], "float")
                y_local[i, j] = T.cast(v, dtype)
            store(y_local, y, row0)

    # One prim_func signature per combination of optional tensors (TileLang binds every
    # declared tensor), all sharing `body`. Each parameter needs its own annotation object:
    # TileLang makes one buffer per object, so a shared one would alias x and y.
    R, V = (rows, n), (n,)
    if has_residual:
        @T.prim_func
        def fused_add_norm(x: T.Tensor(R, dtype), residual: T.Tensor(R, dtype),
                           w: T.Tensor(V, dtype), y: T.Tensor(R, dtype),
                           residual_out: T.Tensor(R, dtype), eps: T.float32):
            body(x, residual, w, None, y, residual_out, eps)
        return fused_add_norm
    if has_weight and has_bias:
        @T.prim_func
        def norm_wb(x: T.Tensor(R, dtype), w: T.Tensor(V, dtype), b: T.Tensor(V, dtype),
                    y: T.Tensor(R, dtype), eps: T.float32):
            body(x, None, w, b, y, None, eps)
        return norm_wb
    if has_weight:
        @T.prim_func
        def rms_norm(x: T.Tensor(R, dtype), w: T.Tensor(V, dtype), y: T.Tensor(R, dtype),
                     eps: T.float32):
            body(x, None, w, None, y, None, eps)
        return rms_norm
    if has_bias:
        @T.prim_func
        def norm_b(x: T.Tensor(R, dtype), b: T.Tensor(V, dtype), y: T.Tensor(R, dtype),
                   eps: T.float32):
            body(x, None, None, b, y, None, eps)
        return norm_b

    @T.prim_func
    def norm(x: T.Tensor(R, dtype), y: T.Tensor(R, dtype), eps: T.float32):
        body(x, None, None, None, y, None, eps)
    return norm


class NormFwdKernel(Kernel):
    """Base of the forward norm kernels. Subclasses fix the program's flags (`flags`) from
    their key; the key always holds dtype and n. Buckets: up to FEW_ROWS rows ("few",
    decode batches), and more ("all")."""

    Config = NormConfig

    def flags(self) -> dict[str, bool]:
        raise NotImplementedError

    def program(self, config: NormConfig, bucket: str):
        return norm_fwd_program(self.key["n"], self.key["dtype"], block_rows=config.block_rows,
                                threads=config.threads, **self.flags())

    def run(self, config: NormConfig, compiled: tuple, *tensors) -> None:
        compiled[0](*(t for t in tensors if t is not None))

    def bucket_of(self, size: int) -> str:
        return "few" if size <= FEW_ROWS else "all"

    def heuristic_config(self, bucket: str, arch: str) -> NormConfig:
        n = self.key["n"]
        # ~16K elements per CTA keeps several 16-byte loads in flight per thread (the H200
        # tuning winners for hidden 8192 and 16384 hold 8 vectors per thread); a decode
        # batch spreads its few rows over more CTAs instead (~2K elements each). At most
        # 64 elements per thread: more would spill.
        target = max(1, (2048 if bucket == "few" else 16384) // n)
        for block_rows in sorted({target, *(r for r in (1, 2, 4, 8, 16, 32) if r < target)},
                                 reverse=True):
            for threads in (256, 128, 64):
                if vector_map_ok(n, block_rows, threads) and block_rows * n <= 64 * threads:
                    return NormConfig(block_rows, threads)
        return NormConfig(block_rows=1, threads=128 if n <= 4096 else 256)  # padded path

    def config_space(self, bucket: str) -> list[NormConfig]:
        # 1024 threads left out: a tuning run on the H200 stalled in this space once, and
        # 1024-thread reductions are the untested corner.
        space = [self.heuristic_config(bucket, "sm_90a")]
        space += [NormConfig(r, t) for r, t in row_configs(self.key["n"], (8, 64))]
        return list(dict.fromkeys(space))


class RMSNormKernel(NormFwdKernel):
    """key: dtype, n (normalized size), has_weight."""

    name = "rms_norm"

    def flags(self) -> dict[str, bool]:
        return {"centered": False, "has_weight": self.key["has_weight"], "has_bias": False,
                "has_residual": False}


class FusedAddRMSNormKernel(NormFwdKernel):
    """key: dtype, n. h = x + residual is written out and normalized (weight required)."""

    name = "fused_add_rms_norm"

    def flags(self) -> dict[str, bool]:
        return {"centered": False, "has_weight": True, "has_bias": False, "has_residual": True}


class LayerNormKernel(NormFwdKernel):
    """key: dtype, n, has_weight, has_bias."""

    name = "layer_norm"

    def flags(self) -> dict[str, bool]:
        return {"centered": True, "has_weight": self.key["has_weight"],
                "has_bias": self.key["has_bias"], "has_residual": False}
