"""GemmFwdOp and tileops.linear (forward and backward) against cuBLAS through torch."""

import pytest

from tileops import GemmFwdOp, LinearBwdOp, LinearFwdOp

OPS = [GemmFwdOp, LinearFwdOp, LinearBwdOp]


@pytest.mark.gpu
def test_gemm(bench, op_cls, workload, dtype):
    bench(op_cls, workload, dtype)
