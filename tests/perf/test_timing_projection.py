"""How the CUPTI timer assigns device activity to calls (CPU, synthetic traces)."""

from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from tileops.perf import timing
from tileops.perf.timing import MARK_NAME, _bracketed_round, _bracketed_sums


def event(name, start, end, device=DeviceType.CUDA, annotation=False):
    interval = SimpleNamespace(start=start, elapsed_us=lambda: end - start)
    return SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation,
                           time_range=interval)


def trace(*calls, start=0):
    """Leading spin, then per call: an L2 flush, a marker, the call's kernels, a marker."""
    events, t = [event(MARK_NAME, start, start + 100)], start + 100
    for kernels in calls:
        events.append(event("fill_flush", t, t + 30))
        events.append(event(MARK_NAME, t + 30, t + 31))
        t += 31
        for name, duration in kernels:
            events.append(event(name, t, t + duration))
            t += duration + 1  # launch gaps never count
        events.append(event(MARK_NAME, t, t + 1))
        t += 1
    return events


def test_every_kernel_between_markers_counts_and_the_flush_does_not():
    events = trace([("tilelang_main", 50), ("memset", 5)], [("tilelang_main", 60)])
    # annotations and CPU-side events in the same window are ignored
    events += [event("tileops::timed_call", 131, 200, annotation=True),
               event("cudaLaunchKernel", 131, 132, device=DeviceType.CPU)]
    assert _bracketed_sums(events, 2) == [55, 60]


def test_order_of_the_event_list_does_not_matter():
    events = trace([("a", 10)], [("b", 20)], [("c", 30)])
    assert _bracketed_sums(list(reversed(events)), 3) == [10, 20, 30]


def test_a_missing_bracket_or_an_empty_call_means_no_projection():
    events = trace([("a", 10)], [("b", 20)])
    assert _bracketed_sums(events[:-1], 2) is None  # the last marker never ran
    assert _bracketed_sums(trace([("a", 10)], []), 2) is None


def test_a_round_splits_the_trace_by_candidate():
    """One profiler session, candidates one after the other, each led by its spin kernel."""
    op = trace([("tilelang_main", 50)], [("tilelang_main", 52)])
    base = trace([("cudnn", 40), ("memset", 2)], [("cudnn", 41)], start=10_000)
    assert _bracketed_round(op + base, 2, 2) == [[50, 52], [42, 41]]
    assert _bracketed_round(list(reversed(base + op)), 2, 2) == [[50, 52], [42, 41]]


def test_a_round_with_a_missing_marker_or_an_empty_bracket():
    op = trace([("a", 10)], [("a", 11)])
    base = trace([("b", 20)], [], start=10_000)  # the second call ran no kernel
    assert _bracketed_round(op + base, 2, 2) == [[10, 11], None]
    assert _bracketed_round(op + base[:-1], 2, 2) is None  # its last marker never ran


def test_the_breakdown_lists_each_activity_of_a_call_in_launch_order(monkeypatch):
    events = trace([("zero_dq", 10), ("main", 100), ("cast_dq", 20)],
                   [("zero_dq", 12), ("main", 104), ("cast_dq", 20)],
                   [("zero_dq", 11), ("main", 90), ("cast_dq", 22)])
    monkeypatch.setattr(timing, "_profiled_calls", lambda fns, reps: list(reversed(events)))
    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda: None)
    assert timing.kernel_breakdown(lambda: None, reps=3) == [
        ("zero_dq", 11), ("main", 100), ("cast_dq", 20)]


def test_the_breakdown_refuses_calls_that_launched_different_kernels(monkeypatch):
    events = trace([("a", 10)], [("b", 10)])
    monkeypatch.setattr(timing, "_profiled_calls", lambda fns, reps: events)
    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda: None)
    with pytest.raises(RuntimeError, match="same device activities"):
        timing.kernel_breakdown(lambda: None, reps=2)
