"""Gated activations act(gate) * up, forward and backward, for silu, gelu and gelu-tanh.

Memory-bound and elementwise. Every thread moves `vecs` 16-byte vectors of each tensor:
all of its loads are issued before any math, so each thread keeps `vecs` x (inputs) x 16
bytes in flight. Vectors are numbered row by row (`n // vec` per row), and vector `v` of
a CTA pass `i` is `(block * vecs + i) * threads + thread`, so a warp's accesses are
contiguous. The token count is symbolic; the row length `n` is compiled in.

Two layouts share that mapping and the math:
- fused: x [rows, 2n], gate = x[:, :n], up = x[:, n:] (vLLM / FlashInfer `*_and_mul`);
  its backward writes dx [rows, 2n];
- split: gate, up [rows, n] (the Hugging Face MLP form); its backward writes dgate, dup.

A vector never crosses a row or the gate/up boundary: its width is the largest power of
two that divides n, at most 16 bytes, so a row length that is not a multiple of 8 (fp16 /
bf16) takes narrower, still aligned, accesses instead of a separate tail path. The only
partial piece is the last CTA's, which is guarded per vector. Math in fp32, with the
exponential and the reciprocal from the SFU (`__expf`, `rcp.approx`); exact gelu uses erff.
"""

import math
from dataclasses import dataclass

import tilelang.language as T

from ..base import Kernel
from ..vectors import vector_width

ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
SMALL_ELEMENTS = 1 << 21  # at most this many output elements: the decode-size bucket
MAX_VECTORS = (1 << 31) - 1  # vector indices are int32

_SQRT1_2 = math.sqrt(0.5)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_TANH_K0 = 2.0 * math.sqrt(2.0 / math.pi)  # 0.5 * (1 + tanh(u)) == sigmoid(2u)
_TANH_K1 = 0.044715


@dataclass(frozen=True)
class GatedActivationConfig:
    threads: int = 256
    vecs: int = 2  # vectors of each tensor per thread


def _sigmoid(z):
    return T.fast_rcp(1.0 + T.__exp(-z))


def _gate_term(activation: str, g):
    """s with act(g) = g * s: the sigmoid term (silu, gelu_tanh) or the normal cdf (gelu)."""
    if activation == "silu":
        return _sigmoid(g)
    if activation == "gelu_tanh":
        return _sigmoid(_TANH_K0 * g * (1.0 + _TANH_K1 * g * g))
    return 0.5 * (1.0 + T.erf(g * _SQRT1_2))


def _act_grad(activation: str, g, s):
    """act'(g), given s = the sigmoid term (silu, gelu_tanh) or the normal cdf (gelu)."""
    if activation == "silu":
        return s * (1.0 + g * (1.0 - s))
    if activation == "gelu_tanh":
        return s + g * s * (1.0 - s) * (_TANH_K0 * (1.0 + 3.0 * _TANH_K1 * g * g))
    return s + g * _INV_SQRT_2PI * T.__exp(-0.5 * g * g)


def gated_activation_program(n: int, dtype: str, activation: str, backward: bool, fused: bool,
                             threads: int, vecs: int):
    """The prim_func of one direction and layout; `rows` is symbolic."""
    rows = T.dynamic("rows")
    vec = vector_width(n, dtype)
    row_vecs = n // vec
    up_col = n if fused else 0  # where up starts in its row (the fused layout shares x)

    @T.macro
    def load(buf, col0, local, i, bx, tx):
        v = (bx * vecs + i) * threads + tx
        if v < rows * row_vecs:
            for j in T.vectorized(vec):
                local[i, j] = buf[v // row_vecs, col0 + (v % row_vecs) * vec + j]

    @T.macro
    def store(local, buf, col0, i, bx, tx):
        v = (bx * vecs + i) * threads + tx
        if v < rows * row_vecs:
            for j in T.vectorized(vec):
                buf[v // row_vecs, col0 + (v % row_vecs) * vec + j] = local[i, j]

    @T.macro
    def forward_body(gate, up, y):
        with T.Kernel(T.ceildiv(rows * row_vecs, threads * vecs), threads=threads) as bx:
            tx = T.get_thread_binding()
            gate_local = T.alloc_local((vecs, vec), dtype)
            up_local = T.alloc_local((vecs, vec), dtype)
            y_local = T.alloc_local((vecs, vec), dtype)
            for i in T.unroll(vecs):
                load(gate, 0, gate_local, i, bx, tx)
                load(up, up_col, up_local, i, bx, tx)
            for i in T.unroll(vecs):
                for j in T.unroll(vec):
                    g = T.cast(gate_local[i, j], "float")
                    y_local[i, j] = T.cast(
                        g * _gate_term(activation, g) * T.cast(up_local[i, j], "float"), dtype)
            for i in T.unroll(vecs):
                store(y_local, y, 0, i, bx, tx)

    @T.macro
    def backward_body(dy, gate, up, dgate, dup):
        with T.Kernel(T.ceildiv(rows * row_vecs, threads * vecs), threads=threads) as bx:
            tx = T.get_thread_binding()
            dy_local = T.alloc_local((vecs, vec), dtype)
            gate_local = T.alloc_local((vecs, vec), dtype)
            up_local = T.alloc_local((vecs, vec), dtype)
            dgate_local = T.alloc_local((vecs, vec), dtype)
            dup_local = T.alloc_local((vecs, vec), dtype)
            s_local = T.alloc_local((1,), "float")
            for i in T.unroll(vecs):
                load(dy, 0, dy_local, i, bx, tx)
                load(gate, 0, gate_local, i, bx, tx)
                load(up, up_col, up_local, i, bx, tx)
            for i in T.unroll(vecs):
                for j in T.unroll(vec):
                    g = T.cast(gate_local[i, j], "float")
                    d = T.cast(dy_local[i, j], "float")
                    # a buffer, not a let: TileLang inlines a let of erf into both uses
                    s_local[0] = _gate_term(activation, g)
                    dgate_local[i, j] = T.cast(d * T.cast(up_local[i, j], "float")
                                               * _act_grad(activation, g, s_local[0]), dtype)
                    dup_local[i, j] = T.cast(d * g * s_local[0], dtype)  # act(g) = g * s
            for i in T.unroll(vecs):
                store(dgate_local, dgate, 0, i, bx, tx)
                store(dup_local, dup, up_col, i, bx, tx)

    if not backward and fused:
        @T.prim_func
        def gated_act_fwd_fused(x: T.Tensor((rows, 2 * n), dtype),
                                y: T.Tensor((rows, n), dtype)):
            forward_body(x, x, y)
        return gated_act_fwd_fused
    if not backward:
        @T.prim_func
        def gated_act_fwd(gate: T.Tensor((rows, n), dtype), up: T.Tensor((rows, n), dtype),
                          y: T.Tensor((rows, n), dtype)):
            forward_body(gate, up, y)
        return gated_act_fwd
    if fused:
        @T.prim_func
        def gated_act_bwd_fused(dy: T.Tensor((rows, n), dtype),
                                x: T.Tensor((rows, 2 * n), dtype),
                                dx: T.Tensor((rows, 2 * n), dtype)):
            backward_body(dy, x, x, dx, dx)
        return gated_act_bwd_fused

    @T.prim_func
    def gated_act_bwd(dy: T.Tensor((rows, n), dtype), gate: T.Tensor((rows, n), dtype),
                      up: T.Tensor((rows, n), dtype), dgate: T.Tensor((rows, n), dtype),
                      dup: T.Tensor((rows, n), dtype)):
        backward_body(dy, gate, up, dgate, dup)
    return gated_act_bwd


class GatedActivationKernel(Kernel):
    """key: dtype, n (gate/up row length), activation, backward, fused.

    Buckets: `small` (decode sizes: one vector per thread, so the few rows still spread over
    many CTAs) and `large`; rows only set the grid inside a bucket.
    """

    name = "gated_activation"
    Config = GatedActivationConfig

    def program(self, config: GatedActivationConfig, bucket: str):
        k = self.key
        return gated_activation_program(k["n"], k["dtype"], k["activation"], k["backward"],
                                        k["fused"], config.threads, config.vecs)

    def run(self, config: GatedActivationConfig, compiled: tuple, *tensors) -> None:
        compiled[0](*tensors)

    def bucket_of(self, rows: int) -> str:
        return "small" if rows * self.key["n"] <= SMALL_ELEMENTS else "large"

    def heuristic_config(self, bucket: str, arch: str) -> GatedActivationConfig:
        # Registers cap the bytes in flight per SM alike for 1, 2 or 4 vectors per thread
        # (about 25 registers per vector of the forward: 8, 4 or 2 CTAs of 256 threads, 64 KB
        # of loads); two vectors halve the CTA count of one and keep four CTAs resident.
        # The split backward (five tensors: dy, gate, up in; dgate, dup out) keeps one vector
        # of each: on the H200 (bf16, 2026-12-04) two ran 1.3-1.8% slower (SwiGLU 8B 550.6
        # against 543.7 us, GeGLU Gemma-3-4B 785.7 against 773.6).
        if bucket == "small":
            return GatedActivationConfig(threads=128, vecs=1)
        if self.key["backward"] and not self.key["fused"]:
            return GatedActivationConfig(threads=256, vecs=1)
        return GatedActivationConfig(threads=256, vecs=2)

    def config_space(self, bucket: str) -> list[GatedActivationConfig]:
        space = [self.heuristic_config(bucket, "sm_90a")]
        for threads in (128, 256, 512):
            for vecs in (1, 2, 4, 8):
                space.append(GatedActivationConfig(threads, vecs))
        return list(dict.fromkeys(space))
