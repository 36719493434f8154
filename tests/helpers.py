"""Correctness helpers: per-dtype tolerances, poisoned outputs and readable mismatches."""

from __future__ import annotations

import importlib.util
import math
import pathlib
import types

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


def _error_stats(x: torch.Tensor, reference: torch.Tensor) -> tuple[float, int, float, float]:
    """(max |x - reference| (inf where x is NaN), its flat index, sum of squared errors,
    sum of squared reference values), in float64 chunks."""
    flat_x, flat_r = x.reshape(-1), reference.reshape(-1)
    worst, worst_at, sq, ref_sq = -1.0, 0, 0.0, 0.0
    for lo in range(0, flat_x.numel(), _CHUNK):
        r = flat_r[lo:lo + _CHUNK].double()
        err = (flat_x[lo:lo + _CHUNK].double() - r).abs()
        err = torch.where(torch.isnan(err), torch.inf, err)
        i = int(err.argmax())
        if err[i].item() > worst:
            worst, worst_at = err[i].item(), lo + i
        sq += float(err.square().sum())
        ref_sq += float(r.square().sum())
    return worst, worst_at, sq, ref_sq


def assert_no_worse_than(actual: torch.Tensor, baseline: torch.Tensor,
                         reference: torch.Tensor, what: str = "output", *,
                         factor: float = 2.0, atol: float | None = None,
                         eps: float | None = None, baseline_rel_max: float = 0.05) -> None:
    """`actual` is at most `factor` times as far from `reference` as `baseline` is.

    FlashAttention's criterion for low-precision results: `reference` is the exact math
    (an fp32/fp64 implementation), `baseline` an eager PyTorch implementation in the same
    low precision that rounds at the same points as the tested code (bf16 GEMM outputs,
    activations, ...), so its error is what that precision costs on this very data,
    cancellation included (a sum of large terms that nearly cancels keeps an absolute error
    of an ulp of its terms, which no fixed atol/rtol pair describes). Requires

        max |actual - reference| <= factor * max |baseline - reference| + atol
        rel_l2(actual) <= factor * rel_l2(baseline) + eps,
        rel_l2(x) = ||x - reference||_2 / ||reference||_2

    (with an all-zero reference, the RMS errors in place of the relative ones). The first
    bounds every element, the second catches a small bias spread over all of them.
    Defaults: atol = eps(actual.dtype) / 4 * RMS(reference) and eps = eps(actual.dtype) / 8
    (bf16: 2^-9 x RMS and 2^-10): slack for a baseline that happens to be exact.
    NaN in `actual` never passes; a NaN in `baseline`, or a baseline whose own relative
    L2 error exceeds `baseline_rel_max`, is an error of the test (the bound would be
    vacuous). On failure, reports the worst element of `actual`, the baseline's value there
    and both errors.
    """
    assert actual.shape == baseline.shape == reference.shape, (
        f"{what}: shapes {actual.shape}, {baseline.shape} (baseline), "
        f"{reference.shape} (reference)")
    actual, baseline, reference = actual.detach(), baseline.detach(), reference.detach()
    finfo = torch.finfo(actual.dtype)
    n = max(actual.numel(), 1)
    a_max, a_at, a_sq, ref_sq = _error_stats(actual, reference)
    b_max, _, b_sq, _ = _error_stats(baseline, reference)
    ref_norm = ref_sq ** 0.5
    assert math.isfinite(ref_norm), f"{what}: the reference is not finite"
    atol = finfo.eps / 4 * ref_norm / n ** 0.5 if atol is None else atol
    eps = finfo.eps / 8 if eps is None else eps
    assert b_max != float("inf"), f"{what}: the baseline holds NaN"
    denom = ref_norm if ref_norm > 0 else n ** 0.5  # all-zero reference: RMS errors
    a_rel, b_rel = a_sq ** 0.5 / denom, b_sq ** 0.5 / denom
    assert b_rel <= baseline_rel_max, (
        f"{what}: the baseline itself is off (relative L2 error {b_rel:.3g}): "
        "the comparison would be vacuous")
    bound = factor * b_max + atol
    if not a_max <= bound:
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(a_at), actual.shape)) \
            if actual.dim() else ()
        raise AssertionError(
            f"{what}: max error {a_max:.4g} at {idx} (got {actual[idx].item():.6g}, "
            f"expected {reference[idx].item():.6g}, baseline {baseline[idx].item():.6g}) > "
            f"{factor:g} x the baseline's max error {b_max:.4g} + atol {atol:.3g}")
    assert a_rel <= factor * b_rel + eps, (
        f"{what}: relative L2 error {a_rel:.4g} > {factor:g} x the baseline's {b_rel:.4g} "
        f"+ {eps:.3g}")


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


def poison_allocator(nbytes: int = 1 << 30) -> None:
    """Leaves NaN in every free block of the caching allocator, where the next outputs land:
    an element a kernel never writes stays NaN.

    Releasing the cache is not enough: `empty_cache` keeps the free tails of segments that
    still hold live tensors, and the allocator's best fit picks such a tail (an earlier
    tensor's values, or zeros) before a fresh poisoned block (what made the grouped GEMM's
    rows-past-the-groups check fail on a kernel that never wrote them). So each remaining
    free block is taken by an allocation of its exact size, largest first (best fit hands
    out that block), filled, and handed back with one more block of `nbytes`."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    sizes = sorted((block["size"] for segment in torch.cuda.memory_snapshot()
                    for block in segment["blocks"] if block["state"] == "inactive"),
                   reverse=True)
    # all bits set: NaN read as fp32, bf16, fp16 or e4m3 alike (an fp32 NaN's low half is a
    # bf16 zero)
    held = [torch.full((size // 4,), -1, dtype=torch.int32, device="cuda")
            for size in [*sizes, nbytes]]
    torch.cuda.synchronize()
    del held


def load_script(name: str) -> types.ModuleType:
    """scripts/<name>.py as a module (the scripts are not a package)."""
    path = pathlib.Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cluster_configs(kernel):
    """The space's first cluster config of every (cluster size, CTAs per SM, meeting,
    landing) shape (the softmax family's cluster_rows.py, its slices meeting through global
    memory, meeting_slices.py, or landing by TMA, cross-entropy's `landed`)."""
    firsts = {}
    for config in kernel.config_space("many"):
        if config.cluster:
            shape = (config.cluster, config.ctas_per_sm, config.meet,
                     config.landed)
            firsts.setdefault(shape, config)
    assert firsts
    return list(firsts.values())
