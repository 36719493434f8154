"""Timing protocol: median device time per call, L2 flushed before every call.

Kernel time comes from CUPTI (torch.profiler / Kineto): every device activity (kernels,
memsets, copies) that runs between two marker kernels enqueued right before and right after
one call, inside an annotated region, is summed, so multi-kernel ops count all their kernels
and the L2 flush, before the first marker, counts none. Calls are bracketed on the GPU
timeline rather than by Kineto's CPU-op correlation because TileLang launches through the CUDA
driver API, which Kineto does not link to the enclosing region: correlation alone silently
drops TileLang's kernels and keeps only the op's torch kernels. When the trace does not hold
one bracket per call, the protocol falls back to CUDA events around each call and says so in
the result. Each trial starts with a spin kernel that keeps the device busy while the host
enqueues every repeat, so event timings see device time rather than host launch time.
Warmup, then `reps` calls x `trials`; the result is the median of the trial medians, with
their spread as the run's noise. An op and its baselines are timed together: one warmup that
keeps the card busy for at least WARM_SECONDS (so its clock settles under this load), then
their trials interleaved (op, baseline, op, baseline, ...), so a drift of the clock during
the measurement (the H200 lowers it by up to 20% on long GEMMs near its power limit) moves
every candidate alike instead of favouring whichever ran first. One profiler session holds a
whole round (one trial of each candidate in turn), since starting and reading a session
costs more than a short candidate's trial; a round that cannot stand for one trial each (a
candidate raised, or the trace did not project) is timed one candidate at a time.

End-to-end call latency (host + device, eager and CUDA-graph replay) is measured apart,
because for decode-size ops the host overhead is what users feel.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.autograd import DeviceType

SPIN_CYCLES = 40_000_000  # ~20 ms at 2 GHz: longer than the host needs to enqueue a trial
REGION = "tileops::timed_call"
MARK_CYCLES = 100  # a marker kernel: ~2 us, never inside a bracket
MARK_NAME = "spin_kernel"  # torch.cuda._sleep's kernel
WARM_SECONDS = 0.25  # sustained load before the first trial
_flush_buffers: dict[int, torch.Tensor] = {}


@dataclass(frozen=True)
class Timing:
    median_ms: float
    spread_pct: float  # (max - min) / median of the trial medians
    method: str  # "cupti" or "cuda-events (...why...)"
    trials_ms: tuple[float, ...]


def flush_l2(device: int | None = None) -> None:
    """Writes a buffer twice the L2's size, evicting whatever the last call left there."""
    device = torch.cuda.current_device() if device is None else device
    buf = _flush_buffers.get(device)
    if buf is None:
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20)
        buf = _flush_buffers[device] = torch.empty(2 * l2 // 4, dtype=torch.int32,
                                                   device=f"cuda:{device}")
    buf.zero_()


def _spread_pct(trials: list[float]) -> float:
    median = statistics.median(trials)
    return 100 * (max(trials) - min(trials)) / median if median > 0 else 0.0


def _summarize(trials: list[float], method: str) -> Timing:
    return Timing(statistics.median(trials), _spread_pct(trials), method, tuple(trials))


def _events_trial(fn: Callable[[], object], reps: int) -> float:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    torch.cuda._sleep(SPIN_CYCLES)
    for i in range(reps):
        flush_l2()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))


def _mark() -> None:
    """A tiny kernel whose name no op launches: brackets one call on the GPU timeline."""
    torch.cuda._sleep(MARK_CYCLES)


def _brackets(events: list, reps: int, candidates: int) -> list[list[list]] | None:
    """Per candidate of a round (in order), per call, the device activities between the
    call's two markers, in launch order; None when the trace does not hold every marker."""
    device = sorted((e for e in events if e.device_type == DeviceType.CUDA
                     and not getattr(e, "is_user_annotation", False)),
                    key=lambda e: e.time_range.start)
    marks = [i for i, e in enumerate(device) if MARK_NAME in e.name]
    per_candidate = 1 + 2 * reps  # its leading spin kernel has the markers' name too
    if len(marks) != candidates * per_candidate:
        return None
    found = []
    for first in range(0, len(marks), per_candidate):
        ends = marks[first + 1:first + per_candidate]
        found.append([device[a + 1:b] for a, b in zip(ends[0::2], ends[1::2], strict=True)])
    return found


def _bracketed_round(events: list, reps: int, candidates: int) -> list | None:
    """Per candidate of a round (in order), the summed duration (us) of device activity
    between each call's two markers, or None for a candidate with an empty bracket; None
    for the whole round when the trace does not hold every marker."""
    found = _brackets(events, reps, candidates)
    if found is None:
        return None
    sums = [[sum(e.time_range.elapsed_us() for e in call) for call in calls]
            for calls in found]
    return [per_call if min(per_call) > 0 else None for per_call in sums]


def _bracketed_sums(events: list, reps: int) -> list[float] | None:
    """Per call, the summed duration (us) of device activity between its two markers."""
    found = _bracketed_round(events, reps, 1)
    return None if found is None else found[0]


def _profiled_calls(fns: list[Callable[[], object]], reps: int) -> list:
    """The trace of `reps` bracketed calls of each of `fns` in turn, each candidate's calls
    led by a spin kernel (the host enqueues while it runs)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for fn in fns:
            torch.cuda._sleep(SPIN_CYCLES)
            for _ in range(reps):
                flush_l2()
                _mark()
                with record_function(REGION):
                    fn()
                _mark()
        torch.cuda.synchronize()
    return prof.events()


def _cupti_trial(fn: Callable[[], object], reps: int) -> float | None:
    """Median over calls of the summed device time inside each call's bracket, or None."""
    per_call = _bracketed_sums(_profiled_calls([fn], reps), reps)
    return None if per_call is None else statistics.median(per_call) / 1e3  # us -> ms


def _cupti_round(fns: dict[str, Callable[[], object]],
                 reps: int) -> dict[str, float | None] | None:
    """One trial of every candidate, in order, in a single profiler session (starting and
    reading a session costs more than a short candidate's trial): name -> median ms, or
    None for a candidate whose brackets hold no kernel. None when the trace does not
    project; a candidate that raises propagates (the caller then times one by one)."""
    found = _bracketed_round(_profiled_calls(list(fns.values()), reps), reps, len(fns))
    if found is None:
        return None
    return {name: None if sums is None else statistics.median(sums) / 1e3
            for name, sums in zip(fns, found, strict=True)}


def kernel_breakdown(fn: Callable[[], object], reps: int = 10) -> list[tuple[str, float]]:
    """What one call of `fn` runs on the device: (name, median us) of each kernel, memset or
    copy, in launch order, L2 flushed before every call as in the timing protocol. Shows
    where a multi-kernel op spends its time (its main kernel against its helper passes).
    Warmed up as the bench warms up (0.25 s of sustained load): a device left idle while
    the host sets up inputs runs its first calls at lower clocks (H100, 2026-12-06: the
    unwarmed breakdown put our norm kernels, each case's first candidate, 7-12% above
    ncu's times of them, Liger's, timed after them, 3%)."""
    errors: dict[str, Exception] = {}
    _warm_up({"fn": fn}, 3, 0.25, errors)
    if errors:
        raise errors["fn"]
    found = _brackets(_profiled_calls([fn], reps), reps, 1)
    if found is None:
        raise RuntimeError("the profiler trace does not hold one bracket per call")
    calls = found[0]
    names = [e.name for e in calls[0]]
    if any([e.name for e in call] != names for call in calls):
        raise RuntimeError("the calls did not all launch the same device activities")
    return [(name, statistics.median(call[i].time_range.elapsed_us() for call in calls))
            for i, name in enumerate(names)]


def measure(fn: Callable[[], object], warmup: int = 5, reps: int = 30, trials: int = 3,
            method: str = "auto") -> Timing:
    """Times `fn()` by the protocol above; `method` is 'auto', 'cupti' or 'events'."""
    result = measure_together({"fn": fn}, warmup, reps, trials, method)["fn"]
    if isinstance(result, Exception):
        raise result
    return result


def measure_together(fns: dict[str, Callable[[], object]], warmup: int = 5, reps: int = 30,
                     trials: int = 3, method: str = "auto", warm_seconds: float = 0.0,
                     max_trials: int | None = None, settle_pct: float = 1.0,
                     focus: str | None = None) -> dict[str, Timing | Exception]:
    """Times each of `fns` by the protocol above, their trials interleaved. A candidate that
    raises gets its exception as its result and drops out of the following trials.

    With `max_trials` above `trials`, rounds go on while the median of some candidate's trials
    is not yet pinned down: its 95% confidence interval (`_median_halfwidth_pct`) is wider
    than +-`settle_pct`. A clock that wanders near the power limit spreads the trials by
    10% or more; the median of more of them moves less from run to run. Steady cases stop at
    `trials`. With `focus` (the op), only it and the fastest other candidate (the best
    baseline) go on past `trials`: the comparison the report makes is between those two.
    """
    alive = dict(fns)
    errors: dict[str, Exception] = {}
    _warm_up(alive, warmup, warm_seconds, errors)
    trial_ms: dict[str, list[float | None]] = {name: [] for name in alive}
    why: dict[str, str] = {}
    use_cupti = method in ("auto", "cupti")
    rounds = alive  # the candidates still taking trials
    for done in range(max(trials, max_trials or 0)):
        if done == trials and focus in alive:
            rounds = _contenders(alive, trial_ms, focus)
        if done >= trials and all(_settled(trial_ms[name], settle_pct) for name in rounds):
            break
        together = _round_together(rounds, reps) if use_cupti and not why else None
        if together is not None:
            for name, ms in together.items():
                trial_ms[name].append(ms)
            continue
        for name in list(rounds):  # one by one: errors and trace problems get their owner
            try:
                trial_ms[name].append(_one_trial(rounds[name], reps, use_cupti, name, why))
            except Exception as e:  # noqa: BLE001 - returned as this candidate's result
                errors[name] = e
                alive.pop(name, None)
                rounds.pop(name, None)
    timings: dict[str, Timing | Exception] = dict(errors)
    for name in alive:
        results = trial_ms[name]
        if use_cupti and all(r is not None for r in results):
            timings[name] = _summarize(results, "cupti")
            continue
        if method == "cupti":
            raise RuntimeError("CUPTI timing did not project kernels onto the regions "
                               f"{why.get(name, '')}")
        fallback = (f"cuda-events ({why.get(name) or 'no kernel time in the trace'})"
                    if use_cupti else "cuda-events")
        fn = alive[name]
        timings[name] = _summarize([_events_trial(fn, reps) for _ in range(trials)], fallback)
    return timings


def _round_together(fns: dict[str, Callable[[], object]],
                    reps: int) -> dict[str, float | None] | None:
    """A CUPTI round of every candidate, or None when it cannot stand for one trial each:
    the trace did not project, a candidate's brackets were empty, or one raised."""
    if not fns:
        return None
    try:
        together = _cupti_round(fns, reps)
    except Exception:  # noqa: BLE001 - the one-by-one trials find who raised, and keep it
        return None
    if together is None or any(ms is None for ms in together.values()):
        return None
    return together


def _contenders(alive: dict[str, Callable[[], object]], trial_ms: dict[str, list[float | None]],
                focus: str) -> dict[str, Callable[[], object]]:
    """`focus` and the other candidate with the lowest median so far."""
    others = [n for n in alive if n != focus and all(t is not None for t in trial_ms[n])]
    keep = {focus} | ({min(others, key=lambda n: statistics.median(trial_ms[n]))}
                      if others else set())
    return {name: fn for name, fn in alive.items() if name in keep}


def _median_halfwidth_pct(trials: list[float]) -> float:
    """Half the width of a distribution-free 95% confidence interval of the median (between
    the order statistics at ranks (n -+ 1.96 sqrt(n)) / 2), in % of the median. At 5 trials
    it spans all of them (half the spread); it narrows as trials accumulate."""
    ordered = sorted(trials)
    n = len(ordered)
    reach = 1.96 * math.sqrt(n) / 2
    low = ordered[max(0, math.floor(n / 2 - reach))]
    high = ordered[min(n - 1, math.ceil(n / 2 + reach) - 1)]
    median = statistics.median(ordered)
    return 50 * (high - low) / median if median > 0 else 0.0


def _settled(trials: list[float | None], settle_pct: float) -> bool:
    """Whether the median of these trials is known within +-`settle_pct`; a trace that did
    not project (None) ends the rounds, since the events fallback re-times it anyway."""
    if any(t is None for t in trials):
        return True
    return _median_halfwidth_pct(trials) <= settle_pct


def _warm_up(fns: dict[str, Callable[[], object]], rounds: int, seconds: float,
             errors: dict[str, Exception]) -> None:
    """At least `rounds` calls of each, continued until the device has run for `seconds`;
    a candidate that raises moves from `fns` to `errors`."""
    start = time.perf_counter()
    done = 0
    while fns and (done < rounds or time.perf_counter() - start < seconds):
        for name in list(fns):
            try:
                fns[name]()
            except Exception as e:  # noqa: BLE001 - measure_together reports it
                errors[name] = e
                del fns[name]
        done += 1
        if done >= rounds:
            torch.cuda.synchronize()  # count device time, not enqueue time
    torch.cuda.synchronize()


def _one_trial(fn: Callable[[], object], reps: int, use_cupti: bool, name: str,
               why: dict[str, str]) -> float | None:
    """One CUPTI trial (None when the trace does not project) or one event trial."""
    if not use_cupti:
        return _events_trial(fn, reps)
    if name in why:  # the profiler already failed for this candidate
        return None
    try:
        ms = _cupti_trial(fn, reps)
    except Exception as e:  # noqa: BLE001 - a profiler that cannot run means fall back
        why[name] = f"profiler failed: {type(e).__name__}"
        return None
    if ms is None:  # it falls back to events anyway: no more profiling, alone or in rounds
        why[name] = "no kernel time in the trace"
    return ms


def time_cuda(fn: Callable[[], object], warmup: int = 5, reps: int = 30,
              trials: int = 3) -> float:
    """Median device time of `fn()` in ms by CUDA events (cheap: used by the autotuner)."""
    return measure(fn, warmup, reps, trials, method="events").median_ms


def call_latency_us(fn: Callable[[], object], calls: int = 200, graph: bool = False) -> float:
    """End-to-end microseconds per call as a user sees it: host work plus device work.

    With `graph=True`, `fn` is captured once in a CUDA graph and the replays are timed.
    """
    if graph:
        fn()
        torch.cuda.synchronize()
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            fn()
        step = cuda_graph.replay
    else:
        step = fn
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def host_us_per_call(fn: Callable[[], object], calls: int = 100) -> float:
    """CPU microseconds one call takes to return: host work and launches, not device work.

    The device is synchronized before and after the loop, never inside it, so kernels run
    behind the host; `calls` times the launches per call must stay below the CUDA launch
    queue (about 1000 entries), or the host waits for the device and the figure becomes
    device time. Callers lower `calls` for long kernels.
    """
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6
