"""Meta tensors through the op layer, argument orders and error messages (CPU, no kernels)."""

import copy
import inspect

import pytest
import torch

import tileops
from tileops import (
    GemmFwdOp,
    GroupedQueryAttentionFwdOp,
    ManifestError,
    RMSNormFwdOp,
    TileOpsTypeError,
    TileOpsValueError,
)
from tileops.manifest import get_spec
from tileops.manifest.spec import CompiledSpec

from .helpers import meta

pytestmark = pytest.mark.smoke


def fake_cuda(*shape, dtype=torch.bfloat16):
    """A tensor that says it lives on cuda:0, made without a GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(*shape, dtype=dtype, device="cuda")


# -- meta outputs -----------------------------------------------------------------------------
def test_functional_ops_return_meta_outputs():
    out = tileops.gemm(meta(100, 64), meta(48, 64))
    assert out.shape == (100, 48) and out.dtype == torch.bfloat16 and out.device.type == "meta"
    out = tileops.gemm(meta(64, 100, dtype=torch.float16), meta(64, 48, dtype=torch.float16),
                       trans_a=True, trans_b=False)
    assert out.shape == (100, 48) and out.dtype == torch.float16

    x, w = meta(2, 7, 128, dtype=torch.float16), meta(128, dtype=torch.float16)
    for out in (tileops.rms_norm(x, [128], w, 1e-5), tileops.rms_norm(x, 128)):
        assert out.shape == x.shape and out.dtype == torch.float16 and out.device.type == "meta"

    q, k, v = meta(2, 64, 8, 128), meta(2, 80, 2, 128), meta(2, 80, 2, 128)
    out = tileops.attention(q, k, v, is_causal=True)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device.type == "meta"


def test_varlen_attention_returns_meta_outputs():
    """cu_seqlens on meta carry no values: the shapes are checked, the lengths cannot be."""
    cu = torch.empty(4, dtype=torch.int32, device="meta")
    q, k, v = meta(70, 8, 64), meta(90, 2, 64), meta(90, 2, 64)
    out = tileops.attention_varlen(q, k, v, cu, cu, 40, 50, is_causal=True)
    assert out.shape == q.shape and out.device.type == "meta"
    with pytest.raises(TileOpsTypeError, match=r"argument 'cu_seqlens_q': expected dtype int32"):
        tileops.attention_varlen(q, k, v, cu.long(), cu, 40, 50)


def test_qk_192_v_128_on_meta_and_its_roofline():
    """o takes V's width; the roofline counts Q K^T at 192 and P V at 128."""
    q, k, v = meta(2, 16, 4, 192), meta(2, 16, 4, 192), meta(2, 16, 4, 128)
    o, lse = GroupedQueryAttentionFwdOp()(q, k, v)
    assert o.shape == (2, 16, 4, 128) and lse.shape == (2, 4, 16)
    flops, nbytes = GroupedQueryAttentionFwdOp().eval_roofline(q, k, v)
    pairs = 16 * 16
    assert flops == 2 * 2 * 4 * (192 + 128) * pairs
    assert nbytes == (2 * 16 * 4 * (192 + 128) + k.numel() + v.numel()) * 2 + 2 * 4 * 16 * 4
    assert tileops.attention(q, k, v).shape == (2, 16, 4, 128)


def test_op_objects_return_every_output_on_meta():
    q, k, v = meta(1, 16, 4, 64), meta(1, 16, 4, 64), meta(1, 16, 4, 64)
    o, lse = GroupedQueryAttentionFwdOp()(q, k, v)
    assert o.shape == q.shape and lse.shape == (1, 4, 16) and lse.dtype == torch.float32
    assert o.device.type == "meta" and lse.device.type == "meta"


def test_meta_calls_are_validated_every_time_and_never_launch(monkeypatch):
    op = GemmFwdOp()
    monkeypatch.setattr(GemmFwdOp, "forward", lambda self, *a: pytest.fail("launched"))
    a, b = meta(8, 64), meta(16, 64)
    assert op(a, b).shape == (8, 16)
    assert op(a, b).shape == (8, 16)
    assert not op._validated  # meta signatures stay out of the CUDA fast path's cache
    assert op.eval_roofline() == (2 * 8 * 16 * 64, 2 * (8 * 64 + 16 * 64 + 8 * 16))
    with pytest.raises(TileOpsValueError, match="argument 'b'"):
        op(a, meta(16, 32))


def test_meta_outputs_get_the_full_validation():
    with pytest.raises(TypeError, match=r"argument 'a': expected dtype float16 \| bfloat16"):
        tileops.gemm(meta(8, 64, dtype=torch.float32), meta(16, 64, dtype=torch.float32))
    with pytest.raises(TileOpsValueError, match=r"argument 'weight'"):
        tileops.rms_norm(meta(4, 64), [64], meta(32))
    with pytest.raises(TileOpsValueError, match=r"argument 'k'"):
        tileops.attention(meta(1, 8, 6, 128), meta(1, 8, 4, 128), meta(1, 8, 4, 128))


@pytest.mark.parametrize("a, b, expected, got", [
    (meta(8, 64), fake_cuda(16, 64), r"a tensor on meta \(like the other inputs\)", "cuda:0"),
    (fake_cuda(8, 64), meta(16, 64), r"a tensor on cuda:0 \(like the other inputs\)", "meta"),
    (meta(8, 64), torch.empty(16, 64, dtype=torch.bfloat16), "a CUDA tensor", "cpu"),
])
def test_mixed_devices_are_an_error(a, b, expected, got):
    with pytest.raises(TileOpsValueError,
                       match=rf"GemmFwdOp: argument 'b': expected {expected}, "
                             rf"got a tensor on {got}$"):
        tileops.gemm(a, b)


def test_meta_through_autograd_and_the_custom_op():
    x = torch.empty(4, 128, dtype=torch.float16, device="meta", requires_grad=True)
    w = meta(128, dtype=torch.float16)
    # requires_grad routes through torch.ops.tileops.rms_norm_fwd (its fake implementation)
    assert RMSNormFwdOp(normalized_shape=[128])(x, w).shape == (4, 128)
    assert tileops.rms_norm(x, [128], w).shape == (4, 128)
    assert torch.ops.tileops.rms_norm_fwd(x, [128], w, None).shape == (4, 128)


def test_torch_compile_traces_a_lazily_loaded_functional(monkeypatch):
    """`tileops.gemm` resolves through the package's lazy loader, inside the trace too."""
    monkeypatch.delitem(tileops.__dict__, "gemm", raising=False)
    f = torch.compile(lambda a, b: tileops.gemm(a, b).relu(), fullgraph=True, backend="eager")
    assert f(meta(16, 64), meta(32, 64)).shape == (16, 32)


# -- one argument order per op ----------------------------------------------------------------
def _functional_pairs():
    """(functional, its Op class) for every functional whose parameters are exactly the
    inputs and params of one forward op's custom op."""
    import tileops.ops

    pairs = []
    for name in tileops.ops.__all__:
        functional = getattr(tileops.ops, name)
        if not name[0].islower() or not callable(functional):
            continue
        params = set(inspect.signature(functional).parameters)
        for cls in tileops.OP_CLASSES.values():
            if set(cls.spec.call_order) == params:
                pairs.append((functional, cls))
    return pairs


def test_functional_and_torch_ops_take_one_argument_order():
    pairs = _functional_pairs()
    assert {f.__name__ for f, _ in pairs} >= {"gemm", "rms_norm", "attention",
                                              "attention_varlen"}
    for functional, cls in pairs:
        schema = cls.torch_op._schema
        assert list(inspect.signature(functional).parameters) == [
            a.name for a in schema.arguments], (functional.__name__, cls.__name__)


def test_rms_norm_follows_the_reference_order():
    assert get_spec("RMSNormFwdOp")["signature"]["call_order"] == [
        "input", "normalized_shape", "weight", "eps"]
    assert list(inspect.signature(torch.nn.functional.rms_norm).parameters) == [
        "input", "normalized_shape", "weight", "eps"]
    assert RMSNormFwdOp.spec.call_order == ["input", "normalized_shape", "weight", "eps"]
    assert GemmFwdOp.spec.call_order == ["a", "b", "trans_a", "trans_b"]  # the default


def _entry(op_name):
    return copy.deepcopy(get_spec(op_name))


@pytest.mark.parametrize("order", [
    ["input", "normalized_shape", "weight"],                 # eps missing
    ["input", "normalized_shape", "weight", "eps", "bias"],  # not an input or param
    ["input", "normalized_shape", "weight", "weight"],       # twice
])
def test_call_order_must_name_every_input_and_param_once(order):
    entry = _entry("RMSNormFwdOp")
    entry["signature"]["call_order"] = order
    with pytest.raises(ManifestError, match=r"RMSNormFwdOp: field 'signature.call_order': "
                                            r"expected every input and param once"):
        CompiledSpec("RMSNormFwdOp", entry)


def test_validator_reports_a_bad_call_order():
    from tileops.manifest import load_manifest
    from tileops.validate import validate

    manifest = copy.deepcopy(load_manifest())
    manifest["RMSNormFwdOp"]["signature"]["call_order"] = ["input", "weight"]
    manifest["GemmFwdOp"]["signature"]["call_order"] = "a, b"
    messages = [str(e) for e in validate(manifest, repo_root=None)]
    assert any(m.startswith("RMSNormFwdOp: field 'signature.call_order': expected every input")
               for m in messages)
    assert any(m.startswith("GemmFwdOp: field 'signature.call_order': 'a, b' is not of type "
                            "'array'") for m in messages)


# -- messages blame the argument that is wrong ------------------------------------------------
@pytest.mark.parametrize("q, k, v, params, pattern", [
    # the query heads are fine; k's head count does not divide them
    (meta(1, 8, 6, 128), meta(1, 8, 4, 128), meta(1, 8, 4, 128), {},
     r"argument 'k': expected shapes satisfying `H % Hkv == 0`, "
     r"got k.shape=\(1, 8, 4, 128\), H=6, Hkv=4$"),
    (meta(1, 8, 6, 128), meta(1, 8, 0, 128), meta(1, 8, 0, 128), {},
     r"argument 'k': expected shapes satisfying `Hkv >= 1`, got k.shape=\(1, 8, 0, 128\), "
     r"Hkv=0$"),
    (meta(1, 8, 8, 128), meta(1, 8, 2, 128), meta(1, 8, 4, 128), {},
     r"argument 'v': expected shape \[B, Skv, Hkv, Dv\] with Hkv = 2 \(from k\)"),
    # a narrower V only with q/k 192 (DeepSeek-V3's MLA prefill)
    (meta(1, 8, 8, 128), meta(1, 8, 2, 128), meta(1, 8, 2, 64), {},
     r"argument 'v': expected shapes satisfying `\(Dv == D and D != 192\) or \(D, Dv\) == "
     r"\(192, 128\)`, got v.shape=\(1, 8, 2, 64\), Dv=64, D=128$"),
    (meta(1, 8, 8, 192), meta(1, 8, 2, 192), meta(1, 8, 2, 192), {},
     r"argument 'v': expected shapes satisfying `\(Dv == D and D != 192\) or \(D, Dv\) == "
     r"\(192, 128\)`, got v.shape=\(1, 8, 2, 192\), Dv=192, D=192$"),
    (meta(1, 8, 8, 128), meta(1, 8, 2, 128), meta(1, 8, 2, 128), {"softcap": -1.0},
     r"argument 'softcap': expected a value satisfying `softcap >= 0`, got softcap=-1.0$"),
    (meta(1, 8, 8, 128), meta(1, 8, 2, 128), meta(1, 8, 2, 128), {"window_size": [5]},
     r"argument 'window_size': expected a value satisfying `len\(window_size\) == 2"),
])
def test_attention_messages_blame_the_wrong_argument(q, k, v, params, pattern):
    with pytest.raises(TileOpsValueError, match="GroupedQueryAttentionFwdOp: " + pattern):
        tileops.attention(q, k, v, **params)


def test_backward_and_varlen_messages_blame_k():
    from tileops import GroupedQueryAttentionBwdOp, GroupedQueryAttentionVarlenFwdOp

    q, k = meta(1, 8, 6, 64), meta(1, 8, 4, 64)
    lse = meta(1, 6, 8, dtype=torch.float32)
    with pytest.raises(TileOpsValueError, match=r"BwdOp: argument 'k': .*`H % Hkv == 0`"):
        GroupedQueryAttentionBwdOp().check([q, q, k, k, q, lse])
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    op = GroupedQueryAttentionVarlenFwdOp(max_seqlen_q=8, max_seqlen_kv=8)
    with pytest.raises(TileOpsValueError, match=r"argument 'k': .*`Hkv >= 1`, got .*Hkv=0$"):
        op.check([meta(8, 6, 64), meta(8, 0, 64), meta(8, 0, 64), cu, cu])
    with pytest.raises(TileOpsValueError, match=r"argument 'max_seqlen_kv': expected a value "
                                                r"satisfying `max_seqlen_kv >= 0`"):
        GroupedQueryAttentionVarlenFwdOp(max_seqlen_q=8, max_seqlen_kv=-1).check(
            [meta(8, 6, 64), meta(8, 2, 64), meta(8, 2, 64), cu, cu])


def test_a_rule_that_raises_reports_values_not_the_exception():
    entry = _entry("GemmFwdOp")
    entry["signature"]["shape_rules"].append("a.shape[5] // 0 == 1")
    spec = CompiledSpec("GemmFwdOp", entry)
    tensors = {"a": meta(8, 64), "b": meta(16, 64)}
    with pytest.raises(TileOpsValueError) as info:
        spec.check_shapes(spec.namespace(tensors, {"trans_a": False, "trans_b": True}))
    assert str(info.value) == ("GemmFwdOp: argument 'a': expected shapes satisfying "
                               "`a.shape[5] // 0 == 1`, got a.shape=(8, 64)")


def test_a_rule_naming_nothing_the_call_has_is_a_manifest_error():
    entry = _entry("GemmFwdOp")
    entry["signature"]["shape_rules"].append("c.ndim == 2")
    with pytest.raises(ManifestError, match=r"GemmFwdOp: field 'signature.shape_rules\[3\]': "
                                            r"'c.ndim == 2' names \['c'\]"):
        CompiledSpec("GemmFwdOp", entry)
    entry["signature"]["shape_rules"][-1] = "all(d > 0 for d in a.shape)"  # d is bound inside
    CompiledSpec("GemmFwdOp", entry)


# -- list_ops ---------------------------------------------------------------------------------
def test_list_ops_reads_the_manifest():
    ops = tileops.list_ops()
    by_name = {op.name: op for op in ops}
    gemm = get_spec("GemmFwdOp")
    assert by_name["GemmFwdOp"] == ("GemmFwdOp", "gemm", "implemented", gemm["ref_api"])
    assert by_name["RMSNormFwdOp"].family == "normalization"
    assert [(op.family, op.name) for op in ops] == sorted((op.family, op.name) for op in ops)
    attention = tileops.list_ops(family="attention")
    assert attention and all(op.family == "attention" for op in attention)
    assert all(op.status == "implemented" for op in tileops.list_ops(status="implemented"))
    assert tileops.list_ops(family="no such family") == []
