"""Correctness helpers: per-dtype tolerances, poisoned outputs and readable mismatches."""

from __future__ import annotations

import torch

# (atol, rtol) per output dtype, against an fp32/fp64 reference of the same inputs.
TOLERANCES = {
    torch.float16: (2e-3, 1e-2),
    torch.bfloat16: (1.6e-2, 1.6e-2),
    torch.float32: (1e-5, 1e-5),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, scale: float = 1.0,
                 what: str = "output") -> None:
    """Elementwise |a - e| <= atol * scale + rtol * |e|; NaN never passes.

    `scale` widens the absolute tolerance for sums whose terms are large (a GEMM's K).
    On failure, reports the worst element, its index and how many elements failed.
    """
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    atol, rtol = TOLERANCES[actual.dtype]
    a = actual.double()
    e = expected.double()
    err = (a - e).abs()
    bad = ~(err <= atol * scale + rtol * e.abs())  # NaN compares False, so it counts as bad
    if bad.any():
        worst = torch.where(torch.isnan(err), torch.inf, err).flatten().argmax().item()
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), a.shape))
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {a.numel()} elements off; worst at {idx}: "
            f"got {a[idx].item():.6g}, expected {e[idx].item():.6g} "
            f"(atol {atol * scale:.3g}, rtol {rtol}, "
            f"max err {err.nan_to_num(torch.inf).max():.3g})")
    # Catches a small bias spread over every element. The floor is the norm of an error of
    # atol everywhere, so an exactly-zero expected tensor (a 1x1 softmax's dq) does not divide
    # rounding noise by zero; the elementwise check above already bounds that case.
    floor = atol * a.numel() ** 0.5
    rel = (a - e).norm() / max(e.norm().item(), floor)
    assert rel < 2 * rtol, f"{what}: relative L2 error {rel:.3g} too large"


def randn(*shape: int, dtype: torch.dtype, device: str = "cuda", std: float = 1.0,
          generator: torch.Generator | None = None) -> torch.Tensor:
    """Fresh random data (never zeros), made in fp32 then cast."""
    return (torch.randn(*shape, device=device, generator=generator) * std).to(dtype)


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fills with NaN so that any element a kernel forgets to write fails the comparison."""
    return t.fill_(float("nan"))
