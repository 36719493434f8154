"""The position-encoding family (rotary embeddings: HF form forward and backward, vLLM's
cache form) against torch eager and torch.compile of the reference formulas, and Liger's
rotary kernel (when importable)."""

import pytest

from tileops import RotaryBwdOp, RotaryFwdOp, RotaryWithCacheFwdOp

OPS = [RotaryFwdOp, RotaryBwdOp, RotaryWithCacheFwdOp]


@pytest.mark.gpu
def test_position_encoding(bench, op_cls, workload, dtype):
    bench(op_cls, workload, dtype)
