"""The loss-and-gradient kernel's generated CUDA on the CPU (tests/cuda_emulation_threads.py:
shuffles, barriers and shared memory run as on the GPU), against a float64 reference: rows
kept in shared memory between the passes (`kept_chunks`) and read again from global memory,
tails past the vector width, ignored rows, label smoothing, softcap and z-loss; plus the
config space's shared-memory bound."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tileops.kernels.softmax.cluster_rows import ClusterRows
from tileops.kernels.softmax.cross_entropy import (
    SMEM_BYTES,
    CrossEntropyConfig,
    CrossEntropyKernel,
    kept_row_configs,
)
from tileops.kernels.softmax.row_map import RowMap
from tileops.kernels.softmax.softmax import landed_configs

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
EMULATED_CLUSTERS = 3  # the persistent grid's clusters: a cluster takes several rows


def _reference(x, target, ignore_index, eps, cap, zloss):
    """(loss, lse, grad) per row in float64, as the kernel defines them (the sum reduction)."""
    leaf = x.double().requires_grad_()
    z = leaf if cap is None else cap * torch.tanh(leaf / cap)
    loss = F.cross_entropy(z, target, ignore_index=ignore_index, reduction="none",
                           label_smoothing=eps)
    lse = torch.logsumexp(z, -1)
    loss = loss + zloss * lse.square() * (target != ignore_index)
    loss.sum().backward()
    return loss.detach(), lse.detach(), leaf.grad


def _run_on_cpu(x, target, config, ignore_index=-100, eps=0.0, cap=None, zloss=0.0):
    from ..cuda_emulation_threads import run

    rows, n = x.shape
    dtype = {BF16: "bfloat16", FP16: "float16", FP32: "float32"}[x.dtype]
    kernel = CrossEntropyKernel(mode="loss_and_grad", n=n, dtype=dtype, softcap=cap is not None,
                                smoothing=eps != 0.0, dloss_per_row=False)
    compiled = kernel.compile(config, "many")[0]
    source = compiled.get_kernel_source()
    if config.kept_chunks:  # the kept chunks are in the program
        assert "kept_shared" in source
    assert ("tileops_l2::load16" in source) == config.l2_hints
    assert ("tl::tma_load(" in source) == config.landed  # one bulk copy a slice
    loss = torch.full((rows,), float("nan"))
    lse = torch.full((rows,), float("nan"))
    grad = torch.full_like(x, float("nan"))
    run(compiled, _grid(rows, n, dtype, config), config.threads,
        dict(x=x, target=target, loss=loss, lse=lse, grad=grad),
        dict(rows=rows, ignore_index=ignore_index, cap=1.0 if cap is None else cap, eps=eps,
             zloss=zloss, clusters=EMULATED_CLUSTERS), cluster=max(config.cluster, 1))
    return loss, lse, grad


def _grid(rows, n, dtype, config, mode="loss_and_grad"):
    """The launch grid of a config: persistent clusters, a CTA per slice of every row
    (`grad` mode), or the streaming kernel's CTAs."""
    if config.cluster and mode == "grad":
        return rows * config.cluster
    if config.cluster:
        return min(rows, EMULATED_CLUSTERS) * config.cluster
    rm = RowMap(n, dtype, config.threads, config.row_threads, config.vecs, 132)
    return min(-(-rows // rm.rows_per_cta), 132 * config.ctas_per_sm)


# (rows, vocab, dtype, config, params): each kept case has chunks read again from global
# memory after the statistics pass, and a last chunk partly past the row
CASES = [
    (5, 5000, BF16, CrossEntropyConfig(64, 64, 2, 1, kept_chunks=3), {}),
    (4, 4104, FP16, CrossEntropyConfig(64, 64, 2, 1, kept_chunks=2),
     {"eps": 0.1, "zloss": 1e-4}),
    (3, 2001, BF16, CrossEntropyConfig(64, 64, 4, 1, kept_chunks=5),
     {"cap": 30.0, "ignore_index": 7}),
    (4, 3000, FP32, CrossEntropyConfig(128, 64, 2, 1, kept_chunks=6), {"eps": 0.05}),
    (3, 3000, BF16, CrossEntropyConfig(64, 64, 2, 1, kept_chunks=0), {}),  # no kept chunks
    (3, 1600, BF16, CrossEntropyConfig(64, 64, 2, 1, kept_chunks=4), {}),  # all kept
    # chunk c + 1 loaded while chunk c is reduced, kept or not
    (4, 5000, BF16, CrossEntropyConfig(64, 64, 2, 1, kept_chunks=3, prefetch=True),
     {"eps": 0.1, "cap": 10.0}),
    (3, 2001, FP16, CrossEntropyConfig(64, 64, 4, 1, prefetch=True), {"zloss": 1e-4}),
    # rows split over a cluster of CTAs (cluster_rows.py), the last slice short
    (4, 5000, BF16, CrossEntropyConfig(threads=64, ctas_per_sm=1, cluster=4),
     {"eps": 0.1, "zloss": 1e-4}),
    (3, 2001, FP16, CrossEntropyConfig(threads=32, ctas_per_sm=1, cluster=8),
     {"cap": 30.0, "ignore_index": 7}),
    (3, 3000, FP32, CrossEntropyConfig(threads=64, ctas_per_sm=2, cluster=3),
     {"eps": 0.05, "cap": 10.0}),
    # slices landing by TMA one row ahead (landed): rows past the resident clusters, so
    # each cluster takes several rows and the landing barrier turns phases
    (59, 4096, BF16, CrossEntropyConfig(threads=64, ctas_per_sm=1, cluster=4, landed=True),
     {"eps": 0.1, "zloss": 1e-4}),
    (41, 3000, FP32, CrossEntropyConfig(threads=32, ctas_per_sm=1, cluster=3, landed=True),
     {"cap": 30.0, "ignore_index": 7}),
    (135, 2000, FP16, CrossEntropyConfig(threads=64, ctas_per_sm=1, cluster=1, landed=True),
     {}),
    # the gradient from kept exps (one exp a logit): landed and not, smoothing and z-loss
    (23, 4096, BF16, CrossEntropyConfig(threads=64, ctas_per_sm=1, cluster=4, landed=True,
                                        kept_exp=True), {"eps": 0.1, "zloss": 1e-4}),
    (4, 3000, FP16, CrossEntropyConfig(threads=64, ctas_per_sm=1, cluster=3, kept_exp=True),
     {"ignore_index": 7}),
    # the second pass last chunk first, with and without L2 hints (kernels/l2_hints.py)
    (5, 5000, BF16, CrossEntropyConfig(64, 64, 2, 1, reverse=True), {"cap": 30.0}),
    (4, 4104, FP16, CrossEntropyConfig(64, 64, 2, 2, reverse=True, l2_hints=True,
                                       launch_bound=True), {"eps": 0.1, "zloss": 1e-4}),
    (3, 3000, FP32, CrossEntropyConfig(64, 64, 2, 1, l2_hints=True), {"ignore_index": 7}),
    (4, 5000, BF16, CrossEntropyConfig(64, 64, 2, 1, kept_chunks=2, reverse=True), {}),
    # several rows a CTA, each over two warps, rows not a multiple: the slots past the end
    # run along on the last row (RowMap.placed_row), storing nothing
    (3, 3000, BF16, CrossEntropyConfig(128, 64, 2, 1), {"cap": 30.0}),
    (5, 4104, FP16, CrossEntropyConfig(256, 64, 2, 1, kept_chunks=2, reverse=True),
     {"eps": 0.1}),
]


def _case_id(case) -> str:
    rows, vocab, dtype, config = case[:4]
    flags = [f"kept{config.kept_chunks}"] + [
        name for name in ("prefetch", "reverse", "l2_hints", "landed", "kept_exp")
        if getattr(config, name)]
    if config.cluster:
        flags.append(f"cluster{config.cluster}")
    return f"{rows}x{vocab}-{str(dtype)[6:]}-{'-'.join(flags)}"



@pytest.mark.compile
@pytest.mark.parametrize("rows, vocab, dtype, config, params", [
    pytest.param(*case, marks=pytest.mark.smoke if i in (0, len(CASES) - 2)
                 or (case[3].landed and case[2] is BF16) else
                 pytest.mark.full, id=_case_id(case))
    for i, case in enumerate(CASES)])
def test_loss_and_gradient_with_kept_chunks_on_the_cpu(rows, vocab, dtype, config, params):
    gen = torch.Generator().manual_seed(rows * vocab)
    x = (torch.randn(rows, vocab, generator=gen) * 2).to(dtype)
    ignore_index = params.get("ignore_index", -100)
    target = torch.randint(0, vocab, (rows,), generator=gen)
    target[1] = ignore_index
    loss, lse, grad = _run_on_cpu(x, target, config, ignore_index, params.get("eps", 0.0),
                                  params.get("cap"), params.get("zloss", 0.0))
    want_loss, want_lse, want_grad = _reference(x, target, ignore_index,
                                                params.get("eps", 0.0), params.get("cap"),
                                                params.get("zloss", 0.0))
    torch.testing.assert_close(loss.double(), want_loss, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    assert not grad.isnan().any()
    tol = {BF16: 1e-2, FP16: 1e-3, FP32: 1e-5}[dtype]
    torch.testing.assert_close(grad.double(), want_grad, rtol=tol, atol=tol * 1e-2)
    assert (grad[1] == 0).all()  # the ignored row


@pytest.mark.parametrize("vocab", [32000, 50257, 128256, 151936, 256000])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_kept_configs_fit_shared_memory(vocab, dtype):
    """Every kept config of the space fits an SM's shared memory with the reductions' room,
    keeps at most the row's chunks, and is in the loss_and_grad kernel's space only."""
    configs = kept_row_configs(vocab, dtype)
    assert configs
    for config in configs:
        rm = RowMap(vocab, dtype, config.threads, config.row_threads, config.vecs, 132)
        assert 0 < config.kept_chunks <= rm.chunks and config.ctas_per_sm == 1
        assert rm.kept_bytes(config.kept_chunks) + 4096 <= SMEM_BYTES
    key = dict(n=vocab, dtype=dtype, softcap=False, smoothing=False, dloss_per_row=False)
    space = CrossEntropyKernel(mode="loss_and_grad", **key).config_space("many")
    assert set(configs) <= set(space)
    loss_space = CrossEntropyKernel(mode="loss", **key).config_space("many")
    assert not any(c.kept_chunks for c in loss_space) and any(c.prefetch for c in loss_space)
    grad_space = CrossEntropyKernel(mode="grad", **key).config_space("many")
    assert not any(c.kept_chunks for c in grad_space) and any(c.prefetch for c in grad_space)
    default = CrossEntropyKernel(mode="loss_and_grad", **key).heuristic_config("many", "sm_90a")
    assert isinstance(default, CrossEntropyConfig)


@pytest.mark.parametrize("vocab", [32000, 128256, 151936, 256000])
def test_gradient_pass_defaults(vocab):
    """The gradient pass's default on rows past one chunk: unclustered slices of at most 8
    vectors a thread; 1024 threads with soft-capping (its SFU chain hides behind more
    warps), the fewest threads from 256 without."""
    for softcap in (False, True):
        kernel = CrossEntropyKernel(mode="grad", n=vocab, dtype="bfloat16", softcap=softcap,
                                    smoothing=False, dloss_per_row=False)
        config = kernel.heuristic_config("many", "sm_90a")
        cr = ClusterRows(vocab, "bfloat16", config.cluster, config.threads)
        assert cr.per_thread <= 8 and config.ctas_per_sm == 1 and not config.prefetch
        assert (config.threads == 1024) if softcap else (config.threads < 1024)
        assert config in kernel.config_space("many")


def test_loss_and_gradient_default_on_long_rows():
    """Loss and gradient of 16-bit vocabulary rows without softcap (smoothed or not) on
    slices landed by TMA (softmax.landed_default, 512 threads, the fewest slices of at most
    16 vectors a thread; the kept-exp pairs of softmax.paired_default in the space only);
    soft-capped or fp32 rows spanning more than one chunk on one CTA of 1024 threads an SM;
    Mistral's soft-capped 32000 and the loss pass alone keep two CTAs of 512."""
    def default(mode, n, softcap=False, smoothing=False, dtype="bfloat16"):
        return CrossEntropyKernel(mode=mode, n=n, dtype=dtype, softcap=softcap,
                                  smoothing=smoothing, dloss_per_row=False).heuristic_config(
                                      "many", "sm_90a")

    for n, cluster in ((128256, 2), (129280, 2), (151936, 4), (32000, 1)):
        for dtype, smoothing in (("bfloat16", False), ("float16", False), ("bfloat16", True)):
            config = default("loss_and_grad", n, smoothing=smoothing, dtype=dtype)
            assert config == CrossEntropyConfig(512, 512, 4, 1, cluster, landed=True), (n, dtype)
    paired = CrossEntropyConfig(256, 256, 4, 2, 8, landed=True, kept_exp=True)
    assert paired in CrossEntropyKernel(mode="loss_and_grad", n=128256, dtype="bfloat16",
                                        softcap=False, smoothing=False,
                                        dloss_per_row=False).config_space("many")
    for config in (default("loss_and_grad", 256000, softcap=True),
                   default("loss_and_grad", 128256, dtype="float32")):
        assert not config.landed
        assert (config.threads, config.row_threads, config.ctas_per_sm) == (1024, 1024, 1)
    for other in (default("loss_and_grad", 32000, softcap=True), default("loss", 256000, True)):
        assert not other.landed
        assert (other.threads, other.ctas_per_sm) == (512, 2)
    few = CrossEntropyKernel(mode="loss_and_grad", n=128256, dtype="bfloat16", softcap=False,
                             smoothing=False, dloss_per_row=False).heuristic_config(
                                 "few", "sm_90a")
    assert not few.landed


def test_kept_chunks_over_shared_memory_are_refused():
    kernel = CrossEntropyKernel(mode="loss_and_grad", n=128256, dtype="bfloat16",
                                softcap=False, smoothing=False, dloss_per_row=False)
    config = CrossEntropyConfig(512, 512, 4, 1, kept_chunks=8)  # the whole 256 KB row
    with pytest.raises(ValueError, match="shared memory"):
        kernel.program(config, "many")
    with pytest.raises(ValueError, match="shared memory"):
        kernel.program(dataclasses.replace(config, kept_chunks=6, ctas_per_sm=2), "many")


@pytest.mark.compile
@pytest.mark.full
@pytest.mark.parametrize("config", [CrossEntropyConfig(64, 64, 2, 1, prefetch=True),
                                    CrossEntropyConfig(128, 64, 2, 2, launch_bound=True),
                                    CrossEntropyConfig(threads=64, cluster=6)],
                         ids=["prefetch", "launch_bound", "cluster"])
def test_gradient_pass_variants_on_the_cpu(config):
    """The gradient-only pass (one dloss per row) with prefetch / the launch bound."""
    from ..cuda_emulation_threads import run

    rows, n = 5, 3000
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(rows, n, generator=gen) * 2).to(BF16)
    target = torch.randint(0, n, (rows,), generator=gen)
    target[2] = -100
    dloss = torch.randn(rows, generator=gen)
    want_loss, want_lse, want_grad = _reference(x, target, -100, 0.1, None, 0.0)
    leaf = x.double().requires_grad_()
    F.cross_entropy(leaf, target, reduction="none", label_smoothing=0.1).backward(
        dloss.double())
    kernel = CrossEntropyKernel(mode="grad", n=n, dtype="bfloat16", softcap=False,
                                smoothing=True, dloss_per_row=True)
    compiled = kernel.compile(config, "many")[0]
    grad = torch.full_like(x, float("nan"))
    run(compiled, _grid(rows, n, "bfloat16", config, "grad"), config.threads,
        dict(dloss=dloss, x=x, target=target, lse=want_lse.float(), grad=grad),
        dict(rows=rows, ignore_index=-100, cap=1.0, eps=0.1, zloss=0.0))
    torch.testing.assert_close(grad.double(), leaf.grad, rtol=1e-2, atol=1e-4)


@pytest.mark.parametrize("vocab", [32000, 128256, 151936, 256000])
def test_landed_configs_fit_and_are_refused_where_slices_are_not_whole(vocab):
    """`landed` shapes: whole 16-byte slices that fit shared memory and the registers, in
    the loss and loss + gradient spaces (not the gradient pass's: it has no next row to
    land); a row not cut into whole vectors is refused, not run on a short copy."""
    configs = landed_configs(vocab, "bfloat16", CrossEntropyConfig)
    assert configs
    for config in configs:
        cr = ClusterRows(vocab, "bfloat16", config.cluster, config.threads)
        assert cr.lands_whole_slices and config.ctas_per_sm == 1
        assert cr.slice_length * 2 + 4096 <= SMEM_BYTES
    key = dict(n=vocab, dtype="bfloat16", softcap=False, smoothing=False, dloss_per_row=False)
    for mode in ("loss", "loss_and_grad"):
        assert set(configs) <= set(CrossEntropyKernel(mode=mode, **key).config_space("many"))
    grad = CrossEntropyKernel(mode="grad", **key)
    assert not any(c.landed for c in grad.config_space("many"))
    with pytest.raises(ValueError, match="landed"):
        grad.program(configs[0], "many")
    odd = CrossEntropyKernel(mode="loss_and_grad", **dict(key, n=vocab + 1))
    with pytest.raises(ValueError, match="whole 16-byte"):
        odd.program(CrossEntropyConfig(1024, 1024, 4, 1, 3, landed=True), "many")


@pytest.mark.compile
@pytest.mark.smoke
def test_landed_program_lands_one_bulk_copy_and_spills_nothing(tmp_path):
    """Llama-3's vocabulary in clusters of 4 x 1024 threads: each slice lands by one 1-D
    bulk copy of its 64128 bytes (no tensor map: `T.assume` proves it in bounds; a box
    copy would take 167 TMA instructions), and the slice held in registers spills none."""
    from ..helpers import assert_no_spills_or_serialized_wgmma

    kernel = CrossEntropyKernel(mode="loss_and_grad", n=128256, dtype="bfloat16",
                                softcap=False, smoothing=False, dloss_per_row=False)
    config = CrossEntropyConfig(1024, 1024, 4, 1, 4, landed=True)
    assert config in kernel.config_space("many")
    compiled = kernel.compile(config, "many")[0]
    source = compiled.get_kernel_source()
    assert "expect_transaction(64128)" in source and "CUtensorMap" not in source
    assert_no_spills_or_serialized_wgmma(compiled, tmp_path)


def test_kept_exp_is_refused_where_it_does_not_apply():
    """The kept exps stand for the logits only without softcap (whose gradient needs them)
    and where a gradient is stored from a persistent cluster."""
    config = CrossEntropyConfig(threads=512, ctas_per_sm=1, cluster=4, kept_exp=True)
    for mode, softcap in (("loss_and_grad", True), ("loss", False)):
        kernel = CrossEntropyKernel(mode=mode, n=128256, dtype="bfloat16", softcap=softcap,
                                    smoothing=False, dloss_per_row=False)
        with pytest.raises(ValueError, match="kept_exp"):
            kernel.program(config, "many")
