"""What torch's plainest memory-bound kernels reach on an op's own tensor sizes.

    python scripts/bandwidth_at_size.py 8192x4096 4096x16384 [--dtype bfloat16]

The calibrated ceiling (scripts/calibrate.py) is a STREAM triad over 1 GiB arrays, where a
launch's ramp-up and tail are a fraction of a percent. A 64 MB row op pays them on every
call, so this times, on arrays of each given shape, the patterns of the row norms: a copy
(one read, one write: the forward) and an add (two reads, one write: the backward's dy and
h in, dx out), by the project's protocol (tileops.perf.timing: CUPTI, L2 flushed, random
data). Each line: us, TB/s, and % of the profile's measured ceiling, so an op's own % of
that ceiling reads against what the simplest kernel moving the same bytes gets.
"""

import argparse

import torch

from tileops.perf.profiles import load_profile
from tileops.perf.timing import measure


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("shapes", nargs="+", help="ROWSxCOLUMNS, e.g. 8192x4096")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    ceiling = load_profile(torch.cuda.get_device_name()).bytes_per_s
    print(f"{torch.cuda.get_device_name()}, {args.dtype}, % of {ceiling / 1e12:.2f} TB/s")
    for text in args.shapes:
        rows, columns = (int(v) for v in text.lower().split("x"))
        a, b, c = (torch.randn(rows, columns, device="cuda").to(dtype) for _ in range(3))
        nbytes = a.numel() * a.element_size()
        patterns = (("copy", lambda a=a, b=b: a.copy_(b), 2 * nbytes),
                    ("add", lambda a=a, b=b, c=c: torch.add(b, c, out=a), 3 * nbytes))
        for name, fn, moved in patterns:
            us = measure(fn, trials=5).median_ms * 1e3
            rate = moved / (us * 1e-6)
            print(f"{text:>12} {name:>4}: {us:8.1f} us {rate / 1e12:5.2f} TB/s "
                  f"{100 * rate / ceiling:5.1f}%")


if __name__ == "__main__":
    main()
