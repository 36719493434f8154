"""RMSNormFwdOp against torch eager, torch.compile and Liger (when importable)."""

import pytest

from tileops import RMSNormFwdOp

OP = RMSNormFwdOp


@pytest.mark.gpu
def test_rms_norm(bench, workload, dtype):
    bench(OP, workload, dtype)
