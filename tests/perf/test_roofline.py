"""Roofline math and GPU profiles (CPU)."""

import pytest
import torch

from tileops import GemmFwdOp, RMSNormFwdOp, TileOpsUnsupportedError
from tileops.perf.profiles import load_profile

pytestmark = pytest.mark.smoke


def test_h200_profile_uses_measured_ceilings():
    profile = load_profile("NVIDIA H200")
    assert profile.bytes_per_s == pytest.approx(4.36e12)
    assert profile.flops_per_s["bfloat16"] == pytest.approx(790e12)
    assert profile.l2_bytes == 60 * 2**20


def test_h100_profile_uses_its_calibration():
    """`tileops bench` runs on the H100s the device tool lends; SOL there is against the
    ceilings calibrate.py measured on one (the triad, 91% of the datasheet's 3.35 TB/s), and
    GEMM picks stay the H200-fitted model's."""
    from tileops.kernels.gemm import select

    profile = load_profile("NVIDIA H100 80GB HBM3")
    assert profile.bytes_per_s == pytest.approx(3.05e12)
    assert profile.flops_per_s["bfloat16"] == pytest.approx(800e12)
    assert select.device("h100", "bfloat16") == select.device("h200", "bfloat16")


def test_unknown_gpu_is_a_clear_error():
    with pytest.raises(TileOpsUnsupportedError,
                       match=r"no GPU profile for 'NVIDIA A100.*h100.*h200"):
        load_profile("NVIDIA A100-SXM4-80GB")


def test_sol_picks_the_binding_resource():
    profile = load_profile("NVIDIA H200")
    # Llama-3.1-8B qkv_proj prefill: compute-bound.
    m, n, k = 4096, 6144, 4096
    meta = {"device": "meta", "dtype": torch.bfloat16}
    flops, nbytes = GemmFwdOp().eval_roofline(torch.empty(m, k, **meta),
                                              torch.empty(n, k, **meta))
    seconds, bound = profile.sol_seconds(flops, nbytes, "bfloat16")
    assert bound == "compute" and seconds == pytest.approx(2 * m * n * k / 790e12)
    # RMSNorm is memory-bound: 2 bytes in + 2 out per element, plus the weight.
    rows, hidden = 8192, 8192
    flops, nbytes = RMSNormFwdOp(normalized_shape=[hidden]).eval_roofline(
        torch.empty(rows, hidden, **meta), torch.empty(hidden, **meta))
    seconds, bound = profile.sol_seconds(flops, nbytes, "bfloat16")
    assert bound == "memory"
    assert seconds == pytest.approx((4 * rows * hidden + 2 * hidden) / 4.36e12)


def test_merge_repeats_reports_median_and_run_to_run_spread():
    from tileops.perf.bench import merge_repeats

    def row(latency, cublas, spread, clock):
        return {"op": "GemmFwdOp", "label": "w", "dtype": "bfloat16", "latency_us": latency,
                "tflops": 1000.0 / latency, "tbps": 10.0 / latency, "sol_us": 50.0,
                "sol_pct": 5000.0 / latency, "bound": "compute", "baselines": {"cublas": cublas},
                "best_baseline": "cublas", "speedup": cublas / latency, "spread_pct": spread,
                "device_state": {"sm_clock_mhz": clock},
                "trials_us": [latency - 1, latency, latency + 1],
                "baseline_trials_us": [cublas, cublas]}

    (merged,) = merge_repeats([[row(100.0, 95.0, 0.5, 1980)], [row(104.0, 97.0, 1.0, 1755)],
                               [row(102.0, 96.0, 0.2, 1980)]])
    # each run's clock stays with the row, so a throttled run can be told apart
    assert [s["sm_clock_mhz"] for s in merged["device_state_runs"]] == [1980, 1755, 1980]
    assert merged["latency_us"] == 102.0 and merged["runs_us"] == [100.0, 104.0, 102.0]
    assert merged["run_to_run_pct"] == pytest.approx(100 * 4 / 102)
    assert merged["spread_pct"] == 1.0  # the noisiest run's trials
    assert merged["tflops"] == pytest.approx(1000.0 / 102)
    assert merged["sol_pct"] == pytest.approx(5000.0 / 102)
    assert merged["baselines"] == {"cublas": 96.0}
    assert [b["cublas"] for b in merged["baselines_runs"]] == [95.0, 97.0, 96.0]
    assert merged["speedup"] == pytest.approx(96.0 / 102)
    # every run's trials, in the order they ran, for a drift against an offset
    assert merged["trials_us_runs"] == [[99.0, 100.0, 101.0], [103.0, 104.0, 105.0],
                                        [101.0, 102.0, 103.0]]
    assert merged["baseline_trials_us_runs"] == [[95.0, 95.0], [97.0, 97.0], [96.0, 96.0]]


def test_device_state_is_empty_without_nvml_or_gpu(monkeypatch):
    from tileops.perf import bench

    def unavailable(*args):
        raise ModuleNotFoundError("pynvml")

    monkeypatch.setattr(bench.torch.cuda, "clock_rate", unavailable)
    assert bench.device_state() == {}
    monkeypatch.setattr(bench.torch.cuda, "clock_rate", lambda *a: 1980)
    monkeypatch.setattr(bench.torch.cuda, "power_draw", lambda *a: 512_400)  # milliwatts
    monkeypatch.setattr(bench.torch.cuda, "temperature", lambda *a: 61)
    assert bench.device_state() == {"sm_clock_mhz": 1980, "power_w": 512, "temperature_c": 61}
