"""argmax and topk on the GPU against torch: exact indices for argmax (ties to the lowest
index, NaN as the maximum), and for topk the values bit-exact and the indices equal to a
stable descending sort's (ties to the lower index), on fresh random data."""

import pytest
import torch

import tileops
from tileops import ArgmaxFwdOp, TopkFwdOp
from tileops.kernels.base import Kernel
from tileops.kernels.selection import ArgmaxKernel, TopkKernel

from ..helpers import poison, randn

pytestmark = pytest.mark.gpu

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# (rows, vocab, dtype): each a size boundary or a code path
ARGMAX_CASES = [
    (1, 256000, BF16),    # gemma-2 batch 1: many chunks per row, merge pass
    (256, 128256, FP16),  # large bucket
    (8, 151936, FP32),    # fp32: 4-element vectors
    (3, 50257, BF16),     # odd vocab: scalar loads, a partial last chunk
    (17, 1000, FP16),     # one chunk per row (no merge pass), large bucket
    (5, 7, FP32),         # a row shorter than one warp
]
# (rows, vocab, k, dtype)
TOPK_CASES = [
    (1, 256000, 64, BF16),    # batch 1, 125 chunks, k_cap 64
    (256, 128256, 50, FP16),  # large bucket
    (8, 151936, 8, FP32),     # k_cap 8, fp32 keys (32 value bits)
    (64, 32000, 128, BF16),   # k = MAX_K
    (3, 50257, 100, FP16),    # odd vocab, k_cap 128
    (17, 1000, 50, FP32),     # one chunk per row: pass 1 writes the sorted output
    (4, 200, 1, BF16),        # k = 1
    (2, 7, 7, FP16),          # k = vocab
]


def stable_topk(x, k):
    """torch's stable descending sort: equal values keep index order, NaN first."""
    values, indices = torch.sort(x, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def check_argmax(x, got):
    want = torch.argmax(x, dim=-1)
    bad = (got != want).nonzero()
    assert not bad.numel(), (f"{len(bad)} rows differ; first row {bad[0].item()}: got "
                             f"{got[bad[0]].item()}, want {want[bad[0]].item()}")


def check_topk(x, values, indices, k):
    want_values, want_indices = stable_topk(x, k)
    assert values.dtype == x.dtype and indices.dtype == torch.int64
    same = (values == want_values) | (values.isnan() & want_values.isnan())
    assert same.all(), f"values differ at {(~same).nonzero()[:4].tolist()}"
    assert torch.equal(indices, want_indices), \
        f"indices differ at {(indices != want_indices).nonzero()[:4].tolist()}"
    # torch.topk agrees on the values (its tie order is unspecified)
    ref = torch.topk(x, k)
    assert ((values == ref.values) | (values.isnan() & ref.values.isnan())).all()


@pytest.mark.smoke
@pytest.mark.parametrize("rows, vocab, dtype", ARGMAX_CASES)
def test_argmax_matches_torch(rows, vocab, dtype):
    x = randn(rows, vocab, dtype=dtype)
    check_argmax(x, tileops.argmax(x, -1))


@pytest.mark.smoke
@pytest.mark.parametrize("rows, vocab, k, dtype", TOPK_CASES)
def test_topk_matches_torch(rows, vocab, k, dtype):
    x = randn(rows, vocab, dtype=dtype)
    values, indices = tileops.topk(x, k)
    check_topk(x, values, indices, k)


@pytest.mark.smoke
@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
def test_ties_nan_and_infinities(dtype):
    """Few distinct values (ties everywhere, the tie-break decides), rows of -inf, NaN
    (several per row: the first wins argmax), +inf, and -0.0 next to +0.0."""
    rows, vocab = 12, 128256
    x = torch.randint(-3, 4, (rows, vocab), device="cuda").to(dtype)
    x[1] = float("-inf")
    x[2, 5000], x[2, 90000], x[2, 100] = float("nan"), float("nan"), 3.0
    x[3, 7] = float("inf")
    x[4] = -0.0
    x[4, 1000::1000] = 0.0
    x[5, :100] = float("nan")  # more NaNs than k
    x[6] = torch.finfo(dtype).min
    x[7, -1] = torch.finfo(dtype).max  # the last element of the last chunk
    check_argmax(x, tileops.argmax(x, -1))
    for k in (1, 50, 128):
        values, indices = tileops.topk(x, k)
        check_topk(x, values, indices, k)


@pytest.mark.smoke
def test_argmax_default_dim_flattens_and_keepdim():
    x = randn(4, 3, 32000, dtype=BF16)
    assert torch.equal(tileops.argmax(x), torch.argmax(x))
    for kwargs in ({"dim": -1, "keepdim": True}, {"dim": 2}, {"dim": None, "keepdim": True}):
        got, want = tileops.argmax(x, **kwargs), torch.argmax(x, **kwargs)
        assert got.shape == want.shape and torch.equal(got, want), kwargs


@pytest.mark.smoke
def test_non_contiguous_and_offset_inputs():
    wide = randn(64, 128256 + 64, dtype=BF16)
    x = wide[:, 3:128256 + 3]  # row stride != vocab, base not 16-byte aligned
    check_argmax(x, tileops.argmax(x, -1))
    values, indices = tileops.topk(x, 50)
    check_topk(x, values, indices, 50)
    t = randn(32000, 8, dtype=FP16).t()  # a transposed view
    check_argmax(t, tileops.argmax(t, -1))
    values, indices = tileops.topk(t, 8)
    check_topk(t, values, indices, 8)


@pytest.mark.smoke
def test_leading_dims_and_empty_batch():
    x = randn(2, 3, 32000, dtype=BF16)
    values, indices = tileops.topk(x, 8)
    check_topk(x.view(6, -1), values.view(6, -1), indices.view(6, -1), 8)
    empty = randn(0, 32000, dtype=BF16)
    assert tileops.argmax(empty, -1).shape == (0,)
    assert tileops.topk(empty, 8)[0].shape == (0, 8)
    assert tileops.topk(x, 0)[1].shape == (2, 3, 0)


@pytest.mark.smoke
@pytest.mark.parametrize("rows", [1, 256])
def test_every_output_slot_is_written(rows):
    """Direct launches into poisoned outputs, both buckets."""
    x = randn(rows, 129280, dtype=BF16)
    kernel = TopkKernel(dtype="bfloat16", vocab=129280, k_cap=64)
    values = poison(torch.empty(rows, 50, dtype=BF16, device="cuda"))
    indices = torch.full((rows, 50), -1, dtype=torch.int64, device="cuda")
    kernel(rows, x, values, indices)
    check_topk(x, values, indices, 50)
    out = torch.full((rows,), -1, dtype=torch.int64, device="cuda")
    ArgmaxKernel(dtype="bfloat16", vocab=129280)(rows, x, out)
    check_argmax(x, out)


@pytest.mark.smoke
def test_argmax_chunks_meet_in_one_launch_on_every_stream():
    """A split row's last CTA writes the index and clears its scratch slots: many calls in
    a row on two streams at once stay exact and leave each stream's buffer zero."""
    from tileops.kernels import workspace

    xs = [randn(rows, 128256, dtype=BF16) for rows in (1, 64)]
    xs[1][5, 1000:1010] = 1e4  # a tie across no chunk boundary: the lower index
    xs[1][7, ::4096] = float("nan")  # NaN in many chunks: the first one
    streams = [torch.cuda.Stream() for _ in xs]
    torch.cuda.synchronize()
    results = []
    for stream, x in zip(streams, xs, strict=True):
        with torch.cuda.stream(stream):
            results.append([tileops.argmax(x, -1) for _ in range(20)])
    torch.cuda.synchronize()
    for x, outs in zip(xs, results, strict=True):
        for got in outs:
            check_argmax(x, got)
    assert workspace._found  # (no torch.any for uint64 on CUDA: viewed as int64)
    assert not any(b.view(torch.int64).any() for _, _, b in workspace._found.values())


@pytest.mark.smoke
def test_torch_compile_fullgraph():
    @torch.compile(fullgraph=True)
    def sample(logits):
        values, indices = tileops.topk(logits.float() * 0.5, 50)
        return tileops.argmax(logits, -1), values, indices

    x = randn(8, 151936, dtype=BF16)
    greedy, values, indices = sample(x)
    check_argmax(x, greedy)
    check_topk(x.float() * 0.5, values, indices, 50)


@pytest.mark.smoke
def test_cuda_graph_replays_with_new_logits():
    x = randn(64, 128256, dtype=BF16)
    tileops.argmax(x, -1), tileops.topk(x, 50)  # load the kernels before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        greedy = tileops.argmax(x, -1)
        values, indices = tileops.topk(x, 50)
    x.copy_(randn(64, 128256, dtype=BF16))
    graph.replay()
    check_argmax(x, greedy)
    check_topk(x, values, indices, 50)


@pytest.mark.smoke
def test_batch_sizes_do_not_recompile():
    op, top = ArgmaxFwdOp(dim=-1), TopkFwdOp(k=50)
    for rows in (1, 16, 17, 256):  # both buckets built once
        x = randn(rows, 32000, dtype=BF16)
        op(x), top(x)
    before = Kernel.compile_count
    for rows in (2, 3, 5, 9, 15, 31, 100, 200, 255, 513):
        x = randn(rows, 32000, dtype=BF16)
        check_argmax(x, op(x))
        values, indices = top(x)
        check_topk(x, values, indices, 50)
    assert Kernel.compile_count == before
    x = randn(4, 32000, dtype=BF16)  # another k in the same bucket: no new program
    values, indices = TopkFwdOp(k=33)(x)
    check_topk(x, values, indices, 33)
    assert Kernel.compile_count == before


@pytest.mark.full
@pytest.mark.parametrize("bucket_rows", [1, 64])
def test_every_topk_config_of_the_space(bucket_rows):
    x = randn(bucket_rows, 50257, dtype=FP16)
    x[0, ::3] = 1.0  # ties across chunks
    kernel = TopkKernel(dtype="float16", vocab=50257, k_cap=64)
    for config in kernel.config_space(kernel.bucket_of(bucket_rows)):
        op = TopkFwdOp(k=64)
        op.pin_config(config, x)
        values, indices = op(x)
        check_topk(x, values, indices, 64)
