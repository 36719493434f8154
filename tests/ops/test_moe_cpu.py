"""MoE ops without a GPU: op-layer errors, meta outputs, the roofline against a hand count,
and (marker `compile`) the generated CUDA of every kernel run on the CPU: each with one host
thread per CUDA thread (tests/cuda_emulation_threads.py: warp shuffles, shared memory and
barriers run as on the GPU)."""

import pytest
import torch

import tileops
from tileops import (
    MoePermuteFwdOp,
    MoeRouteFwdOp,
    MoeUnpermuteFwdOp,
    TileOpsTypeError,
    TileOpsValueError,
)
from tileops.kernels.moe import (
    CHUNK,
    MoeCombineKernel,
    MoeGatherKernel,
    MoeRouteKernel,
    MoeSortKernel,
)

from ..helpers import meta
from . import moe_reference as ref

I32 = torch.int32


# -- op layer ----------------------------------------------------------------------------
@pytest.mark.smoke
@pytest.mark.parametrize("params, logits, bias, pattern", [
    (dict(top_k=9), (4, 8), None, r"MoeRouteFwdOp: argument 'router_logits': expected "
                                   r"shapes satisfying `1 <= top_k <= min\(E, 32\)`"),
    (dict(top_k=2, scoring="relu"), (4, 8), None, r"argument 'scoring': expected a value "
                                                   r"satisfying `scoring in"),
    (dict(top_k=8, n_group=6, topk_group=2), (4, 256), None,
     r"argument 'router_logits': expected shapes satisfying `n_group is None or "
     r"E % n_group == 0`"),
    (dict(top_k=8, n_group=8), (4, 256), None, r"`\(n_group is None\) == \(topk_group is "
                                               r"None\)`"),
    (dict(top_k=8, n_group=8, topk_group=9), (4, 256), None, r"1 <= topk_group <= n_group"),
    (dict(top_k=9, n_group=32, topk_group=1), (4, 256), (256,),
     r"`topk_group is None or top_k <= topk_group \* \(E // n_group\)`"),
    (dict(top_k=8), (4, 512), None, r"`1 <= E <= 384`"),
    (dict(top_k=8, scoring="sigmoid"), (4, 256), (128,),
     r"argument 'correction_bias': expected shapes satisfying `correction_bias is None or "
     r"tuple\(correction_bias.shape\) == \(E,\)`"),
    (dict(top_k=2, routed_scaling_factor=0.0), (4, 8), None, r"routed_scaling_factor > 0"),
])
def test_route_errors_name_the_argument(params, logits, bias, pattern):
    bias = None if bias is None else meta(*bias, dtype=torch.float32)
    with pytest.raises(TileOpsValueError, match=pattern):
        MoeRouteFwdOp(**params)(meta(*logits, dtype=torch.float32), bias)


@pytest.mark.smoke
def test_bad_dtypes():
    with pytest.raises(TileOpsTypeError, match="MoeRouteFwdOp: argument 'correction_bias'"):
        MoeRouteFwdOp(top_k=8, scoring="sigmoid")(meta(4, 256), meta(256))
    with pytest.raises(TileOpsTypeError, match="MoePermuteFwdOp: argument 'topk_ids': "
                                               "expected dtype int32"):
        MoePermuteFwdOp(num_experts=8)(meta(4, 64), meta(4, 2, dtype=torch.int64))
    with pytest.raises(TileOpsTypeError, match="MoeUnpermuteFwdOp: argument 'topk_weights'"):
        MoeUnpermuteFwdOp()(meta(8, 64), meta(4, 2), meta(4, 2, dtype=I32))
    with pytest.raises(TileOpsTypeError, match="MoeRouteFwdOp: argument 'top_k'"):
        MoeRouteFwdOp(top_k=2.0)


@pytest.mark.smoke
def test_permute_and_unpermute_shape_errors():
    with pytest.raises(TileOpsValueError, match="MoePermuteFwdOp: argument 'topk_ids'"):
        MoePermuteFwdOp(num_experts=8)(meta(4, 64), meta(5, 2, dtype=I32))
    with pytest.raises(TileOpsValueError, match="argument 'num_experts'"):
        MoePermuteFwdOp(num_experts=0)(meta(4, 64), meta(4, 2, dtype=I32))
    with pytest.raises(TileOpsValueError, match="num_experts <= expert_map.shape"):
        MoePermuteFwdOp(num_experts=16)(meta(4, 64), meta(4, 2, dtype=I32), meta(8, dtype=I32))
    with pytest.raises(TileOpsValueError, match="MoeUnpermuteFwdOp: argument 'row_index'"):
        MoeUnpermuteFwdOp()(meta(8, 64), meta(4, 2, dtype=torch.float32), meta(4, 3, dtype=I32))


@pytest.mark.smoke
def test_meta_outputs():
    w, ids = tileops.moe_route(meta(64, 256, dtype=torch.float32), 8, "sigmoid", True, 8, 4,
                               meta(256, dtype=torch.float32), 2.5)
    assert w.shape == ids.shape == (64, 8) and w.dtype == torch.float32 and ids.dtype == I32
    permuted, offsets, row_index, source = tileops.moe_permute(
        meta(16, 2048), meta(16, 8, dtype=I32), 8, meta(128, dtype=I32))
    assert permuted.shape == (128, 2048) and permuted.dtype == torch.bfloat16
    assert offsets.shape == (9,) and row_index.shape == (16, 8) and source.shape == (128,)
    out = tileops.moe_unpermute(meta(128, 2048, dtype=torch.float16),
                                meta(16, 8, dtype=torch.float32), row_index)
    assert out.shape == (16, 2048) and out.dtype == torch.float16


@pytest.mark.smoke
def test_rooflines_by_hand():
    op = MoeUnpermuteFwdOp()
    flops, nbytes = op.eval_roofline(meta(32768, 2048), meta(4096, 8, dtype=torch.float32),
                                     meta(4096, 8, dtype=I32))
    assert flops == 2 * 4096 * 8 * 2048
    assert nbytes == 4096 * 8 * 2048 * 2 + 4096 * 8 * (4 + 4) + 4096 * 2048 * 2
    op = MoePermuteFwdOp(num_experts=8)
    _, nbytes = op.eval_roofline(meta(256, 7168), meta(256, 8, dtype=I32), meta(256, dtype=I32))
    assert nbytes == 256 * 7168 * 2 * 9 + 256 * 8 * 12 + 9 * 4 + 256 * 4
    _, nbytes = MoeRouteFwdOp(top_k=8).eval_roofline(meta(64, 256, dtype=torch.float32))
    assert nbytes == 64 * 256 * 4 + 64 * 8 * 8


def test_kernels_for_follow_the_params():
    op = MoeRouteFwdOp(top_k=8, scoring="sigmoid", n_group=1, topk_group=1)
    ns = op.check((meta(4, 384, dtype=torch.float32), meta(384, dtype=torch.float32)))
    [(name, key, size)] = op.kernels_for(ns)
    assert name == "moe_route" and size == 4
    assert key["n_group"] == 1 and key["has_bias"] and key["n_experts"] == 384


# -- the generated CUDA on the CPU ------------------------------------------------------
def _route_on_cpu(logits, bias, **params):
    from ..cuda_emulation_threads import run

    op = MoeRouteFwdOp(**params)
    kernel = MoeRouteKernel(**op._key(logits.dtype, logits.shape[1], bias is not None))
    config = kernel.heuristic_config("all", "sm_90a")
    compiled = kernel.compile(config, "all")[0]
    tokens = logits.shape[0]
    weights = torch.full((tokens, op.top_k), float("nan"))
    ids = torch.full((tokens, op.top_k), -7, dtype=I32)
    tensors = dict(logits=logits, weights=weights, ids=ids)
    if bias is not None:
        tensors["bias"] = bias
    run(compiled, -(-tokens // config.warps), config.warps * 32, tensors,
        dict(tokens=tokens, scale=op.routed_scaling_factor))
    return weights, ids


ROUTES = {  # name -> (tokens, experts, dtype, bias std, params)
    "deepseek-v3": (11, 256, torch.float32, 0.5,
                    dict(top_k=8, scoring="sigmoid", n_group=8, topk_group=4,
                         routed_scaling_factor=2.5)),
    "mixtral": (37, 8, torch.bfloat16, None, dict(top_k=2)),
    "qwen2-moe, no renormalization": (9, 60, torch.float32, None,
                                      dict(top_k=4, renormalize=False)),
    "kimi-k2": (5, 384, torch.bfloat16, 0.5,
                dict(top_k=8, scoring="sigmoid", n_group=1, topk_group=1,
                     routed_scaling_factor=2.827)),
    "grouped softmax, no bias": (6, 64, torch.float16, None,
                                 dict(top_k=6, n_group=8, topk_group=3)),
    "top_k 32 of 33 experts": (3, 33, torch.float32, None, dict(top_k=32)),
}


@pytest.mark.compile
@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.smoke]
                                               if n == "deepseek-v3" else [pytest.mark.full])
                                  for n in ROUTES])
def test_route_program_on_the_cpu(name):
    """The routing kernel, warp shuffles included, against the float64 reference: ids on
    every row not decided by a near-tie, weights at the kernel's ids, sorted, distinct."""
    tokens, experts, dtype, bias_std, params = ROUTES[name]
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(tokens, experts, generator=gen) * 2).to(dtype)
    bias = None if bias_std is None else torch.randn(experts, generator=gen) * bias_std
    weights, ids = _route_on_cpu(logits, bias, **params)
    checked = ref.check_route(weights, ids, logits, params["top_k"],
                              params.get("scoring", "softmax"),
                              params.get("renormalize", True), params.get("n_group"),
                              params.get("topk_group"), bias,
                              params.get("routed_scaling_factor", 1.0))
    assert checked >= tokens - 1  # near-ties are rare in random data


@pytest.mark.compile
@pytest.mark.full
def test_route_ties_go_to_the_lower_index():
    """Logits with many equal values: the kernel's ids are exactly the stable order's."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randint(-2, 3, (7, 64), generator=gen).to(torch.float16)
    weights, ids = _route_on_cpu(logits, None, top_k=8)
    _, want, _ = ref.route_reference(logits, 8)
    assert torch.equal(ids.long(), want)


def _sort_on_cpu(ids, num_experts, expert_map=None):
    from ..cuda_emulation_threads import run

    tokens, top_k = ids.shape
    op = MoePermuteFwdOp(num_experts=num_experts)
    sort_key, _ = op._keys(torch.empty(tokens, 8), top_k, expert_map)
    kernel = MoeSortKernel(**sort_key)
    programs = kernel.compile(kernel.heuristic_config("all", "sm_90a"), "all")
    n_chunks = -(-tokens * top_k // CHUNK)
    t = dict(ids=ids, row_index=torch.full((tokens, top_k), -7, dtype=I32),
             counts=torch.full((num_experts + 1, n_chunks), -7, dtype=I32),
             totals=torch.full((num_experts + 1,), -7, dtype=I32),
             offsets=torch.full((num_experts + 1,), -7, dtype=I32),
             source=torch.full((tokens * top_k,), -7, dtype=I32))
    if expert_map is not None:
        t["expert_map"] = expert_map
    sizes = dict(tokens=tokens, n_chunks=n_chunks)
    run(programs[0], n_chunks, CHUNK, t, sizes)
    run(programs[1], num_experts + 1, CHUNK, t, sizes)
    run(programs[2], n_chunks, CHUNK, t, sizes)
    return t["offsets"], t["row_index"], t["source"]


@pytest.mark.compile
@pytest.mark.smoke
def test_sort_programs_on_the_cpu():
    """The counting sort over 5 chunks: skewed ids, two empty experts, ids out of range
    dropped; offsets, row_index and source equal a stable sort's."""
    gen = torch.Generator().manual_seed(3)
    ids = ref.zipf_ids(300, 30, 8, generator=gen)  # experts 30 and 31 get nothing
    ids[5, 2], ids[77, 0], ids[299, 7] = -1, 32, 1000
    _, offsets, row_index, source = ref.permute_reference(torch.empty(300, 1), ids, 32)
    got = _sort_on_cpu(ids, 32)
    assert torch.equal(got[0].long(), offsets)
    assert torch.equal(got[1].long(), row_index)
    assert torch.equal(got[2].long(), source)


@pytest.mark.compile
@pytest.mark.full
def test_sort_programs_with_an_expert_map_on_the_cpu():
    """Expert parallelism: 8 local experts of 64; a map entry past the local count and
    ids outside the map are dropped too."""
    gen = torch.Generator().manual_seed(4)
    ids = torch.stack([torch.randperm(64, generator=gen)[:6] for _ in range(200)]).to(I32)
    ids[0, 0] = 70
    expert_map = torch.full((64,), -1, dtype=I32)
    expert_map[16:24] = torch.arange(8, dtype=I32)
    expert_map[40] = 9
    _, offsets, row_index, source = ref.permute_reference(torch.empty(200, 1), ids, 8,
                                                          expert_map)
    got = _sort_on_cpu(ids, 8, expert_map)
    assert torch.equal(got[0].long(), offsets)
    assert torch.equal(got[1].long(), row_index)
    assert torch.equal(got[2].long(), source)


@pytest.mark.compile
@pytest.mark.smoke
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gather_and_combine_programs_on_the_cpu(dtype):
    """The gather puts every local slot's token row at its row (dropped slots write
    nothing); the combine sums k rows weighted in fp32 (-1 rows skipped, a token with no
    local expert gets zeros)."""
    from ..cuda_emulation_threads import run  # its prelude has TileLang's bf16/fp16 packing

    gen = torch.Generator().manual_seed(5)
    tokens, top_k, hidden, n_experts = 13, 4, 200, 6
    ids = torch.randint(0, n_experts + 2, (tokens, top_k), generator=gen, dtype=I32)
    ids[3] = n_experts + 1  # token 3: every expert elsewhere
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    want_rows, offsets, row_index, _ = ref.permute_reference(x, ids, n_experts)
    name = str(dtype).removeprefix("torch.")
    gather = MoeGatherKernel(dtype=name, hidden=hidden, top_k=top_k)
    config = gather.heuristic_config("all", "sm_90a")
    permuted = torch.full((tokens * top_k, hidden), float("nan")).to(dtype)
    run(gather.compile(config, "all")[0], -(-tokens * top_k // config.block_rows),
        config.threads, dict(x=x, row_index=row_index.to(I32), permuted=permuted),
        dict(tokens=tokens, rows=tokens * top_k))
    n_local = int(offsets[-1])
    assert torch.equal(permuted[:n_local], want_rows)
    assert permuted[n_local:].isnan().all()

    combine = MoeCombineKernel(dtype=name, hidden=hidden, top_k=top_k)
    config = combine.heuristic_config("all", "sm_90a")
    expert_out = torch.randn(tokens * top_k, hidden, generator=gen).to(dtype)
    weights = torch.rand(tokens, top_k, generator=gen)
    out = torch.full((tokens, hidden), float("nan")).to(dtype)
    run(combine.compile(config, "all")[0], -(-tokens // config.block_rows), config.threads,
        dict(expert_out=expert_out, weights=weights, row_index=row_index.to(I32), out=out),
        dict(tokens=tokens, rows=tokens * top_k))
    want = ref.combine_reference(expert_out, weights, row_index)
    torch.testing.assert_close(out.double(), want.to(dtype).double(), atol=2e-2, rtol=2e-2)
    assert torch.equal(out[3], torch.zeros(hidden, dtype=dtype))


# -- grouped GEMM -----------------------------------------------------------------------
@pytest.mark.smoke
def test_grouped_gemm_errors_and_meta():
    from tileops import GroupedGemmFwdOp

    op = GroupedGemmFwdOp()
    offsets = meta(8, dtype=I32)
    with pytest.raises(TileOpsValueError, match="GroupedGemmFwdOp: argument 'b': expected "
                                                "shapes satisfying `Kb == K`"):
        op(meta(64, 256), meta(8, 128, 512), offsets)
    with pytest.raises(TileOpsValueError, match="argument 'offsets': expected shapes "
                                                "satisfying `Eo == E`"):
        op(meta(64, 256), meta(8, 128, 256), meta(7, dtype=I32))
    with pytest.raises(TileOpsTypeError, match="argument 'offsets': expected dtype int32"):
        op(meta(64, 256), meta(8, 128, 256), meta(8, dtype=torch.int64))
    with pytest.raises(TileOpsTypeError, match="argument 'b'"):
        op(meta(64, 256), meta(8, 128, 256, dtype=torch.float16), offsets)
    with pytest.raises(TileOpsValueError, match="`K % 8 == 0`"):
        op(meta(64, 100), meta(8, 128, 100), offsets)
    out = tileops.grouped_gemm(meta(64, 256), meta(8, 128, 256), offsets)
    assert out.shape == (64, 128) and out.dtype == torch.bfloat16
    flops, nbytes = op.eval_roofline(meta(64, 256), meta(8, 128, 256), offsets)
    assert flops == 2 * 64 * 128 * 256
    assert nbytes == (64 * 256 + 8 * 128 * 256 + 64 * 128) * 2 + 8 * 4


def _grouped_gemm_programs():
    from tileops.kernels.moe import GroupedGemmKernel

    kernel = GroupedGemmKernel(dtype="bfloat16", n=1536, k=2048, n_experts=128)
    config = kernel.heuristic_config("all", "sm_90a")
    return config, kernel.compile(config, "all")


@pytest.mark.compile
@pytest.mark.smoke
def test_grouped_gemm_program_keeps_tma_and_wgmma():
    """The GEMM of the smoke workload: TMA loads by a producer warp group, wgmma, and the
    tile table read on the device (no host-side sizes)."""
    _, (table, gemm) = _grouped_gemm_programs()
    source = gemm.get_kernel_source()
    assert "tma_load" in source and "wgmma" in source, source[:2000]
    assert "table[" in source and "offsets[" in source
    # one block-wide barrier (after the mbarriers' init): none at the top of each tile, so
    # the producer loads the next tile under this one's epilogue
    assert source.count("__syncthreads()") == 1, source


@pytest.mark.compile
@pytest.mark.full
@pytest.mark.parametrize("bucket", ["decode", "prefill"])
def test_every_grouped_gemm_config_keeps_the_fast_path(bucket, tmp_path):
    """Each config of the space: TMA, wgmma, no spills and no serialized wgmma (ptxas)."""
    from tileops.kernels.moe import GroupedGemmKernel

    from ..helpers import assert_no_spills_or_serialized_wgmma

    kernel = GroupedGemmKernel(dtype="bfloat16", n=3072, k=4096, n_experts=128)
    for config in kernel.config_space(bucket):
        gemm = kernel.compile(config, bucket)[1]
        source = gemm.get_kernel_source()
        assert "tma_load" in source and "wgmma" in source, config
        assert_no_spills_or_serialized_wgmma(gemm, tmp_path)


def test_grouped_gemm_buckets_by_rows_per_expert():
    from tileops.kernels.moe import GroupedGemmKernel

    kernel = GroupedGemmKernel(dtype="bfloat16", n=3072, k=4096, n_experts=128)
    assert kernel.bucket_of(512) == kernel.bucket_of(8192) == "decode"  # <= 64 rows each
    assert kernel.bucket_of(8193) == "prefill"
    assert kernel.heuristic_config("decode", "sm_90a").block_m == 64


@pytest.mark.compile
@pytest.mark.smoke
def test_grouped_gemm_tile_table_on_the_cpu():
    """The tile table (one CTA: a scan over experts, shuffles and shared memory) on the CPU:
    each expert's m tiles in order, empty experts none, -1 past the last tile."""
    from ..cuda_emulation_threads import run

    config, (table_program, _) = _grouped_gemm_programs()
    gen = torch.Generator().manual_seed(6)
    sizes = ref.zipf_ids(1, 128, 128, skew=0.0, generator=gen)[0].long() * 7 % 300
    sizes[5] = sizes[77] = 0  # empty experts
    offsets = sizes.cumsum(0).to(I32)
    m_total = int(offsets[-1]) + 50  # rows past the last group
    m_tiles = -(-m_total // config.block_m) + 128
    table = torch.full((m_tiles,), -7, dtype=I32)
    run(table_program, 1, 512, dict(offsets=offsets, table=table), dict(m_tiles=m_tiles))
    want = [e * 65536 + i for e in range(128)
            for i in range(-(-int(sizes[e]) // config.block_m))]
    want += [-1] * (m_tiles - len(want))
    assert table.tolist() == want


@pytest.mark.smoke
@pytest.mark.parametrize("scoring, renormalize, scale", [
    ("softmax", True, 1.0), ("softmax", False, 1.0), ("sigmoid", True, 2.5),
    ("sigmoid", False, 2.827)])
def test_route_backward_formula(scoring, renormalize, scale):
    """moe_route's backward (run on CPU tensors: it is torch math) against autograd of the
    float64 weight formula at the same ids."""
    from types import SimpleNamespace

    from tileops.ops.moe import _route_backward

    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(37, 64, generator=gen) * 2
    _, ids, _ = ref.route_reference(logits, 6, scoring)
    grad_w = torch.randn(37, 6, generator=gen)
    ctx = SimpleNamespace(scoring=scoring, renormalize=renormalize, scale=scale,
                          saved_tensors=(logits, ids.to(I32)))
    got = _route_backward(ctx, grad_w, None)[0]
    x = logits.double().requires_grad_()
    ref.route_weights(x, ids, scoring, renormalize, scale).backward(grad_w.double())
    torch.testing.assert_close(got.double(), x.grad, atol=1e-6, rtol=1e-5)


# -- grouped GEMM backward, gate-up with SiLU, unpermute backward, fused_moe -------------
@pytest.mark.smoke
def test_training_ops_errors_meta_and_rooflines():
    from tileops import GroupedGemmBwdOp, GroupedGemmSiluAndMulFwdOp, MoeUnpermuteBwdOp

    offsets = meta(8, dtype=I32)
    bwd = GroupedGemmBwdOp()
    with pytest.raises(TileOpsValueError, match="GroupedGemmBwdOp: argument 'a': expected "
                                                "shapes satisfying `Mg == M`"):
        bwd(meta(64, 128), meta(63, 256), meta(8, 128, 256), offsets)
    with pytest.raises(TileOpsValueError, match="argument 'b': expected shapes satisfying "
                                                "`Nb == N`"):
        bwd(meta(64, 128), meta(64, 256), meta(8, 64, 256), offsets)
    grad_a, grad_b = bwd(meta(64, 128), meta(64, 256), meta(8, 128, 256), offsets)
    assert grad_a.shape == (64, 256) and grad_b.shape == (8, 128, 256)
    flops, nbytes = bwd.eval_roofline(meta(64, 128), meta(64, 256), meta(8, 128, 256), offsets)
    assert flops == 4 * 64 * 128 * 256
    assert nbytes == (64 * 128 + 2 * 64 * 256 + 2 * 8 * 128 * 256) * 2 + 8 * 4

    silu = GroupedGemmSiluAndMulFwdOp()
    with pytest.raises(TileOpsValueError, match="GroupedGemmSiluAndMulFwdOp: argument "
                                                "'w_gate_up': expected shapes satisfying "
                                                "`F2 % 2 == 0`"):
        silu(meta(64, 256), meta(8, 129, 256), offsets)
    out = tileops.grouped_gemm_silu_and_mul(meta(64, 256), meta(8, 512, 256), offsets)
    assert out.shape == (64, 256) and out.dtype == torch.bfloat16
    flops, nbytes = silu.eval_roofline(meta(64, 256), meta(8, 512, 256), offsets)
    assert flops == 2 * 64 * 512 * 256
    assert nbytes == (64 * 256 + 8 * 512 * 256 + 64 * 256) * 2 + 8 * 4

    unperm = MoeUnpermuteBwdOp(grad_weights=False)
    g_rows, g_w = unperm(meta(16, 64), meta(128, 64), meta(16, 8, dtype=torch.float32),
                         meta(16, 8, dtype=I32))
    assert g_rows.shape == (128, 64) and g_w.shape == (16, 8) and g_w.dtype == torch.float32
    with pytest.raises(TileOpsValueError, match="MoeUnpermuteBwdOp: argument 'row_index'"):
        unperm(meta(16, 64), meta(128, 64), meta(16, 8, dtype=torch.float32),
               meta(16, 4, dtype=I32))


@pytest.mark.smoke
def test_fused_moe_errors_and_meta():
    from tileops import FusedMoeFwdOp

    x, w1, w2 = meta(16, 256), meta(8, 512, 256), meta(8, 256, 256)
    logits = meta(16, 8, dtype=torch.float32)
    weights, ids = meta(16, 2, dtype=torch.float32), meta(16, 2, dtype=I32)
    with pytest.raises(TileOpsValueError, match=r"FusedMoeFwdOp: .*\(router_logits is None\) "
                                                r"!= \(topk_ids is None\)"):
        FusedMoeFwdOp(top_k=2)(x, w1, w2, logits, weights, ids)
    with pytest.raises(TileOpsValueError, match=r"\(router_logits is None\) != "):
        FusedMoeFwdOp(top_k=2)(x, w1, w2)
    with pytest.raises(TileOpsValueError, match="top_k is not None and 1 <= top_k"):
        FusedMoeFwdOp()(x, w1, w2, logits)
    with pytest.raises(TileOpsValueError, match="argument 'w_down': expected shapes "
                                                "satisfying `Hd == H`"):
        FusedMoeFwdOp(top_k=2)(x, w1, meta(8, 128, 256), logits)
    with pytest.raises(TileOpsValueError, match="F2 == 2 \\* F"):
        FusedMoeFwdOp(top_k=2)(x, meta(8, 384, 256), w2, logits)
    with pytest.raises(TileOpsValueError, match="top_k == topk_ids.shape"):
        FusedMoeFwdOp(top_k=4)(x, w1, w2, None, weights, ids)
    assert tileops.fused_moe(x, w1, w2, logits, top_k=2).shape == (16, 256)
    out = tileops.fused_moe(x, w1, w2, topk_weights=weights, topk_ids=ids)
    assert out.shape == (16, 256) and out.dtype == torch.bfloat16
    flops, nbytes = FusedMoeFwdOp(top_k=2).eval_roofline(x, w1, w2, logits)
    assert flops == 6 * 16 * 2 * 256 * 256
    assert nbytes == (2 * 16 * 256 + 8 * 3 * 256 * 256) * 2 + 16 * 8 * 4


def test_fused_moe_kernels_are_its_pieces():
    """The compile plan of a layer: routing, the sort and gather, the gate-up GEMM with the
    SiLU epilogue, the down GEMM and the combine."""
    from tileops import FusedMoeFwdOp

    op = FusedMoeFwdOp(top_k=8, scoring="sigmoid", n_group=8, topk_group=4)
    ns = op.check((meta(64, 7168), meta(256, 4096, 7168), meta(256, 7168, 2048),
                   meta(64, 256, dtype=torch.float32), None, None,
                   meta(256, dtype=torch.float32)))
    plan = op.kernels_for(ns)
    assert [name for name, _, _ in plan] == ["moe_route", "moe_sort", "moe_gather",
                                             "grouped_gemm", "grouped_gemm", "moe_combine"]
    gate_up, down = plan[3][1], plan[4][1]
    assert gate_up == {"dtype": "bfloat16", "n": 2048, "k": 7168, "n_experts": 256,
                       "silu_mul": True}
    assert down == {"dtype": "bfloat16", "n": 7168, "k": 2048, "n_experts": 256}
    assert plan[3][2] == 512  # rows: tokens x top_k


def _training_programs():
    from tileops.kernels.moe import GroupedGemmKernel, GroupedGemmWeightGradKernel

    weight_grad = GroupedGemmWeightGradKernel(dtype="bfloat16", n=1536, k=2048, n_experts=128)
    silu = GroupedGemmKernel(dtype="bfloat16", n=768, k=2048, n_experts=128, silu_mul=True)
    grad_input = GroupedGemmKernel(dtype="bfloat16", n=2048, k=1536, n_experts=128,
                                   trans_b=False)
    return weight_grad, silu, grad_input


@pytest.mark.compile
@pytest.mark.smoke
def test_training_programs_keep_tma_and_wgmma():
    """The weight gradient (TMA pipeline over whole row tiles, then the partial tile loaded
    guarded by the consumers), the gate-up GEMM with SiLU (two accumulators) and the input
    gradient (b untransposed, then the rows no expert owns zeroed)."""
    weight_grad, silu, grad_input = _training_programs()
    _, program = weight_grad.compile(weight_grad.heuristic_config("all", "sm_90a"), "all")
    source = program.get_kernel_source()
    assert "tma_load" in source and "wgmma" in source and "fence_proxy_async" in source
    assert source.count("wgmma_ss<") == 2  # the pipelined tiles and the partial tile
    assert "tma_store" in source  # the output tile leaves through shared memory
    _, gemm = silu.compile(silu.heuristic_config("prefill", "sm_90a"), "prefill")
    source = gemm.get_kernel_source()
    assert "tma_load" in source and source.count("wgmma_ss<") == 2 and "expf" in source
    _, gemm, zero_tail = grad_input.compile(grad_input.heuristic_config("prefill", "sm_90a"),
                                            "prefill")
    assert "tma_load" in gemm.get_kernel_source() and "wgmma" in gemm.get_kernel_source()
    assert "offsets[127]" in zero_tail.get_kernel_source()


@pytest.mark.compile
@pytest.mark.smoke
def test_weight_gradient_walks_experts_in_one_cta():
    """experts_per_cta 4: one loop over the CTA's experts around the TMA pipeline, the
    partial tile and the TMA store (the producer's ring runs across experts); a count that
    does not divide the experts guards the last slots."""
    from tileops.kernels.moe import GroupedGemmWeightGradKernel
    from tileops.kernels.moe.grouped_gemm import GroupedGemmConfig

    for experts, loop, guard in ((128, "i < 4;", None), (5, "i < 2;", "((i * 3) + ")):
        kernel = GroupedGemmWeightGradKernel(dtype="bfloat16", n=1536, k=2048,
                                             n_experts=experts)
        per_cta = 4 if experts == 128 else 2
        _, program = kernel.compile(GroupedGemmConfig(experts_per_cta=per_cta, stages=2), "all")
        source = program.get_kernel_source()
        assert "tma_load" in source and source.count("wgmma_ss<") == 2
        assert "tma_store" in source and loop in source
        assert guard is None or guard + "((int)blockIdx.z)) < 5" in source


@pytest.mark.compile
@pytest.mark.full
def test_every_training_program_config_keeps_the_fast_path(tmp_path):
    """Each config of the weight-gradient and SiLU spaces: TMA, wgmma, no spills and no
    serialized wgmma (ptxas)."""
    from ..helpers import assert_no_spills_or_serialized_wgmma

    weight_grad, silu, grad_input = _training_programs()
    for config in weight_grad.config_space("all"):
        _, program = weight_grad.compile(config, "all")
        assert "tma_load" in program.get_kernel_source(), config
        assert_no_spills_or_serialized_wgmma(program, tmp_path)
    for kernel in (silu, grad_input):
        for bucket in ("decode", "prefill"):
            for config in kernel.config_space(bucket):
                gemm = kernel.compile(config, bucket)[1]
                source = gemm.get_kernel_source()
                assert "tma_load" in source and "wgmma" in source, config
                assert_no_spills_or_serialized_wgmma(gemm, tmp_path)


@pytest.mark.compile
@pytest.mark.smoke
def test_zero_tail_expert_order_and_weighted_gather_on_the_cpu():
    """The rows past offsets[E-1] become zeros, the others stay; the weight gradient's
    expert order is by rows, descending, ties to the lower expert; the weighted gather puts
    w[t, k] * x[t] at row_index[t, k] (fp32 product, rounded once); the combine's weight
    gradient is each slot's dot product (0 for a dropped slot)."""
    import tilelang

    from tileops.kernels.moe.grouped_gemm import expert_order_program, zero_tail_program

    from ..cuda_emulation_threads import run

    target = {"kind": "cuda", "arch": "sm_90a"}
    program = tilelang.compile(zero_tail_program(200, 6, "bfloat16"), target=target)
    x = torch.randn(23, 200).to(torch.bfloat16)
    offsets = torch.tensor([0, 3, 3, 9, 14, 17], dtype=I32)
    want = x.clone()
    want[17:] = 0
    run(program, -(-23 // 4), 128, dict(offsets=offsets, x=x), dict(m_total=23))
    assert torch.equal(x, want)

    sizes = torch.tensor([5, 0, 300, 5, 0, 17] + [3] * 58 + [300, 1])
    order = torch.full((66,), -7, dtype=I32)
    run(tilelang.compile(expert_order_program(66), target=target), 1, 512,
        dict(offsets=sizes.cumsum(0).to(I32), order=order), {})
    want = sorted(range(66), key=lambda e: (-int(sizes[e]), e))
    assert order.tolist() == want

    gen = torch.Generator().manual_seed(7)
    tokens, top_k, hidden = 9, 4, 200
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    weights = torch.rand(tokens, top_k, generator=gen)
    row_index = torch.randperm(tokens * top_k, generator=gen).view(tokens, top_k).to(I32)
    unnamed = int(row_index[2, 1])  # no slot names this row once its slot is dropped
    row_index[2, 1] = -1
    gather = MoeGatherKernel(dtype="bfloat16", hidden=hidden, top_k=top_k, weighted=True)
    config = gather.heuristic_config("all", "sm_90a")
    out = torch.full((tokens * top_k, hidden), float("nan")).to(torch.bfloat16)
    run(gather.compile(config, "all")[0], -(-tokens * top_k // config.block_rows),
        config.threads, dict(x=x, weights=weights, row_index=row_index, permuted=out),
        dict(tokens=tokens, rows=tokens * top_k))
    for t in range(tokens):
        for k in range(top_k):
            r = int(row_index[t, k])
            if r >= 0:
                assert torch.equal(out[r], (x[t].float() * weights[t, k]).to(torch.bfloat16))
    assert out[unnamed].isnan().all()

    from tileops.kernels.moe import MoeCombineWeightGradKernel

    dot = MoeCombineWeightGradKernel(dtype="bfloat16", hidden=hidden, top_k=top_k)
    config = dot.heuristic_config("all", "sm_90a")
    grad_out = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    grad_w = torch.full((tokens, top_k), float("nan"))
    run(dot.compile(config, "all")[0], tokens, config.threads,
        dict(grad_out=grad_out, expert_out=out.nan_to_num(0.0), row_index=row_index,
             grad_w=grad_w), dict(tokens=tokens, rows=tokens * top_k))
    rows = out.nan_to_num(0.0).double()[row_index.long().clamp(min=0)]
    want = torch.where(row_index >= 0, (rows * grad_out.double()[:, None]).sum(-1), 0.0)
    torch.testing.assert_close(grad_w.double(), want, atol=1e-4, rtol=1e-5)


@pytest.mark.smoke
@pytest.mark.parametrize("m_tiles, n_tiles, group", [(72, 112, 16), (5, 7, 3), (9, 16, 16),
                                                     (3, 40, 16), (1, 1, 16)])
def test_grouped_raster_visits_every_tile_once(m_tiles, n_tiles, group):
    """`raster` is a bijection of the tile grid; with n_group 16 on Mixtral's gate-up (72
    m tiles in the bound, 112 n tiles) a wave of 132 CTAs touches at most 16 n tiles (the
    weight tiles it reads), where the plain order touches all 112 (slot = tile otherwise)."""
    from tileops.kernels.moe.grouped_gemm import raster

    tiles = [raster(i, m_tiles, n_tiles, group, minimum=min)
             for i in range(m_tiles * n_tiles)]
    assert sorted(tiles) == list(range(m_tiles * n_tiles))
    if group >= n_tiles:
        assert tiles == list(range(m_tiles * n_tiles))
    wave = tiles[:min(132, m_tiles * group)]  # (within the first group)
    assert len({t % n_tiles for t in wave}) <= min(group, n_tiles)
    assert [raster(i, m_tiles, n_tiles, 0, minimum=min) for i in range(10)] == list(range(10))


@pytest.mark.compile
@pytest.mark.full
@pytest.mark.parametrize("persistent", [False, True])
def test_grouped_raster_keeps_the_fast_path_and_changes_nothing_below_its_width(persistent):
    """n_group configs keep TMA and wgmma; where N has no more tiles than the group
    (Qwen3-30B-A3B's gate-up: 6), the program is the plain order's, line for line."""
    import dataclasses

    from tileops.kernels.moe import GroupedGemmKernel

    wide = GroupedGemmKernel(dtype="bfloat16", n=28672, k=4096, n_experts=8)
    config = dataclasses.replace(wide.heuristic_config("prefill", "sm_90a"), n_group=16,
                                 persistent=persistent, tile_store=not persistent)
    source = wide.compile(config, "prefill")[1].get_kernel_source()
    assert "tma_load" in source and "wgmma" in source
    narrow = GroupedGemmKernel(dtype="bfloat16", n=1536, k=2048, n_experts=128)
    plain = narrow.heuristic_config("prefill", "sm_90a")
    assert narrow.program(dataclasses.replace(plain, n_group=16), "prefill")[1].script() == \
        narrow.program(plain, "prefill")[1].script()
