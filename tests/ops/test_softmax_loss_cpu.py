"""The softmax family, cross-entropy and fused linear cross-entropy without a GPU: meta
outputs through the functional API, errors that name the op and argument, rooflines, the
default thread maps, the fused loss's chunking."""

import pytest
import torch

import tileops
from tileops import (
    CrossEntropyBwdOp,
    CrossEntropyFwdOp,
    FusedLinearCrossEntropyFwdOp,
    LogsumexpFwdOp,
    SoftmaxFwdOp,
)
from tileops.errors import TileOpsError
from tileops.kernels.gemm import GemmKernel
from tileops.kernels.softmax.row_map import RowMap, vector_width
from tileops.kernels.softmax.softmax import default_row_config
from tileops.ops.fused_linear_cross_entropy import chunk_rows

from ..helpers import meta


def test_meta_outputs_have_torch_shapes_and_dtypes():
    x = meta(4, 7, 1000, dtype=torch.float16)
    assert tileops.softmax(x).shape == (4, 7, 1000)
    assert tileops.log_softmax(x, dim=2).dtype == torch.float16
    assert tileops.logsumexp(x).shape == (4, 7)
    assert tileops.logsumexp(x, keepdim=True).shape == (4, 7, 1)
    logits, target = meta(8, 32000), meta(8, dtype=torch.int64)
    assert tileops.cross_entropy(logits, target).shape == ()
    assert tileops.cross_entropy(logits, target).dtype == torch.bfloat16
    assert tileops.cross_entropy(logits, target, reduction="none").shape == (8,)


@pytest.mark.parametrize("call, match", [
    (lambda: tileops.softmax(meta(4, 100), dim=0), "SoftmaxFwdOp.*dim"),
    (lambda: tileops.softmax(meta(4, 100, dtype=torch.int32)), "SoftmaxFwdOp.*'input'.*dtype"),
    (lambda: tileops.cross_entropy(meta(8, 100), meta(4, dtype=torch.int64)),
     "CrossEntropyFwdOp.*'target'.*M = 8"),
    (lambda: tileops.cross_entropy(meta(8, 100), meta(8, dtype=torch.int32)),
     "CrossEntropyFwdOp.*'target'.*int64"),
    (lambda: tileops.cross_entropy(meta(2, 8, 100), meta(2, 8, dtype=torch.int64)),
     "CrossEntropyFwdOp.*'input'.*\\[M, V\\]"),
    (lambda: tileops.cross_entropy(meta(8, 100), meta(8, dtype=torch.int64),
                                   label_smoothing=1.5), "label_smoothing"),
    (lambda: tileops.cross_entropy(meta(8, 100), meta(8, dtype=torch.int64), softcap=0.0),
     "softcap"),
    (lambda: tileops.cross_entropy(meta(8, 100), meta(8, dtype=torch.int64), reduction="avg"),
     "reduction"),
    (lambda: tileops.cross_entropy(meta(8, 100), meta(8, dtype=torch.int64),
                                   weight=meta(100)), "weight"),
])
def test_bad_input_names_the_op_and_argument(call, match):
    with pytest.raises(TileOpsError, match=match):
        call()


def test_backward_op_accepts_one_or_per_row_loss_gradients():
    op = CrossEntropyBwdOp()
    logits, target, lse = meta(8, 100), meta(8, dtype=torch.int64), meta(8, dtype=torch.float32)
    for grad_loss in (meta(1, dtype=torch.float32), meta(8, dtype=torch.float32)):
        assert op(grad_loss, logits, target, lse).shape == (8, 100)
    with pytest.raises(TileOpsError, match="grad_loss"):
        op(meta(3, dtype=torch.float32), logits, target, lse)


def test_rooflines_count_each_tensor_once():
    x = meta(4096, 128256)
    flops, nbytes = SoftmaxFwdOp().eval_roofline(x)
    assert nbytes == 2 * 4096 * 128256 * 2 and flops == 5 * 4096 * 128256
    _, nbytes = LogsumexpFwdOp().eval_roofline(x)
    assert nbytes == (4096 * 128256 + 4096) * 2
    _, nbytes = CrossEntropyFwdOp().eval_roofline(x, meta(4096, dtype=torch.int64))
    assert nbytes == 4096 * 128256 * 2 + 16 * 4096


def test_index_bounds_draw_valid_class_ids():
    assert CrossEntropyFwdOp.index_bounds({"input": meta(8, 321)}) == {"target": 321}


@pytest.mark.parametrize("n", [1, 7, 128, 512, 1000, 1001, 2048, 4096, 4099, 8192, 32000,
                               50257, 128256, 151936, 256000])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_default_thread_maps(n, dtype):
    """Rows up to 1024 vectors are one chunk (read once, kept in registers); at most 4
    vectors per thread; a row's threads are a power of two >= a warp."""
    config = default_row_config(n, dtype, few_rows=False)
    rm = RowMap(n, dtype, config.threads, config.row_threads, config.vecs, 132)
    assert config.vecs <= 4 and rm.rows_per_cta >= 1
    if n // vector_width(n, dtype) <= 1024:
        assert rm.chunks == 1
    assert rm.chunk * rm.chunks >= n


def test_fused_linear_cross_entropy_on_meta_tensors():
    hidden, weight = meta(4096, 4096), meta(128256, 4096)
    target = meta(4096, dtype=torch.int64)
    assert tileops.fused_linear_cross_entropy(hidden, weight, target).shape == ()
    op = FusedLinearCrossEntropyFwdOp()
    loss, grad_hidden, grad_weight, grad_bias = op(hidden, weight, target, meta(128256))
    assert grad_hidden.shape == (4096, 4096) and grad_weight.shape == (128256, 4096)
    assert grad_bias.shape == (128256,) and loss.dtype == torch.float32
    rows, *grads = FusedLinearCrossEntropyFwdOp(reduction="none", with_grad=False)(
        hidden, weight, target)
    assert rows.shape == (4096,) and all(g.numel() == 0 for g in grads)


@pytest.mark.parametrize("call, match", [
    (lambda: FusedLinearCrossEntropyFwdOp()(meta(8, 64), meta(50257, 64),
                                            meta(8, dtype=torch.int64)), "V % 8"),
    (lambda: FusedLinearCrossEntropyFwdOp(reduction="none")(
        meta(8, 64), meta(1024, 64), meta(8, dtype=torch.int64)), "with_grad"),
    (lambda: FusedLinearCrossEntropyFwdOp()(meta(8, 64), meta(1024, 32),
                                            meta(8, dtype=torch.int64)), "'weight'.*H = 64"),
    (lambda: FusedLinearCrossEntropyFwdOp()(meta(8, 64, dtype=torch.float32),
                                            meta(1024, 64, dtype=torch.float32),
                                            meta(8, dtype=torch.int64)), "'hidden'.*dtype"),
    (lambda: tileops.fused_linear_cross_entropy(meta(8, 64), meta(1024, 64),
                                                meta(8, dtype=torch.int64), reduction="avg"),
     "reduction"),
])
def test_fused_linear_cross_entropy_errors(call, match):
    with pytest.raises(TileOpsError, match=match):
        call()


@pytest.mark.parametrize("tokens", [1, 100, 1000, 4096, 8192, 16384, 100000])
def test_fused_linear_chunks_bound_the_memory(tokens):
    """A chunk's 2-byte logits take at most 1/12 of the tokens' fp32 logits once the token
    count leaves room for the 256-row minimum; chunks are a GEMM bucket's power of two
    rows, the largest the bound allows (4096 tokens: 512, where the old rule's 640 fell in
    the 1024-row bucket)."""
    rows = chunk_rows(tokens, 128256)
    assert 1 <= rows <= min(tokens, 2048)
    if tokens >= 256 * 6:
        assert rows & (rows - 1) == 0 and rows * 2 * 12 <= tokens * 4
        assert rows == 2048 or rows * 2 * 2 * 12 > tokens * 4  # the largest that fits
        gemm = GemmKernel(dtype="bfloat16", n=4096, k=128256, trans_a=False, trans_b=False)
        assert gemm.bucket_rows(gemm.bucket_of(rows)) == rows  # a bucket's own row count
    assert chunk_rows(4096, 128256) == 512 and chunk_rows(8192, 151936) == 1024


def test_fused_linear_kernels_cover_the_chunk_tail():
    """grad_weight's GEMMs: the first chunk's writes, the later full chunks' and the
    tail's accumulate; a single chunk only writes."""
    op = FusedLinearCrossEntropyFwdOp()

    def weight_grads(tokens):
        ns = op.check([meta(tokens, 256), meta(16000, 256), meta(tokens, dtype=torch.int64),
                       None])
        return sorted((key["k"], key.get("accumulate", False))
                      for name, key, _ in op.kernels_for(ns) if key.get("trans_a"))

    rows = chunk_rows(3000, 16000)
    assert weight_grads(3000) == sorted({(rows, False), (rows, True), (3000 % rows, True)})
    assert weight_grads(100) == [(100, False)]
