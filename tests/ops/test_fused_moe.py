"""The MoE training and expert-MLP ops on the GPU against float32 per-expert loops: the grouped
GEMM backward (input and weight gradients, empty experts, uneven Zipf groups, rows no
expert owns), the gate-up grouped GEMM with its SiLU-and-mul epilogue, the gradients of
moe_permute / moe_unpermute, and fused_moe (inference values; training gradients w.r.t.
hidden states, both weights and the routing weights), torch.compile(fullgraph=True), CUDA
graphs and bounded compile counts. Fresh random data; outputs land in NaN-poisoned memory
(the caching allocator is filled with NaN first), so an unwritten element fails."""

import math

import pytest
import torch

import tileops
from tileops import FusedMoeFwdOp, GroupedGemmBwdOp, GroupedGemmSiluAndMulFwdOp
from tileops.kernels.base import Kernel

from ..helpers import assert_close, assert_no_worse_than, poison_allocator, randn
from . import moe_reference as ref

pytestmark = pytest.mark.gpu

BF16, FP16, FP32, I32 = torch.bfloat16, torch.float16, torch.float32, torch.int32


def group_offsets(sizes):
    return torch.tensor(sizes, device="cuda").cumsum(0).to(I32)


def zipf_sizes(tokens, experts, top_k, skew=1.2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = ref.zipf_ids(tokens, experts, top_k, skew=skew, generator=gen)
    return torch.bincount(ids.flatten().long(), minlength=experts).tolist()


def groups(offsets):
    start = 0
    for e, end in enumerate(offsets.tolist()):
        yield e, start, end
        start = end


def grouped_backward_reference(dy, a, b, offsets):
    """float32 per-expert loop: (grad_a, rows past offsets[-1] zero; grad_b, empty experts
    zero)."""
    grad_a = torch.zeros(a.shape, dtype=FP32, device=a.device)
    grad_b = torch.zeros(b.shape, dtype=FP32, device=a.device)
    for e, lo, hi in groups(offsets):
        grad_a[lo:hi] = dy[lo:hi].float() @ b[e].float()
        grad_b[e] = dy[lo:hi].float().t() @ a[lo:hi].float()
    return grad_a, grad_b


# (group sizes, N, K, dtype): each a code path
BACKWARD_CASES = [
    pytest.param([0, 1, 200, 0, 129, 64, 1000, 3], 256, 512, BF16,
                 id="empty experts, partial row tiles, a lone row"),
    pytest.param("zipf", 1536, 2048, BF16, id="qwen3-30b-a3b gate-up, zipf groups"),
    pytest.param([513] * 6 + [0, 77], 1000, 520, FP16, id="N and K not multiples of tiles"),
    pytest.param([4] * 128, 3072, 4096, BF16, id="qwen3-235b decode: the 64-row bucket"),
    pytest.param([0] * 7 + [300], 512, 256, BF16, id="every row in the last expert"),
]


@pytest.mark.parametrize("sizes, n, k, dtype", BACKWARD_CASES)
def test_grouped_gemm_backward(sizes, n, k, dtype):
    if sizes == "zipf":
        sizes = zipf_sizes(4096, 128, 8)
    offsets = group_offsets(sizes)
    m = int(offsets[-1]) + 17  # rows no expert owns: grad_a zero there
    a = randn(m, k, dtype=dtype).requires_grad_()
    b = randn(len(sizes), n, k, dtype=dtype, std=n ** -0.5).requires_grad_()
    dy = randn(m, n, dtype=dtype)
    poison_allocator()
    tileops.grouped_gemm(a, b, offsets).backward(dy)
    want_a, want_b = grouped_backward_reference(dy, a.detach(), b.detach(), offsets)
    assert a.grad.dtype == dtype and b.grad.dtype == dtype
    assert_close(a.grad, want_a, what="grad_a")
    assert_close(b.grad, want_b, scale=math.sqrt(max(sizes)), what="grad_b")
    assert (a.grad[int(offsets[-1]):] == 0).all()


@pytest.mark.parametrize("sizes", [[0, 1, 200, 0, 129, 64, 1000], "zipf"],
                         ids=["empty and partial, 7 experts", "zipf, 128 experts"])
def test_every_weight_gradient_config(sizes):
    """Each config of the weight gradient's space (experts_per_cta 2-8 among them: a CTA
    walking several experts, the count not dividing 7) against the float32 loop, into a
    NaN-poisoned output."""
    from tileops.kernels.moe import GroupedGemmWeightGradKernel

    if sizes == "zipf":
        sizes = zipf_sizes(1024, 128, 8)
    offsets = group_offsets(sizes)
    m, n, k = int(offsets[-1]) + 5, 256, 512
    a, dy = randn(m, k, dtype=BF16), randn(m, n, dtype=BF16)
    want = grouped_backward_reference(dy, a, torch.zeros(len(sizes), n, k, device="cuda"),
                                      offsets)[1]
    kernel = GroupedGemmWeightGradKernel(dtype="bfloat16", n=n, k=k, n_experts=len(sizes))
    configs = kernel.config_space("all")
    assert {c.experts_per_cta for c in configs} >= {1, 2, 4, 8}
    for config in configs:
        kernel.use(config, "all")
        db = torch.full((len(sizes), n, k), float("nan"), dtype=BF16, device="cuda")
        kernel(m, dy, a, offsets, db)
        assert_close(db, want, scale=math.sqrt(max(sizes)), what=str(config))


def test_grouped_gemm_backward_op_in_a_cuda_graph_with_new_group_sizes():
    op = GroupedGemmBwdOp()
    offsets = group_offsets([64] * 16)
    a, b = randn(1100, 512, dtype=BF16), randn(16, 256, 512, dtype=BF16, std=1 / 16)
    dy = randn(1100, 256, dtype=BF16)
    op(dy, a, b, offsets)  # loads the kernels before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grad_a, grad_b = op(dy, a, b, offsets)
    offsets.copy_(group_offsets([0, 300, 0, 0, 200, 100, 0, 0, 0, 50, 50, 50, 50, 100, 100, 24]))
    grad_a.fill_(float("nan")), grad_b.fill_(float("nan"))
    graph.replay()  # the sizes are read on the device: no recapture, no host sync
    want_a, want_b = grouped_backward_reference(dy, a, b, offsets)
    assert_close(grad_a, want_a, what="grad_a")
    assert_close(grad_b, want_b, scale=math.sqrt(300), what="grad_b")


def test_grouped_gemm_gradients_under_torch_compile():
    offsets = group_offsets([100, 0, 28, 500, 1])
    a = randn(629, 256, dtype=BF16).requires_grad_()
    b = randn(5, 384, 256, dtype=BF16, std=1 / 16).requires_grad_()
    dy = randn(629, 384, dtype=BF16)

    @torch.compile(fullgraph=True)
    def loss(a, b):
        return (tileops.grouped_gemm(a, b, offsets).float() * dy.float()).sum()

    loss(a, b).backward()
    want_a, want_b = grouped_backward_reference(dy, a.detach(), b.detach(), offsets)
    assert_close(a.grad, want_a, what="grad_a")
    assert_close(b.grad, want_b, scale=math.sqrt(500), what="grad_b")


def test_grouped_gemm_backward_baselines_agree():
    """The benchmark's torch._grouped_mm backward computes the same gradients."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    from tileops.perf.baselines_moe import grouped_mm_backward

    offsets = group_offsets([128, 0, 384, 256] * 8)
    m = int(offsets[-1])
    a, b = randn(m, 2048, dtype=BF16), randn(32, 768, 2048, dtype=BF16, std=0.02)
    dy = randn(m, 768, dtype=BF16)
    want_a, want_b = grouped_backward_reference(dy, a, b, offsets)
    base_a, base_b = grouped_mm_backward(dy, a, b, offsets)
    assert_close(base_a, want_a, what="torch._grouped_mm grad_a")
    assert_close(base_b, want_b, scale=math.sqrt(384), what="torch._grouped_mm grad_b")
    ours_a, ours_b = GroupedGemmBwdOp()(dy, a, b, offsets)
    assert_close(ours_a, want_a, what="grad_a")
    assert_close(ours_b, want_b, scale=math.sqrt(384), what="grad_b")


def test_grouped_gemm_backward_token_counts_do_not_recompile():
    op = GroupedGemmBwdOp()
    b = randn(16, 256, 512, dtype=BF16, std=1 / 16)

    def step(m):
        sizes = [m // 16] * 15 + [m - 15 * (m // 16)]
        offsets = group_offsets(sizes)
        a, dy = randn(m, 512, dtype=BF16), randn(m, 256, dtype=BF16)
        grad_a, grad_b = op(dy, a, b, offsets)
        want_a, want_b = grouped_backward_reference(dy, a, b, offsets)
        assert_close(grad_a, want_a, what="grad_a")
        assert_close(grad_b, want_b, scale=math.sqrt(max(sizes)), what="grad_b")

    step(64), step(4097)  # both buckets of the input gradient
    before = Kernel.compile_count
    for m in (1, 7, 100, 1025, 3000):
        step(m)
    assert Kernel.compile_count == before


# -- gate-up with the SiLU epilogue -----------------------------------------------------
def silu_mul_reference(a, w_gate_up, offsets):
    f = w_gate_up.shape[1] // 2
    out = torch.zeros(a.shape[0], f, dtype=FP32, device=a.device)
    for e, lo, hi in groups(offsets):
        gu = a[lo:hi].float() @ w_gate_up[e].float().t()
        out[lo:hi] = torch.nn.functional.silu(gu[:, :f]) * gu[:, f:]
    return out


# (group sizes, F, K, dtype)
SILU_CASES = [
    pytest.param([0, 1, 200, 0, 129, 64, 1000, 3], 256, 512, BF16, id="empty experts, tails"),
    pytest.param("zipf", 768, 2048, BF16, id="qwen3-30b-a3b, zipf groups"),
    pytest.param([4] * 128, 1536, 4096, FP16, id="qwen3-235b decode bucket"),
    pytest.param([513] * 8, 200, 1024, BF16, id="F not a multiple of the tile"),
]


@pytest.mark.parametrize("sizes, f, k, dtype", SILU_CASES)
def test_grouped_gemm_silu_and_mul(sizes, f, k, dtype):
    if sizes == "zipf":
        sizes = zipf_sizes(4096, 128, 8)
    offsets = group_offsets(sizes)
    end = int(offsets[-1])
    a = randn(end + 9, k, dtype=dtype)
    w = randn(len(sizes), 2 * f, k, dtype=dtype, std=2 * k ** -0.5)  # gate values of +-2
    poison_allocator()
    out = tileops.grouped_gemm_silu_and_mul(a, w, offsets)
    assert out.shape == (end + 9, f) and out.dtype == dtype
    assert_close(out[:end], silu_mul_reference(a, w, offsets)[:end])


def test_silu_and_mul_is_the_two_step_form_and_the_baseline():
    """Equal (to one rounding) to grouped_gemm + silu_and_mul and to the benchmark's
    torch._grouped_mm form: the gate is the first half of each expert's rows."""
    offsets = group_offsets([300, 0, 212, 500])
    a, w = randn(1012, 1024, dtype=BF16), randn(4, 1024, 1024, dtype=BF16, std=1 / 16)
    fused = tileops.grouped_gemm_silu_and_mul(a, w, offsets)
    two_step = tileops.silu_and_mul(tileops.grouped_gemm(a, w, offsets))
    assert_close(fused, two_step.float())
    if hasattr(torch, "_grouped_mm"):
        from tileops.perf.baselines_moe import grouped_mm_silu_and_mul

        assert_close(fused, grouped_mm_silu_and_mul(a, w, offsets).float())


def test_silu_and_mul_cuda_graph_and_no_recompile():
    op = GroupedGemmSiluAndMulFwdOp()
    w = randn(16, 512, 1024, dtype=BF16, std=1 / 32)
    a, offsets = randn(1024, 1024, dtype=BF16), group_offsets([64] * 16)
    op(a, w, offsets)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(a, w, offsets)
    offsets.copy_(group_offsets([0, 300, 0, 0, 200, 100, 0, 0, 0, 50, 50, 50, 50, 100, 100, 24]))
    graph.replay()
    assert_close(out, silu_mul_reference(a, w, offsets))
    op(randn(4097, 1024, dtype=BF16), w, offsets)  # the prefill bucket
    before = Kernel.compile_count
    for m in (1, 7, 100, 1025, 4097):
        a = randn(m, 1024, dtype=BF16)
        offsets = group_offsets([m // 16] * 15 + [m - 15 * (m // 16)])
        assert_close(op(a, w, offsets), silu_mul_reference(a, w, offsets))
    assert Kernel.compile_count == before


# -- permute / unpermute gradients ------------------------------------------------------
@pytest.mark.parametrize("tokens, top_k, hidden, experts, dtype", [
    (4096, 8, 2048, 128, BF16), (1, 8, 7168, 384, FP16), (777, 2, 200, 8, BF16)])
def test_permute_and_unpermute_gradients(tokens, top_k, hidden, experts, dtype):
    ids = ref.zipf_ids(tokens, experts, top_k, skew=1.0).cuda()
    x = randn(tokens, hidden, dtype=dtype).requires_grad_()
    weights = torch.rand(tokens, top_k, device="cuda").requires_grad_()
    permuted, offsets, row_index, _ = tileops.moe_permute(x, ids, experts)
    rows = randn(tokens * top_k, hidden, dtype=dtype).requires_grad_()
    out = tileops.moe_unpermute(rows, weights, row_index)
    g_perm, g_out = randn(*permuted.shape, dtype=dtype), randn(tokens, hidden, dtype=dtype)
    poison_allocator()
    torch.autograd.backward([permuted, out], [g_perm, g_out])
    # the references' own autograd, in float64
    want_x = ref.combine_reference(g_perm, torch.ones(tokens, top_k, device="cuda"), row_index)
    assert_close(x.grad, want_x.float(), scale=math.sqrt(top_k), what="grad hidden")
    rows64 = rows.detach().double().requires_grad_()
    w64 = weights.detach().double().requires_grad_()
    ref.combine_reference(rows64, w64, row_index).backward(g_out.double())
    assert_close(rows.grad, rows64.grad.float(), what="grad expert_output")
    assert_close(weights.grad.to(dtype), w64.grad.float(), scale=math.sqrt(hidden) / 4,
                 what="grad topk_weights")


def test_unpermute_gradient_skips_dropped_slots():
    row_index = torch.full((3, 4), -1, dtype=I32, device="cuda")
    row_index[1] = torch.tensor([5, 0, 9, 2], dtype=I32, device="cuda")
    rows = randn(12, 256, dtype=BF16).requires_grad_()
    weights = torch.rand(3, 4, device="cuda").requires_grad_()
    tileops.moe_unpermute(rows, weights, row_index).backward(randn(3, 256, dtype=BF16))
    untouched = [r for r in range(12) if r not in (5, 0, 9, 2)]
    assert (rows.grad[untouched] == 0).all()
    assert (weights.grad[0] == 0).all() and (weights.grad[2] == 0).all()


# -- fused_moe --------------------------------------------------------------------------
# name -> (tokens, experts, hidden, ffn, routing params or "zipf ids k")
LAYERS = {
    "qwen3-style softmax top-8": (333, 32, 256, 128, dict(top_k=8)),
    "deepseek-style sigmoid, grouped, bias": (200, 64, 512, 256,
                                              dict(top_k=6, scoring="sigmoid", n_group=8,
                                                   topk_group=4, routed_scaling_factor=2.5)),
    "mixtral-style top-2, one token": (1, 8, 1024, 512, dict(top_k=2)),
    "zipf ids, empty experts": (500, 32, 256, 192, 2),
}


def layer_inputs(name, dtype=BF16, seed=0):
    tokens, experts, hidden, ffn, routing = LAYERS[name]
    torch.manual_seed(seed)
    x = randn(tokens, hidden, dtype=dtype)
    w_gate_up = randn(experts, 2 * ffn, hidden, dtype=dtype, std=2 * hidden ** -0.5)
    w_down = randn(experts, hidden, ffn, dtype=dtype, std=ffn ** -0.5)
    if isinstance(routing, int):  # given weights and ids
        ids = ref.zipf_ids(tokens, experts, routing, skew=1.5).cuda()
        weights = torch.rand(tokens, routing, device="cuda")
        return x, w_gate_up, w_down, dict(topk_weights=weights, topk_ids=ids)
    logits = randn(tokens, experts, dtype=FP32)
    bias = randn(experts, dtype=FP32, std=0.05) if routing.get("scoring") == "sigmoid" else None
    return x, w_gate_up, w_down, dict(router_logits=logits, correction_bias=bias, **routing)


def routed(kwargs):
    """The (weights, ids) fused_moe uses: the caller's, or moe_route's (tested elsewhere)."""
    if "topk_ids" in kwargs:
        return kwargs["topk_weights"], kwargs["topk_ids"]
    params = {k: v for k, v in kwargs.items() if k not in ("router_logits", "correction_bias")}
    return tileops.moe_route(kwargs["router_logits"], correction_bias=kwargs["correction_bias"],
                             **params)


@pytest.mark.parametrize("name, dtype", [(name, BF16) for name in LAYERS]
                         + [("qwen3-style softmax top-8", FP16)])
def test_fused_moe_forward(name, dtype):
    x, w_gate_up, w_down, kwargs = layer_inputs(name, dtype)
    poison_allocator()
    out = tileops.fused_moe(x, w_gate_up, w_down, **kwargs)
    assert out.dtype == dtype and out.shape == x.shape
    weights, ids = routed(kwargs)
    assert_close(out, ref.expert_layer(x, w_gate_up, w_down, weights, ids), scale=2.0)


@pytest.mark.parametrize("name", list(LAYERS))
def test_fused_moe_gradients(name):
    """Training: the output and the gradients w.r.t. hidden states, both expert weights and
    the routing (the given weights, or the router logits through moe_route's weights), each
    no more than twice as far from autograd of the float32 loop as autograd of the same
    loop in bf16, rounded where the training path rounds (FlashAttention's criterion: a
    near-zero sum of large terms keeps an ulp of its terms, in either)."""
    x, w_gate_up, w_down, kwargs = layer_inputs(name)
    routing = "topk_weights" if "topk_weights" in kwargs else "router_logits"
    leaves = [x, w_gate_up, w_down, kwargs[routing]]
    for t in leaves:
        t.requires_grad_()
    out = tileops.fused_moe(x, w_gate_up, w_down, **kwargs)
    g = randn(*out.shape, dtype=BF16)
    poison_allocator()
    out.backward(g)
    _, ids = routed({k: (v.detach() if isinstance(v, torch.Tensor) else v)
                     for k, v in kwargs.items()})

    def autograd_of_loop(dtype):
        """(output, gradients of the four leaves) of ref.expert_layer in `dtype` (fp32
        routing weights either way)."""
        mine = [t.detach().to(dtype if i < 3 else FP32).requires_grad_()
                for i, t in enumerate(leaves)]
        if routing == "topk_weights":
            weights = mine[3]
        else:
            weights = ref.route_weights(mine[3], ids, kwargs.get("scoring", "softmax"),
                                        kwargs.get("renormalize", True),
                                        kwargs.get("routed_scaling_factor", 1.0)).float()
        result = ref.expert_layer(*mine[:3], weights, ids, dtype=dtype)
        result.backward(g.to(dtype))
        return result.detach(), [t.grad for t in mine]

    want, want_grads = autograd_of_loop(FP32)
    eager, eager_grads = autograd_of_loop(BF16)
    assert_no_worse_than(out, eager, want)
    for what, t, eager_grad, want_grad in zip(
            ("hidden", "w_gate_up", "w_down", routing), leaves, eager_grads, want_grads,
            strict=True):
        assert t.grad is not None and t.grad.dtype == t.dtype
        assert_no_worse_than(t.grad, eager_grad, want_grad, what=f"grad {what}")


@pytest.mark.parametrize("dtype", [FP32, BF16])
@pytest.mark.parametrize("params", [
    dict(top_k=8), dict(top_k=4, renormalize=False),
    dict(top_k=8, scoring="sigmoid", n_group=8, topk_group=4, routed_scaling_factor=2.5),
    dict(top_k=6, scoring="sigmoid", renormalize=False)], ids=str)
def test_route_gradient(params, dtype):
    """d router_logits of moe_route's weights against autograd of the float64 formula at
    the kernel's ids (the selection carries no gradient)."""
    logits = randn(300, 64, dtype=dtype, std=2.0).requires_grad_()
    bias = randn(64, dtype=FP32, std=0.05) if params.get("scoring") == "sigmoid" else None
    weights, ids = tileops.moe_route(logits, correction_bias=bias, **params)
    g = torch.randn_like(weights)
    weights.backward(g)
    x = logits.detach().double().requires_grad_()
    ref.route_weights(x, ids, params.get("scoring", "softmax"),
                      params.get("renormalize", True),
                      params.get("routed_scaling_factor", 1.0)).backward(g.double())
    assert logits.grad.dtype == dtype
    assert_close(logits.grad, x.grad.float(), scale=10.0, what="grad router_logits")


def test_fused_moe_torch_compile_inference_and_training():
    x, w_gate_up, w_down, kwargs = layer_inputs("deepseek-style sigmoid, grouped, bias")
    layer = torch.compile(tileops.fused_moe, fullgraph=True)
    weights, ids = routed(kwargs)
    want = ref.expert_layer(x, w_gate_up, w_down, weights, ids)
    with torch.no_grad():
        assert_close(layer(x, w_gate_up, w_down, **kwargs), want, scale=2.0)
    w_down.requires_grad_()
    out = layer(x, w_gate_up, w_down, **kwargs)
    out.float().sum().backward()
    ref_down = w_down.detach().float().requires_grad_()
    ref.expert_layer(x, w_gate_up, ref_down, weights, ids).sum().backward()
    assert_close(w_down.grad, ref_down.grad, scale=math.sqrt(200), what="grad w_down")


def test_fused_moe_cuda_graph_replays_with_new_inputs():
    x, w_gate_up, w_down, kwargs = layer_inputs("qwen3-style softmax top-8")
    op = FusedMoeFwdOp(top_k=8)
    logits = kwargs["router_logits"]
    op(x, w_gate_up, w_down, logits)  # loads every kernel before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(x, w_gate_up, w_down, logits)
    x.copy_(randn(*x.shape, dtype=BF16))
    logits.copy_(randn(*logits.shape, dtype=FP32))
    graph.replay()
    weights, ids = tileops.moe_route(logits, 8)
    assert_close(out, ref.expert_layer(x, w_gate_up, w_down, weights, ids), scale=2.0)


def test_fused_moe_token_counts_do_not_recompile():
    x, w_gate_up, w_down, _ = layer_inputs("qwen3-style softmax top-8")
    op = FusedMoeFwdOp(top_k=8)

    def step(tokens):
        xs, logits = randn(tokens, 256, dtype=BF16), randn(tokens, 32, dtype=FP32)
        out = op(xs, w_gate_up, w_down, logits)
        weights, ids = tileops.moe_route(logits, 8)
        assert_close(out, ref.expert_layer(xs, w_gate_up, w_down, weights, ids), scale=2.0)

    step(1), step(1000)  # decode and prefill buckets of the grouped GEMMs
    before = Kernel.compile_count
    for tokens in (2, 3, 63, 64, 65, 511, 4097):
        step(tokens)
    assert Kernel.compile_count == before


def test_fused_moe_matches_the_pure_pytorch_baseline():
    """The whole layer, routing included, against the pure-PyTorch bf16 layer of the
    benchmarks (its routers' code, per-expert cuBLAS GEMMs): both compared with the float32
    loop at the baseline's routing, ours no more than twice as far from it."""
    from tileops.perf.baselines_moe import fused_moe_loop, route_eager

    x, w_gate_up, w_down, kwargs = layer_inputs("deepseek-style sigmoid, grouped, bias")
    params = {k: v for k, v in kwargs.items() if k not in ("router_logits", "correction_bias")}
    base = fused_moe_loop(x, w_gate_up, w_down, kwargs["router_logits"], None, None,
                          kwargs["correction_bias"], **params)
    weights, ids = route_eager(kwargs["router_logits"], kwargs["correction_bias"], **params)
    want = ref.expert_layer(x, w_gate_up, w_down, weights, ids)
    assert_no_worse_than(tileops.fused_moe(x, w_gate_up, w_down, **kwargs), base, want)
