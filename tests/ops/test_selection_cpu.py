"""Selection ops (argmax, topk) without a GPU: op-layer errors, meta outputs, torch.compile
tracing, rooflines against hand counts, the kernels' split plans, and (marker `compile`) the
generated CUDA of the programs the heuristics pick."""


import pytest
import torch

import tileops
from tileops import (
    ArgmaxFwdOp,
    TileOpsError,
    TileOpsTypeError,
    TileOpsUnsupportedError,
    TileOpsValueError,
    TopkFwdOp,
)
from tileops.kernels.selection import K_CAPS, MAX_K, ArgmaxKernel, TopkKernel, k_cap_of
from tileops.kernels.selection.order import index_bits, varying_bits
from tileops.kernels.selection.topk import MAX_MERGE_SLOTS_PER_THREAD
from tileops.manifest import load_workloads
from tileops.prebuild import build_plan

from ..helpers import meta, ptxas_report

VOCABS = (32000, 128256, 151936, 256000, 129280)


@pytest.mark.smoke
@pytest.mark.parametrize("call, err, pattern", [
    (lambda: tileops.argmax(meta(4, 64, dtype=torch.float64)), TileOpsTypeError,
     r"ArgmaxFwdOp: argument 'input': expected dtype float16 \| bfloat16 \| float32, "
     r"got torch.float64"),
    (lambda: tileops.topk(meta(4, 64, dtype=torch.int32), 5), TileOpsTypeError,
     r"TopkFwdOp: argument 'input': expected dtype float16 \| bfloat16 \| float32"),
    (lambda: tileops.argmax(meta(4, 64), 0), TileOpsValueError,
     r"ArgmaxFwdOp: argument 'input': expected shapes satisfying `dim is None or dim == -1 "
     r"or dim == input.ndim - 1`, got input.shape=\(4, 64\), dim=0"),
    (lambda: tileops.topk(meta(4, 64, 3), 2, dim=1), TileOpsValueError,
     r"TopkFwdOp: argument 'input': expected shapes satisfying `dim == -1 or "
     r"dim == input.ndim - 1`"),
    (lambda: tileops.topk(meta(4, 64), 65), TileOpsValueError,
     r"TopkFwdOp: argument 'input': expected shapes satisfying `0 <= k <= input.shape\[-1\]`"
     r", got input.shape=\(4, 64\), k=65"),
    (lambda: tileops.topk(meta(4, 1000), MAX_K + 1), TileOpsUnsupportedError,
     r"TopkFwdOp: argument 'k': expected k <= 128 \(the top-k for sampling\), got 129"),
    (lambda: tileops.topk(meta(4, 1000), 5, largest=False), TileOpsUnsupportedError,
     r"TopkFwdOp: argument 'largest': expected True"),
    (lambda: TopkFwdOp(k=5.0), TileOpsTypeError,
     r"TopkFwdOp: argument 'k': expected int, got 5.0"),
    (lambda: tileops.argmax(meta(4, 0), -1), TileOpsValueError,
     r"ArgmaxFwdOp: argument 'input': expected shapes satisfying `input.shape\[-1\] > 0`"),
    (lambda: tileops.argmax(meta(())), TileOpsValueError,
     r"ArgmaxFwdOp: argument 'input': expected shapes satisfying `input.ndim >= 1`"),
    (lambda: tileops.argmax(torch.randn(4, 64)), TileOpsValueError,
     r"ArgmaxFwdOp: argument 'input': expected a CUDA tensor"),
    (lambda: ArgmaxFwdOp(keepdim=1), TileOpsTypeError,
     r"ArgmaxFwdOp: argument 'keepdim': expected bool, got 1"),
])
def test_bad_input(call, err, pattern):
    with pytest.raises(err, match=pattern):
        call()
    assert issubclass(err, TileOpsError)


@pytest.mark.smoke
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_meta_outputs_match_torch(dtype):
    """Shapes and dtypes as torch gives them, for every dim / keepdim form supported."""
    x = meta(2, 3, 1000, dtype=dtype)
    ref = torch.empty(2, 3, 1000, dtype=dtype, device="meta")
    for kwargs in ({}, {"dim": -1}, {"dim": 2, "keepdim": True}, {"dim": None, "keepdim": True},
                   {"dim": -1, "keepdim": True}):
        ours, want = tileops.argmax(x, **kwargs), torch.argmax(ref, **kwargs)
        assert ours.shape == want.shape and ours.dtype == want.dtype == torch.int64, kwargs
    for k in (0, 1, 50, 128):
        values, indices = tileops.topk(x, k)
        want = torch.topk(ref, k)
        assert values.shape == want.values.shape and values.dtype == dtype
        assert indices.shape == want.indices.shape and indices.dtype == torch.int64


@pytest.mark.smoke
@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_traces_through_the_custom_ops(dynamic):
    @torch.compile(fullgraph=True, backend="aot_eager", dynamic=dynamic)
    def sample(logits):
        values, indices = tileops.topk(logits * 2, 50)
        return tileops.argmax(logits, -1), values.float().sum(-1), indices

    greedy, total, indices = sample(meta(8, 32000))
    assert greedy.shape == (8,) and total.shape == (8,) and indices.shape == (8, 50)


@pytest.mark.smoke
def test_custom_op_schemas():
    assert str(torch.ops.tileops.argmax_fwd.default._schema) == (
        "tileops::argmax_fwd(Tensor input, int? dim, bool keepdim) -> Tensor")
    assert str(torch.ops.tileops.topk_fwd.default._schema) == (
        "tileops::topk_fwd(Tensor input, int k, int dim, bool largest, bool sorted) "
        "-> (Tensor, Tensor)")


@pytest.mark.smoke
def test_roofline_matches_hand_counts():
    for dtype, size in ((torch.bfloat16, 2), (torch.float32, 4)):
        x = meta(64, 128256, dtype=dtype)
        assert ArgmaxFwdOp(dim=-1).eval_roofline(x) == (64 * 128256,
                                                        64 * 128256 * size + 64 * 8)
        assert ArgmaxFwdOp().eval_roofline(x) == (64 * 128256, 64 * 128256 * size + 8)
        assert TopkFwdOp(k=50).eval_roofline(x) == (
            64 * 128256, 64 * 128256 * size + 64 * 50 * (size + 8))


@pytest.mark.smoke
def test_k_buckets_and_key_bits():
    assert [k_cap_of(k) for k in (1, 8, 9, 50, 64, 65, 128)] == [8, 8, 64, 64, 64, 128, 128]
    assert K_CAPS[-1] == MAX_K
    assert index_bits(128256) == 17 and index_bits(2) == 1 and index_bits(1) == 1
    # bf16 / fp16: the 16 value bits on top; fp32: 32; then the index bits at the bottom
    assert varying_bits("bfloat16", 1000) == (0xFFFF << 48) | 0x3FF
    assert varying_bits("float32", 32000) == (0xFFFFFFFF << 32) | 0x7FFF


@pytest.mark.smoke
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_split_plans_fill_the_gpu_and_bound_the_merge(vocab, dtype):
    """Batch 1 spreads a row over enough CTAs for most of 132 SMs; pass 2 holds at most
    MAX_MERGE_SLOTS_PER_THREAD candidate keys per thread."""
    argmax = ArgmaxKernel(dtype=dtype, vocab=vocab)
    small = argmax.heuristic_config("small", "sm_90a")
    assert argmax.splits(small) * 1 >= min(60, vocab // 2048), (vocab, small)
    for k_cap in K_CAPS:
        kernel = TopkKernel(dtype=dtype, vocab=vocab, k_cap=k_cap)
        for bucket in ("small", "large"):
            config = kernel.heuristic_config(bucket, "sm_90a")
            slots = kernel.splits(config) * k_cap
            assert -(-slots // config.merge_threads) <= MAX_MERGE_SLOTS_PER_THREAD
            assert config.threads >= k_cap  # thread maxima can bound the k-th key
        assert kernel.splits(kernel.heuristic_config("small", "sm_90a")) >= \
            min(40, vocab // 4096) or k_cap == MAX_K
    assert argmax.bucket_of(16) == "small" and argmax.bucket_of(17) == "large"


@pytest.mark.smoke
def test_manifest_workloads_are_decode_shapes():
    for name in ("ArgmaxFwdOp", "TopkFwdOp"):
        workloads = load_workloads(name)
        assert {w["inputs"]["input"][1] for w in workloads} == set(VOCABS)
        assert {w["inputs"]["input"][0] for w in workloads} == {1, 8, 64, 256}
        for w in workloads:
            op = {"ArgmaxFwdOp": ArgmaxFwdOp, "TopkFwdOp": TopkFwdOp}[name]
            op(**op.spec.workload_params(w))  # every workload's params are accepted


PLAN = build_plan(["ArgmaxFwdOp", "TopkFwdOp"], tier="smoke")


@pytest.mark.smoke
def test_smoke_plan_covers_both_buckets_and_both_passes():
    kinds = {(item.kernel.name, item.bucket) for item in PLAN}
    assert kinds == {("argmax", "small"), ("argmax", "large"), ("topk", "small"),
                     ("topk", "large")}


# One dtype per smoke workload in `make test` (as tests/test_compile.py): a dtype changes
# the vector width, not the code path; the other dtypes run under `make test-full`.
FAST_PLAN = [i for i in PLAN if i.dtype == "bfloat16"]
OTHER_DTYPES = [i for i in PLAN if i.dtype != "bfloat16"]


def _check_loads_and_spills(item, tmp_path):
    compiled = item.kernel.compile(item.config, item.bucket)
    source = compiled[0].get_kernel_source()
    assert "uint4" in source or "float4" in source, source  # 16-byte logit loads
    if item.kernel.name == "argmax":
        # every smoke shape splits its rows, whose CTAs meet in the one launch
        assert len(compiled) == 1 and "AtomicAddRet" in source, source
    else:
        assert len(compiled) == 2  # top-k: pass 1 + merge
    for program in compiled:
        report = ptxas_report(program, tmp_path)
        assert "0 bytes spill stores" in report, report


@pytest.mark.compile
@pytest.mark.parametrize("item", FAST_PLAN, ids=[i.describe() for i in FAST_PLAN])
def test_smoke_programs_use_16_byte_loads_and_do_not_spill(item, tmp_path):
    _check_loads_and_spills(item, tmp_path)


@pytest.mark.compile
@pytest.mark.full
@pytest.mark.parametrize("item", OTHER_DTYPES, ids=[i.describe() for i in OTHER_DTYPES])
def test_other_dtypes_use_16_byte_loads_and_do_not_spill(item, tmp_path):
    _check_loads_and_spills(item, tmp_path)


@pytest.mark.compile
@pytest.mark.full
def test_widest_merge_does_not_spill(tmp_path):
    """fp32 Gemma-2 rows at batch 1 with k <= 128: the most candidate keys per thread."""
    kernel = TopkKernel(dtype="float32", vocab=256000, k_cap=MAX_K)
    compiled = kernel.compile(kernel.heuristic_config("small", "sm_90a"), "small")
    report = ptxas_report(compiled[1], tmp_path)
    assert "0 bytes spill stores" in report, report
