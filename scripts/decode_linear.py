"""tileops.linear against F.linear (cuBLAS) at decode token counts on Llama-3.1-8B's Linear
shapes, by the project's timing protocol (L2 flushed before each call), with the weight's
read rate (torch.sum over the same bytes) as the ceiling.

    python scripts/decode_linear.py [--tokens 1 8 64]      # on the GPU
    python scripts/decode_linear.py --compile-only         # builds the programs, no GPU

Each output is checked against an fp64 product before timing.
"""

import argparse
import sys

import torch
import torch.nn.functional as F

import tileops

SHAPES = {"q_proj": (4096, 4096), "k_proj": (1024, 4096), "gate_proj": (14336, 4096),
          "down_proj": (4096, 14336), "lm_head": (128256, 4096), "qkv": (6144, 4096),
          "gate_up": (28672, 4096)}


def compile_only(tokens: list[int]) -> int:
    from tileops import prebuild
    from tileops.cli import _compile_plan

    with prebuild.recording() as calls:
        for m in tokens:
            for n, k in SHAPES.values():
                tileops.linear(torch.empty(m, k, dtype=torch.bfloat16, device="meta"),
                               torch.empty(n, k, dtype=torch.bfloat16, device="meta"))
    return _compile_plan(prebuild.recorded_plan(calls, label="decode"), "sm_90a", 2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--compile-only", action="store_true")
    args = parser.parse_args()
    if args.compile_only:
        return compile_only(args.tokens)
    from tileops.perf.timing import measure_together

    print(torch.cuda.get_device_name())
    print(f"{'shape':10} {'M':>4} {'MB':>7} {'tileops us':>10} {'cuBLAS us':>10} {'x':>6} "
          f"{'read us':>8}")
    for m in args.tokens:
        for name, (n, k) in SHAPES.items():
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / 64
            want = (x.double() @ w.double().T).to(torch.bfloat16)
            torch.testing.assert_close(tileops.linear(x, w), want, rtol=2e-2, atol=2e-2)
            r = measure_together({"tileops": lambda x=x, w=w: tileops.linear(x, w),
                                  "cublas": lambda x=x, w=w: F.linear(x, w),
                                  "read": lambda w=w: w.sum()})
            t, c, rd = (r[key].median_ms * 1e3 for key in ("tileops", "cublas", "read"))
            mb = (n * k + m * k + m * n) * 2 / 1e6
            print(f"{name:10} {m:4d} {mb:7.1f} {t:10.1f} {c:10.1f} {c / t:6.3f} {rd:8.1f}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
