"""Host time per call of each layer of a launch (no L2 flush, device work is tiny).

    python scripts/host_overhead.py
"""

import torch

import tileops
from tileops import GemmFwdOp, RMSNormFwdOp
from tileops.perf.timing import call_latency_us


def main():
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    op = RMSNormFwdOp(normalized_shape=[4096], eps=1e-5)
    op(x, w)
    kernel = op.get_kernel("rms_norm", x.device, **op._kernel_key(x.dtype, 4096, has_weight=True))
    config, (exe,) = kernel.select(64)  # the TVM-FFI executable the op launches
    rows = {
        "torch F.rms_norm": lambda: torch.nn.functional.rms_norm(x, [4096], w, 1e-5),
        "torch.empty_like": lambda: torch.empty_like(x),
        "tvm-ffi executable": lambda: exe(x, w, y, 1e-5),
        "Kernel.__call__": lambda: kernel(64, x, w, y, 1e-5),
        "op.check": lambda: op.check([x, w], require_cuda=True),
        "RMSNormFwdOp()": lambda: op(x, w),
        "tileops.rms_norm": lambda: tileops.rms_norm(x, [4096], w, 1e-5),
        "torch.ops.tileops.rms_norm_fwd": lambda: torch.ops.tileops.rms_norm_fwd(x, [4096], w,
                                                                               1e-5),
        "torch add + F.rms_norm": lambda: torch.nn.functional.rms_norm(x + y, [4096], w, 1e-5),
        "tileops.fused_add_rms_norm": lambda: tileops.fused_add_rms_norm(x, y, w, 1e-5),
        "tileops.fused_add_rms_norm_": lambda: tileops.fused_add_rms_norm_(x, y, w, 1e-5),
        "torch F.layer_norm": lambda: torch.nn.functional.layer_norm(x, [4096], w, w),
        "tileops.layer_norm": lambda: tileops.layer_norm(x, [4096], w, w),
    }
    a = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(6144, 4096, device="cuda", dtype=torch.bfloat16)
    g = GemmFwdOp()
    g(a, b)
    rows["torch.matmul 16x6144x4096"] = lambda: torch.matmul(a, b.t())
    rows["tileops.gemm 16x6144x4096"] = lambda: tileops.gemm(a, b)
    print(f"{'layer':40s} host us/call")
    for name, fn in rows.items():
        print(f"{name:40s} {call_latency_us(fn, calls=2000):8.1f}")
    print("dlpack exchange api:", hasattr(torch.Tensor, "__dlpack_c_exchange_api__"),
          hasattr(torch.Tensor, "__c_dlpack_exchange_api__"))


if __name__ == "__main__":
    main()
