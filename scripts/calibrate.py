"""Measures a GPU's ceilings for its profile: HBM bandwidth and dense GEMM peak per dtype.

    python scripts/calibrate.py [--out DIR]

Prints the `measured:` block of src/tileops/perf/profiles/<gpu>.yaml (and writes it to
DIR/calibration.yaml). Bandwidth: STREAM triad a = b + s * c and a device-to-device copy over
arrays far larger than L2, counting bytes read plus written. GEMM: the best of a few large
square and LLM-shaped products through cuBLAS (torch.matmul), torch._scaled_mm for fp8. All
timed by the project's protocol (tileops.perf.timing.measure) on random data.
"""

import argparse
import os

import torch
import yaml

from tileops.kernels.base import gpu_slug
from tileops.perf.timing import measure

GEMM_SHAPES = [(8192, 8192, 8192), (4096, 28672, 4096), (8192, 8192, 28672)]


def bandwidth() -> dict[str, float]:
    n = 256 * 2**20  # 1 GiB of fp32 per array
    a, b, c = (torch.randn(n, device="cuda") for _ in range(3))
    triad = measure(lambda: torch.add(b, c, alpha=3.0, out=a))
    copy = measure(lambda: a.copy_(b))
    return {"triad": 3 * 4 * n / (triad.median_ms * 1e-3),
            "copy": 2 * 4 * n / (copy.median_ms * 1e-3)}


def gemm_tflops(dtype: torch.dtype) -> float:
    best = 0.0
    for m, n, k in GEMM_SHAPES:
        a = torch.randn(m, k, device="cuda").to(dtype)
        b = torch.randn(n, k, device="cuda").to(dtype)
        if dtype in (torch.float8_e4m3fn,):
            one = torch.ones((), device="cuda")
            fn = lambda a=a, b=b, one=one: torch._scaled_mm(  # noqa: E731
                a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        else:
            fn = lambda a=a, b=b: a @ b.t()  # noqa: E731
        best = max(best, 2 * m * n * k / (measure(fn).median_ms * 1e-3) / 1e12)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    bw = bandwidth()
    tflops = {name: round(gemm_tflops(dtype))
              for name, dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16),
                                  ("float8_e4m3fn", torch.float8_e4m3fn))}
    torch.set_float32_matmul_precision("high")  # fp32 inputs through the tf32 tensor cores
    tflops["tf32"] = round(gemm_tflops(torch.float32))
    # the profile's ceiling is the faster pattern (the triad on both Hoppers measured)
    measured = {"measured": {"hbm_bytes_per_s": float(f"{max(bw.values()):.3g}"),
                             "hbm_copy_bytes_per_s": float(f"{bw['copy']:.3g}"),
                             "hbm_triad_bytes_per_s": float(f"{bw['triad']:.3g}"),
                             "tflops": tflops}}
    text = yaml.safe_dump(measured, sort_keys=False)
    print(f"# {torch.cuda.get_device_name()} ({gpu_slug(torch.cuda.get_device_name())}.yaml)")
    print(text)
    with open(os.path.join(args.out, "calibration.yaml"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
