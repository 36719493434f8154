"""Greedy and top-k selection over vocabulary logits (argmax, topk) against torch.argmax /
torch.topk eager and under torch.compile."""

import pytest

from tileops import ArgmaxFwdOp, TopkFwdOp

OPS = [ArgmaxFwdOp, TopkFwdOp]


@pytest.mark.gpu
def test_selection(bench, op_cls, workload, dtype):
    bench(op_cls, workload, dtype)
