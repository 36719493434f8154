"""The AdamW update, in place, on one flat tensor: param, exp_avg and exp_avg_sq read and
written, grad read (14 bytes an element in 16-bit, 28 in fp32).

The math is torch.optim.AdamW's (the fused CUDA form), in fp32 on values of the tensors'
dtype (16-bit tensors divide by the SFU's reciprocal, see `fast_rcp`):
    g = grad * grad_scale                      (grad_scale: -1 for maximize; 1/scale to unscale)
    param = param * decay                      (decay = 1 - lr * weight_decay)
    exp_avg = beta1 * exp_avg + (1 - beta1) * g
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g * g
    param = param - step_size * exp_avg / (sqrt(exp_avg_sq) * bc2_rsqrt + eps)
with step_size = lr / (1 - beta1^t) and bc2_rsqrt = 1 / sqrt(1 - beta2^t) computed on the
host per step: scalar arguments, so every step of every learning-rate schedule runs one
compiled program.

Memory-bound: each thread moves `vecs` vectors of `vec` elements of each tensor, every load
issued before any math. `vec` is 16 bytes where the four tensors' addresses allow (the op
picks it), else narrower; the element count is symbolic. The last partial vector is guarded
element by element.
"""

import dataclasses
from dataclasses import dataclass

import tilelang.language as T

from ..base import Kernel

SMALL_ELEMENTS = 1 << 18  # at most this many elements: the small-tensor bucket (norm weights)


@dataclass(frozen=True)
class AdamWConfig:
    threads: int = 256
    vecs: int = 1  # vectors of each tensor per thread
    # the update's division as a multiply by the SFU's reciprocal (within an fp32 ulp or
    # two of the IEEE quotient) instead of IEEE division's instruction sequence
    fast_rcp: bool = False


def adamw_program(dtype: str, vec: int, threads: int, vecs: int, fast_rcp: bool = False):
    """The prim_func of one dtype and vector width; the element count `n` is symbolic."""
    n = T.dynamic("n")
    per_cta = threads * vecs * vec

    @T.macro
    def load(buf, local, i, start):
        if start + vec <= n:
            for j in T.vectorized(vec):
                local[i, j] = buf[start + j]
        else:
            for j in T.unroll(vec):
                if start + j < n:
                    local[i, j] = buf[start + j]

    @T.macro
    def store(local, buf, i, start):
        if start + vec <= n:
            for j in T.vectorized(vec):
                buf[start + j] = local[i, j]
        else:
            for j in T.unroll(vec):
                if start + j < n:
                    buf[start + j] = local[i, j]

    @T.prim_func
    def adamw_step(param: T.Tensor((n,), dtype), grad: T.Tensor((n,), dtype),
                   exp_avg: T.Tensor((n,), dtype), exp_avg_sq: T.Tensor((n,), dtype),
                   grad_scale: T.float32, decay: T.float32, beta1: T.float32,
                   beta2: T.float32, eps: T.float32, step_size: T.float32,
                   bc2_rsqrt: T.float32):
        with T.Kernel(T.ceildiv(n, per_cta), threads=threads) as bx:
            tx = T.get_thread_binding()
            p_local = T.alloc_local((vecs, vec), dtype)
            g_local = T.alloc_local((vecs, vec), dtype)
            m_local = T.alloc_local((vecs, vec), dtype)
            v_local = T.alloc_local((vecs, vec), dtype)
            for i in T.unroll(vecs):
                start = ((bx * vecs + i) * threads + tx) * vec
                if start < n:
                    load(param, p_local, i, start)
                    load(grad, g_local, i, start)
                    load(exp_avg, m_local, i, start)
                    load(exp_avg_sq, v_local, i, start)
            for i in T.unroll(vecs):
                for j in T.unroll(vec):
                    g = T.cast(g_local[i, j], "float") * grad_scale
                    m = beta1 * T.cast(m_local[i, j], "float") + (1.0 - beta1) * g
                    v = beta2 * T.cast(v_local[i, j], "float") + (1.0 - beta2) * g * g
                    p = T.cast(p_local[i, j], "float") * decay
                    m_local[i, j] = T.cast(m, dtype)
                    v_local[i, j] = T.cast(v, dtype)
                    denom = T.sqrt(v) * bc2_rsqrt + eps
                    step = (step_size * m * T.fast_rcp(denom) if fast_rcp
                            else step_size * m / denom)
                    p_local[i, j] = T.cast(p - step, dtype)
            for i in T.unroll(vecs):
                start = ((bx * vecs + i) * threads + tx) * vec
                if start < n:
                    store(p_local, param, i, start)
                    store(m_local, exp_avg, i, start)
                    store(v_local, exp_avg_sq, i, start)

    return adamw_step


class AdamWKernel(Kernel):
    """key: dtype, vec (elements a vector: 16 bytes where the tensors' addresses allow).

    Buckets: `small` (norm weights, biases: one vector a thread over 128-thread CTAs, so a
    few thousand elements still spread over several SMs) and `large`.
    """

    name = "adamw"
    Config = AdamWConfig

    def program(self, config: AdamWConfig, bucket: str):
        return adamw_program(self.key["dtype"], self.key["vec"], config.threads, config.vecs,
                             config.fast_rcp)

    def run(self, config: AdamWConfig, compiled: tuple, *args) -> None:
        compiled[0](*args)

    def bucket_of(self, size: int) -> str:
        return "small" if size <= SMALL_ELEMENTS else "large"

    def heuristic_config(self, bucket: str, arch: str) -> AdamWConfig:
        # 16-bit tensors divide by the SFU's reciprocal: within an fp32 ulp or two, far under
        # their own rounding, and 1.016-1.033x on the H100 (bf16, 2026-12-06: 4096 x 4096
        # 82.9 -> 80.2 us, 14336 x 4096 278.0 -> 273.3, Qwen3-30B-A3B experts 1866.5 ->
        # 1837.3); fp32 keeps IEEE division (1.000x there), torch's exact quotient
        fast_rcp = self.key["dtype"] != "float32"
        if bucket == "small":
            return AdamWConfig(threads=128, vecs=1, fast_rcp=fast_rcp)
        # four 16-byte loads a thread (one vector of each tensor): 8 CTAs of 256 threads an
        # SM keep 128 KB of loads in flight. On the H100 (bf16, 2026-12-06) two vectors a
        # thread ran 1.6% slower on a 14336 x 4096 weight (285.6 against 281.0 us), 0.3%
        # on Qwen3-30B-A3B's experts; four, 11%.
        return AdamWConfig(threads=256, vecs=1, fast_rcp=fast_rcp)

    def config_space(self, bucket: str) -> list[AdamWConfig]:
        space = [self.heuristic_config(bucket, "sm_90a")]
        for threads in (128, 256, 512):
            for vecs in (1, 2, 4):
                space.append(AdamWConfig(threads, vecs))
        space += [dataclasses.replace(c, fast_rcp=True) for c in space]
        return list(dict.fromkeys(space))
