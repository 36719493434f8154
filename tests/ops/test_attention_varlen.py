"""GroupedQueryAttentionVarlenFwdOp on the GPU: each packed sequence against the dense
fp32 reference of the same options."""

import dataclasses

import pytest
import torch

import tileops
from tileops import GroupedQueryAttentionVarlenFwdOp, TileOpsError, TileOpsTypeError
from tileops.kernels.attention.attention_fwd import AttentionVarlenFwdKernel
from tileops.kernels.base import Kernel

from ..helpers import assert_close, randn
from .test_attention import config_space, reference

pytestmark = pytest.mark.gpu


def packed(lens_q, lens_kv, heads, kv_heads, head_dim, dtype, head_dim_v=None):
    q = randn(sum(lens_q), heads, head_dim, dtype=dtype)
    k = randn(sum(lens_kv), kv_heads, head_dim, dtype=dtype)
    v = randn(sum(lens_kv), kv_heads, head_dim_v or head_dim, dtype=dtype)

    def cu(lens):
        return torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32,
                            device="cuda")

    return q, k, v, cu(lens_q), cu(lens_kv)


def check(lens_q, lens_kv, heads=8, kv_heads=2, head_dim=128, dtype=torch.bfloat16,
          config=None, head_dim_v=None, **opts):
    q, k, v, cu_q, cu_kv = packed(lens_q, lens_kv, heads, kv_heads, head_dim, dtype,
                                  head_dim_v)
    op = GroupedQueryAttentionVarlenFwdOp(max_seqlen_q=max(lens_q), max_seqlen_kv=max(lens_kv),
                                          **opts)
    if config is not None:  # one config of the kernel's space instead of the default
        op.pin_config(config, q, k, v, cu_q, cu_kv)
    o, lse = op(q, k, v, cu_q, cu_kv)
    for b in range(len(lens_q)):
        qs, qe = int(cu_q[b]), int(cu_q[b + 1])
        ks, ke = int(cu_kv[b]), int(cu_kv[b + 1])
        if qe == qs:
            continue
        o_ref, lse_ref = reference(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], **opts)
        assert_close(o[qs:qe], o_ref[0], scale=2.0, what=f"o of sequence {b}")
        ref = lse_ref[0]
        got = lse[:, qs:qe]
        assert torch.equal(torch.isinf(got), torch.isinf(ref)), f"lse -inf rows of {b}"
        finite = torch.isfinite(ref)
        torch.testing.assert_close(got[finite], ref[finite], atol=2e-3, rtol=1e-4)


@pytest.mark.smoke
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("is_causal", [False, True])
def test_mixed_lengths_with_empty_and_single_token_sequences(is_causal, dtype):
    lens = [0, 1, 17, 300, 1000, 129]
    check(lens, lens, dtype=dtype, is_causal=is_causal)


@pytest.mark.parametrize("config", config_space(128, kernel_class=AttentionVarlenFwdKernel),
                         ids=str)
def test_every_config_of_the_space(config):
    """Sequences of 300 and 1000 rows hold blocks inside them (whole-tile stores with
    `tile_store`) and blocks cut by their end (row stores)."""
    lens = [0, 1, 17, 300, 1000, 129]
    check(lens, lens, config=config, is_causal=True)


@pytest.mark.parametrize("kv_head_major", [False, True])
def test_grid_orders_without_a_mask(kv_head_major):
    """kv_head_major's grid (sequence x KV head in z) covers every sequence and head once."""
    kernel = AttentionVarlenFwdKernel(dtype="bfloat16", heads=8, kv_heads=2, head_dim=128,
                                      window_left=-1, window_right=-1, softcap=0.0)
    config = dataclasses.replace(kernel.heuristic_config("long", "sm_90a"),
                                 kv_head_major=kv_head_major)
    assert config in kernel.config_space("long")
    lens = [0, 1, 17, 300, 1000, 129]
    check(lens, lens, config=config)


def test_chunked_prefill_bottom_right_causal():
    check([5, 100, 0, 64], [50, 100, 10, 1000], is_causal=True)


@pytest.mark.parametrize("head_dim", [64, 80, 96, 256])
def test_head_dims(head_dim):
    check([200, 33, 500], [200, 33, 500], head_dim=head_dim, is_causal=True)


@pytest.mark.parametrize("is_causal", [False, True])
def test_qk_192_v_128(is_causal):
    """DeepSeek-V3's MLA prefill widths (q/k 192, v and o 128), packed; a long sequence
    takes the long-key bucket."""
    check([200, 0, 33, 5000], [200, 10, 33, 5000], heads=16, kv_heads=16, head_dim=192,
          head_dim_v=128, is_causal=is_causal)


def test_window_and_softcap():
    check([300, 1000], [300, 1000], heads=4, kv_heads=2, head_dim=256, is_causal=True,
          window_size=(127, 0), softcap=50.0)


def test_every_row_written():
    lens = [7, 300, 129]
    q, k, v, cu_q, cu_kv = packed(lens, lens, 4, 2, 128, torch.bfloat16)
    op = GroupedQueryAttentionVarlenFwdOp(max_seqlen_q=300, max_seqlen_kv=300)
    kernel = op.get_kernel("attention_varlen_fwd", q.device,
                           **op._kernel_key(q.dtype, 4, 2, 128))
    o = torch.full_like(q, float("nan"))
    lse = torch.full((4, q.shape[0]), float("nan"), device="cuda")
    kernel(q.shape[0], q, k, v, cu_q, cu_kv, o, lse, 300, 128 ** -0.5)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()


@pytest.mark.parametrize("cu, pattern", [
    ([0, 5, 3, 8], "to be non-decreasing"),
    ([1, 5, 8], "to start at 0"),
    ([0, 5, 7], "to end at the row count 8"),
    ([0, 2, 8], "no sequence longer than max_seqlen = 5"),
])
def test_bad_cu_seqlens_are_rejected(cu, pattern):
    q, k, v, _, cu_kv = packed([8], [8], 4, 2, 128, torch.bfloat16)
    cu_q = torch.tensor(cu, dtype=torch.int32, device="cuda")
    cu_kv = torch.tensor([0] * (len(cu) - 1) + [8], dtype=torch.int32, device="cuda")
    op = GroupedQueryAttentionVarlenFwdOp(max_seqlen_q=5, max_seqlen_kv=8)
    with pytest.raises(TileOpsError, match=f"argument 'cu_seqlens_q': expected .*{pattern}"):
        op(q, k, v, cu_q, cu_kv)


def test_int64_cu_seqlens_are_rejected():
    q, k, v, cu_q, cu_kv = packed([8], [8], 4, 2, 128, torch.bfloat16)
    with pytest.raises(TileOpsTypeError, match="argument 'cu_seqlens_q': expected dtype int32"):
        GroupedQueryAttentionVarlenFwdOp(max_seqlen_q=8, max_seqlen_kv=8)(
            q, k, v, cu_q.long(), cu_kv)


def test_runtime_lengths_do_not_recompile():
    check([10], [10], is_causal=True)
    before = Kernel.compile_count
    for lens in ([1, 2, 3], [1000], [64] * 9, [5, 0, 77]):
        check(lens, lens, is_causal=True)
    assert Kernel.compile_count == before


def test_torch_compile_and_cuda_graph():
    lens = [100, 3, 400]
    q, k, v, cu_q, cu_kv = packed(lens, lens, 4, 2, 128, torch.float16)
    expected = torch.cat([reference(q[None, s:e], k[None, s:e], v[None, s:e],
                                    is_causal=True)[0][0]
                          for s, e in ((0, 100), (100, 103), (103, 503))])

    @torch.compile(fullgraph=True)
    def f(q, k, v):
        return tileops.attention_varlen(q, k, v, cu_q, cu_kv, 400, 400, is_causal=True)

    assert_close(f(q, k, v), expected, scale=2.0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tileops.attention_varlen(q, k, v, cu_q, cu_kv, 400, 400, is_causal=True)
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, expected, scale=2.0)


def varlen_grads(lens_q, lens_kv, dtype=torch.bfloat16, compile_step=False, head_dim=128,
                 head_dim_v=None, **opts):
    """(TileOPs grads, reference grads) of sum(o * do) through tileops.attention_varlen."""
    q, k, v, cu_q, cu_kv = packed(lens_q, lens_kv, 8, 2, head_dim, dtype, head_dim_v)
    do = randn(*q.shape[:-1], v.shape[-1], dtype=dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def step(q, k, v):
        return tileops.attention_varlen(q, k, v, cu_q, cu_kv, max(lens_q), max(lens_kv), **opts)

    o = (torch.compile(step, fullgraph=True) if compile_step else step)(*leaves)
    got = torch.autograd.grad(o, leaves, do)
    ref_leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref_o = torch.cat([reference(ref_leaves[0][None, cu_q[b]:cu_q[b + 1]],
                                 ref_leaves[1][None, cu_kv[b]:cu_kv[b + 1]],
                                 ref_leaves[2][None, cu_kv[b]:cu_kv[b + 1]], **opts)[0][0]
                       for b in range(len(lens_q))])
    want = torch.autograd.grad(ref_o, ref_leaves, do.float())
    return got, want


@pytest.mark.parametrize("opts", [{"is_causal": True}, {"is_causal": False},
                                  {"is_causal": True, "window_size": (64, 0), "softcap": 30.0}])
@pytest.mark.parametrize("lens_q, lens_kv", [([0, 1, 17, 300, 1000, 129],) * 2,
                                             ([5, 100, 0, 64], [50, 100, 10, 1000])])
def test_gradients_through_attention_varlen(lens_q, lens_kv, opts):
    """Backward through the dense backward on a left-padded batch (ops/varlen_backward.py)."""
    got, want = varlen_grads(lens_q, lens_kv, **opts)
    for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert_close(g, w.to(g.dtype), scale=4.0, what=name)


def test_gradients_of_qk_192_v_128():
    """DeepSeek-V3's MLA widths through the padded dense backward (V, O, dO widened to 192)."""
    got, want = varlen_grads([100, 0, 300], [100, 7, 300], head_dim=192, head_dim_v=128,
                             is_causal=True)
    for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert_close(g, w.to(g.dtype), scale=4.0, what=name)


def test_training_step_under_torch_compile():
    got, want = varlen_grads([100, 3, 400], [100, 3, 400], torch.float16, compile_step=True,
                             is_causal=True)
    for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert_close(g, w.to(g.dtype), scale=4.0, what=name)
