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
    Compares in float64 chunks, so a large output does not need several float64 copies at
    once (the GPU tests run one process per core on one card).
    """
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    atol, rtol = TOLERANCES[actual.dtype]
    flat_a, flat_e = actual.reshape(-1), expected.reshape(-1)
    n_bad, worst, worst_err, diff_sq, ref_sq = 0, -1, -1.0, 0.0, 0.0
    for lo in range(0, flat_a.numel(), _CHUNK):
        a = flat_a[lo:lo + _CHUNK].double()
        e = flat_e[lo:lo + _CHUNK].double()
        diff = a - e
        err = diff.abs()
        bad = ~(err <= atol * scale + rtol * e.abs())  # NaN compares False: counts as bad
        n_bad += int(bad.sum())
        ranked = torch.where(torch.isnan(err), torch.inf, err)
        i = int(ranked.argmax())
        if ranked[i].item() > worst_err:
            worst, worst_err = lo + i, ranked[i].item()
        diff_sq += float(diff.square().sum())
        ref_sq += float(e.square().sum())
    if n_bad:
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), actual.shape))
        raise AssertionError(
            f"{what}: {n_bad} of {actual.numel()} elements off; worst at {idx}: "
            f"got {actual[idx].item():.6g}, expected {expected[idx].item():.6g} "
            f"(atol {atol * scale:.3g}, rtol {rtol}, max err {worst_err:.3g})")
    # Catches a small bias spread over every element. The floor is the norm of an error of
    # atol everywhere, so an exactly-zero expected tensor (a 1x1 softmax's dq) does not divide
    # rounding noise by zero; the elementwise check above already bounds that case.
    floor = atol * actual.numel() ** 0.5
    rel = diff_sq ** 0.5 / max(ref_sq ** 0.5, floor)
    assert rel < 2 * rtol, f"{what}: relative L2 error {rel:.3g} too large"


_CHUNK = 1 << 24  # elements per float64 comparison chunk (128 MiB per copy)


def randn(*shape: int, dtype: torch.dtype, device: str = "cuda", std: float = 1.0,
          generator: torch.Generator | None = None) -> torch.Tensor:
    """Fresh random data (never zeros), made in fp32 then cast."""
    return (torch.randn(*shape, device=device, generator=generator) * std).to(dtype)


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fills with NaN so that any element a kernel forgets to write fails the comparison."""
    return t.fill_(float("nan"))


def meta(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A tensor with only a shape and dtype: op-layer checks without a GPU."""
    return torch.empty(*shape, dtype=dtype, device="meta")


def ptxas_report(compiled_kernel, tmp_path) -> str:
    """ptxas -v's report on a compiled TileLang kernel's PTX for sm_90a (registers, spills,
    serialized-wgmma warnings); skips the test where the CUDA toolkit has no ptxas."""
    import shutil
    import subprocess

    import pytest

    if shutil.which("ptxas") is None:
        pytest.skip("needs ptxas (CUDA toolkit)")
    ptx = tmp_path / "kernel.ptx"
    compiled_kernel.export_ptx(str(ptx))
    return subprocess.run(["ptxas", "-arch=sm_90a", "-v", str(ptx), "-o", "/dev/null"],
                          capture_output=True, text=True, check=True).stderr


def assert_no_spills_or_serialized_wgmma(compiled_kernel, tmp_path, spills: bool = False):
    """A spilled accumulator would cost a kernel its speed, and so would wgmmas that ptxas
    serializes (it does so silently when a non-wgmma instruction may touch an in-flight
    accumulator, e.g. a wgmma under a branch: warning C7511); ptxas reports both.
    `spills=True` tolerates spills (a known, measured exception) but not serialization."""
    report = ptxas_report(compiled_kernel, tmp_path)
    assert spills or "0 bytes spill stores" in report, report
    assert "serialized" not in report and "C7511" not in report, report
