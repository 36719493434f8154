"""The cluster kernels of the softmax family (kernels/softmax/cluster_rows.py) run on the CPU
(tests/cuda_emulation_threads.py: each cluster's blocks concurrently, shared memory per block,
peers' shared memory through map_shared_rank), against float64 references: short last
slices, a whole slice past the row, -inf entries and rows, every kind."""

import pytest
import torch

from tileops.kernels.softmax import RowConfig, SoftmaxKernel
from tileops.kernels.softmax.cluster_rows import (
    ClusterRows,
    cluster_shapes,
    fits_registers,
    slice_shape,
)

from .softmax_emulated import check_backward, check_forward

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
NAMES = {BF16: "bfloat16", FP16: "float16", FP32: "float32"}
# the persistent grid's clusters (the `clusters` launch argument): few, so a cluster takes
# several rows wherever there are more rows than this
EMULATED_CLUSTERS = 3


def _run(kind, tensors, n, dtype, config, rows, clusters=EMULATED_CLUSTERS):
    from ..cuda_emulation_threads import run

    compiled = SoftmaxKernel(kind=kind, n=n, dtype=NAMES[dtype]).compile(config, "many")[0]
    source = compiled.get_kernel_source()
    if config.cluster > 1:
        assert "cluster_sync" in source and "map_shared_rank" in source
    assert ("tl::tma_load(" in source) == config.landed  # one bulk copy a slice
    run(compiled, min(rows, clusters) * config.cluster, config.threads, tensors,
        dict(rows=rows, clusters=clusters), cluster=config.cluster)


def _rows(rows, n, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, n, generator=gen) * 3).to(dtype)
    x[1, 5:n:7] = float("-inf")  # masked entries
    x[2] = float("-inf")  # a fully masked row: softmax NaN, logsumexp -inf (as torch)
    return x


# (rows, n, dtype, cluster, threads, landed): slices of ragged length; 5 vectors in 4 slices
# of 2 leave the last slice empty; landed slices (ClusterRows.row_source) on rows past the
# resident clusters, so each cluster lands several rows (the barrier's phases turn), a
# cluster of one included
CASES = [(4, 5000, BF16, 4, 64, False), (3, 2056, FP16, 3, 64, False),
         (3, 1000, FP32, 8, 32, False), (3, 40, BF16, 4, 32, False),
         (59, 4096, BF16, 4, 64, True), (135, 1000, FP32, 1, 32, True)]


@pytest.mark.compile
@pytest.mark.parametrize("kind", ["softmax", "log_softmax", "logsumexp"])
@pytest.mark.parametrize("rows, n, dtype, cluster, threads, landed", [
    pytest.param(*case, marks=pytest.mark.smoke if i in (0, 4) else pytest.mark.full,
                 id=f"{case[0]}x{case[1]}-{NAMES[case[2]]}-c{case[3]}-t{case[4]}"
                    + ("-landed" if case[5] else ""))
    for i, case in enumerate(CASES)])
def test_cluster_forward_on_the_cpu(kind, rows, n, dtype, cluster, threads, landed):
    x = _rows(rows, n, dtype, rows * n)
    config = RowConfig(threads=threads, ctas_per_sm=1, cluster=cluster, landed=landed)
    check_forward(kind, x, lambda tensors: _run(kind, tensors, n, dtype, config, rows))


@pytest.mark.compile
@pytest.mark.parametrize("rows, n, dtype, cluster, threads, landed", [
    pytest.param(*case, marks=pytest.mark.smoke if i == 1 else pytest.mark.full,
                 id=f"{case[0]}x{case[1]}-{NAMES[case[2]]}-c{case[3]}-t{case[4]}"
                    + ("-landed" if case[5] else ""))
    for i, case in enumerate([(4, 5000, BF16, 4, 64, False), (59, 4096, BF16, 4, 64, True),
                              (6, 2064, FP16, 3, 64, True), (5, 1000, FP32, 2, 32, False)])])
def test_kept_exp_softmax_on_the_cpu(rows, n, dtype, cluster, threads, landed):
    """Softmax from the kept exps (one exp a value): masked entries, a fully masked row
    (NaN), and a row far below 0 whose few finite values sit in a few threads, the others
    holding only -inf (their factor must stay finite: 0, not 0 * inf)."""
    x = _rows(rows, n, dtype, rows * n + 1)
    x[3] = float("-inf")
    x[3, 17], x[3, n - 9] = -300.0, -299.0
    config = RowConfig(threads=threads, ctas_per_sm=1, cluster=cluster, landed=landed,
                       kept_exp=True)
    check_forward("softmax", x, lambda tensors: _run("softmax", tensors, n, dtype, config,
                                                     rows))


def test_kept_exp_is_refused_where_it_does_not_apply():
    for kind, config in (("log_softmax", RowConfig(512, 512, 4, 1, 4, kept_exp=True)),
                         ("softmax", RowConfig(512, 512, 4, 1, 2, kept_exp=True)),
                         ("softmax", RowConfig(512, 512, 4, 1, 4, meet=True, kept_exp=True))):
        with pytest.raises(ValueError, match="kept_exp"):
            SoftmaxKernel(kind=kind, n=128256, dtype="bfloat16").program(config, "many")


def test_landed_is_refused_for_the_backward_kinds():
    kernel = SoftmaxKernel(kind="softmax_bwd", n=4096, dtype="bfloat16")
    assert not any(c.landed for c in kernel.config_space("many"))
    with pytest.raises(ValueError, match="landed"):
        kernel.program(RowConfig(1024, 1024, 4, 1, 4, landed=True), "many")


@pytest.mark.compile
@pytest.mark.full
@pytest.mark.parametrize("kind", ["softmax_bwd", "log_softmax_bwd"])
def test_cluster_backward_on_the_cpu(kind):
    rows, n, dtype = 3, 3000, BF16
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(rows, n, generator=gen, dtype=torch.float64)
    forward = torch.softmax if kind == "softmax_bwd" else torch.log_softmax
    y = forward(x, -1).to(dtype)
    dy = torch.randn(rows, n, generator=gen).to(dtype)
    config = RowConfig(threads=64, ctas_per_sm=1, cluster=5)
    check_backward(kind, y, dy, lambda tensors: _run(kind, tensors, n, dtype, config, rows),
                   1e-2, 1e-3)


@pytest.mark.compile
@pytest.mark.full
def test_persistent_clusters_walk_many_rows_on_the_cpu():
    """With room for one cluster (`clusters` = 1), one cluster takes every row in turn: the
    partials alternate between the two parity buffers, row after row."""
    rows, n, dtype = 7, 1000, BF16
    x = _rows(rows, n, dtype, 11)
    config = RowConfig(threads=64, row_threads=64, vecs=3, ctas_per_sm=1, cluster=2)
    out = torch.full_like(x, float("nan"))
    _run("softmax", dict(x=x, y=out), n, dtype, config, rows, clusters=1)
    torch.testing.assert_close(out.double(), torch.softmax(x.double(), -1), rtol=1e-2,
                               atol=1e-4, equal_nan=True)


@pytest.mark.parametrize("n", [32000, 50257, 128256, 151936, 256000, 129280])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_cluster_shapes_fit_the_registers(n, dtype):
    """Every cluster shape of the space (one and two inputs held) leaves no slice empty and
    fits the register file. The one-pass slices hold at most 8 vectors a thread."""
    for held in (1, 2):
        for cluster, threads, ctas_per_sm in cluster_shapes(n, dtype, held):
            cr = ClusterRows(n, dtype, cluster, threads, ctas_per_sm)
            assert fits_registers(cr, held) and (cluster - 1) * cr.slice_vectors < n // cr.vec
    for min_threads in (256, 1024):
        slices, threads = slice_shape(n, dtype, min_threads=min_threads)
        assert threads >= min_threads
        assert ClusterRows(n, dtype, slices, threads).per_thread <= 8


@pytest.mark.compile
@pytest.mark.full
@pytest.mark.parametrize("kind", ["softmax_bwd", "log_softmax_bwd"])
@pytest.mark.parametrize("n, dtype", [(8200, BF16), (5000, FP32)])
def test_whole_row_backward_default_on_the_cpu(kind, n, dtype):
    """The backward kinds' default for rows one CTA holds whole (a cluster of one,
    softmax.whole_row_default): the last vectors of the row in a part of the threads only,
    more rows than the persistent grid has CTAs (two)."""
    from tileops.kernels.softmax import softmax

    kernel = SoftmaxKernel(kind=kind, n=n, dtype=NAMES[dtype])
    config = kernel.heuristic_config("many", "sm_90a")
    assert config == softmax.whole_row_default(n, NAMES[dtype]) and config.cluster == 1
    rows = 5
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(rows, n, generator=gen, dtype=torch.float64) * 3
    x[1, ::3] = float("-inf")
    forward = torch.softmax if kind == "softmax_bwd" else torch.log_softmax
    y = forward(x, -1).to(dtype)
    dy = torch.randn(rows, n, generator=gen).to(dtype)

    def launch(tensors):
        from ..cuda_emulation_threads import run

        compiled = kernel.compile(config, "many")[0]  # two resident CTAs walk the five rows
        run(compiled, 2, config.threads, tensors, dict(rows=rows, clusters=2), cluster=1)

    check_backward(kind, y, dy, launch, 1e-2, 1e-3)
