"""The inputs the bench and the tuner time on (CPU)."""

import pytest
import torch

from tileops.manifest import load_workloads
from tileops.ops import OP_CLASSES
from tileops.perf.bench import random_inputs


def workloads(op_name):
    """The smoke tier's (the full tier's shapes take seconds each to fill on a CPU)."""
    return [(op_name, w) for w in load_workloads(op_name, "smoke")]


@pytest.mark.parametrize("op_name, workload",
                         workloads("GroupedQueryAttentionVarlenFwdOp") + workloads("GemmFwdOp"),
                         ids=lambda x: x if isinstance(x, str) else x["label"])
def test_inputs_are_random_where_the_workload_gives_a_shape_and_kept_where_it_gives_values(
        op_name, workload):
    op_cls = OP_CLASSES[op_name]
    given = op_cls.spec.workload_tensors(workload, "bfloat16")
    inputs = random_inputs(op_cls, workload, "bfloat16", device="cpu")
    assert len(inputs) == len(given)
    for name, made, spec in zip(given, inputs, given.values(), strict=True):
        if spec is None:
            assert made is None, name
        elif spec.device.type == "cpu":  # values the workload fixes (cu_seqlens)
            assert torch.equal(made, spec), name
        else:  # only a shape: random, never zeros
            assert made.shape == spec.shape and made.dtype == spec.dtype, name
            assert made.float().std() > 0.5, name
    if op_name == "GroupedQueryAttentionVarlenFwdOp":
        cu_seqlens_q = inputs[list(given).index("cu_seqlens_q")]
        assert cu_seqlens_q[-1] == inputs[0].shape[0] and (cu_seqlens_q.diff() >= 0).all()
