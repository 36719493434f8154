"""kernels/fast_math.py: exp as the SFU's ex2 alone, and the helper CUDA every kernel imports
as one text (kernels/cuda_helpers.py). The numbers are checked by the emulator tests of the
softmax family and by the GPU tests; here, that the generated code takes the short path."""

import dataclasses

import pytest

from tileops.kernels.attention.attention_fwd import AttentionFwdKernel
from tileops.kernels.softmax.cross_entropy import CrossEntropyKernel
from tileops.kernels.softmax.softmax import SoftmaxKernel


def source_of(kernel, config, bucket):
    return kernel.compile(config, bucket)[0].get_kernel_source()


@pytest.mark.compile
def test_soft_capped_gradient_takes_ex2_alone():
    """No exp2f (its subnormal fix-up) and no tanhf in the soft-capped gradient pass."""
    kernel = CrossEntropyKernel(mode="grad", n=256000, dtype="bfloat16", softcap=True,
                                smoothing=False, dloss_per_row=False)
    source = source_of(kernel, kernel.heuristic_config("many", "sm_90a"), "many")
    assert "ex2.approx.ftz.f32" in source and "tileops_math::ex2(" in source
    assert "exp2f(" not in source and "tanhf(" not in source


@pytest.mark.compile
def test_l2_hints_and_fast_math_share_one_imported_source():
    """A softmax walk with L2 hints calls both helpers: TileLang refuses a second imported
    text, so both come from cuda_helpers' one, each namespace once."""
    kernel = SoftmaxKernel(kind="softmax_fwd", n=128256, dtype="bfloat16")
    config = next(c for c in kernel.config_space("many") if c.l2_hints)
    source = source_of(kernel, config, "many")
    assert source.count("namespace tileops_l2 {") == 1
    assert source.count("namespace tileops_math {") == 1
    assert "tileops_l2::load16(" in source and "tileops_math::ex2(" in source


@pytest.mark.compile
@pytest.mark.full
def test_attention_fast_exp_config():
    """The attention forward's fast_exp option: the default with a soft cap (measured
    faster there), the soft-capped scores and the probabilities without exp2f or tanhf;
    without a cap the default keeps exp2f and fast_exp is the tuner's variant."""
    kernel = AttentionFwdKernel(dtype="bfloat16", heads=8, kv_heads=2, head_dim=256,
                                window_left=127, window_right=0, softcap=50.0)
    fast = kernel.heuristic_config("long", "sm_90a")
    assert fast.fast_exp
    assert dataclasses.replace(fast, fast_exp=False) in kernel.config_space("long")
    source = source_of(kernel, fast, "long")
    assert "tileops_math::ex2(" in source
    assert "exp2f(" not in source and "tanhf(" not in source
    uncapped = AttentionFwdKernel(dtype="bfloat16", heads=8, kv_heads=2, head_dim=128,
                                  window_left=-1, window_right=0, softcap=0.0)
    default = uncapped.heuristic_config("long", "sm_90a")
    assert not default.fast_exp
    assert dataclasses.replace(default, fast_exp=True) in uncapped.config_space("long")
    assert "exp2f(" in source_of(uncapped, default, "long")


def test_attention_backward_fast_exp_default_with_a_soft_cap():
    """The backward takes fast_exp by default where the scores are soft-capped (Gemma-2,
    measured 5% faster), exp2f otherwise; the other choice stays in the tuner's space."""
    from tileops.kernels.attention.attention_bwd import AttentionBwdKernel

    for softcap, head_dim in ((50.0, 256), (0.0, 128), (0.0, 256)):
        kernel = AttentionBwdKernel(dtype="bfloat16", heads=16, kv_heads=8, head_dim=head_dim,
                                    window_left=4095, window_right=0, softcap=softcap)
        default = kernel.heuristic_config("all", "sm_90a")
        assert default.fast_exp == (softcap > 0)
        assert dataclasses.replace(default, fast_exp=not default.fast_exp) \
            in kernel.config_space("all")
