"""scripts/profile_op.py picks exactly one workload or says which ones matched."""

import dataclasses

import pytest

from .helpers import load_script


@pytest.fixture(scope="module")
def profile_op():
    return load_script("profile_op")


def test_one_matching_workload_is_picked(profile_op):
    op_cls, workload = profile_op.pick_case("GroupedQueryAttentionBwdOp", "8 x 2k", "bfloat16")
    assert op_cls.__name__ == "GroupedQueryAttentionBwdOp"
    assert "8 x 2k" in workload["label"]


def test_several_or_no_matches_name_what_matched(profile_op):
    with pytest.raises(SystemExit, match="matched: .*4 x 4k.*8 x 2k"):
        profile_op.pick_case("GroupedQueryAttentionBwdOp", "training", "bfloat16")
    with pytest.raises(SystemExit, match="matched: none"):
        profile_op.pick_case("GroupedQueryAttentionBwdOp", "no such workload", "bfloat16")


def test_config_replaces_fields_of_the_kernel_default(profile_op):
    op_cls, workload = profile_op.pick_case("GroupedQueryAttentionBwdOp", "8 x 2k", "bfloat16")
    op = op_cls(**op_cls.spec.workload_params(workload))
    shapes = list(op_cls.spec.workload_tensors(workload, "bfloat16").values())  # meta tensors
    config = profile_op.config_with(op, shapes, {"tail_ctas": 0})
    from tileops.kernels.attention import AttentionBwdKernel

    kernel = AttentionBwdKernel(dtype="bfloat16", heads=32, kv_heads=8, head_dim=128,
                                window_left=-1, window_right=0, softcap=0.0)
    assert config == dataclasses.replace(kernel.heuristic_config("all", "sm_90a"),
                                         tail_ctas=0)
    assert config in kernel.config_space("all")
    with pytest.raises(SystemExit, match="no_such_field"):
        profile_op.config_with(op, shapes, {"no_such_field": 1})
    with pytest.raises(SystemExit, match="ds_handoff"):  # an invalid combination
        profile_op.config_with(op, shapes, {"async_mma": True})


def test_config_of_one_kernel_among_several(profile_op):
    """An op running several kernels (the grouped GEMM backward: input and weight
    gradients) takes a config for the kernel named by its dispatch key."""
    op_cls, workload = profile_op.pick_case("GroupedGemmBwdOp", "qwen3-30b-a3b expert gate-up",
                                          "bfloat16")
    op = op_cls(**op_cls.spec.workload_params(workload))
    shapes = list(op_cls.spec.workload_tensors(workload, "bfloat16").values())
    with pytest.raises(SystemExit, match="runs 2 .*--kernel"):
        profile_op.config_with(op, shapes, {"experts_per_cta": 4})
    config = profile_op.config_with(op, shapes, {"experts_per_cta": 4},
                                    "grouped_gemm_weight_grad")
    from tileops.kernels.moe.grouped_gemm import GroupedGemmConfig

    assert config == GroupedGemmConfig(experts_per_cta=4)
