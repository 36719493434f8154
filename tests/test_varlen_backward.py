"""Varlen attention gradients through the dense backward on a left-padded batch (CPU).

The dense backward kernel is replaced by a float64 model of what it computes (P from the
saved lse, rows with lse = -inf invisible, bottom-right masks), so the padding, the lse
layout and the unpadding are checked against autograd through a per-sequence reference
without a GPU. The dense kernel itself is tested against the same math on the H200.
"""

import math

import pytest
import torch

from tileops.ops.varlen_backward import padded_rows, varlen_backward

from .ops.test_attention import reference, visible_pairs

pytestmark = pytest.mark.smoke


def dense_backward_model(do, q, k, v, o, lse, is_causal, scale, window_size, softcap):
    """dq, dk, dv as the dense backward kernel computes them, in float64 on the CPU."""
    batch, seq_q, heads, head_dim = q.shape
    seq_kv, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    qf, dof, of = (t.double().transpose(1, 2) for t in (q, do, o))  # [B, H, S, D]
    kf, vf = (t.double().repeat_interleave(group, dim=2).transpose(1, 2) for t in (k, v))
    scores = qf @ kf.transpose(-1, -2) * scale
    visible = (visible_pairs(seq_q, seq_kv, is_causal, window_size)
               & (lse.double() != -math.inf)[..., None])
    row_lse = lse.double()[..., None].masked_fill(~visible, 0.0)
    if softcap > 0:
        capped = torch.tanh(scores / softcap)
        probs = torch.exp(softcap * capped - row_lse)
        chain = 1 - capped * capped
    else:
        probs, chain = torch.exp(scores - row_lse), 1.0
    probs = probs.masked_fill(~visible, 0.0)
    delta = (dof * of).sum(-1, keepdim=True)
    dscores = probs * (dof @ vf.transpose(-1, -2) - delta) * scale * chain
    dq = (dscores @ kf).transpose(1, 2)
    dk = (dscores.transpose(-1, -2) @ qf).transpose(1, 2)
    dv = (probs.transpose(-1, -2) @ dof).transpose(1, 2)
    fold = (batch, seq_kv, kv_heads, group, head_dim)
    return dq, dk.reshape(fold).sum(3), dv.reshape(fold).sum(3)


def test_padded_rows_end_each_sequence_at_its_block_end():
    cu = torch.tensor([0, 2, 2, 5], dtype=torch.int32)  # lengths 2, 0, 3
    assert padded_rows(cu, 4, 5).tolist() == [2, 3, 9, 10, 11]


@pytest.mark.parametrize("options", [
    {"is_causal": True},
    {"is_causal": False},
    {"is_causal": True, "window_size": (3, 0), "softcap": 5.0},
    {"window_size": (4, 2), "scale": 0.3},
])
@pytest.mark.parametrize("lens_q, lens_kv", [
    ([0, 1, 17, 9, 5], [0, 1, 17, 9, 5]),  # empty and single-token sequences
    ([5, 3, 0, 8], [12, 3, 4, 20]),  # chunked prefill: queries at the end of longer caches
])
def test_gradients_match_autograd_per_sequence(lens_q, lens_kv, options):
    torch.manual_seed(0)
    heads, kv_heads, head_dim = 4, 2, 8
    q = torch.randn(sum(lens_q), heads, head_dim, dtype=torch.float64)
    k = torch.randn(sum(lens_kv), kv_heads, head_dim, dtype=torch.float64)
    v = torch.randn(sum(lens_kv), kv_heads, head_dim, dtype=torch.float64)
    do = torch.randn_like(q)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_kv = torch.tensor([0, *torch.tensor(lens_kv).cumsum(0).tolist()], dtype=torch.int32)
    window = options.get("window_size", (-1, -1))
    params = [options.get("is_causal", False), options.get("scale"), list(window),
              options.get("softcap", 0.0)]

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    outs, lses = [], []
    for b in range(len(lens_q)):
        sq, skv = slice(cu_q[b], cu_q[b + 1]), slice(cu_kv[b], cu_kv[b + 1])
        o_b, lse_b = reference(leaves[0][None, sq], leaves[1][None, skv], leaves[2][None, skv],
                               **options)
        outs.append(o_b[0])
        lses.append(lse_b[0])
    o, lse = torch.cat(outs), torch.cat(lses, dim=1)  # lse [H, Tq], as the varlen op stores
    want = torch.autograd.grad(o, leaves, do)

    got = varlen_backward(do, q, k, v, o.detach(), lse.detach(), cu_q, cu_kv, max(lens_q),
                          max(lens_kv), params, dense_backward_model)
    for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        # the reference runs in float32 (errors near 5e-7); a padding slip is O(1)
        assert (g - w).abs().max() <= 1e-5 * (1 + w.abs().max()), name


def test_nothing_to_differentiate_gives_zeros():
    q = torch.randn(0, 2, 8)
    k = v = torch.randn(3, 2, 8)
    cu_q = torch.tensor([0, 0], dtype=torch.int32)
    cu_kv = torch.tensor([0, 3], dtype=torch.int32)
    dq, dk, dv = varlen_backward(q, q, k, v, q, torch.zeros(2, 0), cu_q, cu_kv, 0, 3,
                                 [True, None, [-1, -1], 0.0], dense_backward_model)
    assert dq.shape == q.shape and not dk.any() and not dv.any()


@pytest.mark.parametrize("head_dim, head_dim_v, width", [(192, 128, 192), (80, 80, 96)])
@pytest.mark.parametrize("options", [{"is_causal": True}, {"window_size": (4, 2), "scale": 0.3}])
def test_head_dims_the_kernel_lacks_run_zero_padded(head_dim, head_dim_v, width, options,
                                                    monkeypatch):
    """DeepSeek-V3's q/k 192 with v 128 and Phi-2's 80: the backward kernel (here its model)
    is called at a width it takes, with the unpadded head dim's scale, and the gradients
    come back at the inputs' widths equal to autograd's."""
    import importlib

    from tileops import GroupedQueryAttentionBwdOp

    attention_ops = importlib.import_module("tileops.ops.attention")  # (the package exports a
    # function of that name)

    widths = []

    def kernel_model(do, q, k, v, o, lse, *params):
        widths.append((q.shape[-1], v.shape[-1], do.shape[-1], o.shape[-1]))
        return dense_backward_model(do, q, k, v, o, lse, *params)

    monkeypatch.setattr(GroupedQueryAttentionBwdOp, "torch_op", kernel_model)
    torch.manual_seed(1)
    q = torch.randn(2, 9, 4, head_dim, dtype=torch.float64)
    k = torch.randn(2, 11, 2, head_dim, dtype=torch.float64)
    v = torch.randn(2, 11, 2, head_dim_v, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o, lse = reference(*leaves, **options)
    do = torch.randn_like(o)
    want = torch.autograd.grad(o, leaves, do)
    params = [options.get("is_causal", False), options.get("scale"),
              list(options.get("window_size", (-1, -1))), 0.0]
    got = attention_ops._backward_at_kernel_width(do, q, k, v, o.detach(), lse.detach(),
                                                  *params)
    assert widths == [(width,) * 4]
    for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert g.shape == w.shape, name
        assert (g - w).abs().max() <= 1e-5 * (1 + w.abs().max()), name


def test_padding_widths_are_the_backward_ops_head_dims():
    """The widths the autograd formulas pad to are exactly those the backward op's shape rule
    admits (a width it refused would fail, one it gained would go unused)."""
    import importlib

    from tileops import GroupedQueryAttentionBwdOp

    widths = importlib.import_module("tileops.ops.attention").BACKWARD_HEAD_DIMS
    rules = [rule.text for rule in GroupedQueryAttentionBwdOp.spec.shape_rules]
    assert f"D in {tuple(widths)}" in rules
