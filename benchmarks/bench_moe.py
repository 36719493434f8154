"""Mixture-of-experts ops (routing, permutation, combine) against what a PyTorch user writes
(the Hugging Face routers, a stable argsort and index ops), eager and under torch.compile.
The permutation's random ids index each workload's expert map (uniform routing)."""

import pytest

from tileops import MoePermuteFwdOp, MoeRouteFwdOp, MoeUnpermuteFwdOp

OPS = [MoeRouteFwdOp, MoePermuteFwdOp, MoeUnpermuteFwdOp]


@pytest.mark.gpu
def test_moe(bench, op_cls, workload, dtype):
    bench(op_cls, workload, dtype)
