"""GroupedQueryAttentionFwdOp on the GPU against an fp32 reference with explicit masks."""

import dataclasses
import math

import pytest
import torch

import tileops
from tileops import GroupedQueryAttentionFwdOp
from tileops.kernels.attention.attention_fwd import AttentionFwdKernel
from tileops.kernels.base import Kernel

from ..helpers import assert_close, randn

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]


def make_qkv(batch, seq_q, seq_kv, heads, kv_heads, head_dim, dtype, head_dim_v=None):
    q = randn(batch, seq_q, heads, head_dim, dtype=dtype)
    k = randn(batch, seq_kv, kv_heads, head_dim, dtype=dtype)
    v = randn(batch, seq_kv, kv_heads, head_dim_v or head_dim, dtype=dtype)
    return q, k, v


def visible_pairs(seq_q, seq_kv, is_causal, window_size, device=None):
    """[Sq, Skv] bool: which keys each query sees, masks aligned bottom-right."""
    left, right = window_size
    if is_causal:
        right = 0 if right < 0 else min(right, 0)
    rel = (torch.arange(seq_kv, device=device)[None, :]
           - torch.arange(seq_q, device=device)[:, None] - (seq_kv - seq_q))
    visible = torch.ones_like(rel, dtype=torch.bool)
    if left >= 0:
        visible &= rel >= -left
    if right >= 0:
        visible &= rel <= right
    return visible


def reference(q, k, v, is_causal=False, scale=None, window_size=(-1, -1), softcap=0.0):
    """(o, lse) in fp32; a row that sees no key gives o = 0 and lse = -inf."""
    batch, seq_q, heads, head_dim = q.shape
    seq_kv, kv_heads = k.shape[1], k.shape[2]
    scale = head_dim ** -0.5 if scale is None else scale
    qf = q.float().transpose(1, 2)
    kf = k.float().repeat_interleave(heads // kv_heads, dim=2).transpose(1, 2)
    vf = v.float().repeat_interleave(heads // kv_heads, dim=2).transpose(1, 2)
    logits = qf @ kf.transpose(-1, -2) * scale
    if softcap > 0:
        logits = softcap * torch.tanh(logits / softcap)
    visible = visible_pairs(seq_q, seq_kv, is_causal, window_size, q.device)
    logits = logits.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.exp(logits - lse[..., None]).nan_to_num(0.0)
    return (probs @ vf).transpose(1, 2), lse


def check(q, k, v, config=None, **options):
    op = GroupedQueryAttentionFwdOp(**options)
    if config is not None:  # one config of the kernel's space instead of the default
        op.pin_config(config, q, k, v)
    o, lse = op(q, k, v)
    o_ref, lse_ref = reference(q, k, v, **options)
    # P is rounded to the input dtype before the PV product, as in every flash kernel.
    assert_close(o, o_ref, scale=2.0, what="o")
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref)), "lse: -inf rows differ"
    finite = torch.isfinite(lse_ref)
    torch.testing.assert_close(lse[finite], lse_ref[finite], atol=2e-3, rtol=1e-4)


@pytest.mark.smoke
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])  # 80: Phi-2, 96: Phi-3
@pytest.mark.parametrize("is_causal", [False, True])
def test_head_dims(head_dim, is_causal, dtype):
    check(*make_qkv(2, 1000, 1000, 8, 2, head_dim, dtype), is_causal=is_causal)


@pytest.mark.smoke
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_q, seq_kv, is_causal", [(1000, 1000, True), (1000, 1000, False),
                                                      (300, 5000, True), (4097, 4097, True)])
def test_qk_192_v_128(seq_q, seq_kv, is_causal, dtype):
    """DeepSeek-V3's MLA prefill: q/k head_dim 192 (128 nope + 64 rope), v and o 128, its
    default scale 1/sqrt(192); both key-count buckets (short <= 4096 < long)."""
    q, k, v = make_qkv(1, seq_q, seq_kv, 16, 16, 192, dtype, head_dim_v=128)
    assert GroupedQueryAttentionFwdOp(is_causal=is_causal)(q, k, v)[0].shape == (
        1, seq_q, 16, 128)
    check(q, k, v, is_causal=is_causal)


def test_qk_192_v_128_gqa_window_and_functional_api():
    q, k, v = make_qkv(2, 700, 700, 16, 4, 192, torch.bfloat16, head_dim_v=128)
    check(q, k, v, is_causal=True, window_size=(255, 0), softcap=30.0, scale=0.1)
    o = tileops.attention(q, k, v, is_causal=True)
    assert_close(o, reference(q, k, v, is_causal=True)[0], scale=2.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_q, seq_kv", [(1, 1), (17, 17), (1, 4097), (4097, 4097),
                                           (100, 1000), (1000, 100)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_sequence_lengths(seq_q, seq_kv, is_causal, dtype):
    """Lengths off every tile size; Sq != Skv aligns the causal mask bottom-right (Sq > Skv
    leaves the first rows with no key: o = 0, lse = -inf)."""
    check(*make_qkv(1, seq_q, seq_kv, 4, 4, 128, dtype), is_causal=is_causal)


def config_space(head_dim, window_left=-1, window_right=0, softcap=0.0,
                 kernel_class=AttentionFwdKernel):
    return kernel_class(dtype="bfloat16", heads=8, kv_heads=2, head_dim=head_dim,
                        window_left=window_left, window_right=window_right,
                        softcap=softcap).config_space("long")


@pytest.mark.parametrize("config", config_space(128), ids=str)
def test_every_config_of_the_space(config):
    """The tuner may pick any config of the space (it checks agreement with the default on
    the tuning inputs only), so each one must be right on tails and Sq != Skv."""
    check(*make_qkv(2, 777, 1000, 8, 2, 128, torch.bfloat16), config=config, is_causal=True)


@pytest.mark.parametrize("kv_head_major", [True, False])
def test_grid_orders_without_a_mask(kv_head_major):
    """The long bidirectional default walks the grid KV head by KV head (kv_head_major);
    with either order every (query head, batch, block) must be computed once, over a batch
    of three with GQA 4 and tails."""
    default = config_space(128, window_right=-1)[0]
    assert default.kv_head_major
    config = dataclasses.replace(default, kv_head_major=kv_head_major)
    check(*make_qkv(3, 300, 1000, 8, 2, 128, torch.bfloat16), config=config)


@pytest.mark.parametrize("config", [c for c in config_space(128) if c.lazy_rescale], ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_lazy_rescale_follows_jumps_of_the_row_max(config, dtype):
    """Keys grow louder along the sequence, so row maxima climb by far more than the 2^8 a
    lazy config lets a stale max stand: O must still be rescaled whenever it moves."""
    q, k, v = make_qkv(2, 777, 1000, 8, 2, 128, dtype)
    loudness = torch.linspace(0.1, 6.0, k.shape[1], device=k.device)
    k = (k.float() * loudness[None, :, None, None]).to(dtype)
    check(q, k, v, config=config, is_causal=True)
    check(q, k.flip(1), v, config=config)  # loud keys first: the max settles at once


@pytest.mark.parametrize("head_dim, options", [
    (128, dict(is_causal=True)), (128, {}), (64, dict(is_causal=True)),
    (256, dict(is_causal=True, window_size=(127, 0), softcap=50.0))], ids=str)
def test_fast_exp_matches_the_reference(head_dim, options):
    """Each default with exp2 and the softcap's tanh on the SFU's ex2 alone (`fast_exp`), on
    tails and Sq != Skv."""
    window_left, window_right = options.get("window_size", (-1, -1))
    if options.get("is_causal"):
        window_right = 0
    default = config_space(head_dim, window_left, window_right, options.get("softcap", 0.0))[0]
    config = dataclasses.replace(default, fast_exp=True)
    check(*make_qkv(2, 777, 1000, 8, 2, head_dim, torch.bfloat16), config=config, **options)


@pytest.mark.parametrize("config", config_space(64), ids=str)
def test_every_config_at_head_dim_64(config):
    check(*make_qkv(2, 777, 1000, 8, 2, 64, torch.float16), config=config, is_causal=True)


@pytest.mark.parametrize("config", config_space(256, 127, 0, 50.0), ids=str)
def test_every_config_with_softcap_and_window(config):
    check(*make_qkv(1, 500, 500, 8, 2, 256, torch.bfloat16), config=config, is_causal=True,
          window_size=(127, 0), softcap=50.0)


@pytest.mark.parametrize("heads, kv_heads", [(8, 8), (8, 2), (16, 2)])
def test_gqa_ratios(heads, kv_heads):
    check(*make_qkv(2, 300, 300, heads, kv_heads, 128, torch.bfloat16), is_causal=True)


@pytest.mark.parametrize("window_size, is_causal", [((64, 0), True), ((32, 16), False),
                                                    ((-1, 40), False), ((200, -1), False)])
def test_sliding_windows(window_size, is_causal):
    check(*make_qkv(1, 777, 777, 4, 2, 128, torch.float16), is_causal=is_causal,
          window_size=window_size)


def test_softcap_window_and_scale_gemma2_style():
    check(*make_qkv(1, 1000, 1000, 4, 2, 256, torch.bfloat16), is_causal=True,
          window_size=(255, 0), softcap=50.0, scale=0.0625)


def test_large_logits_are_stable():
    q, k, v = make_qkv(1, 256, 256, 2, 2, 128, torch.bfloat16)
    check(q * 30, k * 30, v, is_causal=True)


def test_every_element_written():
    q, k, v = make_qkv(2, 333, 333, 4, 2, 128, torch.bfloat16)
    op = GroupedQueryAttentionFwdOp(is_causal=True)
    kernel = op.get_kernel("attention_fwd", q.device, **op._kernel_key(q.dtype, 4, 2, 128))
    o = torch.full_like(q, float("nan"))
    lse = torch.full((2, 4, 333), float("nan"), device="cuda")
    kernel(333, q, k, v, o, lse, 128 ** -0.5)
    o_ref, lse_ref = reference(q, k, v, is_causal=True)
    assert_close(o, o_ref, scale=2.0)
    torch.testing.assert_close(lse, lse_ref, atol=2e-3, rtol=1e-4)


def test_non_contiguous_bhsd_views():
    """Tensors laid out [B, H, S, D] and passed as BSHD views are served (copied)."""
    qb, kb, vb = (randn(2, h, 300, 128, dtype=torch.float16) for h in (8, 2, 2))
    q, k, v = (t.transpose(1, 2) for t in (qb, kb, vb))
    assert not q.is_contiguous()
    check(q, k, v, is_causal=True)


def test_empty_keys_and_queries():
    q, k, v = make_qkv(1, 5, 0, 4, 2, 128, torch.bfloat16)
    o, lse = GroupedQueryAttentionFwdOp()(q, k, v)
    assert bool((o == 0).all()) and bool(torch.isneginf(lse).all())
    q, k, v = make_qkv(1, 0, 5, 4, 2, 128, torch.bfloat16)
    o, lse = GroupedQueryAttentionFwdOp()(q, k, v)
    assert o.shape == (1, 0, 4, 128) and lse.shape == (1, 4, 0)


def test_runtime_lengths_do_not_recompile():
    """A serving loop: new batch sizes and sequence lengths reuse one program per key-count
    bucket (up to 2K keys, and longer)."""
    for seq in (64, 2049):
        q, k, v = make_qkv(1, seq, seq, 4, 2, 128, torch.bfloat16)
        tileops.attention(q, k, v, is_causal=True)
    before = Kernel.compile_count
    for batch, seq_q, seq_kv in [(1, 1, 65), (1, 1, 66), (3, 7, 500), (2, 1000, 1000),
                                 (1, 129, 4000)]:
        q, k, v = make_qkv(batch, seq_q, seq_kv, 4, 2, 128, torch.bfloat16)
        o = tileops.attention(q, k, v, is_causal=True)
        assert_close(o, reference(q, k, v, is_causal=True)[0], scale=2.0)
    assert Kernel.compile_count == before


def test_torch_compile_fullgraph():
    q, k, v = make_qkv(1, 256, 256, 4, 2, 128, torch.bfloat16)

    @torch.compile(fullgraph=True)
    def f(q, k, v):
        return tileops.attention(q, k, v, is_causal=True) * 2

    assert_close(f(q, k, v), reference(q, k, v, is_causal=True)[0] * 2, scale=4.0)


def test_cuda_graph_capture():
    q, k, v = make_qkv(1, 512, 512, 4, 2, 128, torch.float16)
    tileops.attention(q, k, v, is_causal=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tileops.attention(q, k, v, is_causal=True)
    q.copy_(randn(1, 512, 4, 128, dtype=torch.float16))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, reference(q, k, v, is_causal=True)[0], scale=2.0)
