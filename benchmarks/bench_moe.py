"""Mixture-of-experts ops (routing, permutation, combine) against what a PyTorch user writes
(the Hugging Face routers, a stable argsort and index ops), eager and under torch.compile.
The permutation's random ids index each workload's expert map (uniform routing). The
grouped GEMMs (forward, backward, gate-up with SiLU) run on each workload's offsets (uniform
or Zipf group sizes) against torch._grouped_mm and a per-expert cuBLAS loop; the fused layer
against the same chain in pure PyTorch (eager, torch.compile, and with the loop)."""

import pytest

from tileops import (
    FusedMoeFwdOp,
    GroupedGemmBwdOp,
    GroupedGemmFwdOp,
    GroupedGemmSiluAndMulFwdOp,
    MoePermuteFwdOp,
    MoeRouteFwdOp,
    MoeUnpermuteBwdOp,
    MoeUnpermuteFwdOp,
)

OPS = [MoeRouteFwdOp, MoePermuteFwdOp, MoeUnpermuteFwdOp, MoeUnpermuteBwdOp, GroupedGemmFwdOp,
       GroupedGemmBwdOp, GroupedGemmSiluAndMulFwdOp, FusedMoeFwdOp]


@pytest.mark.gpu
def test_moe(bench, op_cls, workload, dtype):
    bench(op_cls, workload, dtype)
