"""Autotunes every manifest workload on this GPU and writes the winners.

    python scripts/tune_h200.py [--op GemmFwdOp] [--out DIR]

Winners go to the user's tuned table (TILEOPS_CACHE_DIR/tuned/<gpu>.json), which is copied
to DIR; commit it as src/tileops/kernels/tuned/<gpu>.json to ship it.
"""

import argparse
import os
import shutil
import time

import torch

from tileops.kernels.base import cache_root, gpu_slug
from tileops.ops import OP_CLASSES


def random_inputs(op_cls, workload, dtype):
    tensors = op_cls.spec.workload_tensors(workload, dtype)
    return [None if t is None else torch.randn(t.shape, device="cuda").to(t.dtype)
            for t in tensors.values()]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--op", action="append")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--label", action="append",
                        help="only workloads whose label contains this text (repeatable)")
    args = parser.parse_args()
    for name in args.op or sorted(OP_CLASSES):
        op_cls = OP_CLASSES[name]
        for workload in op_cls.spec.entry["workloads"]:
            if args.label and not any(text in workload["label"] for text in args.label):
                continue
            for dtype in workload["dtypes"]:
                t = time.time()
                op = op_cls(**op_cls.spec.workload_params(workload), tune=True)
                inputs = random_inputs(op_cls, workload, dtype)
                op(*inputs)
                ns = op.check(inputs)
                for dispatch_key, key, size in op.kernels_for(ns):
                    kernel = op.get_kernel(dispatch_key, inputs[0].device, **key)
                    config, _ = kernel.select(size)
                    print(f"{name} | {workload['label']} | {dtype} | {config} | "
                          f"{time.time() - t:.0f}s", flush=True)
                # copy after every workload: a run cut short still returns what it found
                gpu = gpu_slug(torch.cuda.get_device_name())
                table = cache_root() / "tuned" / f"{gpu}.json"
                shutil.copy(table, os.path.join(args.out, f"{gpu}.json"))


if __name__ == "__main__":
    main()
