"""The normalization family (RMSNorm, fused add + RMSNorm, LayerNorm; forward and backward)
against torch eager, torch.compile and Liger (when importable)."""

import pytest

from tileops import (
    FusedAddRMSNormBwdOp,
    FusedAddRMSNormFwdOp,
    LayerNormBwdOp,
    LayerNormFwdOp,
    RMSNormBwdOp,
    RMSNormFwdOp,
)

OPS = [RMSNormFwdOp, RMSNormBwdOp, FusedAddRMSNormFwdOp, FusedAddRMSNormBwdOp, LayerNormFwdOp,
       LayerNormBwdOp]


@pytest.mark.gpu
def test_normalization(bench, op_cls, workload, dtype):
    bench(op_cls, workload, dtype)
