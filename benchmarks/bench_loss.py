"""Cross-entropy (loss pass, loss-and-gradient pass, gradient pass) and fused linear
cross-entropy against torch eager, torch.compile and Liger-Kernel."""

import pytest

from tileops import (
    CrossEntropyBwdOp,
    CrossEntropyFwdOp,
    CrossEntropyWithGradFwdOp,
    FusedLinearCrossEntropyFwdOp,
)

OPS = [CrossEntropyFwdOp, CrossEntropyWithGradFwdOp, CrossEntropyBwdOp,
       FusedLinearCrossEntropyFwdOp]


@pytest.mark.gpu
def test_loss(bench, op_cls, workload, dtype):
    bench(op_cls, workload, dtype)
