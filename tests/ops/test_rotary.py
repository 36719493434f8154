"""Rotary embeddings (RotaryFwdOp, RotaryBwdOp, RotaryWithCacheFwdOp) against float32
references of the formulas they mirror: transformers' apply_rotary_pos_emb (with GPT-NeoX's
partial rotary and GPT-J's interleaved pairs) and vLLM's rotary_embedding on a cos/sin cache.

GPU tests carry the `gpu` marker; the CPU tests check the op layer's errors, the rooflines
and the kernel configs, and (`compile` + `full`) run the generated CUDA on the CPU through
tests/cuda_emulation.py.
"""

import dataclasses
import math

import pytest
import torch

import tileops
from tileops import RotaryBwdOp, RotaryFwdOp, RotaryWithCacheFwdOp, TileOpsError
from tileops.kernels.base import Kernel
from tileops.kernels.position_encoding import RotaryConfig, RotaryKernel
from tileops.kernels.position_encoding.rotary import thread_layout, vector_width

from ..helpers import assert_close, poison, randn

DTYPES = [torch.float16, torch.bfloat16]


# -- references (float32) -------------------------------------------------------------------
def rotate(x, interleaved):
    """rotate_half (NeoX) or rotate_every_two (GPT-J, as Cohere's rotate_half)."""
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def hf_reference(q, k, cos, sin, unsqueeze_dim=1, interleaved=False):
    """apply_rotary_pos_emb in float32; the first cos.shape[-1] elements rotate (GPT-NeoX)."""
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    cos = cos.float().unsqueeze(unsqueeze_dim)
    sin = sin.float().unsqueeze(unsqueeze_dim)
    rot = cos.shape[-1]

    def one(x):
        x = x.float()
        x_rot = x[..., :rot]
        return torch.cat((x_rot * cos + rotate(x_rot, interleaved) * sin, x[..., rot:]), dim=-1)

    return one(q), one(k)


def hf_rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def hf_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """transformers.models.llama.modeling_llama.apply_rotary_pos_emb, as written there."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (hf_rotate_half(q) * sin)
    k_embed = (k * cos) + (hf_rotate_half(k) * sin)
    return q_embed, k_embed


def cache_reference(positions, q, k, cos_sin_cache, interleaved=False):
    """vLLM's rotary_embedding (forward_native) in float32."""
    rot = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache.float()[positions].unsqueeze(-2).chunk(2, dim=-1)

    def one(x):
        x = x.float()
        x_rot = x[..., :rot]
        if interleaved:
            x1, x2 = x_rot[..., ::2], x_rot[..., 1::2]
            y = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        else:
            x1, x2 = x_rot.chunk(2, dim=-1)
            y = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return torch.cat((y, x[..., rot:]), dim=-1)

    return one(q), one(k)


def rope_cache(max_pos, rot, dtype, base=10000.0):
    """A real [max_pos, rot] cos|sin table (vLLM's layout)."""
    inv_freq = 1.0 / base ** (torch.arange(0, rot, 2, device="cuda").float() / rot)
    freqs = torch.arange(max_pos, device="cuda").float()[:, None] * inv_freq
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


def qk(batch, seq, q_heads, k_heads, head_dim, unsqueeze_dim, dtype):
    """Fresh q, k in the layout unsqueeze_dim selects (1: [B, H, S, D], 2: [B, S, H, D])."""
    def one(heads):
        shape = (batch, heads, seq, head_dim) if unsqueeze_dim == 1 else (
            batch, seq, heads, head_dim)
        return randn(*shape, dtype=dtype)
    return one(q_heads), one(k_heads)


def tables(cos_batch, seq, rot, dtype):
    """Random cos/sin ([S, R] when cos_batch is 0): HF's formula holds for any values, so
    the two entries of a pair need not agree."""
    shape = (seq, rot) if cos_batch == 0 else (cos_batch, seq, rot)
    return randn(*shape, dtype=dtype), randn(*shape, dtype=dtype)


# (label, B, S, Hq, Hk, D, R, unsqueeze_dim, interleaved, cos batch: 0 = [S, R])
CASES = [
    ("llama3.1-8b HF layout", 2, 333, 32, 8, 128, 128, 1, False, 1),
    ("llama3.1-8b bshd, per-sequence cos", 3, 129, 32, 8, 128, 128, 2, False, 3),
    ("gemma-2 head_dim 256", 1, 77, 16, 8, 256, 256, 2, False, 1),
    ("deepseek-v3 rope part, MQA, interleaved", 2, 45, 128, 1, 64, 64, 2, True, 1),
    ("glm-4 partial 64 of 128, interleaved", 1, 199, 32, 2, 128, 64, 2, True, 1),
    ("phi-2 partial 32 of 80, MHA", 2, 31, 32, 32, 80, 32, 1, False, 2),
    ("gpt-neox-20b partial 24 of 96 (4-element vectors)", 1, 17, 64, 64, 96, 24, 2, False, 1),
    ("decode batch 1", 1, 1, 32, 8, 128, 128, 2, False, 1),
    ("decode batch 7, [S, R] tables", 7, 1, 8, 8, 64, 64, 1, False, 0),
]
SMOKE = {"llama3.1-8b HF layout", "deepseek-v3 rope part, MQA, interleaved",
         "glm-4 partial 64 of 128, interleaved"}


def case_params():
    for case in CASES:
        marks = [pytest.mark.smoke] if case[0] in SMOKE else []
        yield pytest.param(*case[1:], id=case[0], marks=marks)


# -- GPU: the HF form -----------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch, seq, q_heads, k_heads, head_dim, rot, unsqueeze_dim, "
                         "interleaved, cos_batch", list(case_params()))
def test_matches_reference(batch, seq, q_heads, k_heads, head_dim, rot, unsqueeze_dim,
                           interleaved, cos_batch, dtype):
    q, k = qk(batch, seq, q_heads, k_heads, head_dim, unsqueeze_dim, dtype)
    cos, sin = tables(cos_batch, seq, rot, dtype)
    q_out, k_out = tileops.apply_rotary(q, k, cos, sin, unsqueeze_dim, interleaved)
    ref_q, ref_k = hf_reference(q, k, cos, sin, unsqueeze_dim, interleaved)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    assert_close(q_out, ref_q, what="q_out")
    assert_close(k_out, ref_k, what="k_out")


@pytest.mark.gpu
@pytest.mark.smoke
@pytest.mark.parametrize("dtype", DTYPES)
def test_defaults_match_transformers(dtype):
    """Every parameter left at its default, as Llama calls it: q/k [B, H, S, D], cos/sin
    [B, S, D] (unsqueeze_dim=1), rotate_half pairs."""
    q, k = qk(2, 100, 32, 8, 128, 1, dtype)
    cos, sin = tables(2, 100, 128, dtype)
    got = tileops.apply_rotary(q, k, cos, sin)
    want = hf_apply_rotary_pos_emb(q.float(), k.float(), cos.float(), sin.float())
    assert_close(got[0], want[0], what="q_out")
    assert_close(got[1], want[1], what="k_out")


@pytest.mark.gpu
@pytest.mark.smoke
def test_transposed_projection_is_read_in_place():
    """HF's q is q_proj(x).view(B, S, H, D).transpose(1, 2): a strided [B, H, S, D] view."""
    batch, seq, dtype = 2, 257, torch.bfloat16
    q = randn(batch, seq, 32 * 128, dtype=dtype).view(batch, seq, 32, 128).transpose(1, 2)
    k = randn(batch, seq, 8 * 128, dtype=dtype).view(batch, seq, 8, 128).transpose(1, 2)
    cos, sin = tables(1, seq, 128, dtype)
    q_out, k_out = tileops.apply_rotary(q, k, cos, sin)
    ref_q, ref_k = hf_reference(q, k, cos, sin)
    assert_close(q_out, ref_q, what="q_out")
    assert_close(k_out, ref_k, what="k_out")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_and_unaligned_inputs(dtype):
    """DeepSeek's rope slice of a 192-wide head, k heads broadcast by a stride-0 expand, cos
    sliced from a wider table, and a view whose base address is not 16-byte aligned."""
    batch, seq = 2, 61
    q_pe = randn(batch, seq, 16, 192, dtype=dtype)[..., 128:]
    k_pe = randn(batch, seq, 1, 64, dtype=dtype).expand(batch, seq, 4, 64)
    cos = randn(1, seq, 96, dtype=dtype)[..., 16:80]
    sin = randn(1, seq, 96, dtype=dtype)[..., 16:80]
    got = tileops.apply_rotary(q_pe, k_pe, cos, sin, 2, True)
    want = hf_reference(q_pe, k_pe, cos, sin, 2, True)
    assert_close(got[0], want[0], what="q_pe")
    assert_close(got[1], want[1], what="k_pe")
    flat = randn(batch * seq * 8 * 128 + 1, dtype=dtype)
    q = flat[1:].view(batch, seq, 8, 128)  # 2 bytes past an aligned address
    k = randn(batch, seq, 8, 128, dtype=dtype)
    cos, sin = tables(0, seq, 128, dtype)
    got = tileops.apply_rotary(q, k, cos, sin, 2)
    want = hf_reference(q, k, cos, sin, 2)
    assert_close(got[0], want[0], what="unaligned q")
    assert_close(got[1], want[1], what="k")


@pytest.mark.gpu
@pytest.mark.smoke
@pytest.mark.parametrize("unsqueeze_dim, interleaved, rot",
                         [(1, False, 128), (2, True, 64)], ids=["bhsd-neox", "bshd-gptj-partial"])
def test_gradients_match_autograd(unsqueeze_dim, interleaved, rot):
    dtype = torch.bfloat16
    q, k = qk(2, 100, 16, 4, 128, unsqueeze_dim, dtype)
    q.requires_grad_()
    k.requires_grad_()
    cos, sin = tables(1, 100, rot, dtype)
    q_out, k_out = tileops.apply_rotary(q, k, cos, sin, unsqueeze_dim, interleaved)
    gq, gk = randn(*q.shape, dtype=dtype), randn(*k.shape, dtype=dtype)
    torch.autograd.backward((q_out, k_out), (gq, gk))
    q32 = q.detach().float().requires_grad_()
    k32 = k.detach().float().requires_grad_()
    ref_q, ref_k = hf_reference(q32, k32, cos, sin, unsqueeze_dim, interleaved)
    torch.autograd.backward((ref_q, ref_k), (gq.float(), gk.float()))
    assert_close(q.grad, q32.grad, what="dq")
    assert_close(k.grad, k32.grad, what="dk")


@pytest.mark.gpu
def test_backward_op_is_the_transpose_for_any_tables():
    """dx = dy * cos - rotate(dy * sin) exactly, also when the two entries of a pair differ."""
    dtype = torch.float16
    for unsqueeze_dim, interleaved, rot in ((2, False, 96), (1, True, 128)):
        dq_out, dk_out = qk(3, 37, 8, 2, 128, unsqueeze_dim, dtype)
        cos, sin = tables(3, 37, rot, dtype)
        dq, dk = RotaryBwdOp(unsqueeze_dim=unsqueeze_dim, interleaved=interleaved)(
            dq_out, dk_out, cos, sin)
        for got, dy in ((dq, dq_out), (dk, dk_out)):
            leaf = torch.zeros(dy.shape, device="cuda", requires_grad=True)
            ref = hf_reference(leaf, leaf, cos, sin, unsqueeze_dim, interleaved)[0]
            (want,) = torch.autograd.grad(ref, leaf, dy.float())
            assert_close(got, want, what=f"{unsqueeze_dim}-{interleaved}")


@pytest.mark.gpu
def test_grad_of_cos_is_refused():
    q, k = qk(1, 8, 4, 4, 64, 1, torch.bfloat16)
    q.requires_grad_()
    cos, sin = tables(1, 8, 64, torch.bfloat16)
    cos.requires_grad_()
    q_out, _ = tileops.apply_rotary(q, k, cos, sin)
    with pytest.raises(TileOpsError, match="argument 'cos'"):
        q_out.sum().backward()


@pytest.mark.gpu
@pytest.mark.smoke
def test_torch_compile_forward_and_backward():
    dtype = torch.bfloat16
    q, k = qk(2, 64, 8, 2, 128, 1, dtype)
    cos, sin = tables(1, 64, 128, dtype)
    w_q, w_k = randn(*q.shape, dtype=torch.float32), randn(*k.shape, dtype=torch.float32)

    @torch.compile(fullgraph=True)
    def loss(q, k):
        q_out, k_out = tileops.apply_rotary(q * 2, k, cos, sin)
        return (q_out.float() * w_q).sum() + (k_out.float() * w_k).sum()

    leaves = [t.clone().requires_grad_() for t in (q, k)]
    loss(*leaves).backward()
    ref = [t.float().requires_grad_() for t in (q, k)]
    ref_q, ref_k = hf_reference(ref[0] * 2, ref[1], cos, sin)
    ((ref_q * w_q).sum() + (ref_k * w_k).sum()).backward()
    # The upstream gradient reaches the kernel rounded to bf16 (q_out is bf16): an element
    # where dy*cos and rotate(dy*sin) nearly cancel keeps that rounding of both terms
    # (~2^-8 of |2 * w| each), so the absolute tolerance scales with them.
    assert_close(leaves[0].grad, ref[0].grad, scale=4.0, what="dq")
    assert_close(leaves[1].grad, ref[1].grad, scale=2.0, what="dk")


@pytest.mark.gpu
def test_cuda_graph_capture():
    dtype = torch.float16
    q, k = qk(4, 33, 32, 8, 128, 2, dtype)
    cos, sin = tables(4, 33, 128, dtype)
    tileops.apply_rotary(q, k, cos, sin, 2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_out, k_out = tileops.apply_rotary(q, k, cos, sin, 2)
    q.copy_(randn(*q.shape, dtype=dtype))
    cos.copy_(randn(*cos.shape, dtype=dtype))
    graph.replay()
    torch.cuda.synchronize()
    ref_q, ref_k = hf_reference(q, k, cos, sin, 2)
    assert_close(q_out, ref_q, what="q_out")
    assert_close(k_out, ref_k, what="k_out")


@pytest.mark.gpu
def test_runtime_token_counts_do_not_recompile():
    """One program per bucket (decode batches up to FEW_TOKENS, the rest): once both have
    run, no token count compiles another."""
    dtype = torch.bfloat16
    for seq in (5, 1000):
        q, k = qk(1, seq, 32, 8, 128, 2, dtype)
        cos, sin = tables(1, seq, 128, dtype)
        tileops.apply_rotary(q, k, cos, sin, 2)
    before = Kernel.compile_count
    for batch, seq in [(1, 1), (3, 1), (64, 1), (1, 17), (2, 1000), (1, 4097), (5, 333)]:
        q, k = qk(batch, seq, 32, 8, 128, 2, dtype)
        cos, sin = tables(batch, seq, 128, dtype)
        got = tileops.apply_rotary(q, k, cos, sin, 2)
        want = hf_reference(q, k, cos, sin, 2)
        assert_close(got[0], want[0], what=f"q_out {batch}x{seq}")
    assert Kernel.compile_count == before


def space_cases():
    """(q heads, k heads, head_dim, rot, interleaved, backward, config) for every config of
    three spaces: Llama-3.1-8B's and -70B's forward and DeepSeek-V3's interleaved rope-part
    backward (70B: its default and the head-chunk configs, the rest are 8B's kinds)."""
    cases = []
    for q_heads, k_heads, head_dim, rot, interleaved, backward in (
            (32, 8, 128, 128, False, False), (64, 8, 128, 128, False, False),
            (128, 1, 64, 64, True, True)):
        kernel = RotaryKernel(form="hf", dtype="bfloat16", table_dtype="bfloat16",
                              q_heads=q_heads, k_heads=k_heads, head_dim=head_dim,
                              rotary_dim=rot, interleaved=interleaved, backward=backward,
                              bhsd=False, inplace=False)
        for i, config in enumerate(kernel.config_space("all")):
            if q_heads == 64 and i and config.head_chunks == 1:
                continue
            cases.append(pytest.param(q_heads, k_heads, head_dim, rot, interleaved, backward,
                                      config, id=f"{q_heads}-{k_heads}-{head_dim}-{config}"))
    return cases


@pytest.mark.gpu
@pytest.mark.parametrize("q_heads, k_heads, head_dim, rot, interleaved, backward, config",
                         space_cases())
def test_every_config_of_the_space(q_heads, k_heads, head_dim, rot, interleaved, backward,
                                   config):
    """The tuner may ship any config: each must write every element (outputs poisoned) for
    token counts off every CTA size, from one token to several waves."""
    dtype = torch.bfloat16
    op = (RotaryBwdOp if backward else RotaryFwdOp)(unsqueeze_dim=2, interleaved=interleaved)
    q, k = qk(1, 3, q_heads, k_heads, head_dim, 2, dtype)
    cos, sin = tables(1, 3, rot, dtype)
    op.pin_config(config, q, k, cos, sin)
    kernel = op.get_kernel("rotary", q.device, **op._kernel_key(dtype, q_heads, k_heads,
                                                                head_dim, rot, False))
    for batch, seq in ((1, 1), (1, 7), (3, 333), (1, 4099)):
        q, k = qk(batch, seq, q_heads, k_heads, head_dim, 2, dtype)
        cos, sin = tables(1, seq, rot, dtype)
        q_out, k_out = poison(torch.empty_like(q)), poison(torch.empty_like(k))
        kernel(batch * seq, q, k, cos, sin, q_out, k_out)
        if backward:
            want = [torch.autograd.grad(hf_reference(leaf, leaf, cos, sin, 2, interleaved)[0],
                                        leaf, dy.float())[0]
                    for dy in (q, k)
                    for leaf in [torch.zeros(dy.shape, device="cuda", requires_grad=True)]]
        else:
            want = hf_reference(q, k, cos, sin, 2, interleaved)
        assert_close(q_out, want[0], what=f"q {batch}x{seq}")
        assert_close(k_out, want[1], what=f"k {batch}x{seq}")


# -- GPU: the cache form --------------------------------------------------------------------
# (label, T, Hq, Hk, D, R, interleaved, table dtype: None = q's)
CACHE_CASES = [
    ("llama3.1-8b decode batch 64", 64, 32, 8, 128, 128, False, None),
    ("llama3.1-8b prefill, odd token count", 2049, 32, 8, 128, 128, False, None),
    ("deepseek-v3 rope part, interleaved", 77, 128, 1, 64, 64, True, None),
    ("partial 64 of 128, float32 table", 33, 16, 16, 128, 64, False, torch.float32),
    ("gemma-2 head_dim 256, interleaved float32 table", 5, 16, 8, 256, 256, True,
     torch.float32),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, q_heads, k_heads, head_dim, rot, interleaved, table_dtype",
                         [pytest.param(*c[1:], id=c[0],
                                       marks=[pytest.mark.smoke] if i < 2 else [])
                          for i, c in enumerate(CACHE_CASES)])
def test_with_cache_in_place_matches_vllm(tokens, q_heads, k_heads, head_dim, rot,
                                          interleaved, table_dtype, dtype):
    """q and k are views into one fused qkv buffer, as vLLM holds them; rotated in place."""
    cache = rope_cache(4096, rot, table_dtype or dtype)
    positions = torch.randint(0, 4096, (tokens,), device="cuda")
    qkv = randn(tokens, (q_heads + 2 * k_heads) * head_dim, dtype=dtype)
    q = qkv[:, :q_heads * head_dim].view(tokens, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim:(q_heads + k_heads) * head_dim].view(tokens, k_heads,
                                                                        head_dim)
    ref_q, ref_k = cache_reference(positions, q, k, cache, interleaved)
    v_before = qkv[:, (q_heads + k_heads) * head_dim:].clone()
    got_q, got_k = tileops.apply_rotary_with_cache(positions, q, k, cache, interleaved)
    assert got_q is q and got_k is k
    assert_close(q, ref_q, what="q")
    assert_close(k, ref_k, what="k")
    assert torch.equal(qkv[:, (q_heads + k_heads) * head_dim:], v_before)  # v untouched


@pytest.mark.gpu
@pytest.mark.smoke
def test_with_cache_defaults_and_op_object():
    """Defaults (NeoX pairs); the Op object returns new tensors and leaves its inputs;
    int32 positions are accepted by the functional form."""
    dtype = torch.bfloat16
    cache = rope_cache(8192, 128, dtype)
    positions = torch.randint(0, 8192, (100,), device="cuda")
    q, k = randn(100, 32, 128, dtype=dtype), randn(100, 8, 128, dtype=dtype)
    ref_q, ref_k = cache_reference(positions, q, k, cache)
    q0, k0 = q.clone(), k.clone()
    q_out, k_out = RotaryWithCacheFwdOp()(positions, q, k, cache)
    assert torch.equal(q, q0) and torch.equal(k, k0)
    assert_close(q_out, ref_q, what="op q_out")
    assert_close(k_out, ref_k, what="op k_out")
    tileops.apply_rotary_with_cache(positions.int(), q, k, cache)
    assert_close(q, ref_q, what="q in place")
    assert_close(k, ref_k, what="k in place")


@pytest.mark.gpu
def test_with_cache_out_of_range_positions_read_the_nearest_row():
    dtype = torch.float16
    cache = rope_cache(64, 64, dtype)
    positions = torch.tensor([-5, 0, 63, 64, 10**6], device="cuda")
    q, k = randn(5, 4, 64, dtype=dtype), randn(5, 1, 64, dtype=dtype)
    ref_q, ref_k = cache_reference(positions.clamp(0, 63), q, k, cache)
    tileops.apply_rotary_with_cache(positions, q, k, cache)
    assert_close(q, ref_q, what="q")
    assert_close(k, ref_k, what="k")


@pytest.mark.gpu
def test_with_cache_torch_compile_and_cuda_graph():
    dtype = torch.bfloat16
    cache = rope_cache(4096, 128, dtype)
    positions = torch.randint(0, 4096, (48,), device="cuda")
    q, k = randn(48, 32, 128, dtype=dtype), randn(48, 8, 128, dtype=dtype)

    @torch.compile(fullgraph=True)
    def step(positions, q, k):
        tileops.apply_rotary_with_cache(positions, q, k, cache)
        return q.float().sum(dim=-1), k * 1

    ref_q, ref_k = cache_reference(positions, q, k, cache)
    q_sum, k_copy = step(positions, q, k)
    assert_close(q, ref_q, what="compiled q")
    assert_close(k_copy, ref_k, what="compiled k")
    torch.testing.assert_close(q_sum, ref_q.sum(dim=-1), rtol=2e-2, atol=2.0)

    q, k = randn(48, 32, 128, dtype=dtype), randn(48, 8, 128, dtype=dtype)
    tileops.apply_rotary_with_cache(positions, q.clone(), k.clone(), cache)  # load first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tileops.apply_rotary_with_cache(positions, q, k, cache)
    fresh_q, fresh_k = randn(48, 32, 128, dtype=dtype), randn(48, 8, 128, dtype=dtype)
    positions.copy_(torch.randint(0, 4096, (48,), device="cuda"))
    q.copy_(fresh_q)
    k.copy_(fresh_k)
    graph.replay()
    torch.cuda.synchronize()
    ref_q, ref_k = cache_reference(positions, fresh_q, fresh_k, cache)
    assert_close(q, ref_q, what="graph q")
    assert_close(k, ref_k, what="graph k")


@pytest.mark.gpu
def test_with_cache_token_counts_do_not_recompile():
    dtype = torch.bfloat16
    cache = rope_cache(1 << 16, 128, dtype)
    run = [randn(3, 32, 128, dtype=dtype), randn(3, 8, 128, dtype=dtype)]
    tileops.apply_rotary_with_cache(torch.arange(3, device="cuda"), *run, cache)
    before = Kernel.compile_count
    for tokens in (1, 2, 5, 64, 255, 256, 1000, 8191):
        positions = torch.randint(0, 1 << 16, (tokens,), device="cuda")
        q, k = randn(tokens, 32, 128, dtype=dtype), randn(tokens, 8, 128, dtype=dtype)
        ref_q, _ = cache_reference(positions, q, k, cache)
        tileops.apply_rotary_with_cache(positions, q, k, cache)
        assert_close(q, ref_q, what=f"q {tokens}")
    assert Kernel.compile_count == before


# -- CPU: op-layer errors and rooflines -----------------------------------------------------
def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


@pytest.mark.parametrize("inputs, params, arg, text", [
    ((meta(2, 8, 16, 64, dtype=torch.float32), meta(2, 8, 16, 64), meta(16, 64), meta(16, 64)),
     {}, "q", "dtype float16 | bfloat16"),
    ((meta(2, 8, 16, 64), meta(2, 8, 16, 32), meta(16, 64), meta(16, 64)), {}, "k", "shapes"),
    ((meta(2, 8, 16, 64), meta(2, 2, 16, 64), meta(15, 64), meta(15, 64)), {}, "cos",
     "cos.shape[-2] == S"),
    ((meta(2, 8, 16, 64), meta(2, 2, 16, 64), meta(16, 96), meta(16, 96)), {}, "cos",
     "R <= D"),
    ((meta(2, 8, 16, 64), meta(2, 2, 16, 64), meta(3, 16, 64), meta(3, 16, 64)), {}, "cos",
     "cos.shape[0] in (1, B)"),
    ((meta(2, 8, 16, 64), meta(2, 2, 16, 64), meta(16, 64), meta(16, 32)), {}, "sin",
     "tuple(sin.shape)"),
    ((meta(2, 8, 16, 64), meta(2, 2, 16, 64), meta(16, 64), meta(16, 64)),
     {"unsqueeze_dim": 3}, "unsqueeze_dim", "unsqueeze_dim == 1"),
    ((meta(16, 8, 64), meta(16, 2, 64), meta(16, 64), meta(16, 64)), {}, "q", "q.ndim == 4"),
])
def test_apply_rotary_errors_name_the_argument(inputs, params, arg, text):
    with pytest.raises(TileOpsError, match=f"RotaryFwdOp: argument '{arg}'") as info:
        RotaryFwdOp(**params).check(inputs)
    assert text in str(info.value)


@pytest.mark.parametrize("inputs, arg, text", [
    ((meta(4, dtype=torch.int32), meta(4, 8, 64), meta(4, 2, 64), meta(100, 64)),
     "positions", "dtype int64"),
    ((meta(4, dtype=torch.int64), meta(4, 8, 64), meta(5, 2, 64), meta(100, 64)),
     "k", "T = 4"),
    ((meta(4, dtype=torch.int64), meta(4, 8, 64), meta(4, 2, 64), meta(100, 66)),
     "cos_sin_cache", "R <= D"),
    ((meta(4, dtype=torch.int64), meta(4, 8, 64, dtype=torch.float16), meta(4, 2, 64,
                                                                            dtype=torch.float16),
      meta(100, 64)), "dtypes", "one of"),
])
def test_with_cache_errors_name_the_argument(inputs, arg, text):
    with pytest.raises(TileOpsError, match=f"RotaryWithCacheFwdOp: argument '{arg}'") as info:
        RotaryWithCacheFwdOp().check(inputs)
    assert text in str(info.value)


def test_with_cache_accepts_a_float32_table():
    inputs = (meta(4, dtype=torch.int64), meta(4, 8, 64, dtype=torch.float16),
              meta(4, 2, 64, dtype=torch.float16), meta(100, 64, dtype=torch.float32))
    RotaryWithCacheFwdOp().check(inputs)


def test_autograd_is_wired_through_the_custom_ops():
    """On meta tensors the fake implementations run: the forward op, then the backward op,
    also when only one output is used; cos needing a gradient is refused."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_function

    q = meta(2, 16, 8, 64).requires_grad_()
    k = meta(2, 16, 2, 64).requires_grad_()
    cos = meta(1, 16, 32)
    q_out, k_out = tileops.apply_rotary(q, k, cos, cos, 2, True)
    assert q_out.shape == q.shape and k_out.shape == k.shape and q_out.requires_grad
    q_out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape

    graphs = []

    def compiler(gm, example_inputs):
        graphs.append(gm.code)
        return make_boxed_func(gm.forward)

    def loss(q, k, cos, sin):
        q_out, k_out = tileops.apply_rotary(q, k, cos, sin, 2, True)
        return q_out.float().sum() + k_out.float().sum()

    aot_function(loss, fw_compiler=compiler, bw_compiler=compiler)(q, k, cos, cos).backward()
    assert "tileops.rotary_fwd.default" in graphs[0]
    assert "tileops.rotary_bwd.default" in graphs[1]

    q_out, _ = tileops.apply_rotary(q, k, cos.clone().requires_grad_(), cos, 2, True)
    with pytest.raises(TileOpsError, match="RotaryFwdOp: argument 'cos'"):
        q_out.sum().backward()


def test_with_cache_in_place_op_traces_as_a_mutation():
    """Under tracing the in-place form is one custom op that declares q and k mutated."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(positions, q, k, cache):
        return tileops.apply_rotary_with_cache(positions, q, k, cache)

    inputs = (meta(8, dtype=torch.int64), meta(8, 4, 64), meta(8, 1, 64), meta(100, 64))
    schema = torch.ops.tileops.rotary_with_cache_inplace.default._schema
    assert [a.alias_info is not None and a.alias_info.is_write for a in schema.arguments] == [
        False, True, True, False, False]
    code = make_fx(lambda *a: torch.ops.tileops.rotary_with_cache_inplace(*a, False))(
        *inputs).code
    assert "rotary_with_cache_inplace" in code
    q, k = step(*inputs)
    assert q is inputs[1] and k is inputs[2]


def test_with_cache_in_place_refuses_tensors_that_need_grad():
    inputs = (meta(8, dtype=torch.int64), meta(8, 4, 64).requires_grad_(), meta(8, 1, 64),
              meta(100, 64))
    with pytest.raises(TileOpsError, match="RotaryWithCacheFwdOp: argument 'q'"):
        tileops.apply_rotary_with_cache(*inputs)


def test_rooflines():
    q, k, cos = meta(2, 32, 100, 128), meta(2, 8, 100, 128), meta(1, 100, 64)
    flops, nbytes = RotaryFwdOp().eval_roofline(q, k, cos, cos)
    assert flops == 3 * 2 * 100 * 40 * 64
    assert nbytes == (2 * (2 * 32 + 2 * 8) * 100 * 128 + 2 * 100 * 64) * 2
    assert RotaryBwdOp().eval_roofline(q, k, cos, cos) == (flops, nbytes)
    positions = meta(64, dtype=torch.int64)
    cache = meta(131072, 128, dtype=torch.float32)
    flops, nbytes = RotaryWithCacheFwdOp().eval_roofline(
        positions, meta(64, 32, 128), meta(64, 8, 128), cache)
    assert flops == 3 * 64 * 40 * 128
    # positions, q and k read and written, one float32 table row per token
    assert nbytes == 64 * 8 + 2 * 64 * 40 * 128 * 2 + 64 * 128 * 4


def test_kernel_configs_are_launchable():
    """Every default and space config: a whole number of warps, at most 1024 threads, and
    every (token, head, unit) slot of a CTA owned by exactly one thread."""
    for heads, units in ((40, 8), (72, 8), (24, 16), (129, 4), (34, 4), (192, 3), (2, 8)):
        kernel = RotaryKernel(form="hf", dtype="bfloat16", table_dtype="bfloat16",
                              q_heads=heads - 1, k_heads=1, head_dim=units * 16,
                              rotary_dim=units * 16, interleaved=False, backward=False,
                              bhsd=False, inplace=False)
        assert kernel.units == units
        for config in kernel.config_space("all"):
            groups, threads = thread_layout(heads, units, config)
            assert threads % 32 == 0 and threads <= 1024, (heads, units, config)
            assert groups * config.heads_per_thread * config.head_chunks >= heads
            assert config.block_tokens * groups * units <= threads
            assert heads % config.head_chunks == 0, config


@pytest.mark.parametrize("form, q_heads, k_heads, head_dim, rot, interleaved, bhsd, want", [
    ("hf", 64, 8, 128, 128, False, False, (4, 2)),    # 70B / Qwen3-32B prefill: 288 threads
    ("cache", 64, 8, 128, 128, False, False, (4, 2)),
    ("hf", 32, 8, 128, 128, False, False, (4, 2)),    # 8B: 160 threads
    ("hf", 16, 8, 256, 256, False, False, (4, 1)),    # Gemma-2: 96 threads, none idle
    ("hf", 64, 8, 128, 128, False, True, (3, 1)),     # [B, H, S, D]: the scored pick
    ("hf", 128, 1, 64, 64, True, False, (3, 1)),      # DeepSeek-V3's 129 rope heads
])
def test_default_layouts(form, q_heads, k_heads, head_dim, rot, interleaved, bhsd, want):
    """4 heads a thread where a token's heads are contiguous and 4 divides their count (the
    H200 sweeps of 2026-12-04), the scored pick elsewhere (the wider rule slowed those)."""
    kernel = RotaryKernel(form=form, dtype="bfloat16", table_dtype="bfloat16",
                          q_heads=q_heads, k_heads=k_heads, head_dim=head_dim, rotary_dim=rot,
                          interleaved=interleaved, backward=False, bhsd=bhsd, inplace=False)
    config = kernel.heuristic_config("all", "sm_90a")
    assert (config.heads_per_thread, config.block_tokens, config.head_chunks) == (*want, 1)


@pytest.mark.parametrize("q_heads, k_heads, backward, want", [
    (64, 8, True, (2, 16, 36)), (32, 8, True, (2, 16, 20)),
    (32, 8, False, (5, 2, 1)),   # the forward keeps the scored pick (slower on an H200)
    (28, 1, True, (5, 2, 1))])   # an odd head count keeps the scored pick
def test_head_plane_defaults(q_heads, k_heads, backward, want):
    """The backward of [B, H, S, D] tensors laid out plane by plane: two heads a thread
    over 16 tokens a CTA (the compares and bench of the fifty-eighth session)."""
    kernel = RotaryKernel(form="hf", dtype="bfloat16", table_dtype="bfloat16",
                          q_heads=q_heads, k_heads=k_heads, head_dim=128, rotary_dim=128,
                          interleaved=False, backward=backward, bhsd=True, inplace=False,
                          planes=True)
    config = kernel.heuristic_config("all", "sm_90a")
    assert (config.heads_per_thread, config.block_tokens, config.head_chunks) == want


def test_head_planes_follow_the_memory_layout():
    """Only a [B, H, S, D] tensor stored plane by plane takes the head-plane default: HF's
    q (a transposed view of the [B, S, H, D] projection), [B, S, H, D] and one-token
    decode steps keep the token-major mapping."""
    from tileops.ops.position_encoding import _head_planes

    plane = torch.empty(2, 32, 64, 128, device="meta")
    view = torch.empty(2, 64, 32, 128, device="meta").transpose(1, 2)
    assert _head_planes(plane, 1) and not _head_planes(view, 1)
    assert not _head_planes(torch.empty(2, 64, 32, 128, device="meta"), 2)
    assert not _head_planes(torch.empty(2, 32, 1, 128, device="meta"), 1)
    op = RotaryFwdOp()
    cos = torch.empty(1, 64, 128, device="meta", dtype=torch.bfloat16)
    for q, planes in ((plane, True), (view, False)):
        q = q.to(torch.bfloat16)
        k = q[:, :8]
        ns = op.check((q, k, cos, cos))
        ((_, key, _),) = op.kernels_for(ns)
        assert key["planes"] is planes


@pytest.mark.parametrize("form", ["hf", "cache"])
def test_decode_batches_take_one_token_a_cta(form):
    """Up to FEW_TOKENS tokens the hf form runs a program of its own, one token a CTA (the
    prefill pick with more CTAs); the cache form keeps one program for every count."""
    from tileops.kernels.position_encoding.rotary import FEW_TOKENS

    kernel = RotaryKernel(form=form, dtype="bfloat16", table_dtype="bfloat16", q_heads=32,
                          k_heads=8, head_dim=128, rotary_dim=128, interleaved=False,
                          backward=False, bhsd=False, inplace=form == "cache")
    prefill = kernel.heuristic_config("all", "sm_90a")
    assert (prefill.heads_per_thread, prefill.block_tokens) == (4, 2)
    buckets = {kernel.bucket_of(t) for t in (1, 64, FEW_TOKENS)}
    assert kernel.bucket_of(FEW_TOKENS + 1) == "all"
    if form == "cache":
        assert buckets == {"all"}
        return
    assert buckets == {"few"}
    decode = kernel.heuristic_config("few", "sm_90a")
    assert decode == dataclasses.replace(prefill, block_tokens=1)
    assert decode in kernel.config_space("few")


def test_vector_width():
    assert vector_width("bfloat16", 128, 128) == 8
    assert vector_width("float16", 64, 192) == 8
    assert vector_width("bfloat16", 24, 96) == 4   # GPT-NeoX-20B: 12 pairs
    assert vector_width("bfloat16", 32, 80) == 8   # Phi-2
    assert vector_width("float16", 6, 64) == 1


# -- compile: the generated code ------------------------------------------------------------
@pytest.mark.compile
@pytest.mark.smoke
def test_smoke_kernels_use_16_byte_accesses():
    """The smoke workloads' programs (the same ones test_compile builds) load and store q/k
    in 16-byte vectors and have no guarded scalar fallback."""
    from tileops.prebuild import build_plan

    plan = build_plan(["RotaryFwdOp", "RotaryBwdOp", "RotaryWithCacheFwdOp"], tier="smoke")
    seen = set()
    for item in plan:
        if item.op_name in seen:
            continue
        seen.add(item.op_name)
        source = item.kernel.compile(item.config, item.bucket)[0].get_kernel_source()
        body = source[source.index("__launch_bounds__"):]
        for buffer in ("q", "k", "q_out", "k_out"):  # two loads / two stores per head slot
            assert body.count(f"*(uint4*)({buffer} + ") >= 2, (buffer, item.describe())


@pytest.mark.compile
@pytest.mark.full
def test_launch_bound_configs_bound_the_program():
    """`ctas_per_sm` (a tuner option) reaches the launch bounds of the default it varies:
    72 heads at 4 heads x 2 tokens (288 threads), 3 CTAs an SM."""
    import dataclasses

    kernel = RotaryKernel(form="hf", dtype="bfloat16", table_dtype="bfloat16", q_heads=64,
                          k_heads=8, head_dim=128, rotary_dim=128, interleaved=False,
                          backward=False, bhsd=False, inplace=False)
    default = kernel.heuristic_config("all", "sm_90a")
    bound = dataclasses.replace(default, ctas_per_sm=3)
    assert bound in kernel.config_space("all")
    assert "__launch_bounds__(288, 3)" in kernel.compile(bound, "all")[0].get_kernel_source()


def emulate(kernel, config):
    """Runs `kernel`'s program for `config` on the CPU (tests/cuda_emulation.py) on small
    strided inputs (padded rows, per-sequence tables for the backward, a token tail in the
    last CTA) and compares with the references."""
    from ..cuda_emulation import run

    key = kernel.key
    torch.manual_seed(0)
    tdt = getattr(torch, key["dtype"])
    compiled = kernel.compile(config, "all")[0]
    q_heads, k_heads, head_dim, rot = (key[n] for n in ("q_heads", "k_heads", "head_dim",
                                                         "rotary_dim"))
    interleaved = key["interleaved"]
    _, threads = thread_layout(q_heads + k_heads, kernel.units, config)

    def strided(*shape):  # every row padded: nothing is contiguous
        return torch.randn(*shape[:-1], shape[-1] + 8).to(tdt)[..., 8:]

    def outputs(q, k):
        if key["inplace"]:
            return q, k
        return (torch.full(q.shape, math.nan, dtype=tdt),
                torch.full(k.shape, math.nan, dtype=tdt))

    if key["form"] == "hf":
        batch, seq, table_batch = 2, 7, 2 if key["backward"] else 1
        q, k = strided(batch, seq, q_heads, head_dim), strided(batch, seq, k_heads, head_dim)
        cos = torch.randn(table_batch, seq, rot).to(tdt)
        sin = torch.randn(table_batch, seq, rot).to(tdt)
        unsqueeze_dim = 1 if key["bhsd"] else 2
        if key["bhsd"]:
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        q_out, k_out = outputs(q, k)
        if key["backward"]:
            want = []
            for dy in (q, k):
                leaf = torch.zeros(dy.shape, requires_grad=True)
                ref = hf_reference(leaf, leaf, cos, sin, unsqueeze_dim, interleaved)[0]
                want.append(torch.autograd.grad(ref, leaf, dy.float())[0])
        else:
            want = hf_reference(q, k, cos, sin, unsqueeze_dim, interleaved)
        run(compiled, -(-batch * seq // config.block_tokens) * config.head_chunks, threads,
            dict(q=q, k=k, cos=cos, sin=sin, q_out=q_out, k_out=k_out),
            dict(batch=batch, seq=seq, table_batch=table_batch))
    else:
        tokens, max_pos = 9, 50
        q, k = strided(tokens, q_heads, head_dim), strided(tokens, k_heads, head_dim)
        cache = torch.randn(max_pos, rot).to(getattr(torch, key["table_dtype"]))
        positions = torch.randint(0, max_pos, (tokens,))
        want = cache_reference(positions, q, k, cache, interleaved)
        q_out, k_out = outputs(q, k)
        run(compiled, -(-tokens // config.block_tokens) * config.head_chunks, threads,
            dict(positions=positions, q=q, k=k, cos_sin_cache=cache, q_out=q_out, k_out=k_out),
            dict(tokens=tokens, max_pos=max_pos))
    assert_close(q_out, want[0], what="q")
    assert_close(k_out, want[1], what="k")


@pytest.mark.compile
@pytest.mark.smoke
def test_smoke_programs_on_the_cpu():
    """The programs the smoke workloads run (Llama-3.1-8B shapes), executed on the CPU."""
    from tileops.prebuild import build_plan

    seen = set()
    for item in build_plan(["RotaryFwdOp", "RotaryBwdOp", "RotaryWithCacheFwdOp"],
                           tier="smoke"):
        if item.op_name not in seen:
            seen.add(item.op_name)
            emulate(item.kernel, item.config)


@pytest.mark.compile
@pytest.mark.full
@pytest.mark.parametrize("form, dtype, table_dtype, q_heads, k_heads, head_dim, rot, "
                         "interleaved, backward, bhsd, inplace, config", [
    ("hf", "bfloat16", "bfloat16", 4, 2, 32, 32, False, False, True, False, (2, 1)),
    ("hf", "float16", "float16", 5, 1, 64, 32, True, False, True, False, (3, 3)),
    ("hf", "bfloat16", "bfloat16", 3, 3, 48, 16, True, True, False, False, (4, 1)),
    ("hf", "float16", "float16", 2, 1, 40, 24, False, True, False, False, (1, 2)),
    ("cache", "bfloat16", "float32", 4, 2, 64, 32, True, False, False, False, (2, 1)),
    ("cache", "bfloat16", "bfloat16", 8, 1, 64, 64, False, False, False, True, (3, 2)),
    ("hf", "bfloat16", "bfloat16", 16, 2, 32, 32, False, False, True, False, (2, 4, 3)),
    ("hf", "float16", "float16", 14, 2, 64, 32, True, True, False, False, (4, 2, 2)),
    ("cache", "bfloat16", "bfloat16", 12, 4, 64, 64, False, False, False, True, (2, 4, 2)),
    # the token-major default's shape (4 heads a thread, 2 tokens a CTA), launch-bounded
    ("hf", "bfloat16", "bfloat16", 10, 2, 64, 64, False, False, False, False, (4, 2, 1, 3)),
], ids=["bhsd", "bhsd-gptj-partial", "bshd-gptj-bwd", "partial-24-bwd", "cache-f32",
        "cache-in-place", "bhsd-head-chunks", "bshd-gptj-bwd-head-chunks",
        "cache-in-place-head-chunks", "bshd-4-heads-2-tokens-bounded"])
def test_generated_cuda_on_the_cpu(form, dtype, table_dtype, q_heads, k_heads, head_dim, rot,
                                   interleaved, backward, bhsd, inplace, config):
    """Small shapes off every vector and CTA boundary, each flag of the program."""
    emulate(RotaryKernel(form=form, dtype=dtype, table_dtype=table_dtype, q_heads=q_heads,
                         k_heads=k_heads, head_dim=head_dim, rotary_dim=rot,
                         interleaved=interleaved, backward=backward, bhsd=bhsd,
                         inplace=inplace), RotaryConfig(*config))
