"""tileops.linear_group: one input by two or three weights. GPU: every output against
float32 F.linear per weight (one launch up to 64 tokens and past them, with and without
biases, weights off the tile and of one tile, both dtypes; one GEMM a weight where the
smallest weight fills a wave or N is not a multiple of 8), poisoned outputs, every
token-tile config, gradients, torch.compile and CUDA-graph capture. CPU: meta shapes,
refusals, the route, the generated code."""

import pytest
import torch
import torch.nn.functional as F

import tileops
from tileops.errors import TileOpsError
from tileops.ops.linear_group import GROUP_ROWS, LinearGroupFwdOp

from ..helpers import assert_close, poison_allocator, randn

BF16, FP16 = torch.bfloat16, torch.float16
# (input shape, out features of each weight, biases, dtype): each a kernel path or a bound
CASES = [
    ((8, 4096), (4096, 1024, 1024), False, BF16),   # Llama-3.1-8B q/k/v, one launch
    ((16, 3584), (3584, 512, 512), True, FP16),     # Qwen2.5-7B q/k/v with biases
    ((1, 2048), (5632, 5632), False, BF16),         # gate / up at one token
    ((2, 3, 512), (200, 72, 1000), True, BF16),     # leading dims; weights off the 64 tile
    ((5, 256), (64, 8), False, FP16),               # one tile, a weight of 8 rows
    ((17, 1024), (1024, 256, 256), True, BF16),     # one launch, bucket m32
    ((50, 2048), (2048, 512, 512), True, FP16),     # one launch, bucket m64
    ((700, 1024), (1024, 256, 256), True, BF16),    # token tiles, a partial last row tile
    ((3, 200, 512), (1000, 72, 200), False, FP16),  # token tiles off the column tiles
    ((65, 256), (64, 8), True, BF16),               # token tiles, weights under one tile
    ((100, 512), (1000, 36), False, BF16),          # N = 36: one GEMM a weight
    ((131 * 128 + 1, 256), (256, 256), False, BF16),  # each weight a wave: a GEMM a weight
]


def _ids(cases):
    return [f"{'x'.join(map(str, s))}-N{'+'.join(map(str, ns))}-{'bias' if b else 'nobias'}"
            f"-{str(d)[6:]}" for s, ns, b, d in cases]


def _inputs(shape, ns, with_bias, dtype):
    k = shape[-1]
    x = randn(*shape, dtype=dtype)
    ws = [randn(n, k, dtype=dtype, std=k ** -0.5) for n in ns]
    bs = [randn(n, dtype=dtype) for n in ns] if with_bias else None
    return x, ws, bs


@pytest.mark.gpu
@pytest.mark.parametrize("shape, ns, with_bias, dtype", CASES, ids=_ids(CASES))
def test_forward_matches_float32(shape, ns, with_bias, dtype):
    x, ws, bs = _inputs(shape, ns, with_bias, dtype)
    poison_allocator()  # an output element no CTA writes stays NaN
    outs = tileops.linear_group(x, ws, bs)
    assert len(outs) == len(ns)
    for g, (y, w) in enumerate(zip(outs, ws, strict=True)):
        ref = F.linear(x.float(), w.float(), None if bs is None else bs[g].float())
        assert y.dtype == dtype and y.shape == ref.shape
        assert_close(y, ref, scale=2.0, what=f"linear_group output {g}")


@pytest.mark.gpu
def test_one_launch_is_the_grouped_kernel():
    """Up to GROUP_ROWS tokens and past them the op launches the grouped kernel (its key
    names every weight): the weight-streaming and the token-tile buckets."""
    from tileops.kernels.gemm.weight_group import GemmGroupKernel

    op = LinearGroupFwdOp()
    for rows in (16, GROUP_ROWS, GROUP_ROWS + 1, 1000):
        x, ws, _ = _inputs((rows, 512), (512, 128, 128), False, BF16)
        op(x, *ws)
    kernels = [k for k in op._call_memo.values() if isinstance(k, GemmGroupKernel)]
    assert [k.key["ns"] for k in kernels] == [(512, 128, 128)]
    assert set(kernels[0]._by_bucket) == {"m16", "m64", "m128", "m1024"}


@pytest.mark.gpu
def test_every_token_tile_config_into_poisoned_output():
    """Each config of the token-tile space (128 x 256 and 128 x 128 tiles, square and
    whole-row warp groups) at 300 rows (a partial row tile) on weights off the column
    tiles, with biases, launched on the kernel into NaN-poisoned outputs."""
    from tileops.kernels.gemm.weight_group import GemmGroupKernel

    ns = (1000, 256, 200)
    x, ws, bs = _inputs((300, 512), ns, True, BF16)
    kernel = GemmGroupKernel(dtype="bfloat16", ns=ns, k=512, has_bias=True)
    configs = kernel.config_space("m512")
    assert len({(c.block_n, c.full_row) for c in configs}) == 4
    for config in configs:
        kernel.use(config, "m512")
        outs = [torch.full((300, n), float("nan"), dtype=BF16, device="cuda") for n in ns]
        kernel(300, x, *ws, *bs, *outs)
        for g, y in enumerate(outs):
            want = F.linear(x.float(), ws[g].float(), bs[g].float())
            assert_close(y, want, scale=2.0, what=f"{config}, output {g}")


@pytest.mark.gpu
@pytest.mark.parametrize("shape, ns, with_bias, dtype", CASES[1:4], ids=_ids(CASES[1:4]))
def test_gradients_match_float32(shape, ns, with_bias, dtype):
    x, ws, bs = _inputs(shape, ns, with_bias, dtype)
    leaves = [x, *ws, *(bs or [])]
    ours = [t.clone().requires_grad_() for t in leaves]
    refs = [t.float().requires_grad_() for t in leaves]
    dys = [randn(*shape[:-1], n, dtype=dtype) for n in ns]
    k = len(ns)
    got = tileops.linear_group(ours[0], ours[1:1 + k], ours[1 + k:] or None)
    torch.autograd.backward(got, dys)
    for g in range(k):
        F.linear(refs[0], refs[1 + g], refs[1 + k + g] if bs else None).backward(
            dys[g].float())
    tokens = x.numel() // shape[-1]
    for i, (a, b) in enumerate(zip(ours, refs, strict=True)):
        terms = sum(ns) if i == 0 else tokens
        assert a.grad.dtype == dtype
        assert_close(a.grad, b.grad, scale=max(1.0, terms ** 0.5 / 8), what=f"grad {i}")


@pytest.mark.gpu
def test_torch_compile_and_cuda_graph():
    """Traced whole (fullgraph) and replayed from a CUDA graph after the input changed."""
    x, ws, bs = _inputs((8, 1024), (1024, 256, 256), True, BF16)
    fn = torch.compile(lambda x: tileops.linear_group(x, ws, bs), fullgraph=True)
    for g, y in enumerate(fn(x)):
        assert_close(y, F.linear(x.float(), ws[g].float(), bs[g].float()), scale=2.0,
                     what=f"compiled output {g}")
    static = x.clone()
    tileops.linear_group(static, ws, bs)  # (loads the module before capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = tileops.linear_group(static, ws, bs)
    static.copy_(randn(8, 1024, dtype=BF16))
    graph.replay()
    for g, y in enumerate(outs):
        assert_close(y, F.linear(static.float(), ws[g].float(), bs[g].float()), scale=2.0,
                     what=f"graph replay output {g}")


@pytest.mark.gpu
def test_strided_and_misaligned_inputs():
    """A transposed input and a weight at a 2-byte offset are read through aligned copies."""
    x = randn(512, 8, dtype=BF16).t()
    w0 = randn(256 * 512 + 1, dtype=BF16)[1:].view(256, 512)
    w1 = randn(128, 512, dtype=BF16)
    y0, y1 = tileops.linear_group(x, [w0, w1])
    assert_close(y0, F.linear(x.float(), w0.float()), scale=2.0, what="output 0")
    assert_close(y1, F.linear(x.float(), w1.float()), scale=2.0, what="output 1")


@pytest.mark.gpu
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rows, ns", [(12, (192, 64)),     # the grouped kernel's plan
                                      (100, (192, 60))],   # N = 60: each weight's plan
                         ids=["grouped", "per-weight"])
def test_repeated_signatures_through_the_planned_launch(with_bias, rows, ns):
    """A seen signature runs the op's planned launch; inputs of that signature it does not
    read as they are (a strided input, a weight or bias at a 2-byte offset) go to forward.
    Outputs land in NaN-poisoned blocks."""
    op = LinearGroupFwdOp()
    n1 = ns[1]
    ws = [randn(n, 256, dtype=BF16, std=256 ** -0.5) for n in ns]
    bs = [randn(n, dtype=BF16) for n in ns] if with_bias else [None, None]
    odd_w = randn(n1 * 256 + 1, dtype=BF16)[1:].view(n1, 256)
    odd_b = randn(n1 + 1, dtype=BF16)[1:] if with_bias else None
    cases = [(randn(rows, 256, dtype=BF16), ws, bs),
             (randn(rows, 256, dtype=BF16), ws, bs),                  # the plan's launch
             (randn(256, rows, dtype=BF16).t(), ws, bs),              # strided input
             (randn(rows, 256, dtype=BF16), [ws[0], odd_w], bs),      # unaligned weight
             (randn(rows, 256, dtype=BF16), ws, [bs[0], odd_b]),      # unaligned bias
             (randn(rows, 256, dtype=BF16), ws, bs)]
    for i, (x, weights, biases) in enumerate(cases):
        poison_allocator()
        outs = op(x, weights[0], weights[1], None, biases[0], biases[1], None)
        assert outs[2].numel() == 0
        for g in range(2):
            want = F.linear(x.float(), weights[g].float(),
                            None if biases[g] is None else biases[g].float())
            assert_close(outs[g], want, scale=2.0, what=f"case {i}, output {g}")
    assert op._validated[next(iter(op._validated))] is not None  # a plan, not forward


def test_meta_shapes_and_the_custom_op():
    x = torch.empty(2, 4, 512, dtype=BF16, device="meta")
    ws = [torch.empty(n, 512, dtype=BF16, device="meta") for n in (512, 128, 64)]
    assert [y.shape for y in tileops.linear_group(x, ws)] == [(2, 4, 512), (2, 4, 128),
                                                             (2, 4, 64)]
    outs = torch.ops.tileops.linear_group_fwd(x, *ws[:2], None, None, None, None)
    assert [y.shape for y in outs] == [(2, 4, 512), (2, 4, 128), (0,)]


@pytest.mark.parametrize("weights, biases, match", [
    (1, None, "argument 'weights': expected a list or tuple of 2 or 3 tensors, got 1 items"),
    (4, None, "argument 'weights'"),
    (3, [None, None], "argument 'biases'"),
    (3, "first", "argument 'bias"),          # biases all or none
    (2, "odd", "argument 'weight1'"),        # in-features differ
])
def test_refusals_name_the_argument(weights, biases, match):
    x = torch.empty(8, 256, dtype=BF16, device="meta")
    ws = [torch.empty(64, 256, dtype=BF16, device="meta") for _ in range(weights)]
    if biases == "first":
        biases = [torch.empty(64, dtype=BF16, device="meta"), None, None]
    elif biases == "odd":
        ws[1], biases = torch.empty(64, 128, dtype=BF16, device="meta"), None
    with pytest.raises(TileOpsError, match=match):
        tileops.linear_group(x, ws, biases)


def test_plan_takes_2d_inputs_only():
    """Inputs with leading dims get no planned launch (they go to forward; found on the
    GPU: a 3-D input once broke the plan). The 2-D cases, which bind CUDA kernels (the
    grouped one, or each weight's linear), run in the GPU tests."""
    op = LinearGroupFwdOp()
    ws = [torch.empty(n, 256, dtype=BF16, device="meta") for n in (256, 64)]
    for shape in ((2, 3, 256), (1, 1, 256), (2, 132 * 64, 256)):
        assert op.plan(torch.empty(*shape, dtype=BF16, device="meta"), *ws) is None, shape


def test_kernels_for_routes_by_token_count():
    """The compile sweep builds what forward launches: one grouped program up to
    GROUP_ROWS tokens, and past them while the smallest weight alone would not fill a wave
    and every N is a multiple of 8 (the outputs' rows are stored by TMA); else one GEMM a
    weight."""
    op = LinearGroupFwdOp()
    for n1, rows, want in ((64, GROUP_ROWS, ["gemm_group"]),
                           (64, GROUP_ROWS + 1, ["gemm_group"]),
                           (60, GROUP_ROWS, ["gemm_group"]),
                           (60, GROUP_ROWS + 1, ["gemm", "gemm"]),
                           # the smallest weight's 128 x 256 tiles: 131, then 132 (a wave)
                           (256, 131 * 128, ["gemm_group"]),
                           (256, 131 * 128 + 1, ["gemm", "gemm"])):
        ws = [torch.empty(n, 256, dtype=BF16, device="meta") for n in (256, n1)]
        ns = op.check([torch.empty(rows, 256, dtype=BF16, device="meta"), *ws])
        assert [d for d, _, _ in op.kernels_for(ns)] == want, (n1, rows)


@pytest.mark.compile
def test_grouped_program_streams_every_weight_by_tma():
    """The generated CUDA (sm_90a, no GPU needed) loads each weight from its own TMA
    descriptor under the tile's branch, and multiplies with wgmma."""
    import re

    from tileops.kernels.gemm.weight_group import GemmGroupKernel

    kernel = GemmGroupKernel(dtype="bfloat16", ns=(1024, 256, 200), k=512, has_bias=True)
    source = kernel.compile(kernel.heuristic_config("m16", "sm_90a"), "m16")[0]
    source = source.get_kernel_source()
    assert sorted(set(re.findall(r"tma_load\((b\d)_desc", source))) == ["b0", "b1", "b2"]
    assert "wgmma" in source


@pytest.mark.compile
def test_token_tile_program_loads_and_stores_every_weight_by_tma(tmp_path):
    """The token-tile form (sm_90a, no GPU needed): each weight loaded from its own TMA
    descriptor, each output stored through its own, wgmma, no spills or serialized
    wgmma, and every config of its space within a CTA's shared memory (compile refuses
    the others)."""
    import re

    from tileops.kernels.gemm.weight_group import GemmGroupKernel

    from ..helpers import assert_no_spills_or_serialized_wgmma

    kernel = GemmGroupKernel(dtype="bfloat16", ns=(1024, 256, 200), k=512, has_bias=True)
    for config in kernel.config_space("m512")[:2]:
        assert not config.weight_rows, config
        program = kernel.compile(config, "m512")[0]
        source = program.get_kernel_source()
        assert sorted(set(re.findall(r"tma_load\((b\d)_desc", source))) == ["b0", "b1", "b2"]
        assert sorted(set(re.findall(r"tma_store\((d\d)_desc", source))) == [
            "d0", "d1", "d2"], config
        assert "wgmma" in source
    assert_no_spills_or_serialized_wgmma(program, tmp_path)
