"""MLA decode without a GPU: shape errors naming the argument, meta outputs, the
roofline, the launch arguments, and (marker `compile`) the generated CUDA."""


import pytest
import torch

import tileops
from tileops import MLADecodeFwdOp, TileOpsValueError
from tileops.kernels.attention.decode import target_slots
from tileops.kernels.attention.mla_decode import MLADecodeKernel

from ..helpers import assert_no_spills_or_serialized_wgmma, meta


def inputs(batch=4, heads=128, dc=512, dr=64, page=64, n_pages=100, max_pages=8):
    return (meta(batch, heads, dc), meta(batch, heads, dr), meta(n_pages, page, dc + dr),
            meta(batch, dtype=torch.int32), meta(batch, max_pages, dtype=torch.int32))


@pytest.mark.smoke
@pytest.mark.parametrize("args, pattern", [
    (inputs(dc=256), r"`Dc == 512`"),
    (inputs(page=16), r"argument 'kv_cache': expected shapes satisfying "
                      r"`S in \(64, 128, 256\)`"),
    (inputs()[:1] + (meta(4, 64, 64),) + inputs()[2:], r"`Bp == B and Hp == H`"),
    (inputs()[:3] + (meta(3, dtype=torch.int32),) + inputs()[4:], r"`Bs == B`"),
])
def test_bad_shapes_name_the_argument(args, pattern):
    with pytest.raises(TileOpsValueError, match=pattern):
        MLADecodeFwdOp()(*args)


@pytest.mark.smoke
def test_meta_outputs_and_roofline():
    o, lse = tileops.mla_decode(*inputs(), return_lse=True)
    assert o.shape == (4, 128, 512) and lse.shape == (4, 128) and lse.dtype == torch.float32
    for heads in (16, 32, 96):  # tensor-parallel shards: a block's rows past H masked
        o, lse = tileops.mla_decode(*inputs(heads=heads), return_lse=True)
        assert o.shape == (4, heads, 512) and lse.shape == (4, heads)
    q_nope, q_pe, kv, _, table = inputs(batch=2)
    lens = torch.tensor([100, 1000], dtype=torch.int32)
    flops, nbytes = MLADecodeFwdOp().eval_roofline(q_nope, q_pe, kv, lens, table)
    assert flops == 2 * 128 * (2 * 512 + 64) * 1100
    pages = (2 + 16) * 4
    assert nbytes == (1100 * 576 + 2 * 128 * (512 + 64) + 2 * 128 * 512) * 2 + 2 * 128 * 4 \
        + 2 * 4 + pages


@pytest.mark.smoke
@pytest.mark.parametrize("waves", [1, 4])
def test_launch_arguments(monkeypatch, waves):
    """The launch's tensors; the partials hold the batch plus the kernel's `split_waves`
    waves of slots (a fitted schedule's config may take up to 4)."""
    op = MLADecodeFwdOp(sm_scale=0.125)
    log = []

    class Recorder:
        def __call__(self, size, *tensors):
            log.append(tensors)

        def split_waves(self, size):
            return waves

    monkeypatch.setattr(op, "get_kernel", lambda dispatch, device, **key: Recorder())
    q_nope = torch.randn(3, 128, 512).to(torch.bfloat16)
    q_pe = torch.randn(3, 128, 64).to(torch.bfloat16)
    kv = torch.randn(10, 64, 576).to(torch.bfloat16)
    lens = torch.tensor([5, 64, 600], dtype=torch.int32)
    table = torch.zeros(3, 10, dtype=torch.int32)
    o, lse = op.forward(q_nope, q_pe, kv, lens, table)
    (args,) = log
    (schedule, _, _, kv_arg, _, _, slot_table, split_ends, o_arg, lse_arg, o_part, lse_part,
     target, scale) = args
    assert schedule is True and kv_arg is kv and scale == 0.125
    slots = 3 + waves * 66
    # the tuner compares all but the work buffers (a fitted schedule's slots differ)
    assert MLADecodeKernel.workspace_args == {i for i, t in enumerate(args) if any(
        t is w for w in (slot_table, split_ends, o_part, lse_part))}
    assert target == target_slots(1, 2) == 66 and slot_table.shape == (slots, 4)
    assert o_arg.shape == (3, 1, 128, 512) and o_arg.data_ptr() == o.data_ptr()
    assert lse_arg.shape == (3, 128, 1) and o_part.shape == (slots, 1, 128, 512)
    assert lse_part.shape == (slots, 1, 128) and split_ends.shape == (3,)


@pytest.mark.compile
@pytest.mark.full
@pytest.mark.parametrize("seesaw, heads", [(False, 128), (True, 128), (False, 16)],
                         ids=["default", "seesaw", "16-heads"])
def test_mla_program_uses_tma_and_wgmma_without_spills(tmp_path, seesaw, heads):
    """Both consumer warpgroups run wgmma (plain: S by columns, P V by 256 output columns
    each, a producer warp group; seesaw: a whole S each, P V from registers and from the
    other's shared P, the consumers issue their own loads), the latent tile arrives by TMA,
    ptxas: no spills, no serialized wgmma. 16 heads (TP 8): q's rows past H load zeros,
    the outputs' are not stored."""
    import tilelang

    from tileops.kernels.attention.mla_decode import MLADecodeKernel

    kernel = MLADecodeKernel(dtype="bfloat16", heads=heads, dim=512, rope=64, page_size=64)
    bucket = "long" if seesaw else "short"
    config = kernel.heuristic_config(bucket, "sm_90a")
    assert config.seesaw == seesaw
    assert config.smem_bytes(512, 64) <= 227 * 1024 - 1024
    compiled = tilelang.compile(kernel.program(config, bucket)[1], target=kernel.target)
    source = compiled.get_kernel_source()
    assert "tma_load" in source and "wgmma_ss" in source
    if seesaw:
        assert "wgmma_rs" in source and "__named_barrier_arrive" in source
        assert "CacheHintSm90::EVICT_FIRST" in source
    else:
        assert "warpgroup_reg_alloc" in source
    # q by TMA, or where H is not a multiple of 64, by loads that zero the rows past H
    assert ("q_nope_desc" in source) == (heads % 64 == 0)
    assert_no_spills_or_serialized_wgmma(compiled, tmp_path)


def test_seesaw_is_the_default_for_long_tables():
    """Calls whose block table can hold >= 4096 (request, 64 heads, 64-key tile) units
    (DeepSeek-V3's 128 heads from batch 32 x 4K, 16 x 8K) take the seesaw on pair runs,
    smaller ones the plain program; 64 heads, or a rope other than 64, keep the plain one."""
    from tileops.kernels.attention.mla_decode import MLADecodeKernel
    from tileops.ops.mla_decode import MLADecodeFwdOp

    def picks(heads, batch, table_keys, rope=64):
        kernel = MLADecodeKernel(dtype="bfloat16", heads=heads, dim=512, rope=rope,
                                 page_size=64)
        ns = {"q_nope": torch.empty(0, dtype=torch.bfloat16), "H": heads, "Dc": 512,
              "Dr": rope, "S": 64, "B": batch, "P": table_keys // 64}
        units = MLADecodeFwdOp().kernels_for(ns)[0][2]
        return units, kernel.heuristic_config(kernel.bucket_of(units), "sm_90a")

    assert picks(128, 32, 4096)[0] == 4096 and picks(128, 8, 8192)[0] == 2048
    for heads, batch, keys, seesaw in [(128, 32, 4096, True), (128, 16, 8192, True),
                                       (128, 128, 8192, True), (128, 32, 4032, False),
                                       (128, 8, 8192, False), (128, 1, 32768, False),
                                       (64, 64, 4096, False), (64, 512, 32768, False),
                                       (16, 256, 32768, False)]:
        config = picks(heads, batch, keys)[1]
        assert (config.seesaw, config.pair_runs) == (seesaw, seesaw), (heads, batch, keys)
    assert not picks(128, 32, 32768, rope=32)[1].seesaw
    odd = MLADecodeKernel(dtype="bfloat16", heads=128, dim=512, rope=32, page_size=64)
    assert not any(c.seesaw for c in odd.config_space("long"))


def test_partials_hold_the_configs_waves():
    """The op sizes the partials by the config a call will run: one wave for the defaults,
    `fit_waves` for a fitted config (pinned or tuned), the most any candidate takes while
    tuning."""
    from tileops.kernels.attention.mla_decode import FIT_WAVES, MLADecodeConfig, MLADecodeKernel

    key = dict(dtype="bfloat16", heads=128, dim=512, rope=64, page_size=64)
    kernel = MLADecodeKernel(**key)
    assert kernel.split_waves(100) == kernel.split_waves(8192) == 1
    kernel._by_bucket["long"] = (MLADecodeConfig(seesaw=True, pair_runs=True,
                                                 fit_waves=FIT_WAVES), ())
    assert kernel.split_waves(8192) == FIT_WAVES and kernel.split_waves(100) == 1
    assert MLADecodeKernel(tune=True, **key).split_waves(100) == FIT_WAVES


@pytest.mark.smoke
@pytest.mark.parametrize("kwargs, pattern", [
    (dict(batch_size=0), "argument 'batch_size': expected an int >= 1"),
    (dict(num_heads=0), "argument 'num_heads': expected an int >= 1"),
    (dict(max_pages=0), "argument 'max_pages'"),
    (dict(page_size=16), "argument 'page_size': expected 64 or 128 or 256"),
    (dict(head_dim=256), "argument 'head_dim': expected 512"),
    (dict(rope_dim=32), "argument 'rope_dim'"),
    (dict(dtype=torch.float32), "argument 'dtype'"),
    (dict(sm_scale=-1.0), "argument 'sm_scale'"),
])
def test_mla_plan_argument_errors(kwargs, pattern):
    args = dict(batch_size=4, num_heads=128, max_pages=8)  # checked before the device
    with pytest.raises(TileOpsValueError, match=f"MLADecodePlan: {pattern}"):
        tileops.plan_mla_decode(**{**args, **kwargs})


@pytest.mark.smoke
def test_mla_plan_launches(monkeypatch):
    """The plan fixes the kernel's size (batch x 64-head blocks x the table's 64-key
    tiles), schedules alone (no tensors but the lengths and its buffers), runs with or
    without a new schedule into the caller's out / lse, and names what does not match the
    plan."""
    from tileops.ops.mla_decode import MLADecodeFwdOp as Op

    log = []

    class Recorder:
        def __call__(self, size, *tensors):
            log.append((size, tensors))

        def split_waves(self, size):
            return 2

    monkeypatch.setattr(Op, "get_kernel", lambda self, dispatch, device, **key: Recorder())
    check = Op.check  # CPU tensors pass the device check: the launch is recorded
    monkeypatch.setattr(Op, "check", lambda self, inputs, require_cuda=False:
                        check(self, inputs))
    plan = tileops.plan_mla_decode(3, 128, 10, device="cpu", num_sms=132, sm_scale=0.125)
    assert plan.num_slots == 3 + 2 * 66 and plan.units == 3 * 2 * 10
    lens = torch.tensor([5, 64, 600], dtype=torch.int32)
    plan.schedule(lens)
    size, (schedule, q_nope, *_rest) = log[-1]
    assert size == 60 and schedule is True and q_nope is None
    q_nope = torch.randn(3, 128, 512).to(torch.bfloat16)
    q_pe = torch.randn(3, 128, 64).to(torch.bfloat16)
    kv = torch.randn(12, 64, 576).to(torch.bfloat16)
    table = torch.zeros(3, 10, dtype=torch.int32)
    out = torch.empty_like(q_nope)
    lse = torch.empty(3, 128)
    o, lse_out = plan.run(q_nope, q_pe, kv, lens, table, out=out, lse=lse, schedule=False)
    assert o is out and lse_out is lse
    (schedule, _, _, kv_arg, table_arg, lens_arg, slot_table, _, o_arg, lse_arg, o_part, _,
     target, scale) = log[-1][1]
    assert schedule is False and kv_arg is kv and scale == 0.125 and target == 66
    assert o_arg.shape == (3, 1, 128, 512) and o_arg.data_ptr() == out.data_ptr()
    assert lse_arg.shape == (3, 128, 1) and o_part.shape == (plan.num_slots, 1, 128, 512)
    assert slot_table is plan.buffers.slot_table
    with pytest.raises(TileOpsValueError, match=r"MLADecodePlan.run: argument 'block_table'"
                                                r": expected shape \[3, 10\]"):
        plan.run(q_nope, q_pe, kv, lens, torch.zeros(3, 9, dtype=torch.int32))
    with pytest.raises(TileOpsValueError, match="MLADecodePlan.run: argument 'q_nope'"):
        plan.run(q_nope.half(), q_pe, kv, lens, table)
    with pytest.raises(TileOpsValueError, match="MLADecodePlan.run: argument 'kv_cache'"):
        plan.run(q_nope, q_pe, kv.view(24, 32, 576), lens, table)
    with pytest.raises(TileOpsValueError, match="MLADecodePlan.run: argument 'lse'"):
        plan.run(q_nope, q_pe, kv, lens, table, lse=torch.empty(3, 128, 1))
    with pytest.raises(TileOpsValueError, match="MLADecodePlan.schedule: argument "
                                                "'cache_seqlens'"):
        plan.schedule(lens.long())
