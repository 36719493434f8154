"""The normalization ops on the CPU: output metadata from meta tensors, the errors of bad
input, rooflines against hand counts, and the kernels' choices (no GPU, no compile)."""

import pytest
import torch

import tileops
from tileops import (
    FusedAddRMSNormBwdOp,
    FusedAddRMSNormFwdOp,
    LayerNormBwdOp,
    LayerNormFwdOp,
    RMSNormBwdOp,
    RMSNormFwdOp,
    TileOpsTypeError,
    TileOpsValueError,
)
from tileops.kernels.normalization import (
    FusedAddRMSNormBwdKernel,
    LayerNormBwdKernel,
    RMSNormBwdKernel,
    RMSNormKernel,
)
from tileops.kernels.normalization.rows import RowTile, stageable, vector_map_ok

from ..helpers import meta

pytestmark = pytest.mark.smoke


def test_meta_outputs_of_every_norm_op():
    y = tileops.rms_norm(meta(2, 7, 4096), [4096], meta(4096))
    assert y.shape == (2, 7, 4096) and y.device.type == "meta"
    y, h = tileops.fused_add_rms_norm(meta(3, 5120), meta(3, 5120), meta(5120))
    assert y.shape == h.shape == (3, 5120)
    assert tileops.layer_norm(meta(9, 1280), [1280]).shape == (9, 1280)
    dx, dw = RMSNormBwdOp(normalized_shape=[8, 128])(meta(4, 8, 128), meta(4, 8, 128),
                                                      meta(8, 128))
    assert dx.shape == (4, 8, 128) and dw.shape == (8, 128)
    dx, dw = RMSNormBwdOp(normalized_shape=[128])(meta(4, 128), meta(4, 128), None)
    assert dw.shape == (0,)  # no weight: no gradient to give
    dx, dw, db = LayerNormBwdOp(normalized_shape=[64])(meta(4, 64), meta(4, 64), None,
                                                      meta(64))
    assert (dw.shape, db.shape) == ((0,), (64,))
    dx, dw = FusedAddRMSNormBwdOp()(meta(6, 256), meta(6, 256), meta(6, 256), meta(256))
    assert dx.shape == (6, 256) and dw.shape == (256,)


def test_in_place_form_checks_shapes_on_meta_tensors():
    x, r = meta(4, 256), meta(4, 256)
    assert tileops.fused_add_rms_norm_(x, r, meta(256)) == (x, r)
    with pytest.raises(TileOpsValueError, match="FusedAddRMSNormFwdOp: argument 'weight'"):
        tileops.fused_add_rms_norm_(x, r, meta(128))


@pytest.mark.parametrize("call, message", [
    (lambda: tileops.rms_norm(meta(4, 256), [256], meta(128)),
     r"RMSNormFwdOp: argument 'weight'"),
    (lambda: tileops.rms_norm(meta(4, 256), [256], meta(256, dtype=torch.float16)),
     r"RMSNormFwdOp: argument 'weight': expected dtype torch.bfloat16"),
    (lambda: tileops.rms_norm(meta(4, 256, dtype=torch.float32), [256]),
     r"RMSNormFwdOp: argument 'input': expected dtype"),
    (lambda: tileops.fused_add_rms_norm(meta(4, 256), meta(4, 128), meta(256)),
     r"FusedAddRMSNormFwdOp: argument 'residual'"),
    (lambda: tileops.layer_norm(meta(4, 256), [256], None, meta(255)),
     r"LayerNormFwdOp: argument 'bias'"),
    (lambda: tileops.layer_norm(meta(4, 256), [128]),
     r"LayerNormFwdOp: argument 'input'"),
    (lambda: RMSNormBwdOp(normalized_shape=[256])(meta(4, 256), meta(5, 256)),
     r"RMSNormBwdOp: argument"),
])
def test_bad_input_names_the_op_and_the_argument(call, message):
    with pytest.raises((TileOpsValueError, TileOpsTypeError), match=message):
        call()


def test_eps_default_is_torchs_fp32_epsilon():
    """F.rms_norm(eps=None) on fp16/bf16 rows uses the epsilon of its fp32 math."""
    from tileops.ops.normalization import FP32_EPS

    assert FP32_EPS == torch.finfo(torch.float32).eps
    assert RMSNormFwdOp(normalized_shape=[8])._eps() == FP32_EPS
    assert FusedAddRMSNormFwdOp()._eps() == FP32_EPS
    assert LayerNormFwdOp(normalized_shape=[8]).eps == 1e-5  # F.layer_norm's


def test_rooflines_count_each_tensor_once():
    rows, n, b = 8192, 4096, 2  # bf16
    assert RMSNormBwdOp(normalized_shape=[n]).eval_roofline(
        meta(rows, n), meta(rows, n), meta(n))[1] == (3 * rows * n + 2 * n) * b
    assert FusedAddRMSNormFwdOp().eval_roofline(
        meta(rows, n), meta(rows, n), meta(n))[1] == (4 * rows * n + n) * b
    assert FusedAddRMSNormBwdOp().eval_roofline(
        meta(rows, n), meta(rows, n), meta(rows, n), meta(n))[1] == (4 * rows * n + 2 * n) * b
    assert LayerNormFwdOp(normalized_shape=[n]).eval_roofline(
        meta(rows, n), meta(n), meta(n))[1] == (2 * rows * n + 2 * n) * b
    assert LayerNormBwdOp(normalized_shape=[n]).eval_roofline(
        meta(rows, n), meta(rows, n), meta(n), None)[1] == (3 * rows * n + 2 * n) * b


@pytest.mark.parametrize("n", [128, 199, 1000, 1280, 2560, 4096, 5120, 6144, 7168, 8192,
                               13824, 16384])
def test_default_configs_keep_registers_in_bounds(n):
    """Forward tiles hold at most 64 elements per thread (more spilled); the backward's
    double buffer only where a thread holds at most 16; its grid is whole waves."""
    fwd = RMSNormKernel(dtype="bfloat16", n=n, has_weight=True)
    for bucket in ("few", "all"):
        config = fwd.heuristic_config(bucket, "sm_90a")
        tile = RowTile(n, config.block_rows, config.threads)
        assert tile.n_tile * config.block_rows <= 64 * config.threads, (bucket, config)
        if config.lanes:  # at most five 16-byte vectors a thread
            assert n * config.block_rows <= 40 * config.threads, (bucket, config)
    for cls, key in ((RMSNormBwdKernel, {"has_weight": True}),
                     (LayerNormBwdKernel, {"has_weight": True, "has_bias": True})):
        bwd = cls(dtype="bfloat16", n=n, **key)
        for bucket in ("few", "many"):
            config = bwd.heuristic_config(bucket, "sm_90a")
            if config.lanes:  # exact 16-byte vectors, at most five a thread, no prefetch
                assert n * config.block_rows <= 40 * config.threads, config
                assert not config.prefetch and config.threads % 32 == 0, config
                if config.stages:  # the shared ring: one row of whole warps, 2-3 steps
                    assert config.block_rows == 1 and config.stages in (2, 3), config
                else:  # short rows: a warp a row at most
                    assert config.threads // config.block_rows <= 32, config
                per_thread = 0
            else:
                per_thread = RowTile(n, config.block_rows, config.threads).n_tile \
                    * config.block_rows // config.threads
            assert per_thread <= 32 and (not config.prefetch or per_thread <= 16), config
            assert config.ctas % 132 == 0 and config in bwd.config_space(bucket)
            if config.stages and not config.lanes:  # TMA: a producer warp group, one CTA
                # per SM of 256 consumers (512 reading the staged rows in shared memory:
                # RMSNorm's 16384 columns)
                assert config.ctas == 132 and not config.prefetch, config
                assert config.threads == (512 if config.from_shared else 256), config
                assert stageable(n, config.block_rows, config.threads), config
    assert bwd.bucket_of(4096) == "few" and bwd.bucket_of(4097) == "many"


def test_backward_lane_map_default_where_vectors_split_over_no_power_of_two():
    """ViT-H's 1280 columns (160 vectors): four rows of a warp, five vectors a lane, two
    CTAs an SM (measured faster than the padded tile); sizes the lane map cannot split
    into a warp a row keep the padded tile; powers of two keep the tile map."""
    vit = LayerNormBwdKernel(dtype="bfloat16", n=1280, has_weight=True, has_bias=True)
    config = vit.heuristic_config("many", "sm_90a")
    assert (config.lanes, config.block_rows, config.threads, config.ctas) == (True, 4, 128, 264)
    assert not LayerNormBwdKernel(dtype="bfloat16", n=1000, has_weight=True,
                                  has_bias=True).heuristic_config("many", "sm_90a").lanes
    assert not RMSNormBwdKernel(dtype="bfloat16", n=4096,
                                has_weight=True).heuristic_config("few", "sm_90a").lanes


def test_backward_defaults_split_no_row_unevenly_past_512_columns():
    """A default tile of several rows past 512 columns maps 16-byte vectors exactly onto
    its threads (or is the lane map / TMA pipeline): a padded tile of two rows of 1536
    over 256 threads did not lower, so every norm backward at 1536 failed to compile."""
    for n in range(512, 16385, 8):
        for kernel in (RMSNormBwdKernel(dtype="bfloat16", n=n, has_weight=True),
                       LayerNormBwdKernel(dtype="bfloat16", n=n, has_weight=True,
                                          has_bias=True),
                       FusedAddRMSNormBwdKernel(dtype="bfloat16", n=n)):
            for bucket in ("few", "many"):
                config = kernel.heuristic_config(bucket, "sm_90a")
                assert config.lanes or config.stages or config.block_rows == 1 or \
                    vector_map_ok(n, config.block_rows, config.threads), (n, bucket, config)


@pytest.mark.parametrize("kind, n, dtype, threads, ctas", [
    ("rms", 4096, "bfloat16", 256, 132), ("rms", 5120, "float16", 320, 132),
    ("rms", 8192, "bfloat16", 512, 132), ("layer", 6144, "bfloat16", 384, 132),
    ("layer", 8192, "float16", 512, 132), ("fused_add", 4096, "bfloat16", 128, 264),
    ("fused_add", 5120, "bfloat16", 160, 264)])
def test_backward_ring_default_at_4096_to_8192_columns(kind, n, dtype, threads, ctas):
    """The lane map's shared ring (3 steps, one row a CTA) where it beat the TMA pipeline
    on an H100; DeepSeek-V3's 7168, the fused add's 8192, fp32, few rows and other widths
    keep their earlier picks."""
    kernel = {"rms": lambda: RMSNormBwdKernel(dtype=dtype, n=n, has_weight=True),
              "layer": lambda: LayerNormBwdKernel(dtype=dtype, n=n, has_weight=True,
                                                  has_bias=True),
              "fused_add": lambda: FusedAddRMSNormBwdKernel(dtype=dtype, n=n)}[kind]()
    config = kernel.heuristic_config("many", "sm_90a")
    assert (config.lanes, config.block_rows, config.threads, config.ctas, config.stages,
            config.prefetch) == (True, 1, threads, ctas, 3, False)
    assert not kernel.heuristic_config("few", "sm_90a").lanes
    for other in (RMSNormBwdKernel(dtype="bfloat16", n=7168, has_weight=True),
                  RMSNormBwdKernel(dtype="float32", n=4096, has_weight=True),
                  FusedAddRMSNormBwdKernel(dtype="bfloat16", n=8192),
                  RMSNormBwdKernel(dtype="bfloat16", n=16384, has_weight=True)):
        assert other.ring_config("many") is None


@pytest.mark.parametrize("n, dtype, block_rows, threads", [
    (1280, "bfloat16", 4, 128),    # ViT-H: five vectors, a warp a row (one a thread: 14%
                                   # slower on the H200; two or four split into no warps)
    (2560, "bfloat16", 2, 128),    # Phi-2: five vectors, two warps a row
    (5120, "float16", 1, 160),     # Qwen3-32B: four vectors
    (6144, "bfloat16", 1, 256),    # GPT-NeoX-20B: three vectors (17% over two on the H200)
    (7168, "bfloat16", 1, 224),    # DeepSeek-V3: four vectors
    (13824, "bfloat16", 1, 576),   # three vectors: 864 threads would fit one CTA per SM
    (3072, "bfloat16", 1, 128),
    (384, "bfloat16", 8, 128),     # 16 threads a row, three vectors, 8 rows a CTA
])
def test_forward_defaults_at_sizes_off_the_powers_of_two_take_the_lane_map(n, dtype,
                                                                            block_rows,
                                                                            threads):
    """Whole 16-byte vectors split exactly over any whole number of warps per row; two
    stacked rows of two warps (2560) on prefill rows take the persistent ring (four CTAs
    an SM, 3 groups), except the fused add (its second staged row)."""
    from tileops.kernels.normalization import FusedAddRMSNormKernel, LayerNormKernel
    from tileops.kernels.normalization.row_norm_fwd import NormConfig, lanes_ok

    for kernel in (RMSNormKernel(dtype=dtype, n=n, has_weight=True),
                   FusedAddRMSNormKernel(dtype=dtype, n=n),
                   LayerNormKernel(dtype=dtype, n=n, has_weight=True, has_bias=False)):
        for bucket in ("few", "all"):
            config = kernel.heuristic_config(bucket, "sm_90a")
            want = NormConfig(block_rows, threads, lanes=True)
            if block_rows == 2 and bucket == "all" and kernel.name != "fused_add_rms_norm":
                want = NormConfig(block_rows, threads, lanes=True, ctas=4 * 132, stages=3)
            assert config == want, (kernel.name, config)
            assert config in kernel.config_space(bucket)
            assert NormConfig(block_rows, threads, lanes=True) in kernel.config_space(bucket)
        for config in kernel.config_space("all"):
            if config.lanes:
                assert lanes_ok(n, dtype, config.block_rows, config.threads), config
                assert config.threads % 32 == 0 and config.threads <= 896, config
                assert 8 <= n * config.block_rows // config.threads <= 40, config


def test_lane_map_needs_an_exact_split_of_16_byte_vectors():
    from tileops.kernels.normalization.row_norm_fwd import default_lanes, lanes_ok

    assert lanes_ok(2560, "bfloat16", 1, 320) and lanes_ok(2560, "bfloat16", 2, 320)
    assert not lanes_ok(2560, "bfloat16", 1, 96)   # 320 vectors over 96 threads
    assert not lanes_ok(2560, "bfloat16", 1, 80)   # not whole warps
    assert not lanes_ok(1000, "bfloat16", 1, 125)  # 8-byte vectors only
    for n in (199, 1000, 24):
        assert default_lanes(n, "float16") is None
    # powers of two keep the tile map they were tuned on
    assert not RMSNormKernel(dtype="bfloat16", n=4096, has_weight=True).heuristic_config(
        "all", "sm_90a").lanes


# -- the lane map's generated CUDA on the CPU (threads, shuffles and shared memory) -------
LANE_CASES = {  # name -> (kind, n, dtype, (block_rows, threads[, prefetch[, ...]]), rows)
    "layer norm 2560, one row per CTA": ("layer", 2560, torch.bfloat16, (1, 160), 3),
    "layer norm 384, 8 rows of 16 lanes, a last CTA of 3": ("layer", 384, torch.float16,
                                                             (8, 128), 11),
    "rms norm 13824, 576 threads": ("rms", 13824, torch.bfloat16, (1, 576), 2),
    "fused add 5120 in place": ("fused_add", 5120, torch.bfloat16, (1, 320), 2),
    "layer norm 6144, weight and bias prefetched": ("layer", 6144, torch.float16,
                                                    (1, 384, True), 2),
    # the five-vector defaults (ViT-H, Phi-2): a warp a row, and two warps a row
    "layer norm 1280, 4 rows of 32 lanes, a last CTA of 1": ("layer", 1280, torch.bfloat16,
                                                             (4, 128), 5),
    "rms norm 2560, 2 rows of 64 lanes, a last CTA of 1": ("rms", 2560, torch.float16,
                                                           (2, 128), 3),
    # persistent grids (config `ctas`): groups of rows in turn, the next one's rows loading
    # during this one's sums, the shared sums alternating between two halves
    "rms norm 2560, 2 CTAs over 5 groups of 2 rows": ("rms", 2560, torch.float16,
                                                      (2, 128, False, 2), 9),
    "layer norm 1280, 3 CTAs over 4 groups, a last group of 1": ("layer", 1280,
                                                                 torch.bfloat16,
                                                                 (4, 128, False, 3), 13),
    "fused add 2560 in place, 2 CTAs": ("fused_add", 2560, torch.bfloat16,
                                        (2, 128, False, 2), 7),
    # LayerNorm's mean and variance as merged moments (`fused_sums`): across 8 warps, two
    # warps a row on a persistent grid, 16 lanes a row (shuffles alone)
    "layer norm 6144, moments over 8 warps": ("layer", 6144, torch.bfloat16,
                                              (1, 256, False, 0, True), 3),
    "layer norm 2560, moments, 2 CTAs": ("layer", 2560, torch.float16,
                                         (2, 128, False, 2, True), 9),
    "layer norm 384, moments of 16 lanes": ("layer", 384, torch.bfloat16,
                                            (8, 128, False, 0, True), 11),
    # persistent grids with the next groups' rows in a shared ring (config `stages`)
    "layer norm 1280, 3 CTAs, a ring of 3 groups": ("layer", 1280, torch.bfloat16,
                                                    (4, 128, False, 3, False, 3), 29),
    "fused add 2560 in place, 2 CTAs, a ring of 2": ("fused_add", 2560, torch.float16,
                                                     (2, 128, False, 2, False, 2), 9),
    # the 2560 / 1536 default's form (a ring of 3 groups of two stacked rows), on 3 CTAs
    # with a partial last group, and more groups than one pass of the ring
    "layer norm 2560, 3 CTAs, a ring of 3 groups of 2": ("layer", 2560, torch.bfloat16,
                                                         (2, 128, False, 3, False, 3), 23),
    "rms norm 1536, 2 CTAs, a ring of 3 groups of 2": ("rms", 1536, torch.float16,
                                                       (2, 128, False, 2, False, 3), 19),
}


@pytest.mark.compile
@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.smoke] if i == 0
                                               else [pytest.mark.full])
                                  for i, n in enumerate(LANE_CASES)])
def test_lane_map_program_on_the_cpu(name):
    """The lane-map kernel, one host thread per CUDA thread, against fp32 torch: row sums
    across warps through shared memory, rows of fewer lanes than a warp, a partial last
    CTA whose spare rows are not stored, and the fused add writing over its inputs."""
    from tileops.kernels.normalization.row_norm_fwd import NormConfig

    kind, n, dtype, fields, rows = LANE_CASES[name]
    # (rows, threads[, prefetch[, ctas[, fused_sums[, stages]]]])
    block_rows, threads, prefetch, ctas, fused, stages = (*fields, False, 0, False, 0)[:6]
    run_forward_on_the_cpu(kind, n, dtype, rows, NormConfig(
        block_rows, threads, lanes=True, prefetch=prefetch, ctas=ctas, fused_sums=fused,
        stages=stages))


# -- the forward's fused row sums on the tile map, run thread by thread on the CPU ------
FUSED_FWD_CASES = {  # name -> (kind, n, dtype, (block_rows, threads), rows)
    "layer norm 8192, two rows a CTA, a last CTA of 1": ("layer", 8192, torch.bfloat16,
                                                         (2, 256), 3),
    "rms norm 4096, one row of 256 threads": ("rms", 4096, torch.float16, (1, 256), 2),
    # (the fused add's packed bf16 add has no host form in the emulator: its GPU tests)
    "rms norm 2048, four rows of 128 threads": ("rms", 2048, torch.bfloat16, (4, 128), 6),
    "layer norm 1000, padded, 128 threads": ("layer", 1000, torch.float16, (1, 128), 2),
}


@pytest.mark.compile
@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.smoke] if i == 0
                                               else [pytest.mark.full])
                                  for i, n in enumerate(FUSED_FWD_CASES)])
def test_fused_row_sums_forward_on_the_cpu(name):
    """The tile map's forward with a row's sums taken by shuffles and one barrier each
    (`cta_sums`): LayerNorm's two sums, several rows a CTA, a partial last CTA, the padded
    scalar path (its padding must stay out of the variance)."""
    from tileops.kernels.normalization.row_norm_fwd import NormConfig

    kind, n, dtype, (block_rows, threads), rows = FUSED_FWD_CASES[name]
    run_forward_on_the_cpu(kind, n, dtype, rows, NormConfig(block_rows, threads,
                                                            fused_sums=True))


def run_forward_on_the_cpu(kind: str, n: int, dtype, rows: int, config) -> None:
    """Runs a forward norm kernel (RMSNorm, LayerNorm or the fused add at `n` columns) with
    `config`, one host thread per CUDA thread, and checks it against fp32 torch (the fused
    add writing both results over its inputs)."""
    import torch.nn.functional as F

    from tileops.kernels.normalization import FusedAddRMSNormKernel, LayerNormKernel

    from ..cuda_emulation_threads import run

    block_rows, threads = config.block_rows, config.threads
    name_of = {torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(rows, n, generator=gen) * 2 + 0.5
    if kind == "layer":  # a row far from zero mean: its variance must not cancel away
        x[-1] += 300.0
    x = x.to(dtype)
    w = torch.randn(n, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    grid = -(-rows // block_rows)
    grid = min(grid, config.ctas) if config.ctas else grid
    if kind == "layer":
        kernel = LayerNormKernel(dtype=name_of, n=n, has_weight=True, has_bias=True)
        y = torch.full_like(x, float("nan"))
        run(kernel.compile(config, "all")[0], grid, threads, dict(x=x, w=w, b=b, y=y),
            dict(rows=rows, eps=1e-5))
        want = F.layer_norm(x.float(), [n], w.float(), b.float(), 1e-5)
    elif kind == "rms":
        kernel = RMSNormKernel(dtype=name_of, n=n, has_weight=True)
        y = torch.full_like(x, float("nan"))
        run(kernel.compile(config, "all")[0], grid, threads, dict(x=x, w=w, y=y),
            dict(rows=rows, eps=1e-6))
        want = F.rms_norm(x.float(), [n], w.float(), 1e-6)
    else:
        kernel = FusedAddRMSNormKernel(dtype=name_of, n=n)
        r = torch.randn(rows, n, generator=gen).to(dtype)
        h_want = x + r
        want = F.rms_norm(h_want.float(), [n], w.float(), 1e-6)
        run(kernel.compile(config, "all")[0], grid, threads,
            dict(x=x, residual=r, w=w, y=x, residual_out=r), dict(rows=rows, eps=1e-6))
        assert torch.equal(r, h_want)
        y = x
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y.float(), want, atol=2e-2, rtol=2e-2)


# -- the backward's fused row sums (`fused_sums`), run thread by thread on the CPU --------
FUSED_SUM_CASES = {  # name -> (kind, n, dtype, config fields, rows)
    "rms norm 4096, register double buffer": ("rms", 4096, torch.bfloat16,
                                              dict(threads=256, prefetch=True), 7),
    "layer norm 1280, padded, 64 threads": ("layer", 1280, torch.float16,
                                           dict(block_rows=1, threads=64, prefetch=False), 5),
    "fused add 2048, two rows a CTA": ("fused_add", 2048, torch.bfloat16,
                                       dict(block_rows=2, threads=256, prefetch=True), 9),
}


@pytest.mark.compile
@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.smoke] if i == 0
                                               else [pytest.mark.full])
                                  for i, n in enumerate(FUSED_SUM_CASES)])
def test_fused_row_sums_backward_on_the_cpu(name):
    """The backward with a row's sums taken by shuffles and one barrier (`cta_sums`) on
    the register path, one host thread per CUDA thread, against fp32 autograd: dx, and dw /
    db summed from the per-CTA partials (a grid of 3 CTAs striding over the rows, a last
    step past the rows)."""
    import dataclasses

    kind, n, dtype, fields, rows = FUSED_SUM_CASES[name]
    run_backward_on_the_cpu(kind, n, dtype, rows, seed=5, config_of=lambda kernel: (
        dataclasses.replace(kernel.heuristic_config("many", "sm_90a"), ctas=3, stages=0,
                            lanes=False, fused_sums=True, **fields)))


def run_backward_on_the_cpu(kind: str, n: int, dtype, rows: int, seed: int, config_of,
                            column_sum: bool = False) -> None:
    """Runs a backward norm kernel (RMSNorm, LayerNorm or the fused add at `n` columns) on
    a grid of 3 CTAs thread by thread, config `config_of(kernel)`, and checks dx and the
    partial rows (and with `column_sum`, dW through the column-sum program) against fp32
    autograd."""
    import torch.nn.functional as F

    from tileops.kernels.normalization import FusedAddRMSNormBwdKernel
    from tileops.kernels.normalization.row_norm_bwd import column_strip

    from ..cuda_emulation_threads import run

    name_of = {torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    gen = torch.Generator().manual_seed(seed)
    h = (torch.randn(rows, n, generator=gen) * 2 + 0.5).to(dtype)
    dy = torch.randn(rows, n, generator=gen).to(dtype)
    w = torch.randn(n, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    dres = torch.randn(rows, n, generator=gen).to(dtype)
    if kind == "layer":
        kernel = LayerNormBwdKernel(dtype=name_of, n=n, has_weight=True, has_bias=True)
    elif kind == "rms":
        kernel = RMSNormBwdKernel(dtype=name_of, n=n, has_weight=True)
    else:
        kernel = FusedAddRMSNormBwdKernel(dtype=name_of, n=n)
    config = config_of(kernel)
    dx = torch.full_like(h, float("nan"))
    dw_part = torch.full((3, n), float("nan"))
    db_part = torch.full((3, n), float("nan"))
    sched = torch.zeros(2, dtype=torch.int32)  # the dynamic deal's counters
    tensors = dict(dy=dy, h=h, w=w, dx=dx, dw_part=dw_part, sched=sched)
    if kind == "layer":
        tensors["db_part"] = db_part
    if kind == "fused_add":
        tensors["dres"] = dres
    eps = 1e-5
    programs = kernel.compile(config, "many")
    run(programs[0], 3, config.threads, tensors, dict(rows=rows, eps=eps))
    assert sched.tolist() == [0, 0], "the last CTA out leaves the counters zero"

    hf, wf, bf = (t.float().requires_grad_() for t in (h, w, b))
    y = F.layer_norm(hf, [n], wf, bf, eps) if kind == "layer" else F.rms_norm(hf, [n], wf, eps)
    y.backward(dy.float())
    want_dx = hf.grad + (dres.float() if kind == "fused_add" else 0)
    torch.testing.assert_close(dx.float(), want_dx, atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(dw_part.sum(0), wf.grad, atol=5e-2, rtol=1e-3)
    if kind == "layer":
        torch.testing.assert_close(db_part.sum(0), bf.grad, atol=5e-2, rtol=1e-3)
    if column_sum:
        dw = torch.full((n,), float("nan"), dtype=dtype)
        db = torch.full((n,), float("nan"), dtype=dtype)
        strips = -(-n // column_strip(n))
        if kind == "layer":  # dW and dB in one launch
            run(programs[1], 2 * strips, 256,
                dict(part=dw_part, part_b=db_part, out=dw, out_b=db), {})
            torch.testing.assert_close(db.float(), bf.grad, atol=5e-2, rtol=1e-2)
        else:
            run(programs[1], strips, 256, dict(part=dw_part, out=dw), {})
        torch.testing.assert_close(dw.float(), wf.grad, atol=5e-2, rtol=1e-2)


def test_fused_sums_where_threads_split_rows_is_refused():
    """Rows shared by groups of threads (128 columns, 32 rows a CTA) would need a sum per
    group: the config is refused, never silently run another way, and the tuner's space
    has no such config."""
    import dataclasses

    kernel = RMSNormBwdKernel(dtype="bfloat16", n=128, has_weight=True)
    config = dataclasses.replace(kernel.heuristic_config("many", "sm_90a"), fused_sums=True)
    with pytest.raises(ValueError, match="fused_sums needs every thread"):
        kernel.program(config, "many")
    assert not any(c.fused_sums for c in kernel.config_space("many"))
    assert any(c.fused_sums for c in RMSNormBwdKernel(
        dtype="bfloat16", n=4096, has_weight=True).config_space("many"))


def test_forward_fused_sums_where_threads_split_rows_is_refused():
    """The tile map's fused sums need each thread in every row of its CTA (not short rows
    shared by groups of threads); on the lane map they merge LayerNorm's two statistics,
    so RMSNorm's one sum is refused there; neither is in the space."""
    from tileops.kernels.normalization.row_norm_fwd import NormConfig

    kernel = RMSNormKernel(dtype="bfloat16", n=128, has_weight=True)
    with pytest.raises(ValueError, match="fused_sums needs the tile map"):
        kernel.program(NormConfig(8, 64, fused_sums=True), "all")
    assert not any(c.fused_sums for c in kernel.config_space("all"))
    lanes = RMSNormKernel(dtype="bfloat16", n=2560, has_weight=True)
    with pytest.raises(ValueError, match="an uncentered norm has one sum"):
        lanes.program(NormConfig(2, 128, lanes=True, fused_sums=True), "all")
    assert not any(c.fused_sums and c.lanes for c in lanes.config_space("all"))
    assert any(c.fused_sums for c in RMSNormKernel(
        dtype="bfloat16", n=4096, has_weight=True).config_space("all"))


def test_fused_sums_with_rows_read_where_they_land_is_refused():
    """`from_shared` (405B's 16384 columns) with fused sums gave wrong dx on the H200: the
    program refuses it and the tuner's space leaves it out."""
    import dataclasses

    kernel = RMSNormBwdKernel(dtype="bfloat16", n=16384, has_weight=True)
    default = kernel.heuristic_config("many", "sm_90a")
    assert default.from_shared and not default.fused_sums
    with pytest.raises(ValueError, match="from_shared"):
        kernel.program(dataclasses.replace(default, fused_sums=True), "many")
    assert not any(c.fused_sums and c.from_shared for c in kernel.config_space("many"))


# -- the lane-map backward (lane_norm_bwd.py) and the column sum, thread by thread ---------
LANE_BWD_CASES = {  # name -> (kind, n, dtype, config fields, rows)
    "layer norm 1280, four rows of a warp, shared dW / dB, double buffer": (
        "layer", 1280, torch.bfloat16,
        dict(block_rows=4, threads=128, prefetch=True, acc_shared=True), 13),
    "rms norm 1536, rows of two warps, register dW": (
        "rms", 1536, torch.float16, dict(block_rows=1, threads=64, prefetch=True), 11),
    "fused add 768, two rows a CTA": (
        "fused_add", 768, torch.bfloat16, dict(block_rows=2, threads=64, prefetch=False), 9),
    "layer norm 2560, two rows of two warps, registers": (
        "layer", 2560, torch.float16, dict(block_rows=2, threads=128, prefetch=False), 10),
    "layer norm 1280, four rows of a warp, a 3-step shared ring": (
        "layer", 1280, torch.bfloat16, dict(block_rows=4, threads=128, prefetch=False,
                                            stages=3), 29),
    "fused add 1536, rows of two warps, a 2-step ring, shared dW": (
        "fused_add", 1536, torch.float16, dict(block_rows=1, threads=64, prefetch=False,
                                               stages=2, acc_shared=True), 8),
    # rows dealt as the CTAs go: past the static first (stages + 1) x 3 CTAs' rows the
    # first CTA (the emulator runs them in turn) takes every row from the counter
    "rms norm 1536, rows of two warps, a 3-step ring, rows dealt as the CTAs go": (
        "rms", 1536, torch.bfloat16, dict(block_rows=1, threads=64, prefetch=False,
                                          stages=3, dynamic=True), 29),
    "layer norm 1280, four rows of a warp, a 2-step ring, rows dealt as the CTAs go": (
        "layer", 1280, torch.float16, dict(block_rows=4, threads=128, prefetch=False,
                                           stages=2, dynamic=True), 61),
}


@pytest.mark.compile
@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.smoke] if i == 0
                                               else [pytest.mark.full])
                                  for i, n in enumerate(LANE_BWD_CASES)])
def test_lane_map_backward_on_the_cpu(name):
    """The lane-map backward, one host thread per CUDA thread, against fp32 autograd: a
    grid of 3 CTAs striding over the rows with a last step past them, row sums by shuffles
    alone and across warps (two shared buffers taken in turn), dW / dB in registers or in
    shared memory, the CTA's row groups combined; then the column sum of the partials."""
    from tileops.kernels.normalization.row_norm_bwd import NormBwdConfig

    kind, n, dtype, fields, rows = LANE_BWD_CASES[name]
    run_backward_on_the_cpu(kind, n, dtype, rows, seed=7, column_sum=True,
                            config_of=lambda kernel: NormBwdConfig(ctas=3, lanes=True, **fields))
