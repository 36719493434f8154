"""The autotuner times only configs whose results agree with the default config's (CPU:
a fake kernel whose "compiled" launchers are Python functions)."""

from dataclasses import dataclass

import pytest
import torch

from tileops.kernels import base
from tileops.kernels.base import Kernel, agrees


@dataclass(frozen=True)
class FakeConfig:
    name: str


class FakeKernel(Kernel):
    """out = 2 * x; 'racy' writes garbage into a corner, 'slow'/'fast' are correct."""

    name = "fake"
    Config = FakeConfig
    cost_ms = {"default": 3.0, "slow": 5.0, "fast": 1.0, "racy": 0.5, "broken": 0.1}

    def compile(self, config, bucket):
        if config.name == "broken":
            raise RuntimeError("does not build")
        return (config,)

    def run(self, config, compiled, x, out):
        out.copy_(2 * x)
        if config.name == "racy":
            out[0, :3] = 1e4

    def heuristic_config(self, bucket, arch):
        return FakeConfig("default")

    def config_space(self, bucket):
        return [FakeConfig(n) for n in ("default", "slow", "fast", "racy", "broken")]

    def bucket_of(self, size):
        return "all"


def test_a_wrong_config_is_rejected_even_when_fastest(monkeypatch):
    monkeypatch.setattr(base, "launchers", lambda compiled: compiled)
    monkeypatch.setattr("tileops.perf.timing.time_cuda",
                        lambda fn: (fn(), FakeKernel.cost_ms[current["name"]])[1])
    kernel = FakeKernel(gpu=None)
    current = {}
    real_run = kernel.run

    def tracking_run(config, compiled, *tensors):
        current["name"] = config.name
        real_run(config, compiled, *tensors)

    monkeypatch.setattr(kernel, "run", tracking_run)
    x = torch.randn(8, 16)
    out = torch.empty_like(x)
    best = kernel.autotune(8, x, out)
    assert best == FakeConfig("fast")
    assert kernel.rejected == [FakeConfig("racy")]
    assert torch.equal(x, x.clone())  # the inputs the tuner was given are untouched


def test_agrees_tolerates_rounding_but_not_garbage_or_moved_infinities():
    want = torch.randn(64, 64)
    assert agrees([want + 1e-3 * want.abs().max()], [want])
    assert not agrees([want + 0.1 * want.abs().max()], [want])
    lse = torch.tensor([-float("inf"), 1.0, 2.0])
    assert agrees([lse.clone()], [lse])
    assert not agrees([torch.tensor([0.0, 1.0, 2.0])], [lse])
    nan = torch.tensor([float("nan"), 1.0])
    assert agrees([nan.clone()], [nan])
    assert not agrees([torch.tensor([0, 1], dtype=torch.int32)],
                      [torch.tensor([0, 2], dtype=torch.int32)])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_agrees_on_half_precision_outputs(dtype):
    want = torch.randn(128, 128).to(dtype)
    got = (want.float() * (1 + 4e-3)).to(dtype)  # about one ulp of bf16
    assert agrees([got], [want])
