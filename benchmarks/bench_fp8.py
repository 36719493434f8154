"""quantize_fp8 (against torch's recipe, eager and compiled), gemm_fp8 (against
torch._scaled_mm in the workload's scaling) and grouped_gemm_fp8 (against our bf16 grouped
GEMM and torch._grouped_mm on the dequantized inputs, and a per-expert torch._scaled_mm
loop) on their manifest workloads."""

import pytest

from tileops import GemmFp8FwdOp, GroupedGemmFp8FwdOp, QuantizeFp8FwdOp

OPS = [QuantizeFp8FwdOp, GemmFp8FwdOp, GroupedGemmFp8FwdOp]


@pytest.mark.gpu
def test_fp8(bench, op_cls, workload, dtype):
    bench(op_cls, workload, dtype)
