"""GemmFwdOp, tileops.linear (forward and backward) and tileops.linear_group against cuBLAS
through torch."""

import pytest

from tileops import GemmFwdOp, LinearBwdOp, LinearFwdOp, LinearGroupFwdOp

OPS = [GemmFwdOp, LinearFwdOp, LinearBwdOp, LinearGroupFwdOp]


@pytest.mark.gpu
def test_gemm(bench, op_cls, workload, dtype):
    bench(op_cls, workload, dtype)
