"""Pre-building kernels: the compile sweep (`tileops compile`) and the warmup API.

Both walk manifest workloads through each op's `kernels_for`, so they build exactly the
programs a call with those shapes would run. No GPU is needed for an explicit target.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

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

    items: dict[tuple, BuildItem] = {}
    for name in op_names or sorted(OP_CLASSES):
        cls = OP_CLASSES[name]
        spec = cls.spec
        for workload in (workloads or {}).get(name) or load_workloads(name, tier):
            for dtype in workload["dtypes"]:
                op = cls(**spec.workload_params(workload))
                tensors = spec.workload_tensors(workload, dtype)
                ns = op.check([tensors[n] for n in spec.input_names])
                for dispatch_key, key, size in op.kernels_for(ns):
                    kernel = op.kernel_map[dispatch_key](target=target, gpu=gpu, **key)
                    bucket = kernel.bucket_of(size)
                    config = kernel.config_for(bucket)
                    dedupe = (type(kernel), tuple(sorted(key.items())), bucket, config)
                    items.setdefault(dedupe, BuildItem(name, workload["label"], dtype, kernel,
                                                       bucket, config))
    return list(items.values())


def warmup(op_names: Iterable[str] | None = None, tier: str | None = None,
           target: dict[str, str] = SM90A, gpu: str | None = "h200",
           progress: Callable[[BuildItem], None] | None = None) -> int:
    """Compiles (or loads from the disk cache) every kernel the manifest workloads need.

    Returns how many programs were built. Later calls with those shapes start fast.
    """
    plan = build_plan(op_names, tier, target, gpu)
    for item in plan:
        if progress:
            progress(item)
        item.kernel.compile(item.config, item.bucket)
    return len(plan)
