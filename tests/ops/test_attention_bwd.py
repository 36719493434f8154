"""Attention backward on the GPU: gradients against torch autograd through the fp32
reference, and the autograd wiring of tileops.attention."""

import dataclasses

import pytest
import torch

import tileops
from tileops import GroupedQueryAttentionBwdOp, GroupedQueryAttentionFwdOp
from tileops.kernels.attention.attention_bwd import AttentionBwdKernel

from ..helpers import assert_close
from .test_attention import make_qkv, reference

pytestmark = pytest.mark.gpu


def reference_grads(q, k, v, do, **options):
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    o, _ = reference(*leaves, **options)
    return torch.autograd.grad(o, leaves, do.float())


def forward(q, k, v, **options):
    """(o, lse) of the forward op; at head_dim 192 with v 192 (a width only the backward
    takes: the op widens DeepSeek-V3's v 128 to it) from the forward at 256 on zero-padded
    q, k and v with the 192-wide scale: zero columns change no score."""
    if q.shape[-1] != 192:
        return GroupedQueryAttentionFwdOp(**options)(q, k, v)
    options = {"scale": 192 ** -0.5, **options}
    o, lse = GroupedQueryAttentionFwdOp(**options)(
        *(torch.nn.functional.pad(t, (0, 64)) for t in (q, k, v)))
    return o[..., :192].contiguous(), lse


def check(batch, seq_q, seq_kv, heads, kv_heads, head_dim, dtype=torch.bfloat16, config=None,
          **options):
    q, k, v = make_qkv(batch, seq_q, seq_kv, heads, kv_heads, head_dim, dtype)
    do = torch.randn_like(q)
    o, lse = forward(q, k, v, **options)
    bwd = GroupedQueryAttentionBwdOp(**options)
    if config is not None:  # one config of the kernel's space instead of the default
        bwd.pin_config(config, do, q, k, v, o, lse)
    dq, dk, dv = bwd(do, q, k, v, o, lse)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv),
                               reference_grads(q, k, v, do, **options), strict=True):
        # gradients sum over up to Skv (dq) or Sq x group (dk, dv) rounded terms
        assert_close(got, want.to(got.dtype), scale=4.0, what=name)


@pytest.mark.smoke
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192])  # 96: Phi-3; 192: DeepSeek-V3
@pytest.mark.parametrize("is_causal", [False, True])
def test_gradients(head_dim, is_causal, dtype):
    check(2, 300, 300, 8, 2, head_dim, dtype, is_causal=is_causal)


@pytest.mark.parametrize("seq_q, seq_kv", [(1, 1), (17, 17), (1000, 1000), (100, 1000),
                                           (1000, 100)])
def test_sequence_lengths(seq_q, seq_kv):
    check(1, seq_q, seq_kv, 4, 4, 128, is_causal=True)


@pytest.mark.parametrize("config", AttentionBwdKernel(
    dtype="bfloat16", heads=8, kv_heads=2, head_dim=128, window_left=-1, window_right=0,
    softcap=0.0).config_space("all"), ids=str)
def test_every_config_of_the_space(config):
    """The tuner may pick any config of the space; each must be right on tails, Sq != Skv
    and a GQA group, and must write zero gradients for key blocks no query sees (the
    window leaves the first blocks of 1000 keys unseen by 100 queries), and on an odd query
    count over a batch (staged_stats pads lse and delta rows to a multiple of 4)."""
    check(1, 300, 777, 8, 2, 128, config=config, is_causal=True)
    check(1, 100, 1000, 8, 2, 128, config=config, is_causal=True, window_size=(64, 0))
    check(2, 301, 301, 8, 2, 128, config=config)


def ds_handoff_configs(head_dim: int, is_causal: bool) -> list:
    kernel = AttentionBwdKernel(dtype="bfloat16", heads=8, kv_heads=2, head_dim=head_dim,
                                window_left=-1, window_right=0 if is_causal else -1,
                                softcap=0.0)
    return [c for c in kernel.config_space("all") if c.ds_handoff and not c.fast_exp]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("index", range(7))
def test_ds_handoff_over_long_key_loops(head_dim, is_causal, index):
    """`ds_handoff`'s consumer warpgroups drift apart over a long walk of query blocks (41
    here, the last one cut): a dS half rewritten before the other warpgroup's dQ read it, or
    a dq tile rewritten before its reduce read it (dq_bulk defers that wait a tile), shows up
    as wrong gradients."""
    configs = ds_handoff_configs(head_dim, is_causal)
    # dq by one TMA reduce per warpgroup, by rows, or dq_bulk (three Q/dO stages or two, the
    # tail heavy first or not); dq_bulk walking the GQA group (two launch orders)
    assert len(configs) == 7
    config = configs[index]
    check(2, 2600, 2600, 8, 2, head_dim, config=config, is_causal=is_causal)


@pytest.mark.parametrize("head_dim, config", [
    (head_dim, config) for head_dim in (192, 256) for config in AttentionBwdKernel(
        dtype="bfloat16", heads=4, kv_heads=2, head_dim=head_dim, window_left=127,
        window_right=0, softcap=50.0).config_space("all")], ids=str)
def test_every_config_of_the_wide_head_spaces(head_dim, config):
    check(1, 400, 400, 4, 2, head_dim, config=config, is_causal=True, window_size=(127, 0),
          softcap=50.0)


@pytest.mark.parametrize("head_dim, softcap", [(128, 0.0), (256, 50.0)])
def test_fast_exp_matches_the_reference(head_dim, softcap):
    """The default with exp2 and the softcap's tanh on the SFU's ex2 alone (`fast_exp`)."""
    window = 127 if softcap else -1
    kernel = AttentionBwdKernel(dtype="bfloat16", heads=4, kv_heads=2, head_dim=head_dim,
                                window_left=window, window_right=0, softcap=softcap)
    default = kernel.config_space("all")[0]
    assert default.fast_exp == (softcap > 0)  # the default with a soft cap (measured faster)
    config = dataclasses.replace(default, fast_exp=True)
    assert config in kernel.config_space("all")
    options = dict(window_size=(127, 0), softcap=softcap) if softcap else {}
    check(1, 400, 777, 4, 2, head_dim, config=config, is_causal=True, **options)
    check(2, 301, 301, 4, 2, head_dim, config=config, **options)


@pytest.mark.parametrize("heads, kv_heads", [(8, 8), (8, 2), (16, 2)])
def test_gqa_sums_over_the_group(heads, kv_heads):
    check(1, 256, 256, heads, kv_heads, 128, is_causal=True)


def test_windows_softcap_and_head_dim_256():
    check(1, 400, 400, 4, 2, 256, is_causal=True, window_size=(127, 0), softcap=50.0)
    check(1, 400, 400, 4, 2, 128, window_size=(64, 32))


def test_autograd_through_tileops_attention():
    q, k, v = (t.requires_grad_() for t in make_qkv(2, 333, 333, 8, 2, 128, torch.bfloat16))
    do = torch.randn_like(q)
    tileops.attention(q, k, v, is_causal=True).backward(do)
    for name, got, want in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad),
                               reference_grads(q, k, v, do, is_causal=True), strict=True):
        assert_close(got, want.to(got.dtype), scale=4.0, what=name)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim, head_dim_v", [(192, 128), (80, 80)])
def test_autograd_of_head_dims_the_kernel_lacks(head_dim, head_dim_v, is_causal):
    """DeepSeek-V3's MLA widths (q/k 192, v 128) and Phi-2's 80: the backward kernel runs at
    192 / 96 on zero-padded tensors; the gradients come back at the inputs' widths."""
    q, k, v = (t.requires_grad_() for t in make_qkv(2, 333, 333, 8, 2, head_dim,
                                                    torch.bfloat16, head_dim_v=head_dim_v))
    o = tileops.attention(q, k, v, is_causal=is_causal)
    do = torch.randn_like(o)
    o.backward(do)
    assert v.grad.shape == v.shape
    for name, got, want in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad),
                               reference_grads(q, k, v, do, is_causal=is_causal), strict=True):
        assert_close(got, want.to(got.dtype), scale=4.0, what=name)


def test_training_step_under_torch_compile():
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 256, 256, 4, 2, 128, torch.bfloat16))

    @torch.compile(fullgraph=True)
    def loss_fn(q, k, v):
        return tileops.attention(q, k, v, is_causal=True).float().square().sum()

    loss_fn(q, k, v).backward()
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    reference(*leaves, is_causal=True)[0].square().sum().backward()
    for got, want in zip((q.grad, k.grad, v.grad), leaves, strict=True):
        assert_close(got, want.grad.to(got.dtype), scale=8.0)


@pytest.mark.parametrize("config", [c for c in AttentionBwdKernel(
    dtype="bfloat16", heads=8, kv_heads=2, head_dim=128, window_left=-1, window_right=0,
    softcap=0.0).config_space("all") if c.edge_masks_only], ids=str)
def test_rows_with_infinite_lse_add_nothing(config):
    """Rows whose lse is -inf saw no key: they must add nothing to dk/dv and get dq = 0, also
    in fully visible tiles, where edge-mask configs skip the mask tests. Here such rows sit
    mid-sequence with no mask at all, as left padding puts them (the varlen backward)."""
    q, k, v = make_qkv(1, 384, 384, 8, 2, 128, torch.bfloat16)
    do = torch.randn_like(q)
    o, lse = GroupedQueryAttentionFwdOp()(q, k, v)
    dead = torch.zeros(384, dtype=torch.bool, device=q.device)
    dead[130:200] = True  # inside the second and third 64-row query blocks
    lse = lse.masked_fill(dead, -float("inf"))
    do = do.masked_fill(dead[None, :, None, None], 0.0)
    o = o.masked_fill(dead[None, :, None, None], 0.0)
    bwd = GroupedQueryAttentionBwdOp()
    bwd.pin_config(config, do, q, k, v, o, lse)
    dq, dk, dv = bwd(do, q, k, v, o, lse)
    live = ~dead
    want = reference_grads(q[:, live], k, v, do[:, live])
    assert torch.all(dq[:, dead] == 0), "dq of rows that saw no key"
    assert_close(dq[:, live], want[0].to(dq.dtype), scale=4.0, what="dq")
    assert_close(dk, want[1].to(dk.dtype), scale=4.0, what="dk")
    assert_close(dv, want[2].to(dv.dtype), scale=4.0, what="dv")
