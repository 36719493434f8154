"""The SFU's approximate 2^x and 1/x as single instructions, for element-wise kernels whose
instruction issue, not HBM, sets the pace (soft-capped cross-entropy: a tanh and an exp per
logit).

CUDA's exp2f (which T.exp2 and T.__exp become without --use_fast_math) wraps the SFU's ex2
in a compare and two predicated multiplies that keep subnormal results: five instructions
where one does. Here `ex2.approx.ftz.f32` alone (about 2 ulp, as exp2f; results below 2^-126
flush to 0, subnormal inputs likewise), written as non-volatile inline PTX so the compiler may
merge repeated calls on the same value. A kernel that uses `exp2` calls `import_source()`
in its T.Kernel body (cuda_helpers: one imported text for every helper).

`div_by` divides many values by one divisor in three instructions where CUDA's IEEE
division spends eight and an SFU reciprocal on each, with the same correctly rounded result.
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
// x / s rounded as IEEE division, given r = 1 / s (IEEE): the product's error corrected by
// one fused residual step (Markstein: r correctly rounded and q within an ulp of x / s make
// q + (x - s q) r round to x / s, while s and r are normal). The step turns an infinite q
// (x infinite, the quotient past the range, s zero) into NaN: there q is the answer; s
// infinite (r = 0) likewise. A NaN r marks a divisor outside those cases (|s| subnormal or
// past 2^126), which takes the division itself.
__device__ __forceinline__ float div_by(float x, float s, float r) {
  float q = x * r;
  float q1 = fmaf(fmaf(-s, q, x), r, q);
  return q1 == q1 ? q1 : q;
}
__device__ __forceinline__ float div_by_checked(float x, float s, float r) {
  return r == r ? div_by(x, s, r) : x / s;
}
__device__ __forceinline__ bool is_nan(float v) { return v != v; }
}  // namespace tileops_math
"""


def import_source():
    """Call inside a T.Kernel body that uses exp2()."""
    cuda_helpers.import_source()


def exp2(v):
    """2^v in float32 on the SFU (one instruction); 0 for v <= -126, inf for v >= 128."""
    return T.call_extern("float32", "tileops_math::ex2", T.cast(v, "float32"))


def reciprocal_for_div_by(s):
    """The r that `div_by` takes for divisor s: 1 / s, or NaN (the division itself, under
    `checked`) where s is subnormal or past 2^126 and so 1 / s or the residual loses bits."""
    s = T.cast(s, "float32")
    a = T.abs(s)
    exact = T.Or(T.Or(a == 0.0, a == T.infinity("float32")),
                 T.And(a >= 2.0 ** -126, a <= 2.0 ** 126))
    return T.if_then_else(exact, T.float32(1.0) / s, T.float32(float("nan")))


def div_by(x, s, r, checked: bool = True):
    """x / s as IEEE rounds it, by the reciprocal r = reciprocal_for_div_by(s). Unchecked
    (five instructions) where s is known normal, zero or infinite, e.g. an amax / 448."""
    name = "tileops_math::div_by_checked" if checked else "tileops_math::div_by"
    return T.call_extern("float32", name, T.cast(x, "float32"), T.cast(s, "float32"),
                         T.cast(r, "float32"))


def is_nan(v):
    """v != v, which TileLang's simplifier would fold to false if written in TIR."""
    return T.call_extern("bool", "tileops_math::is_nan", T.cast(v, "float32"))


def scaled_tanh(v, scale, out_scale):
    """out_scale * tanh(v * scale) as out_scale - 2 out_scale / (2^(2 log2(e) scale v) + 1):
    a multiply into one ex2, the approximate reciprocal and an FMA (tanhf is a long
    polynomial), the factors loop-invariant; exact at +-inf, absolute error ~out_scale *
    1e-7. The one soft-cap formula (cross-entropy's logits, attention's scores)."""
    return out_scale - (2.0 * out_scale) * T.fast_rcp(exp2(v * (2.0 * LOG2E * scale)) + 1.0)


def tanh(v):
    """tanh(v) on the SFU (`scaled_tanh` unscaled)."""
    return scaled_tanh(v, 1.0, 1.0)
