"""MoE ops on the GPU against the float64 references of tests/ops/moe_reference.py: routing
(ids exact outside near-ties, weights at the kernel's ids), the permutation (offsets,
row_index and source equal to a stable sort's, the permuted rows bit-exact), the combine
(fp32 accumulation, dropped rows), and the three chained around a per-expert loop; fresh
random data, NaN-poisoned outputs, tails, T = 1, skewed (Zipf) routing, empty experts,
expert maps, torch.compile, CUDA graphs and bounded compile counts."""

import pytest
import torch

import tileops
from tileops import MoePermuteFwdOp, MoeRouteFwdOp, MoeUnpermuteFwdOp
from tileops.kernels.base import Kernel

from ..helpers import assert_close, poison, randn
from . import moe_reference as ref

pytestmark = pytest.mark.gpu

BF16, FP16, FP32, I32 = torch.bfloat16, torch.float16, torch.float32, torch.int32

# name -> (tokens, experts, logits dtype, bias std or None, params): each a model's router
# or a code path
ROUTES = {
    "deepseek-v3 decode": (64, 256, FP32, 0.05,
                           dict(top_k=8, scoring="sigmoid", n_group=8, topk_group=4,
                                routed_scaling_factor=2.5)),
    "deepseek-v3 prefill, bf16 logits, large bias": (4097, 256, BF16, 1.0,
                                                     dict(top_k=8, scoring="sigmoid",
                                                          n_group=8, topk_group=4,
                                                          routed_scaling_factor=2.5)),
    "kimi-k2 T=1": (1, 384, FP32, 0.05, dict(top_k=8, scoring="sigmoid", n_group=1,
                                             topk_group=1, routed_scaling_factor=2.827)),
    "qwen3-30b-a3b": (1999, 128, BF16, None, dict(top_k=8)),
    "qwen2-moe, no renormalization": (33, 60, FP16, None, dict(top_k=4, renormalize=False)),
    "mixtral": (4096, 8, BF16, None, dict(top_k=2)),
    "sigmoid without bias": (77, 64, FP32, None, dict(top_k=6, scoring="sigmoid")),
    "grouped softmax (deepseek-v2 style)": (130, 160, BF16, None,
                                            dict(top_k=6, n_group=8, topk_group=3)),
    "top_k = 32, E = 33 (tail lane)": (5, 33, FP32, None, dict(top_k=32)),
}


def route_inputs(name, seed=0):
    tokens, experts, dtype, bias_std, params = ROUTES[name]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = randn(tokens, experts, dtype=dtype, std=2.0, generator=gen)
    bias = None if bias_std is None else randn(experts, dtype=FP32, std=bias_std,
                                               generator=gen)
    return logits, bias, params


def check(weights, ids, logits, bias, params):
    return ref.check_route(weights, ids, logits, params["top_k"],
                           params.get("scoring", "softmax"), params.get("renormalize", True),
                           params.get("n_group"), params.get("topk_group"), bias,
                           params.get("routed_scaling_factor", 1.0))


@pytest.mark.parametrize("name", list(ROUTES))
def test_route(name):
    logits, bias, params = route_inputs(name)
    weights, ids = tileops.moe_route(logits, correction_bias=bias, **params)
    assert weights.dtype == FP32 and ids.dtype == I32
    checked = check(weights, ids, logits, bias, params)
    assert checked >= 0.99 * logits.shape[0]


def test_route_ties_go_to_the_lower_index():
    logits = torch.randint(-2, 3, (300, 64), device="cuda").to(FP16)
    weights, ids = tileops.moe_route(logits, 8)
    _, want, _ = ref.route_reference(logits, 8)
    assert torch.equal(ids.long(), want)


def test_route_non_contiguous_logits_and_op_object():
    logits = randn(256, 512, dtype=BF16)[:, ::2]  # a strided view of 256 experts
    op = MoeRouteFwdOp(top_k=8, scoring="sigmoid", n_group=8, topk_group=4,
                       routed_scaling_factor=2.5)
    bias = randn(256, dtype=FP32, std=0.05)
    weights, ids = op(logits, bias)
    check(weights, ids, logits, bias, ROUTES["deepseek-v3 decode"][4])


# -- permutation ------------------------------------------------------------------------
def check_permute(outputs, hidden, ids, num_experts, expert_map=None):
    permuted, offsets, row_index, source = outputs
    want_rows, want_offsets, want_index, want_source = ref.permute_reference(
        hidden, ids, num_experts, expert_map)
    assert torch.equal(offsets.long(), want_offsets), (offsets, want_offsets)
    assert torch.equal(row_index.long(), want_index)
    assert torch.equal(source.long(), want_source)
    n_local = int(want_offsets[-1])
    assert torch.equal(permuted[:n_local], want_rows)


# (tokens, top_k, hidden, experts, dtype, routing)
PERMUTE_CASES = [
    (4096, 8, 2048, 128, BF16, "uniform"),  # qwen3-30b-a3b prefill: 64 chunks
    (1, 8, 7168, 384, FP16, "uniform"),     # kimi-k2 T = 1
    (777, 8, 7168, 256, BF16, "zipf"),      # skewed; several empty experts; a tail chunk
    (4096, 2, 4096, 8, FP16, "zipf"),       # mixtral
    (33, 6, 200, 60, BF16, "uniform"),      # hidden not a multiple of 128
]


@pytest.mark.parametrize("tokens, top_k, hidden, experts, dtype, routing", PERMUTE_CASES)
def test_permute(tokens, top_k, hidden, experts, dtype, routing):
    gen = torch.Generator().manual_seed(tokens)
    ids = (ref.zipf_ids(tokens, experts, top_k, skew=1.5, generator=gen) if routing == "zipf"
           else ref.zipf_ids(tokens, experts, top_k, skew=0.0, generator=gen)).cuda()
    hidden_states = randn(tokens, hidden, dtype=dtype)
    outputs = tileops.moe_permute(hidden_states, ids, experts)
    check_permute(outputs, hidden_states, ids, experts)


def test_permute_with_an_expert_map_and_bad_ids():
    """Expert parallelism (8 local experts of 256, deepseek-v3 over 32 ranks): only local
    slots get rows; ids outside the map and map entries past the local count are dropped;
    the rows after offsets[-1] have source -1."""
    tokens, top_k = 513, 8
    ids = ref.zipf_ids(tokens, 256, top_k, skew=0.0).cuda()
    ids[0, 0], ids[1, 1], ids[2, 2] = -1, 256, 10 ** 6
    expert_map = torch.full((256,), -1, dtype=I32, device="cuda")
    expert_map[24:32] = torch.arange(8, dtype=I32, device="cuda")
    expert_map[100] = 8  # past the local count
    hidden_states = randn(tokens, 7168, dtype=BF16)
    outputs = tileops.moe_permute(hidden_states, ids, 8, expert_map)
    check_permute(outputs, hidden_states, ids, 8, expert_map)
    assert (outputs[3][int(outputs[1][-1]):] == -1).all()


def test_permute_zero_tokens():
    permuted, offsets, row_index, source = tileops.moe_permute(
        randn(0, 256, dtype=BF16), torch.empty(0, 8, dtype=I32, device="cuda"), 16)
    assert permuted.shape == (0, 256) and torch.equal(offsets.cpu(), torch.zeros(17, dtype=I32))


# -- combine ----------------------------------------------------------------------------
@pytest.mark.parametrize("tokens, top_k, hidden, dtype", [
    (4096, 8, 2048, BF16), (1, 8, 7168, FP16), (1000, 2, 4096, BF16), (37, 6, 200, FP16)])
def test_unpermute(tokens, top_k, hidden, dtype):
    rows = tokens * top_k
    row_index = torch.randperm(rows, device="cuda").view(tokens, top_k).to(I32)
    row_index[0, -1] = -1  # a dropped slot
    expert_output = randn(rows, hidden, dtype=dtype, std=3.0)
    weights = torch.rand(tokens, top_k, device="cuda")
    out = tileops.moe_unpermute(expert_output, weights, row_index)
    assert out.dtype == dtype
    assert_close(out, ref.combine_reference(expert_output, weights, row_index).to(FP32),
                 scale=3.0)


def test_unpermute_token_without_local_experts_gets_zeros():
    row_index = torch.full((3, 4), -1, dtype=I32, device="cuda")
    row_index[1] = torch.arange(4, dtype=I32, device="cuda")
    out = tileops.moe_unpermute(randn(12, 1024, dtype=BF16), torch.rand(3, 4, device="cuda"),
                                row_index)
    assert (out[0] == 0).all() and (out[2] == 0).all()


# -- the pieces chained -----------------------------------------------------------------
def moe_layer(x, logits, bias, w1, params, num_experts):
    """route -> permute -> a per-expert matmul on each expert's rows -> combine."""
    weights, ids = tileops.moe_route(logits, correction_bias=bias, **params)
    permuted, offsets, row_index, _ = tileops.moe_permute(x, ids, num_experts)
    expert_out = torch.empty_like(permuted)
    bounds = offsets.tolist()  # the test's loop needs them on the host; the ops do not
    for e in range(num_experts):
        lo, hi = bounds[e], bounds[e + 1]
        expert_out[lo:hi] = (permuted[lo:hi].float() @ w1[e].float().t()).to(x.dtype)
    return tileops.moe_unpermute(expert_out, weights, row_index), weights, ids


def test_layer_against_a_per_expert_loop():
    """DeepSeek-V3-style routing of 300 tokens over 64 experts, each expert a linear map:
    the chained ops equal a float32 loop over tokens and their chosen experts."""
    tokens, hidden, experts = 300, 256, 64
    params = dict(top_k=6, scoring="sigmoid", n_group=8, topk_group=4,
                  routed_scaling_factor=2.5)
    x = randn(tokens, hidden, dtype=BF16)
    logits = randn(tokens, experts, dtype=FP32)
    bias = randn(experts, dtype=FP32, std=0.05)
    w1 = randn(experts, hidden, hidden, dtype=BF16, std=hidden ** -0.5)
    out, weights, ids = moe_layer(x, logits, bias, w1, params, experts)
    want = torch.zeros(tokens, hidden, dtype=torch.float64, device="cuda")
    for k in range(params["top_k"]):
        y = torch.einsum("th,toh->to", x.double(), w1[ids[:, k].long()].double())
        want += weights[:, k, None].double() * y.to(BF16).double()
    assert_close(out, want.float())


@pytest.mark.smoke
def test_torch_compile_fullgraph():
    @torch.compile(fullgraph=True)
    def dispatch(x, logits, bias):
        weights, ids = tileops.moe_route(logits, 8, "sigmoid", True, 8, 4, bias, 2.5)
        permuted, offsets, row_index, source = tileops.moe_permute(x, ids, 256)
        return tileops.moe_unpermute(permuted, weights, row_index), weights, ids

    x, bias = randn(64, 1024, dtype=BF16), randn(256, dtype=FP32, std=0.05)
    logits = randn(64, 256, dtype=FP32)
    out, weights, ids = dispatch(x, logits, bias)
    check(weights, ids, logits, bias, ROUTES["deepseek-v3 decode"][4])
    # unpermuting the permuted rows gives each token its own row times sum(weights) = 2.5
    assert_close(out, (x.float() * 2.5).to(BF16).float())


@pytest.mark.smoke
def test_cuda_graph_replays_with_new_logits():
    x, logits = randn(64, 2048, dtype=BF16), randn(64, 128, dtype=BF16)
    tileops.moe_unpermute(*_dispatch(x, logits)[:3])  # load the kernels before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        expert_out, weights, row_index, ids, offsets, source = _dispatch(x, logits)
        out = tileops.moe_unpermute(expert_out, weights, row_index)
    logits.copy_(randn(64, 128, dtype=BF16))
    x.copy_(randn(64, 2048, dtype=BF16))
    graph.replay()
    check(weights, ids, logits, None, dict(top_k=8))
    check_permute((expert_out, offsets, row_index, source), x, ids, 128)
    assert_close(out, x.float())  # renormalized weights sum to 1


def _dispatch(x, logits):
    weights, ids = tileops.moe_route(logits, 8)
    permuted, offsets, row_index, source = tileops.moe_permute(x, ids, 128)
    return permuted, weights, row_index, ids, offsets, source


@pytest.mark.smoke
def test_token_counts_do_not_recompile():
    route = MoeRouteFwdOp(top_k=8, scoring="sigmoid", n_group=8, topk_group=4,
                          routed_scaling_factor=2.5)
    permute, combine = MoePermuteFwdOp(num_experts=256), MoeUnpermuteFwdOp()
    bias = randn(256, dtype=FP32, std=0.05)

    def step(tokens):
        x, logits = randn(tokens, 512, dtype=BF16), randn(tokens, 256, dtype=FP32)
        weights, ids = route(logits, bias)
        permuted, offsets, row_index, source = permute(x, ids)
        check_permute((permuted, offsets, row_index, source), x, ids, 256)
        combine(permuted, weights, row_index)

    step(4)
    before = Kernel.compile_count
    for tokens in (1, 2, 3, 63, 64, 65, 511, 4097):
        step(tokens)
    assert Kernel.compile_count == before


@pytest.mark.full
def test_every_gather_and_combine_config_of_the_space():
    from tileops.kernels.moe import MoeCombineKernel, MoeGatherKernel

    x, ids = randn(333, 7168, dtype=BF16), ref.zipf_ids(333, 64, 8, skew=1.0).cuda()
    weights = torch.rand(333, 8, device="cuda")
    for config in MoeGatherKernel(dtype="bfloat16", hidden=7168, top_k=8).config_space("all"):
        op = MoePermuteFwdOp(num_experts=64)
        op.pin_config(config, x, ids)
        check_permute(op(x, ids), x, ids, 64)
    permuted, _, row_index, _ = tileops.moe_permute(x, ids, 64)
    want = ref.combine_reference(permuted, weights, row_index).to(FP32)
    for config in MoeCombineKernel(dtype="bfloat16", hidden=7168, top_k=8).config_space("all"):
        op = MoeUnpermuteFwdOp()
        op.pin_config(config, permuted, weights, row_index)
        assert_close(op(permuted, weights, row_index), want)


# -- grouped GEMM -----------------------------------------------------------------------
def grouped_reference(a, b, offsets):
    """float32 per-expert loop; rows past offsets[-1] stay zero."""
    out = torch.zeros(a.shape[0], b.shape[1], dtype=FP32, device=a.device)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        out[start:end] = a[start:end].float() @ b[e].float().t()
        start = end
    return out


def group_offsets(sizes):
    return torch.tensor(sizes, device="cuda").cumsum(0).to(I32)


# (group sizes, N, K, dtype)
GROUPED_CASES = [
    ([0, 1, 200, 0, 129, 64, 1000, 3], 256, 512, BF16),  # empty groups, tails, a lone row
    ([4] * 128, 3072, 4096, BF16),                        # qwen3-235b decode: 64-row tiles
    (None, 1536, 2048, FP16),                             # qwen3-30b-a3b, zipf sizes
    ([513] * 8, 1000, 4096, BF16),                        # N not a multiple of the tile
]


@pytest.mark.parametrize("sizes, n, k, dtype", GROUPED_CASES)
def test_grouped_gemm(sizes, n, k, dtype):
    if sizes is None:
        ids = ref.zipf_ids(4096, 128, 8, skew=1.2)
        sizes = torch.bincount(ids.flatten().long(), minlength=128).tolist()
    offsets = group_offsets(sizes)
    m = int(offsets[-1]) + 17  # rows past the last group are not written
    a = randn(m, k, dtype=dtype)
    b = randn(len(sizes), n, k, dtype=dtype, std=k ** -0.5)
    out = tileops.grouped_gemm(a, b, offsets)
    end = int(offsets[-1])
    assert_close(out[:end], grouped_reference(a, b, offsets)[:end])


@pytest.mark.parametrize("tile_store", [False, True])
def test_grouped_gemm_n_group_panels(tile_store):
    """n_group panels of 3 n tiles over 8 (the last panel partial): every tile of every
    group computed once, nothing past the groups written (the panel is the grid's slowest
    dimension; see GroupedGemmConfig.n_group)."""
    import dataclasses

    from tileops.kernels.moe.grouped_gemm import GroupedGemmKernel

    sizes, n, k = [0, 1, 200, 0, 129, 64, 1000, 3, 256], 1000, 512
    offsets = group_offsets(sizes)
    end = int(offsets[-1])
    a = randn(end + 17, k, dtype=BF16)
    b = randn(len(sizes), n, k, dtype=BF16, std=k ** -0.5)
    kernel = GroupedGemmKernel(dtype="bfloat16", n=n, k=k, n_experts=len(sizes))
    config = dataclasses.replace(kernel.heuristic_config("prefill", "sm_90a"), block_n=128,
                                 stages=4, n_group=3, persistent=False, tile_store=tile_store)
    kernel.use(config, "prefill")
    out = poison(torch.empty(a.shape[0], n, dtype=BF16, device="cuda"))
    kernel(a.shape[0], a, b, offsets, out)
    assert_close(out[:end], grouped_reference(a, b, offsets)[:end], what=str(config))
    assert torch.isnan(out[end:].float()).all(), "rows past the groups written"


@pytest.mark.parametrize("silu_mul", [False, True])
def test_grouped_gemm_every_prefill_config(silu_mul):
    """Every prefill config of the space (the TMA-stored whole tiles of `tile_store`
    included) on groups ending mid-tile, empty groups, a lone row and N off the tile; the
    rows past the last group keep their NaN (never written). Kernel-level launches into an
    output poisoned explicitly: an op's own allocation lands where the allocator's best fit
    puts it (the old poison_allocator missed stale free tails, which a first version of
    this test read as rows written)."""
    from tileops.kernels.moe.grouped_gemm import GroupedGemmKernel

    sizes, n, k = [0, 1, 200, 0, 129, 64, 1000, 3, 256], 1000, 512
    offsets = group_offsets(sizes)
    end = int(offsets[-1])
    a = randn(end + 17, k, dtype=BF16)
    b = randn(len(sizes), 2 * n if silu_mul else n, k, dtype=BF16, std=k ** -0.5)
    key = dict(dtype="bfloat16", n=n, k=k, n_experts=len(sizes))
    if silu_mul:
        key["silu_mul"] = True
        product = grouped_reference(a, b, offsets)
        want = torch.nn.functional.silu(product[:, :n]) * product[:, n:]
    else:
        want = grouped_reference(a, b, offsets)
    configs = GroupedGemmKernel(**key).config_space("prefill")
    assert any(c.tile_store for c in configs)
    for config in configs:
        kernel = GroupedGemmKernel(**key)
        kernel.use(config, "prefill")
        out = poison(torch.empty(a.shape[0], n, dtype=BF16, device="cuda"))
        kernel(a.shape[0], a, b, offsets, out)
        assert_close(out[:end], want[:end], what=str(config))
        assert torch.isnan(out[end:].float()).all(), f"{config}: rows past the groups written"


def test_grouped_gemm_matches_torch_grouped_mm():
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    offsets = group_offsets([128, 0, 384, 256] * 8)
    a, b = randn(int(offsets[-1]), 2048, dtype=BF16), randn(32, 768, 2048, dtype=BF16, std=0.02)
    want = torch._grouped_mm(a, b.transpose(-2, -1), offs=offsets)
    assert_close(tileops.grouped_gemm(a, b, offsets), want.float())


def test_grouped_gemm_cuda_graph_and_no_recompile():
    b = randn(16, 512, 1024, dtype=BF16, std=1 / 32)
    a = randn(1024, 1024, dtype=BF16)
    offsets = group_offsets([64] * 16)
    tileops.grouped_gemm(a, b, offsets)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tileops.grouped_gemm(a, b, offsets)
    offsets.copy_(group_offsets([0, 300, 0, 0, 200, 100, 0, 0, 0, 50, 50, 50, 50, 100, 100, 24]))
    graph.replay()  # new group sizes, same launch: the sizes are read on the device
    assert_close(out, grouped_reference(a, b, offsets))
    tileops.grouped_gemm(randn(4097, 1024, dtype=BF16), b, offsets)  # the prefill bucket
    before = Kernel.compile_count
    for m in (1, 7, 100, 1025, 4097):
        a = randn(m, 1024, dtype=BF16)
        offsets = group_offsets([m // 16] * 15 + [m - 15 * (m // 16)])
        assert_close(tileops.grouped_gemm(a, b, offsets), grouped_reference(a, b, offsets))
    assert Kernel.compile_count == before
