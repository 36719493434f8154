"""Op layer on the CPU: validation errors, fake/meta outputs, roofline counts, registration."""

import pytest
import torch

import tileops
from tileops import (
    GemmFwdOp,
    RMSNormFwdOp,
    TileOpsError,
    TileOpsTypeError,
    TileOpsUnsupportedError,
    TileOpsValueError,
)
from tileops.ops.base import Op, custom_op_name

pytestmark = pytest.mark.smoke


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def test_error_types_are_also_builtin_types():
    assert issubclass(TileOpsTypeError, TypeError) and issubclass(TileOpsTypeError, TileOpsError)
    assert issubclass(TileOpsValueError, ValueError)
    assert issubclass(TileOpsUnsupportedError, ValueError)


@pytest.mark.parametrize("a, b, err, pattern", [
    (meta(8, 64, dtype=torch.float32), meta(16, 64), TileOpsTypeError,
     r"GemmFwdOp: argument 'a': expected dtype float16 \| bfloat16, got torch.float32"),
    (meta(8, 64), meta(16, 64, dtype=torch.float16), TileOpsTypeError,
     r"argument 'b': expected dtype torch.bfloat16 \(same as 'a'\), got torch.float16"),
    (meta(8, 64), meta(16, 32), TileOpsValueError,
     r"argument 'b': expected shapes satisfying .*== K`, got b.shape=\(16, 32\), K=64"),
    (meta(2, 8, 64), meta(16, 64), TileOpsValueError,
     r"argument 'a': expected shapes satisfying `a.ndim == 2`, got a.shape=\(2, 8, 64\)"),
    (meta(8, 64), "w", TileOpsTypeError, r"argument 'b': expected a torch.Tensor, got str"),
])
def test_gemm_bad_input(a, b, err, pattern):
    with pytest.raises(err, match=pattern):
        GemmFwdOp().check([a, b])


def test_cpu_tensors_are_rejected():
    a, b = torch.randn(8, 64).half(), torch.randn(16, 64).half()
    with pytest.raises(TileOpsValueError, match=r"GemmFwdOp: argument 'a': expected a CUDA "
                                                r"tensor, got a tensor on cpu"):
        tileops.gemm(a, b)
    with pytest.raises(TileOpsValueError, match="RMSNormFwdOp: argument 'input'"):
        tileops.rms_norm(torch.randn(4, 64).half(), [64])


@pytest.mark.parametrize("x, shape, w, pattern", [
    (meta(4, 64), [32], None, r"argument 'input': expected shapes satisfying"),
    (meta(4, 64), [64], meta(32), r"argument 'weight': expected shapes satisfying"),
    (meta(64), [4, 64], None, r"argument 'input'"),
    (meta(4, 64), [], None, r"argument 'normalized_shape'"),
])
def test_rms_norm_bad_shapes(x, shape, w, pattern):
    with pytest.raises(TileOpsValueError, match=pattern):
        RMSNormFwdOp(normalized_shape=shape).check([x, w])


def test_bad_params():
    with pytest.raises(TileOpsTypeError, match=r"GemmFwdOp: argument 'trans_a': expected bool"):
        GemmFwdOp(trans_a=1)
    with pytest.raises(TileOpsTypeError, match=r"argument 'eps': expected float \| None"):
        RMSNormFwdOp(normalized_shape=[8], eps="small")
    with pytest.raises(TileOpsTypeError, match=r"argument 'normalized_shape'"):
        RMSNormFwdOp(normalized_shape=[8.0])
    with pytest.raises(TileOpsTypeError, match=r"argument 'b': expected a tensor, got None"):
        GemmFwdOp().check([meta(4, 4), None])


def test_fake_outputs_follow_the_manifest():
    out = torch.ops.tileops.gemm_fwd(meta(100, 64), meta(48, 64), False, True)
    assert out.shape == (100, 48) and out.dtype == torch.bfloat16 and out.device.type == "meta"
    out = torch.ops.tileops.gemm_fwd(meta(64, 100), meta(64, 48), True, False)
    assert out.shape == (100, 48)
    x = meta(2, 7, 128, dtype=torch.float16)
    out = torch.ops.tileops.rms_norm_fwd(x, [128], None, None)
    assert out.shape == x.shape and out.dtype == torch.float16


def test_fake_tensor_mode_checks_inputs():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a, b = torch.empty(8, 64, dtype=torch.float16), torch.empty(16, 64, dtype=torch.float16)
        assert torch.ops.tileops.gemm_fwd(a, b, False, True).shape == (8, 16)
        with pytest.raises(TileOpsValueError):
            torch.ops.tileops.gemm_fwd(a, torch.empty(16, 32, dtype=torch.float16), False, True)


def test_roofline_matches_hand_counts():
    m, n, k = 4096, 6144, 4096
    assert GemmFwdOp().eval_roofline(meta(m, k), meta(n, k)) == (
        2 * m * n * k, 2 * (m * k + n * k + m * n))
    assert GemmFwdOp(trans_a=True, trans_b=False).eval_roofline(meta(k, m), meta(k, n)) == (
        2 * m * n * k, 2 * (m * k + n * k + m * n))
    rows, hidden = 8192, 4096
    x, w = meta(rows, hidden, dtype=torch.float16), meta(hidden, dtype=torch.float16)
    op = RMSNormFwdOp(normalized_shape=[hidden])
    assert op.eval_roofline(x, w) == (4 * rows * hidden, 2 * (2 * rows * hidden + hidden))
    assert op.eval_roofline(x) == (3 * rows * hidden, 2 * 2 * rows * hidden)
    with pytest.raises(TileOpsValueError, match="before any call"):
        op.eval_roofline()


def test_custom_op_names_and_schemas():
    assert custom_op_name("RMSNormFwdOp") == "rms_norm_fwd"
    assert custom_op_name("GroupedQueryAttentionBwdOp") == "grouped_query_attention_bwd"
    assert str(torch.ops.tileops.gemm_fwd.default._schema) == (
        "tileops::gemm_fwd(Tensor a, Tensor b, bool trans_a, bool trans_b) -> Tensor")
    assert str(torch.ops.tileops.rms_norm_fwd.default._schema) == (
        "tileops::rms_norm_fwd(Tensor input, int[] normalized_shape, Tensor? weight, "
        "float? eps) -> Tensor")


def test_cached_instances_are_shared_per_params():
    assert GemmFwdOp.cached(trans_a=False, trans_b=True) is GemmFwdOp.cached(
        trans_a=False, trans_b=True)
    assert GemmFwdOp.cached(trans_a=True, trans_b=True) is not GemmFwdOp.cached(
        trans_a=False, trans_b=True)


def test_cached_instances_tell_equal_values_of_other_types_apart():
    """5 and 5.0 (and True and 1) hash alike: an instance made for one must not serve the
    other, whose param check would have refused it."""
    from tileops import TopkFwdOp
    from tileops.errors import TileOpsTypeError

    assert TopkFwdOp.cached(k=5) is TopkFwdOp.cached(k=5)
    with pytest.raises(TileOpsTypeError, match="'k'"):
        TopkFwdOp.cached(k=5.0)
    shape = RMSNormFwdOp.cached(normalized_shape=[64], eps=None)  # a list: frozen, still cached
    assert shape is RMSNormFwdOp.cached(normalized_shape=[64], eps=None)


def test_functionals_find_their_shared_instance_by_key(monkeypatch):
    """rms_norm / layer_norm look their instance up by (shape, eps, type(eps)), softmax and
    argmax by their dims (`Op.apply_keyed`): the instance `cached` gives for those params."""
    seen = []
    monkeypatch.setattr(Op, "run", lambda self, *inputs: seen.append(self))
    x, w = torch.randn(4, 64), torch.randn(64)
    for _ in range(2):
        tileops.rms_norm(x, [64], w, 1e-6)
        tileops.rms_norm(x, 64, w, 1e-6)
    assert all(op is RMSNormFwdOp.cached(normalized_shape=(64,), eps=1e-6) for op in seen)
    seen.clear()
    tileops.layer_norm(x, [64], w, w, eps=1)
    tileops.layer_norm(x, [64], w, w, eps=1.0)
    tileops.layer_norm(x, (64,), w, w, eps=1e-5)
    assert seen[0] is seen[1] is not seen[2]  # (eps is made a float before the op sees it)
    assert seen[0].eps == 1.0 and type(seen[0].eps) is float
    assert len({id(op) for op in RMSNormFwdOp._keyed.values()}) <= len(RMSNormFwdOp._instances)
    seen.clear()
    for _ in range(2):
        tileops.softmax(x)
        tileops.argmax(x, -1)
    from tileops import ArgmaxFwdOp, SoftmaxFwdOp

    assert seen[0] is seen[2] is SoftmaxFwdOp.cached(dim=-1)
    assert seen[1] is seen[3] is ArgmaxFwdOp.cached(dim=-1, keepdim=False)


def test_unsupported_gpu_is_rejected(monkeypatch):
    from tileops.kernels import base

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (8, 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    base._target_cache.clear()
    with pytest.raises(TileOpsUnsupportedError, match="compute capability 8.0.*Hopper"):
        base.target_for_device(torch.device("cuda", 0), "GemmFwdOp")
    base._target_cache.clear()


def test_kernel_buckets_are_few():
    from tileops.kernels.gemm import GemmKernel

    kernel = GemmKernel(dtype="bfloat16", n=4096, k=4096, trans_a=False, trans_b=True)
    buckets = {kernel.bucket_of(m) for m in range(1, 20000, 3)}
    assert len(buckets) == 12  # powers of two from 16 to 16K rows, then "large"


@pytest.mark.parametrize("q, k, v, params, err, pattern", [
    (meta(1, 8, 6, 128), meta(1, 8, 4, 128), meta(1, 8, 4, 128), {}, TileOpsValueError,
     r"argument 'k': expected shapes satisfying `H % Hkv == 0`, "
     r"got k.shape=\(1, 8, 4, 128\), H=6, Hkv=4$"),
    (meta(1, 8, 8, 72), meta(1, 8, 2, 72), meta(1, 8, 2, 72), {}, TileOpsValueError,
     r"`D in \(64, 80, 96, 128, 192, 256\)`, got q.shape=\(1, 8, 8, 72\), D=72"),
    (meta(1, 8, 8, 128), meta(1, 8, 2, 128), meta(1, 9, 2, 128), {}, TileOpsValueError,
     r"argument 'v': expected shape \[B, Skv, Hkv, Dv\] with Skv = 8 \(from k\)"),
    (meta(8, 8, 128), meta(1, 8, 2, 128), meta(1, 8, 2, 128), {}, TileOpsValueError,
     r"argument 'q': expected shape \[B, Sq, H, D\] \(4 dims\)"),
    (meta(1, 8, 8, 128, dtype=torch.float32), meta(1, 8, 2, 128), meta(1, 8, 2, 128), {},
     TileOpsTypeError, r"argument 'q': expected dtype float16 \| bfloat16"),
    (meta(1, 8, 8, 128), meta(1, 8, 2, 128), meta(1, 8, 2, 128), {"window_size": [-2, 0]},
     TileOpsValueError, r"argument 'window_size'"),
    # the kernels take the row max of the raw scores: a scale <= 0 would overflow exp2
    (meta(1, 8, 8, 128), meta(1, 8, 2, 128), meta(1, 8, 2, 128), {"scale": -0.1},
     TileOpsValueError, r"argument 'scale': expected .*scale > 0`, got scale=-0.1"),
    (meta(1, 8, 8, 128), meta(1, 8, 2, 128), meta(1, 8, 2, 128), {"scale": 0.0},
     TileOpsValueError, r"argument 'scale'"),
])
def test_attention_bad_input(q, k, v, params, err, pattern):
    from tileops import GroupedQueryAttentionFwdOp

    with pytest.raises(err, match=pattern):
        GroupedQueryAttentionFwdOp(**params).check([q, k, v])


def test_attention_roofline_counts_visible_pairs():
    from tileops import GroupedQueryAttentionFwdOp
    from tileops.perf.formulas import visible_pairs

    assert visible_pairs(4, 4, -1, 0) == 10                  # causal: 1 + 2 + 3 + 4
    assert visible_pairs(2, 4, -1, 0) == 3 + 4               # bottom-right aligned
    assert visible_pairs(4, 2, -1, 0) == 0 + 0 + 1 + 2       # first rows see nothing
    assert visible_pairs(5, 5, 1, 0) == 1 + 2 + 2 + 2 + 2    # sliding window of 2
    assert visible_pairs(3, 3, -1, -1) == 9
    b, s, h, hkv, d = 2, 1024, 32, 8, 128
    flops, nbytes = GroupedQueryAttentionFwdOp(is_causal=True).eval_roofline(
        meta(b, s, h, d), meta(b, s, hkv, d), meta(b, s, hkv, d))
    assert flops == 4 * b * h * d * (s * (s + 1) // 2)
    assert nbytes == 2 * (2 * b * s * h * d + 2 * b * s * hkv * d) + 4 * b * h * s


def test_attention_autograd_is_wired_through_the_custom_ops():
    """On meta tensors the fake implementations run: forward, then the backward op."""
    q = torch.empty(2, 64, 8, 128, dtype=torch.bfloat16, device="meta", requires_grad=True)
    k = torch.empty(2, 80, 2, 128, dtype=torch.bfloat16, device="meta", requires_grad=True)
    v = torch.empty(2, 80, 2, 128, dtype=torch.bfloat16, device="meta", requires_grad=True)
    out = tileops.attention(q, k, v, is_causal=True)
    assert out.requires_grad and out.shape == q.shape
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


def test_pin_config_changes_only_that_op_instance(monkeypatch):
    """Tests pin each config of a space on one op; the shared kernel must keep its own."""
    from tileops import GroupedQueryAttentionFwdOp
    from tileops.kernels.attention.attention_fwd import AttentionFwdConfig, AttentionFwdKernel
    from tileops.kernels.base import SM90A, Kernel

    shared = AttentionFwdKernel(target=SM90A, gpu="h200", dtype="bfloat16", heads=8,
                                kv_heads=2, head_dim=128, window_left=-1, window_right=0,
                                softcap=0.0)
    monkeypatch.setattr(GroupedQueryAttentionFwdOp, "_shared_kernel",
                        lambda self, dispatch_key, device, key: shared)
    monkeypatch.setattr(Kernel, "compile", lambda self, config, bucket: ("compiled",))
    monkeypatch.setattr("tileops.kernels.base.launchers", lambda compiled: compiled)
    pinned = GroupedQueryAttentionFwdOp(is_causal=True)
    other = GroupedQueryAttentionFwdOp(is_causal=True)
    q, k, v = meta(1, 300, 8, 128), meta(1, 300, 2, 128), meta(1, 300, 2, 128)
    config = AttentionFwdConfig(block_n=64, stages=1, overlap=True)
    pinned.pin_config(config, q, k, v)
    key = pinned._kernel_key(torch.bfloat16, 8, 2, 128)
    assert pinned.get_kernel("attention_fwd", q.device, **key).select(300)[0] == config
    assert other.get_kernel("attention_fwd", q.device, **key) is shared
    assert shared._by_bucket == {}


def test_varlen_attention_autograd_is_wired_through_the_custom_ops():
    """attention_varlen differentiates through the dense backward op on a padded batch."""
    def leaf(*shape):
        return torch.empty(*shape, dtype=torch.float16, device="meta", requires_grad=True)

    q, k, v = leaf(70, 8, 64), leaf(90, 2, 64), leaf(90, 2, 64)
    cu_q = torch.empty(4, dtype=torch.int32, device="meta")
    cu_kv = torch.empty(4, dtype=torch.int32, device="meta")
    out = tileops.attention_varlen(q, k, v, cu_q, cu_kv, 40, 50, is_causal=True)
    assert out.requires_grad and out.shape == q.shape
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


def test_attention_backward_refuses_head_dim_80_by_name():
    """Phi-2's head_dim 80 runs forward only: the backward says so, naming the rule."""
    from tileops import GroupedQueryAttentionBwdOp

    q, kv = meta(1, 8, 8, 80), meta(1, 8, 2, 80)
    lse = meta(1, 8, 8, dtype=torch.float32)
    with pytest.raises(TileOpsValueError, match=r"GroupedQueryAttentionBwdOp: argument 'do'.*"
                                                r"`D in \(64, 96, 128, 192, 256\)`.*D=80"):
        GroupedQueryAttentionBwdOp().check([q, q, kv, kv, q, lse])
