"""The timing protocol against kernels of known cost (GPU)."""

import statistics

import pytest
import torch

from tileops.perf.profiles import load_profile
from tileops.perf.timing import call_latency_us, kernel_breakdown, measure

pytestmark = pytest.mark.gpu


def test_large_copy_runs_near_the_copy_ceiling():
    src = torch.randn(256 * 2**20, device="cuda")  # 1 GiB, far past L2
    dst = torch.empty_like(src)
    timing = measure(lambda: dst.copy_(src))
    moved = 2 * src.numel() * src.element_size()
    ceiling = load_profile(torch.cuda.get_device_name()).bytes_per_s
    achieved = moved / (timing.median_ms * 1e-3)
    assert 0.8 * ceiling < achieved < 1.1 * ceiling, (timing, achieved / 1e12)
    assert timing.method == "cupti", timing.method


def assert_cupti_and_events_agree(fn, rounds: int = 5):
    """A long GEMM lowers the clock as it heats the card, so the two methods take turns
    after a sustained warmup: timed one after the other they would see different clocks."""
    measure(fn, warmup=200, trials=1)
    cupti, events = [], []
    for _ in range(rounds):
        cupti.append(measure(fn, warmup=1, trials=1, method="cupti").median_ms)
        events.append(measure(fn, warmup=1, trials=1, method="events").median_ms)
    gap = abs(statistics.median(cupti) - statistics.median(events)) / statistics.median(events)
    assert gap < 0.03, (cupti, events)


def test_cupti_and_events_agree_on_a_long_kernel():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    assert_cupti_and_events_agree(lambda: a @ b)


def test_call_latency_covers_host_and_device():
    x = torch.randn(1024, device="cuda")
    eager = call_latency_us(lambda: x.add_(1))
    graph = call_latency_us(lambda: x.add_(1), graph=True)
    assert 0 < graph and 0 < eager < 1000


def test_cupti_counts_tilelang_kernels_launched_through_the_driver_api():
    """TileLang launches bypass the CUDA runtime; the timer must still see every kernel."""
    from tileops import GemmFwdOp

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    gemm = GemmFwdOp()
    assert_cupti_and_events_agree(lambda: gemm(a, b))


def test_the_breakdown_names_each_kernel_and_adds_up_to_the_timer():
    """A GEMM then an elementwise kernel: at least two activities (cuBLAS may add its own),
    the elementwise one last and smaller than the GEMM, and their sum is what the timer
    reports for the whole call."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def two_kernels():
        return (a @ b).relu_()

    rows = kernel_breakdown(two_kernels)
    assert len(rows) >= 2 and max(us for _, us in rows) > rows[-1][1] > 0, rows
    whole = measure(two_kernels, warmup=20, method="cupti").median_ms * 1e3
    assert abs(sum(us for _, us in rows) - whole) < 0.1 * whole, (rows, whole)
