"""prebuild.recording(): ops called on meta tensors list the programs a GPU call would build
(CPU, no kernels)."""

import pytest
import torch

import tileops
from tileops.prebuild import build_plan, recorded_plan, recording

from .helpers import meta

pytestmark = pytest.mark.smoke


def _programs(plan):
    return {(type(i.kernel), i.bucket, i.config) for i in plan}


def test_meta_calls_record_the_programs_their_workload_builds():
    workload = {"label": "recorded rms_norm", "dtypes": ["bfloat16"],
                "inputs": {"input": [4096, 4096], "weight": [4096]},
                "params": {"normalized_shape": [4096], "eps": 1e-6}}
    expected = build_plan(["RMSNormFwdOp"], workloads={"RMSNormFwdOp": [workload]})
    assert expected
    with recording() as calls:
        out = tileops.rms_norm(meta(4096, 4096), [4096], meta(4096), 1e-6)
    assert out.device.type == "meta" and len(calls) == 1
    plan = recorded_plan(calls)
    assert _programs(plan) == _programs(expected)
    assert plan[0].dtype == "bfloat16" and plan[0].op_name == "RMSNormFwdOp"


def test_recorded_programs_are_deduplicated_and_only_inside_the_context():
    tileops.rms_norm(meta(64, 1024), [1024], meta(1024))  # before: not recorded
    with recording() as outer:
        tileops.rms_norm(meta(64, 1024), [1024], meta(1024))
        with recording() as inner:  # the innermost recording takes the calls
            tileops.gemm(meta(512, 256), meta(128, 256))
        tileops.rms_norm(meta(64, 1024), [1024], meta(1024))
    tileops.rms_norm(meta(64, 1024), [1024], meta(1024))  # after: not recorded
    assert len(outer) == 2 and len(inner) == 1
    assert len(recorded_plan(outer)) == 1
    assert [i.op_name for i in recorded_plan(inner)] == ["GemmFwdOp"]


def test_autograd_on_meta_records_the_backward_programs():
    x = meta(256, 2048).requires_grad_()
    w = meta(2048).requires_grad_()
    with recording() as calls:
        tileops.rms_norm(x, [2048], w, 1e-5).sum().backward()
    ops = {i.op_name for i in recorded_plan(calls)}
    assert ops == {"RMSNormFwdOp", "RMSNormBwdOp"}
    assert x.grad is not None and x.grad.device.type == "meta"


def test_cuda_like_fake_tensors_record_too():
    # torch.compile traces on fake tensors: the custom op's fake kernel notes them as well
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(128, 4096, dtype=torch.bfloat16, device="cuda")
        w = torch.empty(4096, dtype=torch.bfloat16, device="cuda")
        with recording() as calls:
            torch.ops.tileops.rms_norm_fwd(x, [4096], w, 1e-6)
    assert [type(op).__name__ for op, _ in calls] == ["RMSNormFwdOp"]
