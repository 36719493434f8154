"""Command-line wrapper shared by the benchmark modules."""

from __future__ import annotations

import argparse
import os

from tileops.manifest import load_workloads
from tileops.perf.bench import TABLE_HEADER, bench_op, write_results


def main(op_cls, make_inputs, baselines, name: str) -> None:
    parser = argparse.ArgumentParser(description=f"Benchmark {op_cls.__name__} on the manifest "
                                     "workloads against its baselines.")
    parser.add_argument("--tier", choices=["smoke", "full"], default="full")
    parser.add_argument("--dtype", action="append", help="only these dtypes (repeatable)")
    parser.add_argument("--label", help="only workloads whose label contains this text")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-results"))
    args = parser.parse_args()
    workloads = load_workloads(op_cls.__name__, None if args.tier == "full" else "smoke")
    if args.label:
        workloads = [w for w in workloads if args.label in w["label"]]
    print(TABLE_HEADER)
    rows = bench_op(op_cls, make_inputs, baselines, workloads, args.dtype)
    print(f"\n{op_cls.__name__}\n" + write_results(rows, args.out, name))
