"""Compile-only: every kernel builds for sm_90a on the smoke workloads, on the fast paths."""

import dataclasses
import re

import pytest

from tileops.kernels.attention import (
    AttentionBwdKernel,
    AttentionFwdKernel,
    AttentionVarlenFwdKernel,
)
from tileops.kernels.attention.attention_bwd import tail_launch_order
from tileops.kernels.attention.attention_fwd import SHORT_KEYS
from tileops.kernels.attention.mask import INT_OPS
from tileops.kernels.gemm import GemmKernel
from tileops.kernels.normalization import RMSNormKernel
from tileops.prebuild import build_plan

from .helpers import assert_no_spills_or_serialized_wgmma

pytestmark = pytest.mark.compile

# Every distinct program the smoke workloads build, in every dtype (`full`), and the CI set:
# one dtype per workload, since the dtype changes no code path of a kernel.
PLAN = build_plan(tier="smoke")
FIRST_DTYPE = {}
for _item in PLAN:
    FIRST_DTYPE.setdefault((_item.op_name, _item.label), _item.dtype)
SMOKE_PLAN = [i for i in PLAN if FIRST_DTYPE[(i.op_name, i.label)] == i.dtype]


def backward_kernel(head_dim: int) -> AttentionBwdKernel:
    """The Llama-3.1-8B-shaped causal backward (32 query heads, 8 KV heads), bf16."""
    return AttentionBwdKernel(dtype="bfloat16", heads=32, kv_heads=8, head_dim=head_dim,
                              window_left=-1, window_right=0, softcap=0.0)


def default_and_lockstep(kernel: AttentionBwdKernel):
    """The backward default and its twin with the consumer warpgroups in lockstep (no
    ds_handoff, so no dq_bulk) and three Q/dO stages: the loop shape the older choices were
    measured in."""
    default = kernel.heuristic_config("all", "sm_90a")
    return default, dataclasses.replace(default, stages=3, ds_handoff=False, dq_bulk=False,
                                        tail_ctas=0)


def check_fast_path(item, compiled, tmp_path) -> None:
    """The program the op would run uses the Hopper fast path and spills nothing."""
    source = compiled[0].get_kernel_source()
    if isinstance(item.kernel, GemmKernel):
        # TileLang silently falls back to mma.sync / cp.async; the fast path must be there.
        assert "wgmma" in source and "tma_load" in source, item.describe()
    if isinstance(item.kernel, AttentionFwdKernel):
        # QK^T from shared memory, PV with P in registers, K/V through TMA, producer warps.
        for needle in ("wgmma_ss", "wgmma_rs", "tma_load", "warpgroup_reg_alloc"):
            assert needle in source, (needle, item.describe())
        assert_no_spills_or_serialized_wgmma(compiled[0], tmp_path)
    if isinstance(item.kernel, AttentionBwdKernel):
        main = compiled[1]  # [0] is the delta = rowsum(o*do) pass
        for needle in ("wgmma_ss", "wgmma_rs", "tma_load"):
            assert needle in main.get_kernel_source(), (needle, item.describe())
        assert_no_spills_or_serialized_wgmma(main, tmp_path)


@pytest.mark.smoke
@pytest.mark.parametrize("item", SMOKE_PLAN, ids=[i.describe() for i in SMOKE_PLAN])
def test_smoke_workloads_compile(item, tmp_path):
    check_fast_path(item, item.kernel.compile(item.config, item.bucket), tmp_path)


@pytest.mark.full
@pytest.mark.parametrize("item", PLAN, ids=[i.describe() for i in PLAN])
def test_smoke_workloads_compile_in_every_dtype(item, tmp_path):
    check_fast_path(item, item.kernel.compile(item.config, item.bucket), tmp_path)


@pytest.mark.smoke
def test_odd_k_still_uses_wgmma():
    kernel = GemmKernel(dtype="float16", n=3000, k=777, trans_a=False, trans_b=True)
    compiled = kernel.compile(kernel.heuristic_config("large", "sm_90a"), "large")
    assert "wgmma" in compiled[0].get_kernel_source()


@pytest.mark.smoke
@pytest.mark.parametrize("fields", [
    {"full_row": True},
    {"full_row": True, "async_mma": True},
    {"full_row": True, "async_mma": True, "persistent": True},
    {"full_row": True, "async_mma": True, "cluster_m": 2, "raster": 0},
], ids=["full-row", "async", "persistent", "cluster"])
def test_gemm_pipeline_forms_compile(fields, tmp_path):
    """Whole-row warp groups issue one m64 x 128 wgmma a K slice; the hand-written pipeline
    (and its persistent walk) keeps one K step in flight, loads by TMA, spills nothing and
    leaves ptxas no reason to serialize its wgmmas."""
    from tileops.kernels.gemm import GemmConfig

    kernel = GemmKernel(dtype="bfloat16", n=3000, k=4192, trans_a=False, trans_b=True)
    compiled = kernel.compile(GemmConfig(**{**GemmConfig(128, 128, 64, 4, 256, 1, 8).__dict__,
                                            **fields}), "m4096")
    source = compiled[0].get_kernel_source()
    assert "kFloat32, 64, 128, 16, " in source and "tma_load" in source
    if fields.get("async_mma"):
        assert "wait_wgmma<1>" in source
    if fields.get("cluster_m"):
        assert "tma_load_multicast" in source and "cluster_sync" in source
    assert_no_spills_or_serialized_wgmma(compiled[0], tmp_path)


@pytest.mark.smoke
def test_rms_norm_uses_16_byte_accesses():
    kernel = RMSNormKernel(dtype="bfloat16", n=4096, has_weight=True)
    compiled = kernel.compile(kernel.heuristic_config("all", "sm_90a"), "all")
    assert "uint4" in compiled[0].get_kernel_source()


@pytest.mark.smoke
@pytest.mark.parametrize("hidden", [24, 199])
def test_rms_norm_padded_path_compiles(hidden):
    """Hidden sizes whose 16-byte vectors cannot split over the threads take the padded path."""
    kernel = RMSNormKernel(dtype="float16", n=hidden, has_weight=True)
    config = kernel.heuristic_config("all", "sm_90a")
    assert (config.block_rows, config.threads) == (1, 128)
    assert "rms_norm_kernel" in kernel.compile(config, "all")[0].get_kernel_source()


def norm_forward_kernel(kind: str, n: int, dtype: str = "bfloat16"):
    from tileops.kernels.normalization import FusedAddRMSNormKernel, LayerNormKernel

    return {"rms": lambda: RMSNormKernel(dtype=dtype, n=n, has_weight=True),
            "layer": lambda: LayerNormKernel(dtype=dtype, n=n, has_weight=True, has_bias=True),
            "fused_add": lambda: FusedAddRMSNormKernel(dtype=dtype, n=n)}[kind]()


def norm_backward_kernel(kind: str, n: int, dtype: str = "bfloat16"):
    from tileops.kernels.normalization import (
        FusedAddRMSNormBwdKernel,
        LayerNormBwdKernel,
        RMSNormBwdKernel,
    )

    return {"rms": lambda: RMSNormBwdKernel(dtype=dtype, n=n, has_weight=True),
            "layer": lambda: LayerNormBwdKernel(dtype=dtype, n=n, has_weight=True,
                                                has_bias=True),
            "fused_add": lambda: FusedAddRMSNormBwdKernel(dtype=dtype, n=n)}[kind]()


def assert_lane_map_source(compiled, tmp_path, loads: int) -> None:
    """16-byte loads only (the row, weight and bias vectors), no scalar bf16/fp16 accesses
    of global memory, two barriers at most (one per row sum), nothing spilled."""
    source = compiled.get_kernel_source()
    assert len(re.findall(r"= \*\(uint4\*\)\((?:x|w|b|residual) \+", source)) == loads, source
    assert not re.search(r"[^_]\b(?:x|w|b|residual)\[", source), source  # no scalar reads
    assert source.count("__syncthreads()") <= 2, source
    assert_no_spills_or_serialized_wgmma(compiled, tmp_path)


@pytest.mark.smoke
def test_layer_norm_forward_at_hidden_2560_reads_whole_16_byte_vectors(tmp_path):
    """Phi-2's 2560 columns: two rows a CTA, each two warps of five 16-byte vectors a thread
    (the lane map), where a power-of-two thread count gave 40 elements per thread. The
    prefill default is its persistent form with a shared ring: rows by cp.async."""
    import dataclasses

    kernel = norm_forward_kernel("layer", 2560)
    config = kernel.heuristic_config("all", "sm_90a")
    assert (config.block_rows, config.threads, config.lanes, config.stages) == (2, 128, True, 3)
    ring = kernel.compile(config, "all")[0]
    assert "cp_async" in ring.get_kernel_source()
    assert_no_spills_or_serialized_wgmma(ring, tmp_path)
    # the plain lane map: x, w and b two vectors each (unrolled by nvcc, not in the source)
    plain = dataclasses.replace(config, ctas=0, stages=0)
    assert plain == kernel.heuristic_config("few", "sm_90a")
    assert_lane_map_source(kernel.compile(plain, "all")[0], tmp_path, loads=3)


@pytest.mark.full
@pytest.mark.parametrize("kind, n, dtype", [("layer", 6144, "bfloat16"),
                                            ("layer", 1280, "float16"),
                                            ("rms", 13824, "bfloat16"),
                                            ("fused_add", 5120, "float16"),
                                            ("fused_add", 7168, "bfloat16"),
                                            ("rms", 2560, "bfloat16")])
def test_norm_forward_lane_defaults_read_16_byte_vectors(kind, n, dtype, tmp_path):
    kernel = norm_forward_kernel(kind, n, dtype)
    config = kernel.heuristic_config("few", "sm_90a")  # the plain lane map (no ring)
    assert config.lanes and not config.stages, config
    loads = {"layer": 3, "rms": 2, "fused_add": 3}[kind]
    assert_lane_map_source(kernel.compile(config, "all")[0], tmp_path, loads=loads)


@pytest.mark.full
@pytest.mark.parametrize("kind, n", [("layer", 2560), ("layer", 6144), ("fused_add", 5120),
                                     ("fused_add", 7168), ("rms", 13824)])
def test_norm_forward_lane_configs_of_the_space_compile_without_spills(kind, n, tmp_path):
    kernel = norm_forward_kernel(kind, n)
    for config in kernel.config_space("all"):
        if config.lanes:
            assert_no_spills_or_serialized_wgmma(kernel.compile(config, "all")[0], tmp_path)


@pytest.mark.parametrize("kind, n", [("layer", 1024), ("rms", 199)])
def test_norm_backward_reduces_a_threads_rows_in_one_all_reduce(kind, n):
    """Several rows per CTA (1024 columns, 4 rows staged; 199 padded, 20 rows split over
    thread groups): each row sum is one batched all-reduce over the thread's rows, not one
    per row (their barriers bound the kernel). The batch must divide what TileLang gives
    each thread, or this compile fails."""
    from tileops.kernels.normalization import LayerNormBwdKernel, RMSNormBwdKernel
    from tileops.kernels.normalization.rows import RowTile

    kernel = (LayerNormBwdKernel(dtype="bfloat16", n=n, has_weight=True, has_bias=True)
              if kind == "layer" else RMSNormBwdKernel(dtype="bfloat16", n=n, has_weight=True))
    config = kernel.heuristic_config("many", "sm_90a")
    assert RowTile(n, config.block_rows, config.threads).rows_per_thread > 1
    assert "run_batch" in kernel.compile(config, "many")[0].get_kernel_source()


@pytest.mark.parametrize("kind", ["rms", "layer", "fused_add"])
def test_norm_backward_default_compiles_at_1536_columns(kind):
    """Qwen2-1.5B's hidden 1536 (192 vectors, split evenly only by 64 threads at 48
    elements each) took a padded tile of two rows over 256 threads that TileLang cannot
    lower ("ReduceOp: batch=2 exceeds per-thread output element count"): every norm
    backward at that width failed. It now takes one row a CTA."""
    kernel = norm_backward_kernel(kind, 1536)
    for bucket in ("few", "many"):
        config = kernel.heuristic_config(bucket, "sm_90a")
        assert (config.block_rows, config.threads) == (1, 64), config
        kernel.compile(config, bucket)


@pytest.mark.full
@pytest.mark.parametrize("head_dim, pass_", [(80, "fwd"), (96, "fwd"), (96, "bwd")])
def test_attention_at_phi_head_dims_keeps_the_fast_path(head_dim, pass_, tmp_path):
    """Phi-2's 80 and Phi-3's 96: wgmma, TMA and no spills in every default program of the
    pass (the forward's short- and long-key buckets; the backward's main pass)."""
    from tileops.kernels.attention.attention_bwd import AttentionBwdKernel
    from tileops.kernels.attention.attention_fwd import AttentionFwdKernel

    cls = AttentionFwdKernel if pass_ == "fwd" else AttentionBwdKernel
    kernel = cls(dtype="bfloat16", heads=32, kv_heads=8, head_dim=head_dim, window_left=-1,
                 window_right=0, softcap=0.0)
    for bucket in ("short", "long") if pass_ == "fwd" else (kernel.bucket_of(4096),):
        compiled = kernel.compile(kernel.heuristic_config(bucket, "sm_90a"), bucket)
        main = compiled[0] if pass_ == "fwd" else compiled[1]
        source = main.get_kernel_source()
        assert "wgmma" in source and "tma_load" in source
        assert_no_spills_or_serialized_wgmma(main, tmp_path)


@pytest.mark.full
@pytest.mark.parametrize("kind, n", [("rms", 128), ("rms", 4096), ("rms", 5120), ("rms", 7168),
                                     ("rms", 8192), ("layer", 6144), ("layer", 8192),
                                     ("fused_add", 5120), ("fused_add", 8192)])
def test_norm_backward_staged_defaults_load_by_tma_and_spill_nothing(kind, n, tmp_path):
    """Where the backward stages rows through shared memory by TMA (the default, or the
    TMA config the lane ring replaced as default), its producer warp group caps registers
    at 168: the accumulators must still stay in registers."""
    kernel = norm_backward_kernel(kind, n)
    config = kernel.staged_config("many")
    assert config is not None and config.stages > 0 and not config.lanes, config
    assert config in kernel.config_space("many")
    main = kernel.compile(config, "many")[0]
    assert "tma_load" in main.get_kernel_source()
    assert_no_spills_or_serialized_wgmma(main, tmp_path)


@pytest.mark.full
@pytest.mark.parametrize("kind, n", [("rms", 4096), ("rms", 5120), ("rms", 8192),
                                     ("layer", 6144), ("layer", 8192), ("fused_add", 4096),
                                     ("fused_add", 5120)])
def test_norm_backward_ring_defaults_copy_by_cp_async_and_spill_nothing(kind, n, tmp_path):
    """The lane map's shared ring, the default at 4096-8192 columns (16-bit, many rows):
    each thread's vectors land by cp.async, no TMA, no spills."""
    kernel = norm_backward_kernel(kind, n)
    config = kernel.heuristic_config("many", "sm_90a")
    assert config.lanes and config.stages == 3 and config == kernel.ring_config("many")
    source = kernel.compile(config, "many")[0].get_kernel_source()
    assert "cp_async" in source and "tma_load" not in source
    assert_no_spills_or_serialized_wgmma(kernel.compile(config, "many")[0], tmp_path)


@pytest.mark.full
@pytest.mark.parametrize("kind, n", [("rms", 4096), ("rms", 8192), ("layer", 6144),
                                     ("layer", 8192), ("fused_add", 4096)])
def test_norm_backward_fused_sums_take_no_all_reduce_and_spill_nothing(kind, n, tmp_path):
    """The staged defaults with `fused_sums`: a row's sums by shuffles and one barrier
    (rows.cta_sums, two for LayerNorm's mean first), no TileLang all-reduce, no spills.
    (16384 columns read the staged rows in shared memory, where fused sums are refused:
    test_normalization_cpu.py::test_fused_sums_with_rows_read_where_they_land_is_refused.)"""
    import dataclasses

    kernel = norm_backward_kernel(kind, n)
    config = dataclasses.replace(kernel.staged_config("many"), fused_sums=True)
    assert config in kernel.config_space("many")
    main = kernel.compile(config, "many")[0]
    source = main.get_kernel_source()
    assert "tma_load" in source and "AllReduce" not in source and "__shfl_xor_sync" in source
    assert_no_spills_or_serialized_wgmma(main, tmp_path)


@pytest.mark.full
@pytest.mark.parametrize("head_dim, variant", [(64, None), (128, None), (256, None),
                                               (128, "overlap"), (256, "overlap"),
                                               (64, "two CTAs per SM"), (128, "two CTAs per SM"),
                                               (128, "every tile masked"),
                                               (256, "every tile masked"),
                                               (64, "two CTAs per SM, every tile masked"),
                                               (128, "lazy rescale"), (256, "lazy rescale"),
                                               (128, "two CTAs per SM, lazy rescale"),
                                               (128, "two CTAs per SM, overlap"),
                                               (64, "192 keys"), (128, "192 keys"),
                                               (128, "two CTAs per SM, 160 keys"),
                                               (64, "bidirectional"), (128, "bidirectional")])
def test_attention_forward_keeps_everything_in_registers(head_dim, variant, tmp_path):
    kernel = AttentionFwdKernel(dtype="bfloat16", heads=32, kv_heads=8, head_dim=head_dim,
                                window_left=-1 if head_dim < 256 else 127,
                                window_right=-1 if variant == "bidirectional" else 0,
                                softcap=0.0 if head_dim < 256 else 50.0)
    bucket = "short" if variant and variant.startswith("two CTAs per SM") else "long"
    config = kernel.heuristic_config(bucket, "sm_90a")  # masks only the tiles a mask cuts
    if variant and variant.endswith("overlap"):  # the space's overlap form of the default
        config = next(c for c in kernel.config_space(bucket) if c.overlap and (
            c.block_m, c.block_n, c.ctas_per_sm) == (config.block_m, config.block_n,
                                                     config.ctas_per_sm))
    elif variant and variant.endswith("every tile masked"):
        config = dataclasses.replace(config, edge_masks_only=False)
    elif variant and variant.endswith("lazy rescale"):
        config = dataclasses.replace(config, lazy_rescale=True)
    elif variant and variant.endswith(" keys"):
        config = dataclasses.replace(config, block_n=int(variant.split()[-2]))
    assert config in kernel.config_space(bucket), config
    compiled = kernel.compile(config, bucket)[0]
    assert_no_spills_or_serialized_wgmma(compiled, tmp_path)
    if variant == "two CTAs per SM":  # two CTAs resident: launch bound
        assert "__launch_bounds__(256, 2)" in compiled.get_kernel_source()


@pytest.mark.full
@pytest.mark.parametrize("kernel_class", [AttentionFwdKernel, AttentionVarlenFwdKernel])
def test_attention_forward_kv_head_major_grid(kernel_class):
    """`kv_head_major`: grid x is the query head within its GQA group (4), z the sequence
    times the KV head (8), so K/V rows come from KV head z % 8 and Q rows from head
    (z % 8) * 4 + x."""
    kernel = kernel_class(dtype="bfloat16", heads=32, kv_heads=8, head_dim=128, window_left=-1,
                          window_right=-1, softcap=0.0)
    config = dataclasses.replace(kernel.heuristic_config("long", "sm_90a"), kv_head_major=True)
    assert config in kernel.config_space("long")
    compiled = kernel.compile(config, "long")[0]
    source = compiled.get_kernel_source()
    assert "((((int)blockIdx.z) & 7) * 4) + ((int)blockIdx.x))" in source
    host = compiled.get_host_source()  # the launch's grid z: sequences x 8
    assert re.search(r"= \(\(int64_t\)\(\(?batch(_1)? \* 8\)( - 8\))?\);", host)


@pytest.mark.smoke
def test_attention_forward_picks_two_ctas_per_sm_for_short_keys():
    """Up to SHORT_KEYS (4K) keys two 64-row CTAs share an SM (faster on the H200); longer
    key loops and head_dim 256 (no registers for two) keep one 128-row CTA, unless every
    key is visible (no causal mask, no window): then one 128 x 192 CTA, KV head by KV head."""
    def default(head_dim, seq_kv, kernel_class=AttentionFwdKernel, window_right=0):
        kernel = kernel_class(dtype="float16", heads=32, kv_heads=8, head_dim=head_dim,
                              window_left=-1, window_right=window_right, softcap=0.0)
        return kernel.heuristic_config(kernel.bucket_of(seq_kv), "sm_90a")

    bidirectional = default(128, SHORT_KEYS + 1, window_right=-1)
    assert (bidirectional.ctas_per_sm, bidirectional.block_m, bidirectional.block_n) == (1, 128,
                                                                                        192)
    assert default(256, SHORT_KEYS + 1, window_right=-1).ctas_per_sm == 1
    # and, with no causal order to keep, the grid goes KV head by KV head
    assert bidirectional.kv_head_major and not default(128, SHORT_KEYS + 1).kv_head_major

    assert SHORT_KEYS == 4096
    assert default(128, 1).ctas_per_sm == default(64, SHORT_KEYS).ctas_per_sm == 2
    assert default(128, SHORT_KEYS).block_m == 64
    assert default(128, SHORT_KEYS + 1).ctas_per_sm == default(256, 1024).ctas_per_sm == 1
    assert default(128, SHORT_KEYS + 1).block_m == 128
    # the varlen defaults are the dense ones with whole-tile stores
    for head_dim, seq_kv in ((64, 100), (128, SHORT_KEYS + 1), (256, 1024)):
        varlen = default(head_dim, seq_kv, AttentionVarlenFwdKernel)
        assert varlen == dataclasses.replace(default(head_dim, seq_kv), tile_store=True)


@pytest.mark.full
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("variant", [{}, {"edge_masks_only": False, "staged_stats": False},
                                     {"edge_masks_only": False, "staged_stats": False,
                                      "group_loop": True},
                                     {"edge_masks_only": False, "staged_stats": False,
                                      "group_loop": True, "async_mma": True},
                                     {"staged_stats": False},
                                     {"group_loop": True}, {"kv_chunks": 2},
                                     {"kv_chunks": 4}, {"group_loop": True, "kv_chunks": 2},
                                     {"stages": 3}, {"dq_rows": True},
                                     {"dq_rows": True, "stages": 3}, {"async_mma": True},
                                     {"async_mma": True, "dq_rows": True},
                                     {"clear_by_mma": True},
                                     {"clear_by_mma": True, "stages": 3},
                                     {"tma_dkv": True, "stages": 3},
                                     {"clear_by_mma": True, "tma_dkv": True, "stages": 3},
                                     {"clear_by_mma": True, "tma_dkv": True, "stages": 3,
                                      "ds_handoff": True},
                                     {"clear_by_mma": True, "tma_dkv": True, "stages": 3,
                                      "ds_handoff": True, "dq_rows": True},
                                     {"clear_by_mma": True, "tma_dkv": True, "stages": 3,
                                      "ds_handoff": True, "dq_bulk": True},
                                     {"clear_by_mma": True, "tma_dkv": True,
                                      "ds_handoff": True, "dq_bulk": True},
                                     {"clear_by_mma": True, "tma_dkv": True,
                                      "ds_handoff": True, "dq_bulk": True, "tail_ctas": 256},
                                     {"clear_by_mma": True, "stages": 3, "ds_handoff": True,
                                      "dq_bulk": True, "group_loop": True}],
                         ids=str)
def test_attention_backward_keeps_everything_in_registers(head_dim, variant, tmp_path):
    """head_dim 256 is left out: its backward spills (a known cost, see docs/performance)."""
    kernel = backward_kernel(head_dim)
    # variants of the lighter loop with two Q/dO stages in the grid's plain order; the last
    # but one is the default
    lighter_loop = {"stages": 2, "clear_by_mma": False, "tma_dkv": False, "ds_handoff": False,
                    "dq_bulk": False, "tail_ctas": 0}
    config = dataclasses.replace(kernel.heuristic_config("all", "sm_90a"),
                                 **{**lighter_loop, **variant})
    assert config in kernel.config_space("all")
    assert_no_spills_or_serialized_wgmma(kernel.compile(config, "all")[1], tmp_path)


@pytest.mark.full
@pytest.mark.parametrize("head_dim", [64, 128])
def test_attention_backward_two_ctas_per_sm_keep_everything_in_registers(head_dim, tmp_path):
    """Two CTAs share an SM: launch bound and register split for both, no spills, and
    wgmmas that ptxas does not serialize."""
    kernel = backward_kernel(head_dim)
    configs = [c for c in kernel.config_space("all") if c.ctas_per_sm == 2]
    assert len(configs) == 2
    for config in configs:
        compiled = kernel.compile(config, "all")[1]
        source = compiled.get_kernel_source()
        assert "__launch_bounds__(256, 2)" in source
        assert "warpgroup_reg_alloc<232>" in source
        assert_no_spills_or_serialized_wgmma(compiled, tmp_path)


@pytest.mark.full
def test_attention_backward_clear_by_mma_zeroes_no_accumulator_by_hand():
    """`clear_by_mma`: S, dP and dQ start from their first wgmma (scale-d off), so the only
    zeroed fragments left are dK and dV, once per CTA."""
    kernel = backward_kernel(128)
    default, lockstep = default_and_lockstep(kernel)
    assert default.clear_by_mma
    by_hand = dataclasses.replace(lockstep, clear_by_mma=False)
    assert {by_hand, lockstep} <= set(kernel.config_space("all"))

    def zeroed_fragments(source):  # how TileLang writes T.clear of a fragment
        return len(re.findall(r"float broadcast_var(_\d+)? = 0x0p\+0f", source))

    assert zeroed_fragments(kernel.compile(by_hand, "all")[1].get_kernel_source()) == 5
    source = kernel.compile(lockstep, "all")[1].get_kernel_source()
    assert zeroed_fragments(source) == 2  # dK and dV, before the loop
    assert source.count("((0 < ki") == 3  # the first k-step of each of the three GEMMs
    with pytest.raises(ValueError, match="clear_by_mma"):
        dataclasses.replace(default, clear_by_mma=True, async_mma=True)


@pytest.mark.full
def test_attention_backward_dq_rows_defers_the_wait_for_its_row_reduces():
    """`dq_rows`: one bulk reduce per dq row from a padded, linear shared tile; inside the
    key loop each issuing thread waits only before the tile is rewritten (one wait there,
    one after the loop), not right after issuing."""
    kernel = backward_kernel(128)
    config = dataclasses.replace(kernel.heuristic_config("all", "sm_90a"), dq_rows=True,
                                 clear_by_mma=False, tma_dkv=False, ds_handoff=False,
                                 dq_bulk=False, tail_ctas=0)
    assert config in kernel.config_space("all")
    source = kernel.compile(config, "all")[1].get_kernel_source()
    assert "dq_desc" not in source  # no tensor-map reduce of the whole tile
    issue = source.index("tl::tma_store_add(")
    assert ", 512);" in source[issue:issue + 1000]  # 128 fp32 per row
    assert source.count("tl::tma_store_wait<0, true>()") == 2
    first_wait = source.index("tl::tma_store_wait<0, true>()")
    assert first_wait < issue < source.index("tl::tma_store_arrive()", issue)
    assert "* 136)" in source  # rows 128 + 8 floats apart


@pytest.mark.full
def test_attention_backward_tma_dkv_adds_dk_and_dv_by_tma_in_no_extra_shared_memory():
    """`tma_dkv`: after the key loop dk and dv leave by tensor-map reduce-adds from shared
    tiles laid over the dead K/V and Q/dO tiles, so the CTA needs no more shared memory."""
    kernel = backward_kernel(128)
    default, lockstep = default_and_lockstep(kernel)
    assert default.tma_dkv
    atomics = dataclasses.replace(lockstep, tma_dkv=False)
    assert {atomics, lockstep} <= set(kernel.config_space("all"))

    def dynamic_smem(compiled):  # the launch's shared-memory bytes, an argument > 200 KB
        found = re.findall(r"\(\(int64_t\)(2\d{5})\)", compiled.get_host_source())
        assert len(set(found)) == 1, found
        return found[0]

    compiled = kernel.compile(lockstep, "all")[1]
    source = compiled.get_kernel_source()
    assert "AtomicAdd" not in source
    for tensor in ("dq", "dk", "dv"):
        assert f"tl::tma_store_add({tensor}_desc" in source, tensor
    assert "AtomicAddx2((&(dk[" in kernel.compile(atomics, "all")[1].get_kernel_source()
    assert dynamic_smem(compiled) == dynamic_smem(kernel.compile(atomics, "all")[1])
    assert "AtomicAdd" not in kernel.compile(default, "all")[1].get_kernel_source()
    assert lockstep.smem_bytes(128) == atomics.smem_bytes(128)
    with pytest.raises(ValueError, match="tma_dkv"):
        dataclasses.replace(lockstep, group_loop=True)


@pytest.mark.full
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dq_rows", [False, True])
def test_attention_backward_ds_handoff_places_every_sync_by_hand(head_dim, dq_rows):
    """`ds_handoff`: no CTA-wide barrier inside the key loop. Each warpgroup syncs on the
    other's dS half (a one-sided named barrier the other arrives at), hands it back after
    dQ, syncs its own dq columns on its own barrier and reduces them, by one TMA reduce or
    by rows; TileLang's automatic syncs are off for the main pass only."""
    kernel = backward_kernel(head_dim)
    default, lockstep = default_and_lockstep(kernel)
    assert default.ds_handoff
    config = dataclasses.replace(default, stages=3, dq_bulk=False, dq_rows=dq_rows,
                                 tail_ctas=0)
    assert {config, lockstep} <= set(kernel.config_space("all"))
    assert kernel.pass_configs(config, 1) == {"tl.disable_thread_storage_sync": True}
    assert kernel.pass_configs(config, 0) == {}  # the delta pass keeps its syncs
    assert kernel.pass_configs(lockstep, 1) == {}
    delta, main = kernel.compile(config, "all")
    lockstep_delta = kernel.compile(lockstep, "all")[0]
    assert delta.get_kernel_source() == lockstep_delta.get_kernel_source()
    source = main.get_kernel_source()
    loop = source[source.index("for (int t_1"):source.index("\n    }\n", source.index(
        "for (int t_1"))]
    assert "__sync_thread_partial(3, 256)" not in source
    assert "__syncthreads" not in loop
    # consumer warpgroup h (threadIdx.x >> 7 is h + 1): dS ready 9 + h, free 11 + h, own 13 + h
    assert "__named_barrier_arrive(((((int)threadIdx.x) >> 7) + 8), 256)" in loop  # ready
    assert "__sync_thread_partial((11 - (((int)threadIdx.x) >> 7)), 256)" in loop  # other's
    assert "__named_barrier_arrive((13 - (((int)threadIdx.x) >> 7)), 256)" in loop  # free
    assert "__sync_thread_partial(((((int)threadIdx.x) >> 7) + 10), 256)" in loop  # ours
    assert loop.count("__sync_thread_partial(((((int)threadIdx.x) >> 7) + 12), 128)") == 3
    if dq_rows:  # one bulk reduce per row of a warpgroup's columns: head_dim / 2 * 4 bytes
        assert "dq_desc" not in source
        assert f", {head_dim * 2});" in loop
    else:  # one tensor-map reduce per warpgroup, from its first thread
        assert "if (((int)threadIdx.x) == 128)" in loop
        assert "if (((int)threadIdx.x) == 256)" in loop
        assert loop.count("tl::tma_store_add(dq_desc") == 2
    # the arrives are under the consumers' loop, not in the prologue the producer runs too
    assert source.index("__named_barrier_arrive") > source.index("for (int t_1")
    with pytest.raises(ValueError, match="ds_handoff"):
        dataclasses.replace(config, async_mma=True, clear_by_mma=False, dq_bulk=False)


@pytest.mark.smoke
@pytest.mark.parametrize("head_dim", [pytest.param(64, marks=pytest.mark.full), 128])
def test_attention_backward_dq_bulk_adds_each_warpgroup_half_by_one_deferred_bulk_reduce(
        head_dim):
    """`dq_bulk`: each consumer warpgroup adds its dQ half by one bulk reduce of a contiguous
    padded run into the head-major fp32 buffer; its first thread waits for the read only
    before the next rewrite (and once after the loop), never right after the issue."""
    kernel = backward_kernel(head_dim)
    config = kernel.heuristic_config("all", "sm_90a")
    assert config.dq_bulk
    source = kernel.compile(config, "all")[1].get_kernel_source()
    loop = source[source.index("for (int t_1"):source.index("\n    }\n", source.index(
        "for (int t_1"))]
    assert "dq_desc" not in source
    half_run = 64 * (head_dim // 2 + 8) * 4  # block_q padded half rows of fp32
    assert loop.count(f"), {half_run});") == 1  # one issue site, by the elected thread
    wait, issue = loop.index("tl::tma_store_wait<0, true>()"), loop.index("tl::tma_store_add(")
    assert loop.count("tl::tma_store_wait<0, true>()") == 1 and wait < issue
    assert "tl::tma_store_wait" not in loop[issue:]  # deferred to the next tile
    assert "if ((((int)threadIdx.x) % 128) == 0)" in loop
    for bad in ({"ds_handoff": False}, {"dq_rows": True}):
        with pytest.raises(ValueError, match="dq_bulk"):
            dataclasses.replace(config, **bad)


@pytest.mark.smoke
@pytest.mark.parametrize("head_dim", [pytest.param(64, marks=pytest.mark.full), 128])
def test_attention_backward_dq_bulk_casts_dq_by_whole_rows(head_dim):
    """dq_bulk's head-major fp32 dq becomes dq by a kernel of its own: 16-byte loads and
    8-byte stores along whole rows (torch's copy through a permuted view ran at half the
    bandwidth)."""
    kernel = backward_kernel(head_dim)
    config = kernel.heuristic_config("all", "sm_90a")
    assert config.dq_bulk
    cast = kernel.compile(config, "all")[2].get_kernel_source()
    assert "*(float4*)(dq32 + " in cast and "*(uint2*)(dq + " in cast
    lockstep = default_and_lockstep(kernel)[1]
    assert len(kernel.program(lockstep, "all")) == 2  # dq.copy_ of a [B, S, H, D] buffer


@pytest.mark.full
@pytest.mark.parametrize("bucket", ["short", "long"])
def test_attention_varlen_tile_store_stores_whole_tiles_by_tma(bucket, tmp_path):
    """`tile_store`: blocks inside their sequence store O by TMA (the row path stays for
    blocks cut by a sequence's end), without spills."""
    from tileops.kernels.attention import AttentionVarlenFwdKernel

    kernel = AttentionVarlenFwdKernel(dtype="bfloat16", heads=32, kv_heads=8, head_dim=128,
                                      window_left=-1, window_right=0, softcap=0.0)
    config = dataclasses.replace(kernel.heuristic_config(bucket, "sm_90a"), tile_store=True)
    assert config in kernel.config_space(bucket)
    compiled = kernel.compile(config, bucket)[0]
    assert "tma_store(o_desc" in compiled.get_kernel_source()
    assert_no_spills_or_serialized_wgmma(compiled, tmp_path)


@pytest.mark.smoke
@pytest.mark.parametrize("n_kv, n_heads, tail_ctas", [(16, 256, 256), (32, 128, 256),
                                                      (64, 128, 256), (3, 16, 256),
                                                      (5, 21, 9), (7, 3, 1)])
def test_tail_launch_order_is_a_permutation_heavy_first_at_the_end(n_kv, n_heads,
                                                                   tail_ctas):
    """`tail_ctas`: every (key block, head) is launched exactly once; before the tail the
    grid's order is kept, and in it the key blocks (heaviest first under a causal mask)
    never go back."""
    order = [tail_launch_order(bx, flat, n_kv, n_heads, tail_ctas, INT_OPS)
             for flat in range(n_heads) for bx in range(n_kv)]
    assert sorted(order) == [(bx, flat) for bx in range(n_kv) for flat in range(n_heads)]
    n_tail = min(-(-tail_ctas // n_kv), n_heads)
    head_part = (n_heads - n_tail) * n_kv
    assert order[:head_part] == [(bx, flat) for flat in range(n_heads - n_tail)
                                 for bx in range(n_kv)]
    tail_blocks = [bx for bx, _ in order[head_part:]]
    assert tail_blocks == sorted(tail_blocks)
    assert len(order) - head_part >= min(tail_ctas, n_kv * n_heads)


@pytest.mark.smoke
def test_compile_jobs_share_the_cores_with_other_xdist_workers(monkeypatch):
    """compile_many's threads: every core alone, 4 x cores / workers under pytest-xdist (16
    workers each compiling on 16 threads took a worker down on the 16-core GPU machine)."""
    from tileops.kernels import base

    monkeypatch.setattr(base.os, "cpu_count", lambda: 16)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    assert base.default_compile_jobs() == 16
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "16")
    assert base.default_compile_jobs() == 4
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    assert base.default_compile_jobs() == 16
    monkeypatch.setattr(base.os, "cpu_count", lambda: 2)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "16")
    assert base.default_compile_jobs() == 1
