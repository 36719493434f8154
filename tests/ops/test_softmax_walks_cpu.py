"""The streaming softmax kernels' second-pass walks (kernels/softmax/row_map.py: `reverse`,
the chunks last to first; `l2_hints`, loads and stores with L2 eviction priorities) run on
the CPU (tests/cuda_emulation_threads.py) against float64 references: rows of several
chunks, the last one short, -inf entries and a fully masked row; plus where the config
space offers them."""

import dataclasses

import pytest
import torch

from tileops.kernels.softmax import RowConfig, SoftmaxKernel
from tileops.kernels.softmax.row_map import RowMap
from tileops.kernels.softmax.softmax import default_row_config

from .softmax_emulated import TOL, check_backward, check_forward

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
NAMES = {BF16: "bfloat16", FP16: "float16", FP32: "float32"}


def _run(kind, tensors, n, dtype, config, rows):
    from ..cuda_emulation_threads import run

    compiled = SoftmaxKernel(kind=kind, n=n, dtype=NAMES[dtype]).compile(config, "many")[0]
    assert ("tileops_l2::store16" in compiled.get_kernel_source()) == (
        config.l2_hints and kind != "logsumexp")
    rm = RowMap(n, NAMES[dtype], config.threads, config.row_threads, config.vecs, 132)
    run(compiled, min(-(-rows // rm.rows_per_cta), 132 * config.ctas_per_sm), config.threads,
        tensors, dict(rows=rows))


# (rows, n, dtype, config): 64 threads x 2 vectors a chunk, so 3-5 chunks a row, the last
# short. The last two hold several rows a CTA, each over two warps, with a row count they do
# not divide: the last group's slots past the end must still reach the row reductions'
# CTA-wide barriers (RowMap.placed_row), or the emulator's pthread barriers wait forever.
CASES = [
    (4, 5000, BF16, RowConfig(64, 64, 2, 1, reverse=True)),
    (3, 4104, FP16, RowConfig(64, 64, 2, 2, reverse=True, l2_hints=True)),
    (3, 3000, FP32, RowConfig(64, 64, 2, 1, l2_hints=True)),
    (5, 2056, BF16, RowConfig(128, 64, 1, 1, reverse=True, l2_hints=True)),
    (7, 3000, BF16, RowConfig(256, 64, 2, 1)),
]


def _id(case):
    rows, n, dtype, config = case
    walk = "-".join(name for name in ("reverse", "l2_hints") if getattr(config, name))
    return f"{rows}x{n}-{NAMES[dtype]}-{walk or 'plain'}-{config.threads // config.row_threads}rows"


@pytest.mark.compile
@pytest.mark.parametrize("kind", ["softmax", "log_softmax", "logsumexp"])
@pytest.mark.parametrize("rows, n, dtype, config", [
    pytest.param(*case, marks=pytest.mark.smoke if i in (1, 4) else pytest.mark.full,
                 id=_id(case))
    for i, case in enumerate(CASES)])
def test_forward_walks_on_the_cpu(kind, rows, n, dtype, config):
    gen = torch.Generator().manual_seed(rows * n)
    x = (torch.randn(rows, n, generator=gen) * 3).to(dtype)
    x[0, 5:n:7] = float("-inf")
    x[2] = float("-inf")  # softmax NaN, logsumexp -inf, as torch
    check_forward(kind, x, lambda tensors: _run(kind, tensors, n, dtype, config, rows))


@pytest.mark.compile
@pytest.mark.parametrize("kind", ["softmax_bwd", "log_softmax_bwd"])
@pytest.mark.parametrize("rows, n, dtype, config", [
    pytest.param(*case, marks=pytest.mark.smoke if i == 4 else pytest.mark.full,
                 id=_id(case)) for i, case in enumerate(CASES)])
def test_backward_walks_on_the_cpu(kind, rows, n, dtype, config):
    gen = torch.Generator().manual_seed(rows + n)
    x = torch.randn(rows, n, generator=gen, dtype=torch.float64)
    forward = torch.softmax if kind == "softmax_bwd" else torch.log_softmax
    y = forward(x, -1).to(dtype)
    dy = torch.randn(rows, n, generator=gen).to(dtype)
    check_backward(kind, y, dy, lambda tensors: _run(kind, tensors, n, dtype, config, rows),
                   TOL[dtype], TOL[dtype] * 1e-1)


def test_hints_need_16_byte_vectors():
    with pytest.raises(ValueError, match="16-byte"):
        RowMap(4099, "bfloat16", 64, 64, 2, 132, l2_hints=True)


@pytest.mark.parametrize("n, dtype, offered", [(128256, "float32", True),
                                                (4099, "float32", False),
                                                (2048, "bfloat16", False)])
def test_space_offers_the_walks_on_multi_chunk_rows(n, dtype, offered):
    """The streaming default's walks join the tuner's space where a row takes several chunks
    and vectors are 16 bytes (hints) or at all (reverse); one-chunk rows have no second read."""
    kernel = SoftmaxKernel(kind="softmax", n=n, dtype=dtype)
    space = kernel.config_space("many")
    streaming = default_row_config(n, dtype, False)
    hinted = dataclasses.replace(streaming, reverse=True, l2_hints=True)
    assert (hinted in space) == offered
    # the default where the rows in flight outgrow the L2 and no landed default applies
    # (fp32 here; test_softmax_defaults_cpu.py)
    assert (kernel.heuristic_config("many", "sm_90a") == hinted) == offered
