"""GemmFwdOp vs cuBLAS (torch.matmul) on the manifest workloads.

    python benchmarks/bench_gemm.py [--tier smoke] [--dtype bfloat16] [--out DIR]
"""

import torch

from tileops import GemmFwdOp

try:
    from .common import main
except ImportError:
    from common import main


def make_inputs(workload, dtype):
    a_shape, b_shape = workload["inputs"]["a"], workload["inputs"]["b"]
    a = torch.randn(a_shape, device="cuda").to(dtype)
    b = (torch.randn(b_shape, device="cuda") * b_shape[-1] ** -0.5).to(dtype)
    return a, b


def cublas(a, b, trans_a=False, trans_b=True):
    return torch.matmul(a.t() if trans_a else a, b.t() if trans_b else b)


if __name__ == "__main__":
    main(GemmFwdOp, make_inputs, {"cublas": cublas}, "gemm")
