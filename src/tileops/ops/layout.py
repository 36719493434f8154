"""Layout normalization shared by ops: what TileLang's TMA-based kernels need of a tensor."""

from __future__ import annotations

import torch

TMA_ALIGN_BYTES = 16
# What a planned launch of a row kernel checks per call (its signature fixes the rest): the
# base addresses' alignment (`(a.data_ptr() | b.data_ptr()) % TMA_ALIGN_BYTES`, ~0.1 us a
# tensor) and the strides, which TileLang's executable checks itself before it launches
# anything, raising one of STRIDE_ERRORS (~0.1 us a tensor less than `is_tma_ready`).
STRIDE_ERRORS = (RuntimeError,)


def is_tma_ready(t: torch.Tensor) -> bool:
    """Whether a kernel reads `t` as it is: contiguous, 16-byte-aligned base (what
    `tma_ready` returns without a copy). The ops' planned launches check this per call."""
    return t.is_contiguous() and t.data_ptr() % TMA_ALIGN_BYTES == 0


def tma_ready(t: torch.Tensor) -> torch.Tensor:
    """`t` itself when contiguous and 16-byte aligned, else an aligned contiguous copy.

    TMA descriptors need a 16-byte-aligned base address; a contiguous view at an odd
    storage offset (x[1:]) is the usual way to get an unaligned one.
    """
    if t.is_contiguous() and t.data_ptr() % TMA_ALIGN_BYTES == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def as_rows(t: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """`t` as a [rows, n] tensor row kernels can read: a view where possible, else an
    aligned contiguous copy."""
    if t is None:
        return None
    return tma_ready(t if t.dim() == 2 and t.shape[1] == n else t.reshape(-1, n))


def output_rows(rows: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out_rows, out): a new contiguous tensor shaped as `rows` for a kernel to write, and
    the same storage in `like`'s shape (the tensor itself when `rows` is `like`).

    Host time: torch.empty_like of the row view and no view for 2-D inputs cost ~1.3 us on
    the CPU here, where torch.empty(shape, dtype=, device=) plus .view() cost ~8 us.
    """
    out = torch.empty_like(rows)
    return out, (out if rows is like else out.view(like.shape))
