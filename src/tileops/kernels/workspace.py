"""Zeroed scratch memory that kernels hand back zeroed, one buffer per (device, stream).

A one-launch reduction across CTAs (the last CTA of a row merges what the others left, see
selection/argmax.py) needs per-row slots that start at zero. Allocating and clearing them
on every call would cost an allocation and a memset launch, the host time the single
launch is there to save; instead the kernel's last CTA clears the slots it used, so the
buffer is zero again when the next launch on the same stream starts. Launches on one stream
run in order; a buffer per stream keeps launches on different streams from sharing slots.

A buffer only grows. The old one is kept alive rather than freed, since a captured CUDA
graph may still point at it.
"""

from __future__ import annotations

import threading

import torch

_lock = threading.Lock()
# slot -> (rows, columns, buffer): a call's size check and the buffer in one lookup,
# without reading the buffer's shape (~0.3 us a call)
_found: dict[tuple[torch.device, int, torch.dtype, bool], tuple[int, int, torch.Tensor]] = {}
_retired: list[torch.Tensor] = []  # outgrown buffers a captured graph may still use
MIN_COLUMNS = 1024


def zeroed_scratch(device: torch.device, rows: int, columns: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """A zeroed [>= rows, >= columns] buffer on `device` (a CUDA device with its index)
    for the current stream. The caller's kernel must leave every element it touches zero
    again."""
    return _scratch(device, rows, columns, dtype, True)


def scratch(device: torch.device, rows: int, columns: int,
            dtype: torch.dtype) -> torch.Tensor:
    """Like `zeroed_scratch`, but its contents are whatever the last kernel left: for
    partial results a launch writes before it reads them."""
    return _scratch(device, rows, columns, dtype, False)


def _scratch(device: torch.device, rows: int, columns: int, dtype: torch.dtype,
             zeroed: bool) -> torch.Tensor:
    # (the raw handle: building a torch.cuda.Stream object costs a microsecond or more)
    slot = (device, torch._C._cuda_getCurrentRawStream(device.index), dtype, zeroed)
    found = _found.get(slot)
    if found is not None and found[0] >= rows and found[1] >= columns:
        return found[2]
    with _lock:
        old_rows, old_columns, old = _found.get(slot, (0, 0, None))
        shape = (max(rows, old_rows), max(columns, MIN_COLUMNS, 2 * old_columns))
        if old is not None:
            _retired.append(old)
        buffer = (torch.zeros if zeroed else torch.empty)(shape, dtype=dtype, device=device)
        _found[slot] = (*shape, buffer)
        return buffer


_counter_views: dict[tuple[int, int], torch.Tensor] = {}


def zeroed_counters(device: torch.device, count: int) -> torch.Tensor:
    """`count` zeroed int32 counters of the current stream (the first of its int32
    `zeroed_scratch`), for a kernel that hands them back zeroed. The view is built once per
    buffer (a view costs host time on every call)."""
    buffer = zeroed_scratch(device, 1, count, torch.int32)
    key = (buffer.data_ptr(), count)
    view = _counter_views.get(key)
    if view is None:
        view = _counter_views[key] = buffer.view(-1)[:count]
    return view
