"""Cross-entropy (loss pass, loss-and-gradient pass, gradient pass) against torch eager,
torch.compile and Liger-Kernel."""

import pytest

from tileops import CrossEntropyBwdOp, CrossEntropyFwdOp, CrossEntropyWithGradFwdOp

OPS = [CrossEntropyFwdOp, CrossEntropyWithGradFwdOp, CrossEntropyBwdOp]


@pytest.mark.gpu
def test_loss(bench, op_cls, workload, dtype):
    bench(op_cls, workload, dtype)
