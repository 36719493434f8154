"""The SFU's approximate 2^x and 1/x as single instructions, for element-wise kernels whose
instruction issue, not HBM, sets the pace (soft-capped cross-entropy: a tanh and an exp per
logit).

CUDA's exp2f (which T.exp2 and T.__exp become without --use_fast_math) wraps the SFU's ex2
in a compare and two predicated multiplies that keep subnormal results: five instructions
where one does. Here `ex2.approx.ftz.f32` alone (about 2 ulp, as exp2f; results below 2^-126
flush to 0, subnormal inputs likewise), written as non-volatile inline PTX so the compiler may
merge repeated calls on the same value. A kernel that uses `exp2` calls `import_source()`
in its T.Kernel body (cuda_helpers: one imported text for every helper).
"""

import math

import tilelang.language as T

from . import cuda_helpers

LOG2E = math.log2(math.e)  # exp(x) = exp2(x * LOG2E): the one definition kernels share

CUDA_SOURCE = r"""
namespace tileops_math {
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
}  // namespace tileops_math
"""


def import_source():
    """Call inside a T.Kernel body that uses exp2()."""
    cuda_helpers.import_source()


def exp2(v):
    """2^v in float32 on the SFU (one instruction); 0 for v <= -126, inf for v >= 128."""
    return T.call_extern("float32", "tileops_math::ex2", T.cast(v, "float32"))


def scaled_tanh(v, scale, out_scale):
    """out_scale * tanh(v * scale) as out_scale - 2 out_scale / (2^(2 log2(e) scale v) + 1):
    a multiply into one ex2, the approximate reciprocal and an FMA (tanhf is a long
    polynomial), the factors loop-invariant; exact at +-inf, absolute error ~out_scale *
    1e-7. The one soft-cap formula (cross-entropy's logits, attention's scores)."""
    return out_scale - (2.0 * out_scale) * T.fast_rcp(exp2(v * (2.0 * LOG2E * scale)) + 1.0)


def tanh(v):
    """tanh(v) on the SFU (`scaled_tanh` unscaled)."""
    return scaled_tanh(v, 1.0, 1.0)
