"""Benchmark rows for an op over its manifest workloads, against independent baselines."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .baselines import Baseline, baselines_for
from .profiles import load_profile
from .timing import WARM_SECONDS, host_us_per_call, measure_together

POOL_BYTES_LIMIT = 1 << 30  # inputs larger than this are not cloned into a pool
TRIALS = 5  # per candidate, interleaved; the median trial is the result
MAX_TRIALS = 45  # while the median trial is not known within +-1% (a clock near its power limit)
OP_KEY = "tileops"  # the op's entry among the timed candidates (baselines have their names)


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
    spread_pct: float = 0.0  # spread of the TileOPs latency over one run's trials
    timing: str = ""
    input_pool: int = 1  # distinct input copies rotated through (addresses change)
    gpu: str = ""
    device_state: dict = field(default_factory=dict)  # SM clock, power, temperature after
    # TileOPs' trial medians in the order run, and the best baseline's, interleaved with
    # them: whether a run-to-run gap is a drift within the run or a constant offset
    trials_us: list = field(default_factory=list)
    baseline_trials_us: list = field(default_factory=list)
    # CPU time per eager call (launch included, device work overlapped): ours and the best
    # baseline's; 0 when not measured
    host_us: float = 0.0
    baseline_host_us: float = 0.0


def device_state() -> dict[str, int]:
    """SM clock (MHz), power (W) and temperature (C) over NVML's last sample period, sampled
    right after a measurement, so a throttled run shows in its rows; {} without NVML."""
    try:
        return {"sm_clock_mhz": torch.cuda.clock_rate(),
                "power_w": round(torch.cuda.power_draw() / 1000),
                "temperature_c": torch.cuda.temperature()}
    except Exception:  # noqa: BLE001 - pynvml missing or the query unsupported
        return {}


def random_inputs(op_cls: Any, workload: dict, dtype: str,
                  device: str = "cuda") -> list[torch.Tensor | None]:
    """A workload's inputs on `device`: fresh random values (never zeros) where the workload
    gives only a shape, its own values where it gives them (a varlen batch's cu_seqlens)."""
    tensors = op_cls.spec.workload_tensors(workload, dtype)
    bounds = op_cls.index_bounds(tensors, op_cls.spec.workload_params(workload))
    return [None if t is None else t.to(device) if t.device.type == "cpu"
            else torch.randint(0, bounds[name], t.shape, device=device, dtype=t.dtype)
            if name in bounds else torch.randn(t.shape, device=device).to(t.dtype)
            for name, t in tensors.items()]


def pool_size_for(inputs: list, pool_size: int = 4) -> int:
    """`pool_size`, or 1 where that many copies of the inputs would pass POOL_BYTES_LIMIT."""
    nbytes_in = sum(t.numel() * t.element_size() for t in inputs if t is not None)
    return pool_size if nbytes_in * pool_size <= POOL_BYTES_LIMIT else 1


def rotating(inputs: list, pool_size: int) -> Callable[[Callable[..., Any]], Callable[[], Any]]:
    """Makes zero-argument callables that take the next of `pool_size` input copies (fresh
    addresses each call, as a model's activations have; one buffer timed over and over
    read ~5% faster for a rotary kernel on an H100, fifty-seventh session)."""
    pool = [inputs] + [[None if t is None else t.clone() for t in inputs]
                       for _ in range(pool_size - 1)]
    counter = iter(range(1 << 62))

    def bind(fn: Callable[..., Any]) -> Callable[[], Any]:
        return lambda: fn(*pool[next(counter) % pool_size])

    return bind


def case_candidates(op: Any, params: dict, bind: Callable[[Callable[..., Any]], Callable[[], Any]],
                    baselines: dict[str, Baseline]) -> dict[str, Callable[[], Any]]:
    """Zero-argument calls of the op (under OP_KEY) and of each baseline with the case's
    params, their inputs supplied by `bind` (see `rotating`)."""
    candidates = {OP_KEY: bind(op)}
    for name, fn in baselines.items():
        candidates[name] = bind(lambda *x, f=fn: f(*x, **params))
    return candidates


def bench_workload(op_cls: Any, workload: dict, dtype: str,
                   baselines: dict[str, Baseline] | None = None, pool_size: int = 4,
                   log: Callable[[str], None] = lambda s: None) -> BenchRow:
    """Times the op and each baseline on one (workload, dtype); never checks values."""
    gpu = torch.cuda.get_device_name()
    profile = load_profile(gpu)
    params = op_cls.spec.workload_params(workload)
    op = op_cls(**params)
    inputs = random_inputs(op_cls, workload, dtype)
    pool = pool_size_for(inputs, pool_size)
    op(*inputs)  # compile / load before timing
    candidates = case_candidates(op, params, rotating(inputs, pool),
                                 baselines_for(op_cls.__name__) if baselines is None
                                 else baselines)
    # One sustained warmup, then the op's and the baselines' trials interleaved: a clock that
    # drifts during the case moves them alike.
    timings = measure_together(candidates, trials=TRIALS, warm_seconds=WARM_SECONDS,
                               max_trials=MAX_TRIALS, focus=OP_KEY)
    state = device_state()
    timing = timings.pop(OP_KEY)
    if isinstance(timing, Exception):
        raise timing
    latency = timing.median_ms * 1e3
    flops, nbytes = op.eval_roofline(*inputs)
    sol_s, bound = profile.sol_seconds(flops, nbytes, dtype)
    base = {}
    for name, result in timings.items():
        if isinstance(result, Exception):  # a baseline that cannot run is left out
            log(f"baseline {name} failed on {workload['label']} {dtype}: "
                f"{type(result).__name__}: {result}")
        else:
            base[name] = result.median_ms * 1e3
    best = min(base, key=base.get) if base else ""
    # Host time only matters where the device time is short; long kernels get few calls so
    # the launch queue never fills (see host_us_per_call).
    calls = max(5, min(100, int(2e4 / max(latency, 1.0))))
    host = host_us_per_call(candidates[OP_KEY], calls)
    base_host = host_us_per_call(candidates[best], calls) if best else 0.0
    return BenchRow(op_cls.__name__, workload["label"], dtype, latency, flops / latency / 1e6,
                    nbytes / latency / 1e6, sol_s * 1e6, 100 * sol_s * 1e6 / latency, bound,
                    base, best, base[best] / latency if best else 0.0, timing.spread_pct,
                    timing.method, pool, gpu, state, [t * 1e3 for t in timing.trials_ms],
                    [t * 1e3 for t in timings[best].trials_ms] if best else [], host,
                    base_host)


def bench_cases(op_classes: list[Any], tier: str | None = None,
                dtypes: list[str] | None = None, texts: list[str] | None = None,
                models: list[str] | None = None) -> Iterator[tuple[Any, dict, str]]:
    """Every (op class, workload, dtype) a benchmark run covers; `texts` keeps the workloads
    whose label contains one of them. Tier 'models' takes the workloads derived from public
    model configs (`perf.models`; `models` filters by model name) that the op accepts, in
    bfloat16 unless `dtypes` says otherwise."""
    from ..manifest import load_workloads, select_workloads
    from . import models as model_shapes

    if tier == "models":
        dtypes = dtypes or model_shapes.DEFAULT_DTYPES
    for op_cls in op_classes:
        if tier == "models":
            if op_cls.__name__ not in model_shapes.MODEL_OPS:
                continue
            workloads, _ = model_shapes.split_refused(
                op_cls, model_shapes.model_workloads(op_cls.__name__, models))
        else:
            workloads = load_workloads(op_cls.__name__, tier)
        for workload, kept in select_workloads(workloads, texts, dtypes):
            for dtype in kept:
                yield op_cls, workload, dtype


def merge_repeats(runs: list[list[dict]]) -> list[dict]:
    """One row per case from `runs` repeats of the same benchmark (rows as dicts).

    Latencies (TileOPs and baselines) become the median over the runs; `runs_us` keeps each
    run's TileOPs latency; `spread_pct` stays the in-run trial spread (the largest of the
    runs') and `run_to_run_pct` is the spread of the runs' latencies, the number the 3%
    agreement target is about.
    """
    import statistics

    from .report import spread_pct

    merged = []
    for case in zip(*runs, strict=True):
        first = dict(case[0])
        assert all((r["op"], r["label"], r["dtype"]) == (first["op"], first["label"],
                                                         first["dtype"]) for r in case)
        latencies = [r["latency_us"] for r in case]
        median = statistics.median(latencies)
        scale = first["latency_us"] / median  # per-latency quantities scale inversely
        first.update(
            latency_us=median, tflops=first["tflops"] * scale, tbps=first["tbps"] * scale,
            sol_pct=first["sol_pct"] * scale, runs_us=latencies,
            spread_pct=max(r.get("spread_pct") or 0.0 for r in case),
            run_to_run_pct=spread_pct(latencies),
            host_us=statistics.median(r.get("host_us") or 0.0 for r in case),
            baseline_host_us=statistics.median(r.get("baseline_host_us") or 0.0 for r in case),
            device_state_runs=[r.get("device_state") or {} for r in case],
            trials_us_runs=[r.get("trials_us") or [] for r in case],
            baseline_trials_us_runs=[r.get("baseline_trials_us") or [] for r in case],
            baselines_runs=[r["baselines"] for r in case],
            baselines={name: statistics.median(r["baselines"][name] for r in case
                                               if name in r["baselines"])
                       for name in first["baselines"]})
        best = min(first["baselines"], key=first["baselines"].get, default="")
        first.update(best_baseline=best,
                     speedup=first["baselines"][best] / median if best else 0.0)
        merged.append(first)
    return merged
