"""Timing protocol: median device time per call, L2 flushed before every call.

Each call runs between two CUDA events after a write of a buffer twice the L2's size, so
no call finds its inputs in L2. Each trial starts with a spin kernel that keeps the device
busy while the host enqueues every repeat, so the events measure device time only, not
host launch overhead (which small decode-size calls would otherwise be dominated by).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

_flush_buffers: dict[int, torch.Tensor] = {}
SPIN_CYCLES = 40_000_000  # ~20 ms at 2 GHz: longer than the host needs to enqueue a trial


def flush_l2(device: int | None = None) -> None:
    device = torch.cuda.current_device() if device is None else device
    buf = _flush_buffers.get(device)
    if buf is None:
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20)
        buf = _flush_buffers[device] = torch.empty(2 * l2 // 4, dtype=torch.int32,
                                                   device=f"cuda:{device}")
    buf.zero_()


def time_cuda(fn: Callable[[], object], warmup: int = 5, reps: int = 30,
              trials: int = 3) -> float:
    """Median over `trials` of the per-trial median time of `fn()`, in milliseconds."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    trial_medians = []
    for _ in range(trials):
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        torch.cuda._sleep(SPIN_CYCLES)
        for i in range(reps):
            flush_l2()
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]
        trial_medians.append(statistics.median(times))
    return statistics.median(trial_medians)
