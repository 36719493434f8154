"""GemmFwdOp against cuBLAS (torch.matmul) on the manifest workloads."""

import pytest

from tileops import GemmFwdOp

OP = GemmFwdOp


@pytest.mark.gpu
def test_gemm(bench, workload, dtype):
    bench(OP, workload, dtype)
