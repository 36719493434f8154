"""MLADecodeFwdOp on the GPU against an fp32 reference that gathers each request's latent
pages and attends over its own length."""

import math

import pytest
import torch

import tileops
from tileops import MLADecodeFwdOp
from tileops.kernels.attention.mla_decode import FIT_WAVES, MLADecodeConfig, MLADecodeKernel
from tileops.kernels.base import Kernel

from ..helpers import assert_close, poison, randn

pytestmark = pytest.mark.gpu

DC, DR = 512, 64
BF16 = torch.bfloat16


def make_latent(lengths, page_size=64, spare_pages=3, dtype=torch.bfloat16):
    """(kv, cache_seqlens, block_table): pages handed out shuffled, junk past each
    request's pages (-1, out of range); every row random, past the lengths too."""
    batch = len(lengths)
    need = [math.ceil(n / page_size) for n in lengths]
    max_pages = max(max(need), 1) + 1
    n_pages = sum(need) + spare_pages
    kv = randn(n_pages, page_size, DC + DR, dtype=dtype)
    order = torch.randperm(n_pages, device="cuda").to(torch.int32)
    table = torch.full((batch, max_pages), -1, dtype=torch.int32, device="cuda")
    table[:, -1] = n_pages + 5
    used = 0
    for b, count in enumerate(need):
        table[b, :count] = order[used:used + count]
        used += count
    return kv, torch.tensor(lengths, dtype=torch.int32, device="cuda"), table


def reference(q_nope, q_pe, kv, seqlens, table, sm_scale):
    batch, heads, _ = q_nope.shape
    page = kv.shape[1]
    o = torch.zeros(q_nope.shape, dtype=torch.float32, device=q_nope.device)
    lse = torch.full((batch, heads), -math.inf, device=q_nope.device)
    for b in range(batch):
        n = int(seqlens[b])
        if n == 0:
            continue
        rows = kv[table[b, :math.ceil(n / page)].long()].reshape(-1, DC + DR)[:n].float()
        s = (q_nope[b].float() @ rows[:, :DC].T + q_pe[b].float() @ rows[:, DC:].T) * sm_scale
        lse[b] = torch.logsumexp(s, dim=-1)
        o[b] = torch.softmax(s, dim=-1) @ rows[:, :DC]
    return o, lse


def check(lengths, heads=128, dtype=torch.bfloat16, page_size=64, sm_scale=0.1352, op=None):
    kv, seqlens, table = make_latent(lengths, page_size, dtype=dtype)
    q_nope = randn(len(lengths), heads, DC, dtype=dtype)
    q_pe = randn(len(lengths), heads, DR, dtype=dtype)
    for _ in range(2):  # NaN blocks the outputs and partials reuse
        poison(torch.empty(1 << 24, device="cuda"))
    op = op or MLADecodeFwdOp(sm_scale=sm_scale)
    o, lse = op(q_nope, q_pe, kv, seqlens, table)
    o_ref, lse_ref = reference(q_nope, q_pe, kv, seqlens, table, sm_scale)
    assert_close(o, o_ref, scale=2.0, what="o")
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref))
    finite = torch.isfinite(lse_ref)
    torch.testing.assert_close(lse[finite], lse_ref[finite], atol=2e-3, rtol=1e-4)
    return op


MIXED = [1, 0, 63, 64, 65, 700, 5000, 130]


@pytest.mark.smoke
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_lengths(dtype):
    check(MIXED, dtype=dtype)


@pytest.mark.parametrize("page_size", [64, 128, 256])
def test_page_sizes(page_size):
    check([33, 1000, 4097], page_size=page_size)


@pytest.mark.parametrize("heads", [16, 32, 64, 96, 256])
def test_head_counts(heads):
    check([100, 3000], heads=heads)


def test_single_long_request_splits_and_batch_128():
    check([20000])
    check([(37 * i) % 2000 for i in range(128)])  # a full batch, a 0 among them


@pytest.mark.parametrize("lengths", [[4096] * 32, [8192] * 80], ids=["32x4k", "80x8k"])
def test_fitted_schedule_on_equal_requests(lengths):
    """The seesaw on pair runs under the fitted schedule (`fit_waves`): 32 requests of 4K
    take one wave rounded down (2 splits each, not 3), 80 of 8K four waves of quarter
    splits (320 slots; the partials sized for them)."""
    kv, seqlens, table = make_latent(lengths)
    batch = len(lengths)
    q_nope, q_pe = randn(batch, 128, DC, dtype=BF16), randn(batch, 128, DR, dtype=BF16)
    op = MLADecodeFwdOp(sm_scale=0.1352)
    op.pin_config(MLADecodeConfig(seesaw=True, pair_runs=True, fit_waves=FIT_WAVES), q_nope,
                  q_pe, kv, seqlens, table)
    check(lengths, op=op)


def test_default_scale_and_functional_lse():
    kv, seqlens, table = make_latent([5, 300])
    q_nope, q_pe = randn(2, 128, DC, dtype=BF16), randn(2, 128, DR, dtype=BF16)
    o, lse = tileops.mla_decode(q_nope, q_pe, kv, seqlens, table, return_lse=True)
    o_ref, lse_ref = reference(q_nope, q_pe, kv, seqlens, table, (DC + DR) ** -0.5)
    assert_close(o, o_ref, scale=2.0)
    torch.testing.assert_close(lse, lse_ref, atol=2e-3, rtol=1e-4)


def replay_with_new_lengths(graph, o, q_nope, q_pe, kv, seqlens, table):
    """Replays `graph` (a call of scale 0.1 into `o`) on new lengths (0 and the table's
    capacity among them), random pages and queries, each against the reference."""
    capacity = table.shape[1] * 64
    for lengths in ([101, 2001, 6, 901], [0, capacity, 1, 64]):
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        table.copy_(torch.randint(0, kv.shape[0], table.shape, dtype=torch.int32))
        q_nope.copy_(randn(*q_nope.shape, dtype=BF16))
        poison(o)
        graph.replay()
        torch.cuda.synchronize()
        assert_close(o, reference(q_nope, q_pe, kv, seqlens, table, 0.1)[0], scale=2.0,
                     what=f"replay with {lengths}")


def test_cuda_graph_replay_and_no_recompile():
    kv, seqlens, table = make_latent([100, 2000, 5, 900], spare_pages=100)
    q_nope, q_pe = randn(4, 128, DC, dtype=BF16), randn(4, 128, DR, dtype=BF16)
    op = MLADecodeFwdOp(sm_scale=0.1)
    op(q_nope, q_pe, kv, seqlens, table)
    before = Kernel.compile_count
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, _ = op(q_nope, q_pe, kv, seqlens, table)
    replay_with_new_lengths(graph, o, q_nope, q_pe, kv, seqlens, table)
    check([7] * 3, op=op, sm_scale=0.1)
    assert Kernel.compile_count == before


def test_plan_across_layers_stale_schedules_and_graph_replay():
    """`plan_mla_decode`: one schedule reused by two layers' caches; a schedule made for
    other lengths (stale) still exact; the schedule and a run captured in a CUDA graph
    replayed with new lengths, pages and queries into the same buffers."""
    lengths = [100, 2000, 5, 900]
    kv, seqlens, table = make_latent(lengths, spare_pages=100)
    kv2 = randn(*kv.shape, dtype=BF16)
    q_nope, q_pe = randn(4, 128, DC, dtype=BF16), randn(4, 128, DR, dtype=BF16)
    plan = tileops.plan_mla_decode(4, 128, table.shape[1], sm_scale=0.1)
    plan.schedule(seqlens)
    for cache in (kv, kv2):
        o, lse = plan.run(q_nope, q_pe, cache, seqlens, table, schedule=False)
        o_ref, lse_ref = reference(q_nope, q_pe, cache, seqlens, table, 0.1)
        assert_close(o, o_ref, scale=2.0, what="o, a layer on the step's schedule")
        torch.testing.assert_close(lse, lse_ref, atol=2e-3, rtol=1e-4)
    plan.schedule(torch.tensor([3000, 1, 64, 2], dtype=torch.int32, device="cuda"))
    o, _ = plan.run(q_nope, q_pe, kv, seqlens, table, schedule=False)
    assert_close(o, reference(q_nope, q_pe, kv, seqlens, table, 0.1)[0], scale=2.0,
                 what="o on a stale schedule")
    out, lse = torch.empty_like(q_nope), torch.empty(4, 128, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.schedule(seqlens)
        plan.run(q_nope, q_pe, kv, seqlens, table, out=out, lse=lse, schedule=False)
    replay_with_new_lengths(graph, out, q_nope, q_pe, kv, seqlens, table)


def test_torch_compile_fullgraph():
    kv, seqlens, table = make_latent([40, 900])
    q_nope, q_pe = randn(2, 128, DC, dtype=BF16), randn(2, 128, DR, dtype=BF16)

    @torch.compile(fullgraph=True)
    def f(q_nope):
        return tileops.mla_decode(q_nope * 1, q_pe, kv, seqlens, table, sm_scale=0.1) * 2

    assert_close(f(q_nope), reference(q_nope, q_pe, kv, seqlens, table, 0.1)[0] * 2,
                 scale=4.0)


def space(heads):
    return [(heads, config) for config in MLADecodeKernel(
        dtype="bfloat16", heads=heads, dim=DC, rope=DR, page_size=64).config_space("long")]


@pytest.mark.parametrize("heads, config", space(128) + space(16), ids=str)
def test_every_config_of_the_space(heads, config):
    """Every config of the tuner's space at 128 heads and at 16 (TP 8: the plain program's
    masked rows), on mixed lengths."""
    kv, seqlens, table = make_latent(MIXED)
    q_nope = randn(len(MIXED), heads, DC, dtype=BF16)
    q_pe = randn(len(MIXED), heads, DR, dtype=BF16)
    op = MLADecodeFwdOp(sm_scale=0.1352)
    op.pin_config(config, q_nope, q_pe, kv, seqlens, table)
    check(MIXED, heads=heads, op=op)


def test_planned_combine_on_many_splits():
    """The planned combine against torch on synthetic partials: requests of 1 split (left
    alone), 2, 9, 129 and 300 splits, an empty split inside one and a request whose splits
    are all empty (o = 0, lse = -inf)."""
    kernel = MLADecodeKernel(dtype="bfloat16", heads=128, dim=DC, rope=DR, page_size=64)
    combine = kernel.compile(MLADecodeConfig(), "short")[2]
    counts = [1, 2, 9, 129, 300, 3]
    ends = torch.tensor(counts).cumsum(0)
    n_slots, batch = int(ends[-1]), len(counts)
    lse_part = torch.randn(n_slots, 1, 128, device="cuda") * 4
    lse_part[int(ends[2]) - 4] = -math.inf  # an empty split among 9
    lse_part[int(ends[4]):] = -math.inf  # a request that saw no key
    o_part = torch.randn(n_slots, 1, 128, DC, device="cuda")
    o_part[torch.isinf(lse_part)] = 0.0  # as the attention writes an empty split
    slot_table = torch.zeros(n_slots, 4, dtype=torch.int32, device="cuda")
    for b, (count, end) in enumerate(zip(counts, ends.tolist(), strict=True)):
        slot_table[end - count:end, 0] = b
        slot_table[end - 1, 3] = count
    o = poison(torch.empty(batch, 1, 128, DC, dtype=BF16, device="cuda"))
    lse = poison(torch.empty(batch, 128, 1, device="cuda"))
    combine(o_part, lse_part, slot_table, ends.to(torch.int32).cuda(), o, lse)
    for b, (count, end) in enumerate(zip(counts, ends.tolist(), strict=True)):
        if count == 1:  # written by the attention itself: untouched
            assert torch.isnan(o[b].float()).all() and torch.isnan(lse[b]).all()
            continue
        parts = lse_part[end - count:end, 0]  # [splits, H]
        lse_ref = torch.logsumexp(parts, dim=0)
        weights = torch.nan_to_num(torch.exp(parts - lse_ref), nan=0.0)
        o_ref = (weights[:, :, None] * o_part[end - count:end, 0]).sum(0)
        assert_close(o[b, 0], o_ref, scale=1.0, what=f"o of a request of {count} splits")
        torch.testing.assert_close(lse[b, :, 0], lse_ref, atol=1e-5, rtol=1e-5)


SEESAW_CASES = {  # (lengths, heads, dtype, page_size)
    "mixed-fp16": (MIXED, 128, torch.float16, 64),
    "pages-128": ([33, 1000, 4097], 128, BF16, 128),
    "pages-256": ([33, 1000, 4097], 128, BF16, 256),
    "heads-64": ([100, 3000], 64, BF16, 64),
    "heads-256": ([100, 3000], 256, BF16, 64),
    "one-long-request": ([20000], 128, BF16, 64),
    "batch-128": ([(37 * i) % 2000 for i in range(128)], 128, BF16, 64),
    "odd-and-even-runs": ([64 * 7, 64 * 8 + 1, 64, 1], 128, BF16, 64),
}


SEESAW_VARIANTS = {"tile-runs": {}, "pair-runs": {"pair_runs": True},
                   "no-evict-hint": {"evict_first": False}}


@pytest.mark.parametrize("case, variant", [
    (case, variant) for case in SEESAW_CASES for variant in SEESAW_VARIANTS
    if variant != "no-evict-hint" or case == "batch-128"])
def test_seesaw_schedule(case, variant):
    """The seesaw program (two warp groups taking key tiles in turns, each S of the next
    pair issued behind this pair's P V, parts of a tile refilled as they are freed) on
    every shape the plain program's tests cover: odd runs end on a masked tile, runs of
    one and two pairs (no refills, refills without the S ahead), splits merge;
    `pair_runs`: the schedule deals pairs."""
    lengths, heads, dtype, page_size = SEESAW_CASES[case]
    kv, seqlens, table = make_latent(lengths, page_size, dtype=dtype)
    q_nope = randn(len(lengths), heads, DC, dtype=dtype)
    q_pe = randn(len(lengths), heads, DR, dtype=dtype)
    op = MLADecodeFwdOp(sm_scale=0.1352)
    op.pin_config(MLADecodeConfig(seesaw=True, **SEESAW_VARIANTS[variant]), q_nope, q_pe, kv,
                  seqlens, table)
    check(lengths, heads=heads, dtype=dtype, page_size=page_size, op=op)
