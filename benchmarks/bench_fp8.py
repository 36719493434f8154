"""quantize_fp8 (against torch's recipe, eager and compiled) and gemm_fp8 (against
torch._scaled_mm in the workload's scaling) on their manifest workloads."""

import pytest

from tileops import GemmFp8FwdOp, QuantizeFp8FwdOp

OPS = [QuantizeFp8FwdOp, GemmFp8FwdOp]


@pytest.mark.gpu
def test_fp8(bench, op_cls, workload, dtype):
    bench(op_cls, workload, dtype)
