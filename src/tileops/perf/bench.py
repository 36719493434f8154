"""Benchmark rows for an op over its manifest workloads, against independent baselines."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..manifest.spec import DTYPES
from .profiles import load_profile
from .timing import time_cuda


@dataclass
class BenchRow:
    op: str
    label: str
    dtype: str
    latency_us: float
    tflops: float
    tbps: float
    sol_us: float
    sol_pct: float
    bound: str
    baselines: dict[str, float] = field(default_factory=dict)  # name -> latency (us)
    best_baseline: str = ""
    speedup: float = 0.0  # best baseline latency / TileOPs latency
    timing: str = "cuda-events, L2 flushed, median of 3 trials"


def bench_op(op_cls: Any, make_inputs: Callable[[dict, torch.dtype], tuple],
             baselines: dict[str, Callable[..., Any]], workloads: list[dict],
             dtypes: list[str] | None = None, progress: Callable[[str], None] = print,
             ) -> list[BenchRow]:
    """Times the op and each baseline on every (workload, dtype); never checks values."""
    profile = load_profile(torch.cuda.get_device_name())
    rows = []
    for workload in workloads:
        params = op_cls.spec.workload_params(workload)
        op = op_cls(**params)
        for dtype_name in workload["dtypes"]:
            if dtypes and dtype_name not in dtypes:
                continue
            inputs = make_inputs(workload, DTYPES[dtype_name])
            op(*inputs)  # compile / load before timing
            latency = time_cuda(lambda o=op, x=inputs: o(*x)) * 1e3
            flops, nbytes = op.eval_roofline(*inputs)
            sol_s, bound = profile.sol_seconds(flops, nbytes, dtype_name)
            base = {}
            for name, fn in baselines.items():
                try:
                    base[name] = time_cuda(
                        lambda f=fn, x=inputs, p=params: f(*x, **p)) * 1e3
                except Exception as e:  # noqa: BLE001 - a baseline that cannot run is skipped
                    progress(f"  baseline {name} failed: {type(e).__name__}: {e}")
            best = min(base, key=base.get) if base else ""
            row = BenchRow(op_cls.__name__, workload["label"], dtype_name, latency,
                           flops / latency / 1e6, nbytes / latency / 1e6, sol_s * 1e6,
                           100 * sol_s * 1e6 / latency, bound, base, best,
                           base[best] / latency if best else 0.0)
            progress(format_row(row))
            rows.append(row)
    return rows


def format_row(r: BenchRow) -> str:
    best = f"{r.best_baseline} {r.baselines.get(r.best_baseline, 0):.1f}"
    return (f"| {r.label} | {r.dtype} | {r.latency_us:.1f} | {r.tflops:.0f} | {r.tbps:.2f} | "
            f"{r.sol_pct:.0f}% {r.bound} | {best} | {r.speedup:.2f}x |")


TABLE_HEADER = ("| workload | dtype | TileOPs us | TFLOP/s | TB/s | SOL | best baseline us | "
                "speed-up |\n|---|---|---|---|---|---|---|---|")


def write_results(rows: list[BenchRow], out_dir: str | pathlib.Path, name: str) -> str:
    """Writes <name>.json and <name>.md; returns the Markdown table."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name()
    (out / f"{name}.json").write_text(json.dumps(
        {"gpu": gpu, "rows": [asdict(r) for r in rows]}, indent=1))
    table = "\n".join([TABLE_HEADER] + [format_row(r) for r in rows])
    (out / f"{name}.md").write_text(f"{gpu}\n\n{table}\n")
    return table
