"""tileops.linear without a GPU: meta outputs and gradients' shapes, errors, the GEMM kernels
a call runs (bias in the key only when there is one, a symbolic K for the weight gradient)."""

import pytest
import torch

import tileops
from tileops import LinearBwdOp, LinearFwdOp
from tileops.errors import TileOpsError

from ..helpers import meta


def test_meta_shapes_follow_f_linear():
    x, w, b = meta(2, 7, 512), meta(384, 512), meta(384)
    assert tileops.linear(x, w, b).shape == (2, 7, 384)
    assert tileops.linear(meta(512), w).shape == (384,)
    dx, dw, db = LinearBwdOp(has_bias=True)(meta(2, 7, 384), x, w)
    assert dx.shape == x.shape and dw.shape == w.shape and db.shape == (384,)
    assert LinearBwdOp()(meta(2, 7, 384), x, w)[2].shape == (0,)


@pytest.mark.parametrize("call, match", [
    (lambda: tileops.linear(meta(4, 512), meta(384, 256)),
     "LinearFwdOp.*'weight'.*input.shape\\[-1\\] == K"),
    (lambda: tileops.linear(meta(4, 512), meta(384, 512), meta(100)), "'bias'.*N = 384"),
    (lambda: tileops.linear(meta(4, 512, dtype=torch.float32), meta(384, 512,
                                                                    dtype=torch.float32)),
     "'input'.*dtype"),
    (lambda: LinearBwdOp()(meta(4, 267), meta(4, 512), meta(267, 512)), "N % 8"),
    (lambda: LinearBwdOp()(meta(4, 100), meta(4, 512), meta(384, 512)), "grad_output"),
])
def test_errors_name_the_op_and_argument(call, match):
    with pytest.raises(TileOpsError, match=match):
        call()


def test_kernels_of_a_call():
    fwd = LinearFwdOp()
    ns = fwd.check([meta(2, 1000, 512), meta(1536, 512), meta(1536)])
    ((_, key, rows),) = fwd.kernels_for(ns)
    assert key["has_bias"] and key["n"] == 1536 and key["k"] == 512 and rows == 2000
    ns = fwd.check([meta(8, 512), meta(1536, 512), None])
    assert "has_bias" not in fwd.kernels_for(ns)[0][1]  # a plain GEMM's key: tuned entries
    bwd = LinearBwdOp()
    ns = bwd.check([meta(1000, 1536), meta(1000, 512), meta(1536, 512)])
    (_, dx_key, dx_rows), (_, dw_key, dw_rows) = bwd.kernels_for(ns)
    assert (dx_key["n"], dx_key["k"], dx_rows) == (512, 1536, 1000)
    assert (dw_key["n"], dw_key["k"], dw_key["trans_a"], dw_rows) == (512, None, True, 1536)
