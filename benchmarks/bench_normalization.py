"""RMSNormFwdOp vs torch eager, torch.compile and Liger (when importable).

    python benchmarks/bench_normalization.py [--tier smoke] [--dtype bfloat16] [--out DIR]
"""

import torch
import torch.nn.functional as F

from tileops import RMSNormFwdOp

try:
    from .common import main
except ImportError:
    from common import main


def make_inputs(workload, dtype):
    x = torch.randn(workload["inputs"]["input"], device="cuda").to(dtype)
    w = torch.randn(workload["inputs"]["weight"], device="cuda").to(dtype)
    return x, w


def eager(x, w, normalized_shape, eps):
    return F.rms_norm(x, normalized_shape, w, eps)


_compiled = torch.compile(eager, dynamic=False)


def compiled(x, w, normalized_shape, eps):
    return _compiled(x, w, normalized_shape, eps)


BASELINES = {"torch-eager": eager, "torch-compile": compiled}
try:
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    def liger(x, w, normalized_shape, eps):
        return LigerRMSNormFunction.apply(x, w, eps)

    BASELINES["liger"] = liger
except ImportError:
    pass

if __name__ == "__main__":
    main(RMSNormFwdOp, make_inputs, BASELINES, "normalization")
