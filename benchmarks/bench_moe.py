"""Mixture-of-experts ops (routing, permutation, combine) against what a PyTorch user writes
(the Hugging Face routers, a stable argsort and index ops), eager and under torch.compile.
The permutation's random ids index each workload's expert map (uniform routing). The
grouped GEMM runs on each workload's offsets (uniform or Zipf group sizes) against
torch._grouped_mm and a per-expert cuBLAS loop."""

import pytest

from tileops import GroupedGemmFwdOp, MoePermuteFwdOp, MoeRouteFwdOp, MoeUnpermuteFwdOp

OPS = [MoeRouteFwdOp, MoePermuteFwdOp, MoeUnpermuteFwdOp, GroupedGemmFwdOp]


@pytest.mark.gpu
def test_moe(bench, op_cls, workload, dtype):
    bench(op_cls, workload, dtype)
