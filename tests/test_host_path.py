"""The host side of a call on the CPU (issue 19 item 5): kernels stubbed out as in
`scripts/host_overhead.py --stub`, so every layer above TileLang's launch runs: the signature
cache and the ops' planned launches, the custom op's kernels (direct, redispatched, autograd).
No timing is asserted here (a shared CI machine); the script reports it."""


import pytest
import torch

import tileops
from tileops import LayerNormFwdOp, RMSNormFwdOp, TileOpsError
from tileops.ops.base import Op
from tileops.ops.signature import signature_of

from .helpers import load_script


@pytest.fixture(scope="module")
def host_overhead():
    return load_script("host_overhead")


@pytest.fixture
def stub(host_overhead):
    with host_overhead.stub_launches():
        yield


def bf16(*shape, requires_grad=False):
    return torch.randn(*shape, dtype=torch.bfloat16, requires_grad=requires_grad)


def test_every_row_of_the_stub_harness_runs(host_overhead, stub):
    rows = host_overhead.layer_rows("cpu")
    for fn in rows.values():
        fn()
    assert "torch.ops.tileops.rms_norm_fwd" in rows


def test_stub_kernels_do_not_outlive_the_stub(host_overhead):
    before = dict(Op._kernels)
    with host_overhead.stub_launches():
        RMSNormFwdOp(normalized_shape=[256])(bf16(4, 256), bf16(256))
        assert len(Op._kernels) > len(before)
    assert Op._kernels == before


def test_a_seen_signature_launches_through_the_plan_and_a_new_one_is_validated(stub):
    op = RMSNormFwdOp(normalized_shape=[256])
    x, w = bf16(8, 256), bf16(256)
    assert op(x, w).shape == (8, 256)
    launch = op._validated[signature_of((x, w))]
    assert launch is not None  # the planned launch
    assert op(bf16(8, 256), bf16(256)).shape == (8, 256)
    # same shapes, a strided input: the plan hands it to forward (which copies it)
    assert op(bf16(256, 8).t(), w).shape == (8, 256)
    # a new signature is checked in full, after a cached one, with the same errors
    with pytest.raises(TileOpsError, match=r"RMSNormFwdOp: argument 'weight': expected "):
        op(x, bf16(128))
    with pytest.raises(TileOpsError, match=r"RMSNormFwdOp: argument 'weight': expected dtype"):
        op(x, w.half())
    with pytest.raises(TileOpsError, match=r"RMSNormFwdOp: argument 'input': expected a "
                                           r"torch.Tensor"):
        op([1.0], w)


def test_planned_launches_decline_what_they_do_not_serve(stub):
    assert RMSNormFwdOp(normalized_shape=[4, 64]).plan(bf16(8, 4, 64), None) is None
    assert RMSNormFwdOp(normalized_shape=[64]).plan(bf16(2, 4, 64), None) is None
    assert LayerNormFwdOp(normalized_shape=[64]).plan(bf16(0, 64), None, None) is None
    assert LayerNormFwdOp(normalized_shape=[64]).plan(bf16(3, 64), None, None) is not None


def test_pin_config_replaces_the_planned_launch(stub):
    op = RMSNormFwdOp(normalized_shape=[256])
    x, w = bf16(8, 256), bf16(256)
    op(x, w)
    kernel = op._kernel(x, w)
    op.pin_config(kernel.config_for(kernel.bucket_of(8)), x, w)
    assert not op._validated and not op._call_memo
    op(x, w)
    assert op._kernel(x, w) is not kernel  # the pinned copy


def test_custom_op_direct_redispatched_and_differentiable_paths(stub):
    x, w = bf16(8, 256), bf16(256)
    # CPU tensors, no grad: the autograd kernel calls the real kernel directly
    assert torch.ops.tileops.rms_norm_fwd(x, [256], w, 1e-5).shape == (8, 256)
    with torch.no_grad():
        assert torch.ops.tileops.layer_norm_fwd(x, [256], w, w, 1e-5).shape == (8, 256)
    # meta tensors: the redispatch to the fake (meta) kernel
    m = torch.empty(8, 256, dtype=torch.bfloat16, device="meta")
    out = torch.ops.tileops.rms_norm_fwd(m, [256], w.to("meta"), None)
    assert out.device.type == "meta" and out.shape == (8, 256)
    # inputs that need grad: the registered formula runs in backward
    xg, wg = bf16(8, 256, requires_grad=True), bf16(256, requires_grad=True)
    y = torch.ops.tileops.rms_norm_fwd(xg, [256], wg, 1e-5)
    assert y.requires_grad
    y.sum().backward()
    assert xg.grad.shape == xg.shape and wg.grad.shape == wg.shape
    xg.grad = wg.grad = None
    tileops.layer_norm(xg, [256], wg, None).sum().backward()
    assert xg.grad.shape == xg.shape and wg.grad.shape == wg.shape


def test_custom_op_still_rejects_what_the_op_rejects():
    x = bf16(8, 256)  # no stub: CPU tensors are no launch device
    with pytest.raises(TileOpsError, match=r"RMSNormFwdOp: argument 'input': expected a CUDA "
                                           r"tensor, got a tensor on cpu"):
        torch.ops.tileops.rms_norm_fwd(x, [256], bf16(256), 1e-5)
    with pytest.raises(TileOpsError, match=r"RMSNormFwdOp: argument 'input': expected a CUDA "
                                           r"tensor, got a tensor on cpu"):
        tileops.rms_norm(bf16(8, 256, requires_grad=True), [256], bf16(256), 1e-5)


def test_an_op_without_a_formula_says_so_in_backward(stub):
    from tileops import RMSNormBwdOp

    g, x, w = bf16(8, 256), bf16(8, 256, requires_grad=True), bf16(256)
    dx, _ = RMSNormBwdOp.through_custom_op(g, x, w, normalized_shape=[256], eps=1e-5)
    with pytest.raises(RuntimeError, match="no autograd formula"):
        dx.sum().backward()


def test_register_autograd_replaces_the_formula(stub):
    import tileops.ops.normalization as norm

    seen = []

    def spy(ctx, grad):
        seen.append(grad.shape)
        return norm._rms_norm_backward(ctx, grad)

    setup = RMSNormFwdOp._autograd_formula[1]
    RMSNormFwdOp.register_autograd(spy, setup_context=setup)
    try:
        tileops.rms_norm(bf16(8, 256, requires_grad=True), [256], bf16(256)).sum().backward()
    finally:
        RMSNormFwdOp.register_autograd(norm._rms_norm_backward, setup_context=setup)
    assert seen == [(8, 256)]


def test_gemm_plan_and_its_fallbacks(stub):
    from tileops import GemmFwdOp

    op = GemmFwdOp()
    a, b = bf16(16, 64), bf16(32, 64)
    for x, y in ((a, b), (bf16(16, 64), b), (bf16(64, 16).t(), b), (a, bf16(64, 32).t())):
        assert op(x, y).shape == (16, 32)
    assert op._validated[signature_of((a, b))]
    assert GemmFwdOp(trans_a=True).plan(bf16(64, 12), b) is None  # M % 8: forward copies a


def test_linear_plan_and_its_fallbacks(stub):
    from tileops import LinearFwdOp

    op = LinearFwdOp()
    x, w, b = bf16(16, 64), bf16(32, 64), bf16(32)
    for args in ((x, w, b), (bf16(16, 64), w, b), (bf16(64, 16).t(), w, b), (x, w, None),
                 (x, w, None), (bf16(2, 8, 64), w, b), (bf16(2, 8, 64), w, b)):
        assert op(*args).shape == (*args[0].shape[:-1], 32)
    assert op._validated[signature_of((x, w, b))]
    assert op.plan(bf16(2, 8, 64), w, b) is None  # 3-D input: forward's views


def test_fused_add_plan_and_the_in_place_form(stub):
    from tileops import FusedAddRMSNormFwdOp

    op = FusedAddRMSNormFwdOp(eps=1e-6)
    x, r, w = bf16(8, 256), bf16(8, 256), bf16(256)
    for args in ((x, r, w), (bf16(8, 256), r, w), (x, bf16(256, 8).t(), w)):
        y, h = op(*args)
        assert y.shape == h.shape == (8, 256)
    assert op._validated[signature_of((x, r, w))]
    for shape in ((8, 256), (2, 4, 256)):
        a, b = bf16(*shape), bf16(*shape)
        out, res = tileops.fused_add_rms_norm_(a, b, w)
        assert out is a and res is b


def test_argmax_plan_and_its_fallbacks(stub):
    from tileops import ArgmaxFwdOp

    op = ArgmaxFwdOp(dim=-1)
    x = bf16(8, 1000)
    for logits in (x, bf16(8, 1000), bf16(1000, 8).t()):  # the last: strided, to forward
        out = op(logits)
        assert out.shape == (8,) and out.dtype == torch.int64
    assert op._validated[signature_of((x,))] is not None
    assert ArgmaxFwdOp(dim=-1, keepdim=True).plan(x) is None
    assert ArgmaxFwdOp().plan(x) is None  # dim=None: the flattened tensor
    assert op.plan(bf16(2, 4, 1000)) is None  # leading dims: forward's view
    assert op.plan(bf16(0, 1000)) is None
    assert tileops.argmax(x, -1, keepdim=True).shape == (8, 1)


def test_planned_launches_call_the_bound_executable_until_the_bucket_is_repinned(
        stub, monkeypatch):
    """A plan calls its bucket's executable itself (`Kernel.bind`) with the arguments the
    kernel's run would pass, and goes back through the kernel once the bucket holds another
    pick (here: a test's)."""
    from tileops import SoftmaxFwdOp
    from tileops.kernels import base as kernels_base

    calls = []
    monkeypatch.setattr(kernels_base.Kernel, "compile",
                        lambda self, config, bucket: (lambda *args: calls.append(args),) * 4)
    x, w = bf16(8, 256), bf16(256)
    for op, inputs, expected in (
            (RMSNormFwdOp(normalized_shape=[256], eps=1e-5), (x, w), (x, w, "out", 1e-5)),
            (RMSNormFwdOp(normalized_shape=[256], eps=1e-5), (x, None), (x, "out", 1e-5)),
            (LayerNormFwdOp(normalized_shape=[256]), (x, w, w), (x, w, w, "out", 1e-5)),
            (SoftmaxFwdOp(), (x,), (x, "out", 1))):
        for planned in (False, True):  # the first call plans, the second takes the plan
            calls.clear()
            with monkeypatch.context() as patch:
                if planned:  # the executable directly: the kernel itself is never called
                    patch.setattr(kernels_base.Kernel, "__call__", None)
                out = op(*inputs)
            assert len(calls) == 1
            got = calls[0]
            assert len(got) == len(expected) and all(
                (g is out) if e == "out" else (g is e or g == e)
                for g, e in zip(got, expected, strict=True))
        kernel = next(iter(op._call_memo.values()))
        bucket = kernel.bucket_of(8)
        repinned = []
        kernel._by_bucket[bucket] = (kernel._by_bucket[bucket][0],
                                     (lambda *args, sink=repinned: sink.append(args),) * 4)
        calls.clear()
        op(*inputs)
        assert not calls and len(repinned) == 1, type(op).__name__


def test_signatures_tell_apart_what_validation_depends_on():
    from tileops.ops.signature import signature_builder

    x, w = bf16(8, 256), bf16(256)
    sigs = [signature_of(inputs) for inputs in (
        (x, w), (x, None), (x, w.float()), (x, bf16(255)), (bf16(8, 255), w),
        (x, w, None), (x, None, w), (x, w, w), (x,), (x, w, w, None),
        (x, None, None, w))]
    assert len(set(sigs)) == len(sigs)
    assert signature_of((x, w)) == signature_of((bf16(8, 256), bf16(256)))
    # (CPU and meta tensors share device index -1: neither kind of signature is ever kept,
    # CPU inputs failing validation, meta ones returning before it is kept: test_meta.py)
    assert signature_builder(2)((x, w)) == signature_of((x, w))
    with pytest.raises(ValueError):  # an op's own builder takes all of its inputs
        signature_builder(2)((x,))
    with pytest.raises(AttributeError):
        signature_of(([1.0], w))


def test_functionals_reuse_the_launch_their_instance_planned(stub, monkeypatch):
    """The second call of a functional with a seen signature goes straight to the planned
    launch (Op.run never runs); a new signature is validated in full, with the op's errors;
    pin_config drops the launches its class kept."""
    from tileops import ArgmaxFwdOp, SoftmaxFwdOp

    x, w = bf16(8, 256), bf16(256)
    calls = [lambda: tileops.rms_norm(x, [256], w, 1e-5),
             lambda: tileops.rms_norm(x, 256, None),
             lambda: tileops.layer_norm(x, [256], w, None),
             lambda: tileops.softmax(x), lambda: tileops.argmax(x, -1)]
    first = [call() for call in calls]
    with monkeypatch.context() as patch:
        patch.setattr(Op, "run", None)
        for call, out in zip(calls, first, strict=True):
            again = call()
            assert again.shape == out.shape and again.dtype == out.dtype
    for cls in (RMSNormFwdOp, LayerNormFwdOp, SoftmaxFwdOp, ArgmaxFwdOp):
        assert cls._keyed_launches
    with pytest.raises(TileOpsError, match=r"RMSNormFwdOp: argument 'weight': expected "):
        tileops.rms_norm(x, [256], bf16(128), 1e-5)
    with pytest.raises(TileOpsError, match=r"LayerNormFwdOp: argument 'bias': expected dtype"):
        tileops.layer_norm(x, [256], w, w.float())
    with pytest.raises(TileOpsError, match=r"RMSNormFwdOp: argument 'input': expected a "
                                           r"torch.Tensor"):
        tileops.rms_norm([1.0], [256], w, 1e-5)
    op = RMSNormFwdOp.cached(normalized_shape=(256,), eps=1e-5)
    kernel = op._kernel(x, w)
    op.pin_config(kernel.config_for(kernel.bucket_of(8)), x, w)
    assert not RMSNormFwdOp._keyed_launches


def test_argmax_split_rows_launch_their_executable_with_the_scratch(stub, monkeypatch):
    """Rows split over CTAs meet in a zeroed scratch buffer: the planned launch calls the
    executable with it (`ArgmaxKernel.direct_call`), as the kernel's run would."""
    from tileops import ArgmaxFwdOp
    from tileops.kernels import base as kernels_base

    calls = []
    monkeypatch.setattr(kernels_base.Kernel, "compile",
                        lambda self, config, bucket: (lambda *args: calls.append(args),) * 4)
    op = ArgmaxFwdOp(dim=-1)
    logits = bf16(64, 32000)
    op(logits)
    kernel = next(iter(op._call_memo.values()))
    assert kernel.splits(kernel.select(64)[0]) > 1
    calls.clear()
    with monkeypatch.context() as patch:
        patch.setattr(kernels_base.Kernel, "__call__", None)
        out = op(logits)
    (got,) = calls
    assert got[0] is logits and got[2] is out and got[1].dtype == torch.uint64
    assert got[1].shape[0] >= 2 and got[1].shape[1] >= 64 and not got[1].any()


@pytest.mark.compile
def test_row_executables_reject_strided_inputs_with_a_stride_error():
    """Planned row launches check alignment only and leave strides to TileLang's executable,
    which raises one of STRIDE_ERRORS before launching (here on CPU tensors: its stride
    check comes before its device check): the plan then sends the call to forward."""
    from tileops.kernels.normalization import RMSNormKernel
    from tileops.ops.layout import STRIDE_ERRORS

    exe = RMSNormKernel(gpu="h200", dtype="bfloat16", n=256, has_weight=True).select(8)[1][0]
    x, w, y = bf16(256, 8).t(), bf16(256), bf16(8, 256)
    with pytest.raises(STRIDE_ERRORS, match="strides"):
        exe(x, w, y, 1e-5)
    with pytest.raises(STRIDE_ERRORS, match="device_type"):  # contiguous: the next check
        exe(x.contiguous(), w, y, 1e-5)


def test_custom_op_records_autograd_for_any_input_that_needs_grad(stub):
    """The custom op's autograd kernel reads requires_grad off the schema's tensor arguments
    (an optional one may be None): a weight alone needing grad is recorded, params never."""
    x, w = bf16(8, 256), bf16(256, requires_grad=True)
    y = torch.ops.tileops.rms_norm_fwd(x, [256], w, 1e-5)
    assert y.requires_grad
    y.sum().backward()
    assert w.grad is not None and w.grad.shape == w.shape
    assert not torch.ops.tileops.rms_norm_fwd(x, [256], None, 1e-5).requires_grad
    b = bf16(256, requires_grad=True)
    out = torch.ops.tileops.layer_norm_fwd(x, [256], None, b, 1e-5)
    assert out.requires_grad
    with torch.no_grad():
        assert not torch.ops.tileops.layer_norm_fwd(x, [256], None, b, 1e-5).requires_grad
