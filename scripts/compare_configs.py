"""Times an op's default config against variants of it and against the op's baselines, on
manifest workloads, interleaved by the bench's timer (CUPTI, L2 flushed, the bench's pool of
input copies rotated call by call, trials taken round by round, so a drifting clock moves
every candidate alike; at most 15 trials, where the bench allows 45):

    python scripts/compare_configs.py GroupedQueryAttentionBwdOp --workload "8 x 2k" \
        --workload "4 x 4k" --dtype bfloat16 --config '{"stages": 3}'

Each --config replaces fields of the default config (see profile_op.py); for an op that runs
several kernels, of the one named by --kernel (GroupedGemmBwdOp: --kernel
grouped_gemm_weight_grad), the others keeping theirs. A variant whose
outputs disagree with the default's on the same inputs is reported and not timed, as in
the tuner. Cheaper than `tileops tune` when only a few configs of a large space matter,
and it puts the best baseline in the same rounds. --baseline NAME (repeatable) times only
those baselines: two grouped-GEMM compares (4 variants, torch._grouped_mm and the
per-expert loop `torch-loop`, hundreds of launches a call) did not finish in 100 s; the
loop is the likely cost, and `--baseline torch-grouped-mm` leaves it out.

With --compile-only it needs no GPU: it builds the programs the comparison would run (the
default config's and each variant's, for sm_90a) into the kernel cache under
$TILEOPS_CACHE_DIR. Built here into .tilecache and carried to the GPU machine
(`carry: [".gpu", ".whl", ".tilecache"]`; gpu_session.sh reads that cache), the device
call times instead of compiling:

    TILEOPS_CACHE_DIR=.tilecache python scripts/compare_configs.py LayerNormFwdOp \
        --workload phi-2 --config '{"threads": 320}' --compile-only
"""

import argparse
import json

import torch
from profile_op import config_with

from tileops.kernels.base import agrees
from tileops.ops import OP_CLASSES
from tileops.perf.baselines import select_baselines
from tileops.perf.bench import (
    OP_KEY,
    bench_cases,
    case_candidates,
    pool_size_for,
    random_inputs,
    rotating,
)
from tileops.perf.timing import measure_together


def _tensors(outputs) -> list:
    """An op's outputs as a list of tensors (`list` of a lone tensor would split its rows:
    one comparison per row, 17 s per variant at 32768 rows)."""
    return list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]


def _outputs_on_copies(op, inputs) -> list:
    """The op's outputs on copies of `inputs`: an in-place op (AdamW, the cache append)
    leaves the inputs that every candidate is checked and timed on as they were."""
    return _tensors(op(*[t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]))


def compare(op_cls, workload: dict, dtype: str, variants: list[dict],
            only_baselines: list[str] | None = None, dispatch_key: str | None = None) -> None:
    params = op_cls.spec.workload_params(workload)
    inputs = random_inputs(op_cls, workload, dtype)
    default_op = op_cls(**params)
    reference = _outputs_on_copies(default_op, inputs)
    try:  # e.g. leave out a slow per-expert loop
        baselines = select_baselines(op_cls.__name__, only_baselines)
    except ValueError as err:
        raise SystemExit(f"--baseline: {err}") from None
    # the bench's candidates (the op under OP_KEY, then its baselines), variants added
    # the bench's pool of input copies, so both time the same thing
    bind = rotating(inputs, pool_size_for(inputs))
    candidates = case_candidates(default_op, params, bind, baselines)
    for overrides in variants:
        name = json.dumps(overrides)
        op = op_cls(**params)
        op.pin_config(config_with(op, inputs, overrides, dispatch_key), *inputs,
                      dispatch_key=dispatch_key)
        if not agrees(_outputs_on_copies(op, inputs), reference):
            print(f"  {name}: outputs disagree with the default's (not timed)")
            continue
        candidates[name] = bind(op)
    timings = measure_together(candidates, trials=5, warm_seconds=2.0, max_trials=15)
    base = timings[OP_KEY].median_ms
    best = min((n for n in baselines if not isinstance(timings[n], Exception)),
               key=lambda n: timings[n].median_ms, default=None)
    print(f"\n{op_cls.__name__} [{workload['label']}] {dtype}")
    for name, timing in timings.items():
        if isinstance(timing, Exception):
            print(f"  {name}: {type(timing).__name__}: {timing}")
            continue
        ms = timing.median_ms
        line = (f"  {ms * 1e3:10.1f} us  {base / ms:6.3f}x default  "
                f"spread {timing.spread_pct:4.1f}%")
        if best is not None and name not in baselines:
            line += f"  {timings[best].median_ms / ms:6.3f}x {best}"
        print(f"{line}  {'default' if name == OP_KEY else name}")


def compile_only(op_cls, workload: dict, dtype: str, variants: list[dict],
                 dispatch_key: str | None = None) -> None:
    """Builds what `compare` runs on this workload, from the shapes alone (meta tensors)."""
    spec = op_cls.spec
    op = op_cls(**spec.workload_params(workload))
    tensors = spec.workload_tensors(workload, dtype)
    inputs = [tensors[name] for name in spec.input_names]
    for dispatch_key, key, size in op.kernels_for(op.check(inputs)):
        kernel = op.kernel_map[dispatch_key](gpu="h200", **key)
        bucket = kernel.bucket_of(size)
        kernel.compile(kernel.config_for(bucket), bucket)
    for overrides in variants:
        config = config_with(op, inputs, overrides, dispatch_key)
        dispatch, key, size = next(k for k in op.kernels_for(op.check(inputs))
                                   if dispatch_key in (None, k[0]))
        kernel = op.kernel_map[dispatch](gpu="h200", **key)
        kernel.compile(config, kernel.bucket_of(size))
    print(f"built {op_cls.__name__} [{workload['label']}] {dtype}: default + "
          f"{len(variants)} variant(s)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("op", choices=sorted(OP_CLASSES))
    parser.add_argument("--workload", action="append", required=True, metavar="TEXT",
                        help="workloads whose label contains TEXT, or equals TEXT after a "
                             "leading = (repeatable)")
    parser.add_argument("--dtype", nargs="+", default=["bfloat16"])
    parser.add_argument("--config", type=json.loads, action="append", default=[],
                        metavar="JSON", help="fields of the default config to replace")
    parser.add_argument("--baseline", action="append", metavar="NAME",
                        help="time only these baselines (repeatable; default: all of the op's; "
                             "--baseline none: the op's configs alone)")
    parser.add_argument("--kernel", metavar="DISPATCH_KEY",
                        help="for ops that run several kernels: the one the configs replace "
                             "(a key of the op's kernel_map, e.g. grouped_gemm_weight_grad)")
    parser.add_argument("--compile-only", action="store_true",
                        help="build the programs into the kernel cache (no GPU needed)")
    args = parser.parse_args()
    op_cls = OP_CLASSES[args.op]
    for _, workload, dtype in bench_cases([op_cls], None, args.dtype, args.workload):
        if args.compile_only:
            compile_only(op_cls, workload, dtype, args.config, args.kernel)
            continue
        only = None if args.baseline is None else [b for b in args.baseline if b != "none"]
        compare(op_cls, workload, dtype, args.config, only, args.kernel)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
