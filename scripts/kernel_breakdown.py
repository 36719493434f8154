"""What one call of an op, and of each of its baselines, runs on the GPU: every kernel,
memset and copy with its median time (CUPTI, L2 flushed before each call), in launch order.

    python scripts/kernel_breakdown.py GroupedQueryAttentionBwdOp --workload "8 x 2k" \
        --dtype bfloat16

Shows where a multi-kernel op spends its time (main kernel against helper passes) next to
how a baseline splits the same work.
"""

import argparse

import torch

from tileops.ops import OP_CLASSES
from tileops.perf.baselines import select_baselines
from tileops.perf.bench import bench_cases, case_candidates, random_inputs
from tileops.perf.timing import kernel_breakdown

NAME_WIDTH = 90


def print_case(op_cls, workload: dict, dtype: str, only_baselines: list[str] | None) -> None:
    """The breakdown of the op and of each of its baselines (or of those named) on one
    (workload, dtype)."""
    params = op_cls.spec.workload_params(workload)
    op = op_cls(**params)
    inputs = random_inputs(op_cls, workload, dtype)
    try:  # e.g. leave out torch.compile's device-side compile
        baselines = select_baselines(op_cls.__name__, only_baselines)
    except ValueError as err:
        raise SystemExit(f"--baseline: {err}") from None
    candidates = case_candidates(op, params, lambda fn: lambda: fn(*inputs), baselines)
    print(f"\n{op_cls.__name__} [{workload['label']}] {dtype}")
    for name, fn in candidates.items():
        try:
            rows = kernel_breakdown(fn)
        except Exception as e:  # noqa: BLE001 - a baseline that cannot run is reported
            print(f"  {name}: {type(e).__name__}: {e}")
            continue
        print(f"  {name}: {sum(us for _, us in rows):.1f} us in {len(rows)} activities")
        for kernel, us in rows:
            print(f"    {us:10.1f} us  {kernel[:NAME_WIDTH]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("op", choices=sorted(OP_CLASSES))
    parser.add_argument("--workload", action="append", metavar="TEXT",
                        help="only workloads whose label contains TEXT (repeatable)")
    parser.add_argument("--dtype", nargs="+", metavar="D", help="only these dtypes")
    parser.add_argument("--baseline", action="append", metavar="NAME",
                        help="only these baselines (repeatable; --baseline none: the op alone)")
    args = parser.parse_args()
    op_cls = OP_CLASSES[args.op]
    for _, workload, dtype in bench_cases([op_cls], None, args.dtype, args.workload):
        only = None if args.baseline is None else [b for b in args.baseline if b != "none"]
        print_case(op_cls, workload, dtype, only)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
