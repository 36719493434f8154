"""Calls one op on one manifest workload a few times, for a profiler to watch:

    ncu --clock-control none --kernel-name regex:attention_bwd_kernel --launch-skip 1 \
        --launch-count 1 python scripts/profile_op.py GroupedQueryAttentionBwdOp \
        --workload "8 x 2k" --dtype bfloat16

The first call compiles and loads the kernels (skip it); the inputs are the bench's (fresh
random values). `--config '{"tail_ctas": 0}'` runs the op's kernel with those fields of
its default config replaced (here a config of the space that is not the default).
gpu_session.sh `ncu` wraps this.
"""

import argparse
import dataclasses
import json
import sys

import torch

from tileops.ops import OP_CLASSES
from tileops.perf.bench import bench_cases, random_inputs


def pick_case(op_name: str, workload_text: str, dtype: str) -> tuple:
    """(op class, workload) of the one manifest workload of `op_name` whose label contains
    `workload_text` and that runs in `dtype`; SystemExit naming the matches otherwise."""
    op_cls = OP_CLASSES[op_name]
    cases = [(c, w) for c, w, _ in bench_cases([op_cls], None, [dtype], [workload_text])]
    if len(cases) != 1:
        labels = [w["label"] for _, w in cases] or ["none"]
        raise SystemExit(f"profile_op: --workload {workload_text!r} must match one "
                         f"{op_name} workload in {dtype}, matched: {'; '.join(labels)}")
    return cases[0]


def config_with(op, inputs: list, overrides: dict, dispatch_key: str | None = None):
    """The default config of the one kernel `op` runs on `inputs` (shapes suffice), or of
    its kernel under `dispatch_key`, with `overrides` replacing its fields; SystemExit when
    that leaves several kernels or none, or a field is unknown or the combination invalid."""
    kernels = [k for k in op.kernels_for(op.check(inputs))
               if dispatch_key in (None, k[0])]
    if len(kernels) != 1:
        raise SystemExit(f"profile_op: --config needs one kernel, {type(op).__name__} runs "
                         f"{len(kernels)}{'' if dispatch_key is None else ' under ' + dispatch_key}"
                         " (name one with --kernel)")
    dispatch_key, key, size = kernels[0]
    kernel = op.kernel_map[dispatch_key](**key)
    default = kernel.heuristic_config(kernel.bucket_of(size), kernel.target["arch"])
    try:
        return dataclasses.replace(default, **overrides)
    except (TypeError, ValueError) as err:
        raise SystemExit(f"profile_op: --config {json.dumps(overrides)}: {err}") from None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("op", choices=sorted(OP_CLASSES))
    parser.add_argument("--workload", required=True, metavar="TEXT",
                        help="the workload whose label contains TEXT (exactly one)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--calls", type=int, default=2, help="calls, the first included")
    parser.add_argument("--config", type=json.loads, metavar="JSON",
                        help="fields of the kernel's default config to replace")
    args = parser.parse_args(argv)
    op_cls, workload = pick_case(args.op, args.workload, args.dtype)
    op = op_cls(**op_cls.spec.workload_params(workload))
    inputs = random_inputs(op_cls, workload, args.dtype)
    if args.config:
        config = config_with(op, inputs, args.config)
        op.pin_config(config, *inputs)
        print(f"profile_op: {config}", file=sys.stderr)
    for _ in range(args.calls):
        op(*inputs)
    torch.cuda.synchronize()
    print(f"{args.op} [{workload['label']}] {args.dtype}: {args.calls} calls", file=sys.stderr)


if __name__ == "__main__":
    main()
