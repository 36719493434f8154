"""Pre-building kernels: the compile sweep (`tileops compile`) and the warmup API.

Both walk manifest workloads through each op's `kernels_for`, so they build exactly the
programs a call with those shapes would run. No GPU is needed for an explicit target.
`recording()` does the same for whatever a program calls on meta tensors (a model's
training step, say: `tileops bench-model --compile-only`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .errors import TileOpsValueError
from .kernels.base import SM90A, Kernel
from .manifest import load_workloads


@dataclass(frozen=True)
class BuildItem:
    op_name: str
    label: str
    dtype: str
    kernel: Kernel
    bucket: Any
    config: Any

    def describe(self) -> str:
        return f"{self.op_name} [{self.label}] {self.dtype} {self.kernel.name} {self.bucket}"


def build_plan(op_names: Iterable[str] | None = None, tier: str | None = None,
               target: dict[str, str] = SM90A, gpu: str | None = "h200",
               workloads: dict[str, list[dict[str, Any]]] | None = None) -> list[BuildItem]:
    """Every distinct (kernel, bucket, config) the given ops' workloads would build."""
    from .ops import OP_CLASSES

    op_names = list(op_names or sorted(OP_CLASSES))
    unknown = [n for n in op_names if n not in OP_CLASSES]
    if unknown:
        raise TileOpsValueError(f"unknown op(s) {unknown}; implemented: {sorted(OP_CLASSES)}")
    items: dict[tuple, BuildItem] = {}
    for name in op_names:
        cls = OP_CLASSES[name]
        spec = cls.spec
        for workload in (workloads or {}).get(name) or load_workloads(name, tier):
            for dtype in workload["dtypes"]:
                op = cls(**spec.workload_params(workload))
                tensors = spec.workload_tensors(workload, dtype)
                ns = op.check([tensors[n] for n in spec.input_names])
                _add_items(items, op, ns, workload["label"], dtype, target, gpu)
    return list(items.values())


def _add_items(items: dict[tuple, BuildItem], op: Any, ns: Any, label: str, dtype: str,
               target: dict[str, str], gpu: str | None) -> None:
    """The (kernel, bucket, config) programs a call of `op` with namespace `ns` runs, added
    to `items` unless there already."""
    for dispatch_key, key, size in op.kernels_for(ns):
        kernel = op.kernel_map[dispatch_key](target=target, gpu=gpu, **key)
        bucket = kernel.bucket_of(size)
        config = kernel.config_for(bucket)
        dedupe = (type(kernel), tuple(sorted(key.items())), bucket, config)
        items.setdefault(dedupe, BuildItem(op.spec.op_name, label, dtype, kernel, bucket,
                                           config))


# -- recording the calls of a program ---------------------------------------------------------
# Ops called on meta tensors are validated and return meta outputs (ops/base.py). Inside
# `recording()` each such call is also noted, so running a model's step on the meta device
# (no GPU, no memory) lists exactly the programs the same step on a GPU would build.
_recorders: list[list[tuple[Any, Any]]] = []


def note_meta_call(op: Any, ns: Any) -> None:
    """Called by Op._meta_outputs (meta inputs, or the custom op's fake kernel): noted
    by the innermost `recording()`, if any."""
    if _recorders:
        _recorders[-1].append((op, ns))


@contextlib.contextmanager
def recording() -> Iterator[list[tuple[Any, Any]]]:
    """Notes every op called on meta tensors inside: yields the (op, namespace) list that
    `recorded_plan` turns into programs."""
    calls: list[tuple[Any, Any]] = []
    _recorders.append(calls)
    try:
        yield calls
    finally:
        _recorders.remove(calls)


def recorded_plan(calls: Iterable[tuple[Any, Any]], label: str = "recorded",
                  target: dict[str, str] = SM90A, gpu: str | None = "h200") -> list[BuildItem]:
    """Every distinct (kernel, bucket, config) the recorded calls would build."""
    items: dict[tuple, BuildItem] = {}
    for op, ns in calls:
        dtype = next((str(t.dtype).removeprefix("torch.") for t in ns.values()
                      if isinstance(t, torch.Tensor)), "")
        _add_items(items, op, ns, label, dtype, target, gpu)
    return list(items.values())


def print_progress(line: str) -> None:
    """warmup's default progress: each line on stderr, at once."""
    print(f"tileops.warmup: {line}", file=sys.stderr, flush=True)


def warmup(op_names: Iterable[str] | None = None, tier: str | None = None,
           target: dict[str, str] = SM90A, gpu: str | None = "h200",
           progress: Callable[[str], None] | None = print_progress) -> int:
    """Compiles (or loads from the disk cache) every kernel the manifest workloads need.

    This only compiles, for `target` (sm_90a by default): nothing runs and no GPU is needed
    or used. The programs land in TileLang's disk cache (`$TILELANG_CACHE_DIR`, by default
    under `$TILEOPS_CACHE_DIR`), where a later process that calls an op with these shapes
    finds them instead of compiling; a program already there loads in milliseconds. New
    programs need nvcc and take seconds to minutes each.

    Args:
        op_names: the ops to warm up (Op class names); default: every implemented op.
        tier: 'smoke' for the workloads CI compiles; default: every workload.
        target: the TileLang target, e.g. {"kind": "cuda", "arch": "sm_90a"}.
        gpu: whose tuned table picks the configs ('h200'); None: the rule-based defaults.
        progress: called with one line of text: what will be built, then one line before
            each program ("[3/12] ..."), then the total time. The default prints to
            stderr; None is silent.

    Returns:
        How many programs were built or loaded.
    """
    plan = build_plan(op_names, tier, target, gpu)
    total = len(plan)
    if progress:
        progress(_plan_summary(total, target))
    start = time.perf_counter()
    width = len(str(total))
    for done, item in enumerate(plan, 1):
        if progress:
            progress(f"[{done:>{width}}/{total}] {item.describe()}")
        item.kernel.compile(item.config, item.bucket)
    if progress:
        progress(f"{total} programs ready in {time.perf_counter() - start:.1f} s")
    return total


def _plan_summary(total: int, target: dict[str, str]) -> str:
    cache = os.environ.get("TILELANG_CACHE_DIR", "TileLang's default")
    nvcc = shutil.which("nvcc")
    compiler = (f"nvcc {nvcc}" if nvcc else
                "nvcc not found: only programs already in the cache will load")
    return (f"{total} programs for {target['kind']} {target['arch']} (compile only, nothing "
            f"runs on a GPU; cache {cache}; {compiler})")
