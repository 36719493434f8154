"""The gated activations (silu_and_mul, gelu_and_mul, swiglu, geglu; forward and
backward) against torch eager, torch.compile, Liger and FlashInfer (when importable)."""

import pytest

from tileops import (
    GegluBwdOp,
    GegluFwdOp,
    GeluAndMulBwdOp,
    GeluAndMulFwdOp,
    SiluAndMulBwdOp,
    SiluAndMulFwdOp,
    SwigluBwdOp,
    SwigluFwdOp,
)

OPS = [SiluAndMulFwdOp, SiluAndMulBwdOp, GeluAndMulFwdOp, GeluAndMulBwdOp, SwigluFwdOp,
       SwigluBwdOp, GegluFwdOp, GegluBwdOp]


@pytest.mark.gpu
def test_activation(bench, op_cls, workload, dtype):
    bench(op_cls, workload, dtype)
