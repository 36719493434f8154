"""The AdamW update (one parameter tensor, in place) against torch.optim.AdamW's fused and
foreach updates."""

import pytest

from tileops import AdamwStepFwdOp

OPS = [AdamwStepFwdOp]


@pytest.mark.gpu
def test_optimizer(bench, op_cls, workload, dtype):
    bench(op_cls, workload, dtype)
