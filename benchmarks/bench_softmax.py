"""The softmax family (softmax, log_softmax, logsumexp; forward and backward) against torch
eager, torch.compile and Liger (softmax forward)."""

import pytest

from tileops import (
    LogSoftmaxBwdOp,
    LogSoftmaxFwdOp,
    LogsumexpBwdOp,
    LogsumexpFwdOp,
    SoftmaxBwdOp,
    SoftmaxFwdOp,
)

OPS = [SoftmaxFwdOp, SoftmaxBwdOp, LogSoftmaxFwdOp, LogSoftmaxBwdOp, LogsumexpFwdOp,
       LogsumexpBwdOp]


@pytest.mark.gpu
def test_softmax(bench, op_cls, workload, dtype):
    bench(op_cls, workload, dtype)
