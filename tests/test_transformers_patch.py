"""tileops.transformers.apply on the CPU: which modules each family gets replaced, the
messages for what stays on PyTorch, idempotence, revert, that other models are untouched,
and the patched forwards' plumbing: with the ops swapped for fp32 PyTorch references (spies),
a patched model's logits, loss and gradients equal the unpatched model's."""

from __future__ import annotations

import copy
import math
import sys
import types

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

import tileops  # noqa: E402
import tileops.ops  # noqa: E402
import tileops.transformers as tt  # noqa: E402
from tileops.transformers import _patch, bench  # noqa: E402
from tileops.transformers import attention as hf_attention  # noqa: E402

from . import hf_models  # noqa: E402

pytestmark = pytest.mark.smoke

DENSE = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3"]
MOE = ["mixtral", "qwen3_moe", "deepseek_v3"]


def _names(model, suffix):
    return sorted(n for n, m in model.named_modules() if type(m).__name__.endswith(suffix))


def _apply(model, **kw):
    kw.setdefault("verbose", False)
    return tt.apply(model, **kw)


# -- which modules get replaced ------------------------------------------------------------
@pytest.mark.parametrize("family", DENSE + MOE)
def test_each_family_patches_its_modules(family):
    model = hf_models.model(family, dtype=torch.bfloat16)
    report = _apply(model)
    assert report.family == hf_models.config(family).model_type
    assert sorted(report.patched["rms_norm"]) == _names(model, "RMSNorm")
    assert sorted(report.patched["rope"]) == _names(model, "Attention")
    assert report.patched["attention"] == ["config"]
    assert report.patched["cross_entropy"] == ["model"] or report.patched["cross_entropy"] == [""]
    assert model.config._attn_implementation == "tileops"
    for name in _names(model, "RMSNorm"):
        assert model.get_submodule(name)._tileops_patch == "rms_norm"
    mlps = _names(model, "MLP")
    assert sorted(report.patched.get("mlp", [])) == mlps  # Gemma's GeLU-tanh: geglu
    assert report.unpatched == []
    if family in MOE:
        experts = _names(model, "Experts")
        assert experts and sorted(report.patched["moe"]) == experts
    if family == "qwen3":  # the per-head q_norm / k_norm are RMSNorms too
        assert "model.layers.0.self_attn.q_norm" in report.patched["rms_norm"]
    linears = sorted(n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear))
    assert sorted(report.patched.get("linear", [])) == linears  # decode calls, by default


def test_linear_flag_patches_every_linear():
    model = hf_models.model("llama", dtype=torch.bfloat16)
    report = _apply(model, linear=True)
    linears = sorted(n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear))
    assert sorted(report.patched["linear"]) == linears
    assert "linear" not in _apply(hf_models.model("llama", dtype=torch.bfloat16),
                                  linear=False).patched
    with pytest.raises(tileops.TileOpsError, match="argument 'linear'"):
        _apply(hf_models.model("llama", dtype=torch.bfloat16), linear="prefill")


@pytest.mark.parametrize("linear, tokens, graphed, on_tileops", [
    ("decode", 16, True, True), ("decode", 17, True, False), ("decode", 16, False, False),
    (True, 17, False, True), (False, 1, True, False)])
def test_linear_calls_by_token_count(linear, tokens, graphed, on_tileops, spies, monkeypatch):
    """linear="decode" (the default) puts calls of up to 16 tokens on tileops.linear when
    compiled or captured, larger ones and eager ones on F.linear; True every call, False
    none. The output is F.linear's."""
    monkeypatch.setattr(_patch, "_graphed", lambda: graphed)
    layer = torch.nn.Linear(64, 32, dtype=torch.bfloat16)
    model = hf_models.model("llama", dtype=torch.bfloat16)
    model.model.extra = layer  # (any nn.Linear of the model is patched alike)
    _apply(model, linear=linear)
    x = torch.randn(1, tokens, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    assert bool(spies.get("linear")) == on_tileops


def test_decode_linear_routes_traced_calls(spies):
    """Under torch.compile the decode step's Linear calls are traced onto tileops.linear
    (`_graphed` holds while dynamo traces); the same eager step's stay on F.linear."""
    model = hf_models.model("llama")
    _apply(model)
    ids = torch.randint(1, 512, (2, 11))
    traced = torch.compile(model.forward, fullgraph=True, backend="eager")
    for forward, want in ((model.forward, False), (traced, True)):
        step = bench.DecodeStep(model, ids, steps=2, forward=forward)
        with torch.no_grad():
            step.prefill()
            spies.clear()
            step()
        assert bool(spies.get("linear")) == want


def _ref_linear_group(x, weights, biases=None):
    return tuple(F.linear(x, w, None if biases is None else b)
                 for w, b in zip(weights, biases or weights, strict=True))


def test_grouped_projections_trace_one_launch_each(spies, monkeypatch):
    """With TILEOPS_HF_GROUP_PROJECTIONS=1, a traced decode step runs each layer's q/k/v and
    gate/up as one linear_group call each (o_proj, down_proj and the head stay single) and
    decodes the unpatched model's greedy tokens; eager steps call neither."""
    monkeypatch.setenv("TILEOPS_HF_GROUP_PROJECTIONS", "1")
    model = hf_models.model("qwen2")  # q/k/v with biases
    reference = copy.deepcopy(model)
    report = _apply(model)
    linears = sorted(n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear))
    assert sorted(report.patched["linear"]) == linears
    assert model.model.layers[0].self_attn.k_proj._tileops_patch == "linear"
    ids = torch.randint(1, 512, (2, 11))
    traced = torch.compile(model.forward, fullgraph=True, backend="eager")
    tokens = {}
    for name, m, forward in (("reference", reference, reference.forward),
                             ("eager", model, model.forward), ("traced", model, traced)):
        step = bench.DecodeStep(m, ids, steps=3, forward=forward)
        with torch.no_grad():
            step.prefill()
            spies.clear()
            step()
            calls = {k: len(v) for k, v in spies.items()}
            step()
        tokens[name] = step.token.clone()
        if name == "eager":
            assert not calls.get("linear_group") and not calls.get("linear")
        if name == "traced":  # (the spies record each run of the traced step)
            layers = model.config.num_hidden_layers
            assert calls["linear_group"] == 2 * layers
            assert calls["linear"] == 2 * layers + 1
            groups = list(_groups(model))
            assert len(groups) == 2 * layers  # q/k/v and gate/up of each layer
            assert all(not group.pending for group in groups)
    assert torch.equal(tokens["traced"], tokens["reference"])
    assert torch.equal(tokens["eager"], tokens["reference"])


@pytest.mark.parametrize("family", [f for f in DENSE + MOE if f != "qwen2"])
def test_grouped_projections_decode_every_family(family, spies, monkeypatch):
    """Every family's traced decode step with grouped projections (q/k/v where the
    attention has them, gate/up in dense MLPs) decodes the unpatched model's greedy
    tokens."""
    monkeypatch.setenv("TILEOPS_HF_GROUP_PROJECTIONS", "1")
    torch._dynamo.reset()  # (the families share transformers' wrappers' code objects)
    model = hf_models.model(family)
    reference = copy.deepcopy(model)
    _apply(model)
    ids = torch.randint(1, 512, (2, 11))
    traced = torch.compile(model.forward, fullgraph=True, backend="eager")
    tokens = []
    for m, forward in ((reference, reference.forward), (model, traced)):
        step = bench.DecodeStep(m, ids, steps=3, forward=forward)
        with torch.no_grad():
            step.prefill()
            spies.clear()
            step()
            step()
        tokens.append(step.token.clone())
    assert spies.get("linear_group")
    assert torch.equal(tokens[0], tokens[1])


def _groups(model):
    return {id(g): g for m in model.modules() if "forward" in m.__dict__
            for g in _closure_groups(m.forward)}.values()


def _closure_groups(fn):
    """The _ProjectionGroup a patched forward (the bound signature wrapper around the
    grouped forward) closes over."""
    for cell in getattr(fn, "__func__", fn).__closure__ or ():
        value = cell.cell_contents
        if isinstance(value, _patch._ProjectionGroup):
            yield value
        elif isinstance(value, types.FunctionType):
            yield from _closure_groups(value)


@pytest.mark.parametrize("tokens, graphed, grouped", [(16, True, True), (64, True, True),
                                                      (65, True, False), (1, False, False)])
def test_grouped_projections_by_token_count(tokens, graphed, grouped, spies, monkeypatch):
    """Grouped members take compiled or captured calls of up to GROUPED_TOKENS tokens
    (linear_group's weight-streaming rows) in one launch, the first member called computing
    all; others run F.linear. A member called on another tensor than the one its group ran
    on computes its own."""
    from tileops.ops.linear_group import GROUP_ROWS

    assert _patch.GROUPED_TOKENS == GROUP_ROWS
    monkeypatch.setenv("TILEOPS_HF_GROUP_PROJECTIONS", "1")
    monkeypatch.setattr(_patch, "_graphed", lambda: graphed)
    model = hf_models.model("llama", dtype=torch.bfloat16)
    _apply(model)
    mlp = model.model.layers[0].mlp
    x = torch.randn(1, tokens, mlp.gate_proj.in_features, dtype=torch.bfloat16)
    up, gate = mlp.up_proj(x), mlp.gate_proj(x)  # any member first
    torch.testing.assert_close(gate, F.linear(x, mlp.gate_proj.weight))
    torch.testing.assert_close(up, F.linear(x, mlp.up_proj.weight))
    assert len(spies.get("linear_group", [])) == int(grouped)
    assert not spies.get("linear")
    if grouped:
        other = x.clone()
        mlp.gate_proj(x)  # leaves up's output for x
        torch.testing.assert_close(mlp.up_proj(other), F.linear(other, mlp.up_proj.weight))
        assert len(spies["linear_group"]) == 3


def test_grouped_projections_switch_off(spies, monkeypatch):
    """TILEOPS_HF_GROUP_PROJECTIONS=0: each member runs its own decode call (linear)."""
    monkeypatch.setenv("TILEOPS_HF_GROUP_PROJECTIONS", "0")
    monkeypatch.setattr(_patch, "_graphed", lambda: True)
    model = hf_models.model("llama", dtype=torch.bfloat16)
    _apply(model)
    mlp = model.model.layers[0].mlp
    x = torch.randn(1, 1, mlp.gate_proj.in_features, dtype=torch.bfloat16)
    torch.testing.assert_close(mlp.gate_proj(x), F.linear(x, mlp.gate_proj.weight))
    assert len(spies["linear"]) == 1 and not spies.get("linear_group")


def test_flags_off_patch_nothing():
    model = hf_models.model("llama", dtype=torch.bfloat16)
    report = _apply(model, rms_norm=False, rope=False, attention=False, mlp=False,
                    cross_entropy=False, moe=False, linear=False)
    assert report.patched == {} and report.unpatched == []
    assert model.config._attn_implementation == "sdpa"
    assert all("forward" not in m.__dict__ for m in model.modules())


# -- messages ---------------------------------------------------------------------------------
def test_unsupported_family_is_refused_untouched():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=128))
    with pytest.raises(tileops.TileOpsUnsupportedError, match="gpt2.*nothing was patched"):
        tt.apply(model)
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_family_helper_refuses_another_family():
    model = hf_models.model("qwen3", dtype=torch.bfloat16)
    with pytest.raises(tileops.TileOpsUnsupportedError, match="apply_to_llama.*'qwen3'"):
        tt.apply_to_llama(model)
    assert tt.apply_to_qwen3(model, verbose=False).patched["rms_norm"]
    with pytest.raises(tileops.TileOpsUnsupportedError, match="apply_to_deepseek_v3"):
        tt.apply_to_deepseek_v3(model)
    assert tt.apply_to_deepseek_v3(hf_models.model("deepseek_v3"), verbose=False).patched["moe"]


def test_unpatched_parts_warn_and_strict_raises_before_patching():
    model = hf_models.model("llama", dtype=torch.bfloat16, hidden_act="relu")  # no relu op
    with pytest.raises(tileops.TileOpsUnsupportedError, match="left on PyTorch mlp"):
        tt.apply(model, strict=True)
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert model.config._attn_implementation == "sdpa"
    with pytest.warns(UserWarning, match="activation 'ReLU'"):
        tt.apply(model)
    # with the MLP not requested, strict passes
    tt.revert(model)
    tt.apply(model, mlp=False, strict=True)


def test_shapes_the_ops_refuse_are_reported():
    # head_dim 72: no attention / rotary kernel; the norms and the MLP still patch
    model = hf_models.model("llama", dtype=torch.bfloat16, head_dim=72)
    report = _apply(model)
    kinds = {k for k, _, _ in report.unpatched}
    assert "attention" in kinds and "rms_norm" not in kinds
    assert model.config._attn_implementation == "sdpa"
    assert "head_dim" in report.summary() or "72" in report.summary()


def test_attention_dropout_is_reported():
    model = hf_models.model("llama", dtype=torch.bfloat16, attention_dropout=0.1)
    report = _apply(model)
    assert ("attention", "config") in {(k, n) for k, n, _ in report.unpatched}


def test_router_aux_loss_keeps_the_model_loss():
    model = hf_models.model("mixtral", dtype=torch.bfloat16, output_router_logits=True)
    report = _apply(model)
    assert "cross_entropy" not in report.patched
    assert any(k == "cross_entropy" and "router" in why for k, _, why in report.unpatched)


# -- idempotence, revert, other models untouched --------------------------------------------
def test_apply_twice_patches_nothing_new():
    model = hf_models.model("qwen3", dtype=torch.bfloat16)
    _apply(model)
    forwards = {n: m.__dict__.get("forward") for n, m in model.named_modules()}
    again = _apply(model)
    assert again.patched == {} and again.unpatched == []
    assert forwards == {n: m.__dict__.get("forward") for n, m in model.named_modules()}


def test_other_models_and_classes_are_untouched():
    model = hf_models.model("llama", dtype=torch.bfloat16)
    reference = copy.deepcopy(model)
    modeling = sys.modules[type(model.model.layers[0].self_attn).__module__]
    rotary, attn_forward = modeling.apply_rotary_pos_emb, modeling.LlamaAttention.forward
    _apply(model)
    assert modeling.apply_rotary_pos_emb is rotary
    assert modeling.LlamaAttention.forward is attn_forward
    assert reference.config._attn_implementation == "sdpa"
    assert all("forward" not in m.__dict__ for m in reference.modules())
    # a model created after the patch is a plain transformers model
    fresh = hf_models.model("llama", dtype=torch.bfloat16)
    assert all("forward" not in m.__dict__ for m in fresh.modules())


def test_revert_restores_the_model():
    model = hf_models.model("gemma3", dtype=torch.bfloat16)
    _apply(model)
    tt.revert(model)
    assert model.config._attn_implementation == "sdpa"
    assert all("forward" not in m.__dict__ and not hasattr(m, "_tileops_patch")
               for m in model.modules())
    assert _apply(model).patched["rms_norm"]


def test_rebound_forward_keeps_the_decorators():
    model = hf_models.model("llama", dtype=torch.bfloat16)
    _apply(model)
    attn = model.model.layers[0].self_attn
    cls_forward = type(attn).forward
    mine = attn.forward.__func__
    assert mine is not cls_forward and mine.__code__ is cls_forward.__code__
    inner = mine
    while getattr(inner, "__wrapped__", None) is not None:
        inner = inner.__wrapped__
    assert getattr(inner.__globals__["apply_rotary_pos_emb"], "__tileops__", False)


def test_patched_forwards_keep_their_signatures():
    import inspect

    model = hf_models.model("mixtral", dtype=torch.bfloat16)
    before = {n: inspect.signature(m.forward) for n, m in model.named_modules()}
    _apply(model)
    assert "forward" in model.__dict__  # the loss patch
    for name, module in model.named_modules():
        assert inspect.signature(module.forward) == before[name], name
    assert {"attention_mask", "logits_to_keep", "labels"} <= set(
        inspect.signature(model.forward).parameters)


# -- CPU, fp32: the patched model falls back to transformers' code ----------------------------
@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3_moe"])
def test_cpu_model_falls_back_exactly(family):
    model = hf_models.model(family)
    reference = copy.deepcopy(model)
    _apply(model)
    ids = torch.randint(0, 512, (2, 24))
    for m in (model, reference):
        m.train()
    out, ref = model(input_ids=ids, labels=ids, use_cache=False), reference(
        input_ids=ids, labels=ids, use_cache=False)
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=0)
    torch.testing.assert_close(out.loss, ref.loss, rtol=0, atol=0)


# -- spies: the ops replaced by fp32 references -------------------------------------------------
def _ref_attention(q, k, v, is_causal=False, scale=None, window_size=(-1, -1), softcap=0.0):
    _, sq, heads, d = q.shape
    skv = k.shape[1]
    rep = heads // k.shape[2]
    qh = q.transpose(1, 2)
    kh = k.transpose(1, 2).repeat_interleave(rep, 1)
    vh = v.transpose(1, 2).repeat_interleave(rep, 1)
    s = qh @ kh.transpose(-1, -2) * (scale if scale is not None else d ** -0.5)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    left, right = window_size
    if is_causal:
        right = 0 if right < 0 else min(right, 0)
    i = torch.arange(sq)[:, None] + (skv - sq)
    j = torch.arange(skv)[None, :]
    ok = torch.ones(sq, skv, dtype=torch.bool)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    p = torch.softmax(s.masked_fill(~ok, -math.inf), -1)
    return (p @ vh).transpose(1, 2)


def _ref_decode(q, k, v, lengths, block_table=None, sm_scale=None, softcap=None,
                window_left=None, is_causal=True, return_lse=False, kv_layout="NHD"):
    """decode_attention on a contiguous cache as the static-cache route calls it:
    kv_layout "HND", q [B, Sq, H, D], k/v the static layer's own contiguous
    [B, Hkv, S_max, D] tensors, cache_seqlens int32 [B] counting the keys (new ones too)."""
    assert kv_layout == "HND" and block_table is None
    assert k.is_contiguous() and v.is_contiguous() and k.shape == v.shape
    batch, sq, heads, d = q.shape
    assert k.dim() == 4 and k.shape[0] == batch and k.shape[3] == d
    assert lengths.dtype == torch.int32 and lengths.shape == (batch,)
    if not torch.compiler.is_compiling():
        assert bool(((lengths >= sq) & (lengths <= k.shape[2])).all()), lengths
    rep = heads // k.shape[1]
    kh = k.repeat_interleave(rep, 1)
    vh = v.repeat_interleave(rep, 1)
    s = q.transpose(1, 2) @ kh.transpose(-1, -2) * (sm_scale or d ** -0.5)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    pos = lengths.long()[:, None] - sq + torch.arange(sq)  # [B, Sq]
    j = torch.arange(k.shape[2])
    ok = (j <= pos[..., None]) & (j < lengths.long()[:, None, None])
    if window_left is not None and window_left >= 0:
        ok &= j >= pos[..., None] - window_left
    p = torch.softmax(s.masked_fill(~ok[:, None], -math.inf), -1)
    return (p @ vh).transpose(1, 2)


def _ref_chunked(q, k, v, cu, lengths, max_q, **kw):
    """chunked_prefill_attention where every request has max_q new tokens."""
    batch = lengths.shape[0]
    assert torch.equal(cu, torch.arange(batch + 1, dtype=torch.int32) * max_q)
    o = _ref_decode(q.view(batch, max_q, *q.shape[1:]), k, v, lengths, **kw)
    return o.reshape(q.shape)


def _ref_varlen(q, k, v, cu_q, cu_kv, max_q, max_kv, is_causal=False, scale=None,
                window_size=(-1, -1), softcap=0.0):
    """attention_varlen: each packed sequence through _ref_attention."""
    assert torch.equal(cu_q, cu_kv) and cu_q.dtype == torch.int32
    out = torch.zeros_like(q)
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True):
        assert b - a <= max_q
        if b > a:
            out[a:b] = _ref_attention(q[None, a:b], k[None, a:b], v[None, a:b], is_causal,
                                      scale, window_size, softcap)[0]
    return out


def _ref_rotary(q, k, cos, sin, unsqueeze_dim=1, interleaved=False):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)

    def rot(x):
        h = x.shape[-1] // 2
        return torch.cat((-x[..., h:], x[..., :h]), -1)

    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


def _ref_fused_moe(x, w_gate_up, w_down, topk_weights=None, topk_ids=None):
    out = torch.zeros_like(x)
    for j in range(topk_ids.shape[1]):
        ids = topk_ids[:, j].long()
        gate, up = torch.einsum("th,tfh->tf", x, w_gate_up[ids]).chunk(2, -1)
        y = torch.einsum("tf,thf->th", F.silu(gate) * up, w_down[ids])
        out = out + topk_weights[:, j, None] * y
    return out


def _ref_flce(hidden, weight, target, bias, ignore_index, softcap, summed):
    logits = hidden @ weight.T + (0 if bias is None else bias)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(logits.float(), target, ignore_index=ignore_index,
                           reduction="sum" if summed else "mean")


@pytest.fixture
def spies(monkeypatch):
    calls: dict[str, list] = {}

    def spy(name, fn, real=None):
        def wrapped(*args, **kwargs):
            if any(isinstance(a, torch.Tensor) and a.is_meta for a in args):
                return real(*args, **kwargs)  # apply's shape probes: the real op's checks
            calls.setdefault(name, []).append(kwargs)
            return fn(*args, **kwargs)
        return wrapped

    def op(name, fn, key=None):
        real = getattr(tileops.ops, name)
        monkeypatch.setattr(tileops.ops, name, spy(key or name, fn, real))

    monkeypatch.setattr(hf_attention, "served", lambda *ts: True)
    op("rms_norm", lambda x, n, w, eps: F.rms_norm(x, (n,) if isinstance(n, int) else n, w, eps))
    op("swiglu", lambda g, u, reuse_inputs=False: F.silu(g) * u)
    op("geglu", lambda g, u, approximate="none", reuse_inputs=False:
       F.gelu(g, approximate=approximate) * u)
    op("apply_rotary", _ref_rotary, "rope")
    op("attention", _ref_attention)
    op("decode_attention", _ref_decode)
    op("attention_varlen", _ref_varlen)
    op("chunked_prefill_attention", _ref_chunked)
    op("linear", F.linear)
    op("linear_group", _ref_linear_group)
    op("fused_moe", _ref_fused_moe)
    monkeypatch.setattr(_patch, "_flce", spy("loss", _ref_flce))
    return calls


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", DENSE + MOE)
def test_patched_forward_and_backward_match(family, spies):
    model = hf_models.model(family)
    reference = copy.deepcopy(model)
    _apply(model, linear=family == "llama")
    ids = torch.randint(0, 512, (2, 40))  # longer than the 16-token windows
    model.train()
    reference.train()
    out = model(input_ids=ids, labels=ids, use_cache=False)
    ref = reference(input_ids=ids, labels=ids, use_cache=False)
    assert out.logits is None  # the fused loss materializes no logits
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-5)
    out.loss.backward()
    ref.loss.backward()
    grads, ref_grads = _grads(model), _grads(reference)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)
    model.eval()
    reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits,
                                   rtol=1e-4, atol=1e-5)
    layers = model.config.num_hidden_layers
    assert len(spies["rope"]) == 2 * layers  # the training and the eval forward
    assert spies["attention"] and spies["rms_norm"] and spies["loss"]
    if family == "llama":
        assert spies["linear"]
    if family in MOE:  # both forwards, every MoE layer (DeepSeek's first is dense)
        assert len(spies["fused_moe"]) == 2 * len(_names(model, "Experts"))
    if family == "gemma2":  # softcap and the 16-token window reach the kernel
        kinds = {(tuple(c["window_size"]), c["softcap"]) for c in spies["attention"]}
        assert kinds == {((15, 0), 50.0), ((-1, 0), 50.0)}
        assert all(c["scale"] == 64 ** -0.5 for c in spies["attention"])
    if family == "mistral":
        assert {tuple(c["window_size"]) for c in spies["attention"]} == {(15, 0)}
    if family.startswith("gemma"):  # gelu_pytorch_tanh MLPs, both forwards, every layer
        assert [c["approximate"] for c in spies["geglu"]] == ["tanh"] * (2 * layers)
        assert "swiglu" not in spies
    else:
        assert "geglu" not in spies


def test_padding_mask_goes_to_sdpa(spies):
    model = hf_models.model("llama")
    reference = copy.deepcopy(model)
    _apply(model)
    ids = torch.randint(0, 512, (2, 24))
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[1, :5] = 0  # left padding
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask).logits
        ref = reference(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    assert "attention" not in spies and spies["rms_norm"]


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_padding_mask_on_attention_varlen(family, spies, monkeypatch):
    """PADDED_VARLEN: left/right padding and a hole, unpadded on the device into two packed
    sequences per row (valid tokens, then the padding); full-attention layers run
    attention_varlen, sliding ones (gemma2) stay on PyTorch. Valid positions' logits, the
    loss and the gradients (no label predicted from a padded position) match the unpatched
    model."""
    monkeypatch.setattr(hf_attention, "PADDED_VARLEN", True)
    model = hf_models.model(family)
    reference = copy.deepcopy(model)
    _apply(model)
    ids = torch.randint(0, 512, (3, 24))
    mask = torch.ones(3, 24, dtype=torch.long)
    mask[0, :5] = 0  # left padding
    mask[1, 20:] = 0  # right padding
    mask[2, 7:9] = 0  # a hole
    keep = mask.bool()
    with torch.no_grad():
        out = model.eval()(input_ids=ids, attention_mask=mask).logits
        ref = reference.eval()(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(out[keep], ref[keep], rtol=1e-4, atol=1e-5)
    layers = model.config.num_hidden_layers
    calls = spies["attention_varlen"]
    assert len(calls) == (layers // 2 if family == "gemma2" else layers)
    assert all(c["is_causal"] for c in calls)
    # labels predicted from valid positions only (position t - 1 predicts label t): a padded
    # position's output is not the reference's
    labels = ids.masked_fill(~(keep & F.pad(keep, (1, 0))[:, :-1]), -100)
    for m in (model, reference):
        m.train()
        m(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    grads, ref_grads = _grads(model), _grads(reference)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("act, approximate", [("gelu", "none"), ("gelu_pytorch_tanh", "tanh"),
                                              ("gelu_new", "tanh"), ("silu", None)])
def test_mlp_activation_comes_from_the_module(act, approximate, spies):
    """The MLP's act_fn module picks the op (a Gemma-1 config runs hidden_act, Gemma-2/3
    hidden_activation): exact gelu -> geglu('none'), the tanh forms -> geglu('tanh')."""
    model = hf_models.model("llama", hidden_act=act)
    reference = copy.deepcopy(model)
    report = _apply(model)
    assert sorted(report.patched["mlp"]) == _names(model, "MLP")
    ids = torch.randint(0, 512, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(input_ids=ids).logits,
                                   reference.eval()(input_ids=ids).logits, rtol=1e-4, atol=1e-5)
    if approximate is None:
        assert spies["swiglu"] and "geglu" not in spies
    else:
        assert {c["approximate"] for c in spies["geglu"]} == {approximate}


def test_mlp_gradients_overwrite_its_own_projections_unless_hooked(spies):
    """The patched MLP asks swiglu for reuse_inputs (its backward writes the gradients over
    the gate/up projections) only where no forward hook could have kept those outputs."""
    model = hf_models.model("llama")
    _apply(model)
    kept = []
    model.model.layers[0].mlp.up_proj.register_forward_hook(lambda m, i, out: kept.append(out))
    model(input_ids=torch.randint(0, 512, (2, 12)), labels=torch.randint(0, 512, (2, 12)))
    reuse = [c["reuse_inputs"] for c in spies["swiglu"]]
    assert reuse == [False] + [True] * (len(reuse) - 1) and len(reuse) > 1, reuse


def test_generate_matches(spies):
    model = hf_models.model("qwen3")
    reference = copy.deepcopy(model)
    _apply(model)
    ids = torch.randint(0, 512, (1, 12))
    kw = dict(max_new_tokens=6, do_sample=False)
    out = model.generate(ids, **kw)
    ref = reference.generate(ids, **kw)
    assert torch.equal(out, ref)
    assert spies["attention"]  # prefill and dynamic-cache decode steps run the kernel


# -- tileops bench-model: configs and report, without a GPU -----------------------------------
@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen3-30b-a3b", "qwen3-8b", "mistral-7b-v0.3",
                                  "gemma-2-9b"])
def test_bench_model_configs_build_and_patch(name):
    from tileops.transformers import bench

    model = bench.make_model(name, layers=2, device="meta")
    assert model.config.num_hidden_layers == 2
    assert next(model.parameters()).dtype == torch.bfloat16
    report = tt.apply(model, verbose=False)
    assert report.patched["rms_norm"] and report.patched["attention"] == ["config"]
    assert report.patched["cross_entropy"]
    if name == "qwen3-30b-a3b":
        assert report.unpatched == [] and len(report.patched["moe"]) == 2


def test_bench_model_compile_only_records_the_training_and_decode_programs():
    """`bench-model --compile-only`: the tileops variant's step on the meta device lists
    every program the GPU run builds: the MoE layer's forward and backward, attention,
    the fused loss, and the static-cache prefill and decode steps."""
    from tileops.transformers import bench

    plan = bench.recorded_programs(["qwen3-30b-a3b"], {"qwen3-30b-a3b": 8}, 1, 4096, (8,),
                                   512, 64, train=True, generate=True)
    ops = {i.op_name for i in plan}
    assert {"RMSNormFwdOp", "RMSNormBwdOp", "RotaryFwdOp", "RotaryBwdOp",
            "GroupedQueryAttentionFwdOp", "GroupedQueryAttentionBwdOp", "MoePermuteFwdOp",
            "GroupedGemmFwdOp", "GroupedGemmBwdOp", "MoeUnpermuteFwdOp",
            "FusedLinearCrossEntropyFwdOp", "DecodeAttentionFwdOp"} <= ops
    programs = {(type(i.kernel), tuple(sorted(i.kernel.key.items())), i.bucket, i.config)
                for i in plan}
    assert len(programs) == len(plan)  # each program once, however many layers call it
    only_decode = bench.recorded_programs(["llama-3.1-8b"], {}, 1, 4096, (8,), 512, 64,
                                          train=False, generate=True)
    assert {"DecodeAttentionFwdOp", "LinearFwdOp"} <= {i.op_name for i in only_decode}
    assert not {"RMSNormBwdOp", "FusedLinearCrossEntropyFwdOp"} & {
        i.op_name for i in only_decode}


def test_bench_model_optimizers():
    """The unpatched variants step torch's fused AdamW (the Trainer's default); the tileops
    variants tileops.optim.AdamW unless told "torch"."""
    from tileops.optim import AdamW
    from tileops.transformers import bench

    model = torch.nn.Linear(4, 4)
    for variant in ("eager", "compile", "liger"):
        opt = bench.make_optimizer(model, variant, "tileops")
        assert type(opt) is torch.optim.AdamW and opt.defaults["fused"]
    for variant in ("tileops", "tileops-compile"):
        assert type(bench.make_optimizer(model, variant)) is AdamW
        assert type(bench.make_optimizer(model, variant, "torch")) is torch.optim.AdamW


def test_bench_model_report(tmp_path):
    from tileops.transformers import bench

    rows = [{"model": "llama-3.1-8b", "variant": "eager", "layers": 8,
             "train_tokens_per_s": 1000.0, "train_peak_gib": 40.0,
             "generate": {"8": {"prefill_ms": 20.0, "decode_tokens_per_s": 500.0}}},
            {"model": "llama-3.1-8b", "variant": "tileops", "layers": 8, "note": "",
             "optimizer": "tileops.AdamW", "train_tokens_per_s": 1300.0, "train_peak_gib": 30.0,
             "train_fwd_bwd_peak_gib": 25.0,
             "generate": {"8": {"prefill_ms": 15.0, "decode_tokens_per_s": 600.0}}},
            {"model": "llama-3.1-8b", "variant": "liger", "error": "ImportError: x"},
            {"model": "llama-3.1-8b", "variant": "compile", "layers": 8,
             "generate": {"8": {"graph_decode_ms": 2.0}}},
            {"model": "llama-3.1-8b", "variant": "tileops-compile", "layers": 8,
             "generate": {"8": {"graph_decode_ms": 1.6}}}]
    bench._write(rows, tmp_path)
    text = (tmp_path / "bench-model.md").read_text()
    assert "| llama-3.1-8b | 8 | tileops | tileops.AdamW | 1300 | 1.30x | 30.0 | 25.0 |" in text
    assert "| llama-3.1-8b | 8 | eager | - | 1000 | 1.00x | 40.0 | - |" in text
    assert "| llama-3.1-8b | tileops | 8 | 15.0 | 600 | 1.20x | - | - | - |" in text
    assert "| llama-3.1-8b | compile | 8 | - | - | - | 2000 | 4000 | 1.00x |" in text
    assert "| llama-3.1-8b | tileops-compile | 8 | - | - | - | 1600 | 5000 | 1.25x |" in text
    assert "liger: ImportError: x" in text


@pytest.mark.parametrize("patched", [False, True])
def test_bench_model_decode_step_is_generate_greedy(patched, spies):
    """The step `graph_decode` times (fixed token / position buffers, a mask of the cache's
    length, the prompt put in by transformers' generate) decodes the tokens transformers'
    greedy generate does, unpatched and on the patched model's decode path."""
    from tileops.transformers import bench

    model = hf_models.model("llama")
    if patched:
        _apply(model)
    ids = torch.randint(1, 512, (2, 11))
    out = model.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation="static",
                         disable_compile=True, pad_token_id=0)
    step = bench.DecodeStep(model, ids, steps=5)
    for _ in range(2):  # the second time over the cache the first one filled
        tokens = []
        with torch.no_grad():
            step.prefill()
            spies.clear()  # (generate's calls: the reference's and the prefill's)
            for _ in range(5):
                tokens.append(step.token.clone())
                step()
        tokens.append(step.token.clone())
        assert torch.equal(torch.cat(tokens, 1), out[:, 11:])
        assert step.position.item() == 16
        assert len(spies.get("decode_attention", [])) == (5 * model.config.num_hidden_layers
                                                          if patched else 0)


def test_patched_decode_step_traces_whole(spies):
    """The patched model's decode step compiles as one graph (fullgraph=True): no import or
    host read in the patched forwards and mask functions breaks it, so torch.compile and
    CUDA graphs see the step whole (bench-model's graph decode)."""
    from tileops.transformers import bench

    model = hf_models.model("llama")
    _apply(model)
    ids = torch.randint(1, 512, (2, 11))
    eager = bench.DecodeStep(model, ids, steps=3)
    step = bench.DecodeStep(model, ids, steps=3, forward=torch.compile(
        model.forward, fullgraph=True, backend="eager"))
    with torch.no_grad():
        for s in (eager, step):
            s.prefill()
            s()
            s()
    assert torch.equal(step.token, eager.token)


def test_bench_model_cli_usage_errors(capsys):
    from tileops.cli import main

    assert main(["bench-model", "--model", "gpt-5"]) == 2
    assert "known: llama-3.1-8b" in capsys.readouterr().err
    assert main(["bench-model", "--layers", "llama-3.1-8b=x"]) == 2
    assert main(["bench-model", "--variant", "fast"]) == 2


@pytest.mark.parametrize("family", ["llama", "gemma2", "mistral"])
def test_static_cache_generate_matches(family, spies):
    """Prefill into an empty static cache skips the mask (the attention kernel, over the
    first q_len keys); decode steps read the static layers' own [B, Hkv, S_max, D] tensors
    in place through decode_attention (kv_layout "HND"; gemma2: softcap, and its 16-token
    sliding layers once full and rolled)."""
    model = hf_models.model(family)
    reference = copy.deepcopy(model)
    _apply(model)
    ids = torch.randint(0, 512, (2, 20))
    kw = dict(max_new_tokens=5, do_sample=False, cache_implementation="static",
              disable_compile=True, return_dict_in_generate=True, output_logits=True)
    out, ref = model.generate(ids, **kw), reference.generate(ids, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(ref.logits), rtol=1e-4,
                               atol=1e-4)
    layers = model.config.num_hidden_layers
    assert len(spies["attention"]) == layers  # the prefill
    assert len(spies["decode_attention"]) == layers * 4  # every decode step
    if family == "gemma2":
        assert {(c["softcap"], c["window_left"]) for c in spies["decode_attention"]} == {
            (50.0, 15), (50.0, -1)}
    assert {c["kv_layout"] for c in spies["decode_attention"]} == {"HND"}
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    for layer in cache.layers:  # transformers' own layout, untouched
        assert layer.keys.is_contiguous() and layer.keys.shape[:2] == (2, 2)


def _static_cache(model, max_len):
    from transformers import StaticCache

    return StaticCache(config=model.config, max_cache_len=max_len)


def _cache_kw(model, cache):
    """The cache under the name this transformers version's forward takes (`cache` in 5.24,
    `past_key_values` in 5.17: the other name lands in **kwargs, unused)."""
    from tileops.transformers import static_cache

    return {static_cache.cache_kwarg(model.model): cache}


def test_static_cache_continuation_and_speculative_steps(spies):
    """A 20-token prefill onto a filled static cache (chunked_prefill_attention) and a
    4-token step (decode_attention with Sq 4) match the unpatched model."""
    model = hf_models.model("qwen3")
    reference = copy.deepcopy(model)
    _apply(model)
    ids = torch.randint(0, 512, (2, 44))
    caches = [_static_cache(m, 64) for m in (model, reference)]
    outs = [[], []]
    with torch.no_grad():
        for start, end in ((0, 20), (20, 40), (40, 44)):
            mask = torch.ones(2, end, dtype=torch.long)
            for i, m in enumerate((model, reference)):
                outs[i].append(m.eval()(input_ids=ids[:, start:end], attention_mask=mask,
                                        **_cache_kw(m, caches[i])).logits)
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    layers = model.config.num_hidden_layers
    assert len(spies["chunked_prefill_attention"]) == layers
    assert len(spies["decode_attention"]) == layers
    assert all(c["kv_layout"] == "HND" for c in spies["chunked_prefill_attention"])


@pytest.mark.parametrize("call", ["model", "base"])
def test_static_cache_under_either_kwarg_name(call, spies):
    """A static cache passed under the other name: 5.24 maps the deprecated
    `past_key_values` onto `cache` (the static cache is used, the modules are marked and
    decode), 5.17 swallows `cache=` into **kwargs and runs a DynamicCache of its own (the
    pre-hook must not mark the modules from the unused cache). Either way the logits match."""
    from tileops.transformers import static_cache

    model = hf_models.model("llama")
    reference = copy.deepcopy(model)
    _apply(model)
    right = static_cache.cache_kwarg(model.model)
    other = next(n for n in static_cache.CACHE_KWARGS if n != right)
    ids = torch.randint(0, 512, (2, 24))
    cache = _static_cache(model, 64)
    m = model.eval() if call == "model" else model.model

    def logits(sl):
        out = m(input_ids=ids[:, sl], **{other: cache})
        return out.logits if call == "model" else model.lm_head(out[0])

    with torch.no_grad():
        outs = [logits(slice(0, 23))]  # a prefill
        used = bool(getattr(cache.layers[0], "is_initialized", False))
        if used:  # then a decode step on the cache
            outs.append(logits(slice(23, 24)))
        ref = reference.eval()(input_ids=ids[:, :23 + used]).logits
    torch.testing.assert_close(torch.cat(outs, 1), ref, rtol=1e-4, atol=1e-5)
    assert used == (other == "past_key_values")  # only the deprecated alias is honored
    marks = [getattr(a, static_cache.MARK) for a in model.model._tileops_attn_modules]
    assert marks == ([64, 64] if used else [0, 0])
    assert len(spies.get("decode_attention", [])) == (2 if used else 0)  # 1 step, 2 layers


def test_padded_static_cache_stays_on_pytorch(spies):
    """A left-padded batch: the prefill's host read of the mask marks the cache, and its
    decode steps run PyTorch's attention on the mask; a later unpadded generate with the
    same (reset, reused) cache takes the kernel again, and a padded one leaves it again."""
    from tileops.transformers import static_cache

    model = hf_models.model("llama")
    reference = copy.deepcopy(model)
    _apply(model)
    ids = torch.randint(1, 512, (2, 20))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    kw = dict(max_new_tokens=4, do_sample=False, cache_implementation="static",
              disable_compile=True, pad_token_id=0)
    layers = model.config.num_hidden_layers
    for padded in (True, False, True):
        spies.clear()
        m = mask if padded else torch.ones_like(ids)
        out = model.generate(ids, attention_mask=m, **kw)
        ref = reference.generate(ids, attention_mask=m, **kw)
        assert torch.equal(out, ref)
        assert len(spies.get("decode_attention", [])) == (0 if padded else 3 * layers)
        attn = [a for a in model.modules() if hasattr(a, static_cache.MARK)]
        assert len(attn) == layers
        marks = [getattr(a, static_cache.MARK) for a in attn]
        assert marks == [0 if padded else 20 + 4 - 1] * layers, padded  # the cache's slots


def test_mask_function_skips_only_plain_causal_masks():
    from transformers.masking_utils import bidirectional_mask_function, causal_mask_function

    assert hf_attention.tileops_mask(2, 8, 8, mask_function=causal_mask_function) is None
    padded = torch.ones(2, 8, dtype=torch.bool)
    padded[0, 0] = False
    mask = hf_attention.tileops_mask(2, 8, 8, mask_function=causal_mask_function,
                                     attention_mask=padded)
    assert mask.shape == (2, 1, 8, 8) and not mask[0, 0, 3, 0] and mask[1, 0, 3, 0]
    # a bidirectional mask is never replaced by the kernel's causal one
    full = hf_attention.tileops_mask(2, 8, 8, mask_function=bidirectional_mask_function,
                                     allow_is_bidirectional_skip=True, attention_mask=padded)
    assert full is not None and full[1, 0, 0, 7]
    none = hf_attention.tileops_mask(2, 8, 8, mask_function=causal_mask_function,
                                     allow_is_causal_skip=False)
    assert none is not None and not none[0, 0, 0, 1]


def test_static_cache_decode_step_compiles_in_one_graph(spies):
    """generate's automatic compile of the decode step (fullgraph, dynamo's eager backend on
    the CPU): the pre-hook, the mask and the routed decode call trace without a graph
    break, and the tokens match the unpatched model's."""
    from transformers import CompileConfig

    model = hf_models.model("llama")
    reference = copy.deepcopy(model)
    _apply(model)
    config = CompileConfig(backend="eager", mode=None, fullgraph=True)
    config._compile_all_devices = True
    ids = torch.randint(1, 512, (2, 20))
    kw = dict(max_new_tokens=4, do_sample=False, cache_implementation="static")
    torch._dynamo.reset()
    out = model.generate(ids, compile_config=config, **kw)
    ref = reference.generate(ids, disable_compile=True, **kw)
    torch._dynamo.reset()
    assert torch.equal(out, ref)
    assert spies["decode_attention"]


@torch.library.custom_op("tileops_test::hnd_decode", mutates_args=())
def _hnd_decode_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                   sm_scale: float, softcap: float, window_left: int) -> torch.Tensor:
    _HND_CALLS.append(tuple(k.shape))
    return _ref_decode(q, k, v, lengths, sm_scale=sm_scale, softcap=softcap,
                       window_left=window_left, kv_layout="HND").contiguous()


@_hnd_decode_op.register_fake
def _(q, k, v, lengths, sm_scale, softcap, window_left):
    # DecodeAttentionFwdOp's fake implementation checks the cache too: inductor's layouts
    # are checked when it compiles
    assert k.is_contiguous() and v.is_contiguous(), (k.stride(), v.stride())
    return q.new_empty(q.shape)


_HND_CALLS: list = []


@pytest.mark.full
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_static_cache_decode_step_under_inductor(family, spies, monkeypatch):
    """generate's automatic compile of the decode step on inductor (CPU, no CUDA graphs),
    decode_attention an opaque custom op as tileops' are: inductor functionalizes the
    cache's in-place update and hands the op its own buffer in the default contiguous
    [B, Hkv, S_max, D] layout, which the HND route reads (the old [B, S_max, Hkv, D]
    re-layout got a transposed view of that buffer there and was refused)."""
    from transformers import CompileConfig

    def decode(q, k, v, lengths, sm_scale=None, softcap=None, window_left=None,
               kv_layout="NHD", **kw):
        assert kv_layout == "HND" and not kw.get("return_lse")
        return _hnd_decode_op(q, k, v, lengths, float(sm_scale or q.shape[-1] ** -0.5),
                              float(softcap or 0.0),
                              -1 if window_left is None else int(window_left))

    monkeypatch.setattr(tileops.ops, "decode_attention", decode)
    model = hf_models.model(family)
    reference = copy.deepcopy(model)
    _apply(model)
    config = CompileConfig(backend="inductor", mode=None, fullgraph=True)
    config._compile_all_devices = True
    ids = torch.randint(1, 512, (2, 20))
    kw = dict(max_new_tokens=5, do_sample=False, cache_implementation="static",
              return_dict_in_generate=True, output_logits=True)
    _HND_CALLS.clear()
    torch._dynamo.reset()
    out = model.generate(ids, compile_config=config, **kw)
    torch._dynamo.reset()
    ref = reference.generate(ids, disable_compile=True, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(ref.logits), rtol=1e-4,
                               atol=1e-4)
    assert len(_HND_CALLS) == 4 * model.config.num_hidden_layers  # every decode step ran it


@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_deepseek_latent_cache_generate_matches(cache, spies):
    """DeepSeek-V3 caches latents, so its decode steps reach the attention function with
    keys and values expanded from them (q/k 192, v 128), never a static layer's own
    tensors: the prefill runs the attention kernel, the masked steps PyTorch's SDPA, and
    generation equals the unpatched model's."""
    model = hf_models.model("deepseek_v3")
    reference = copy.deepcopy(model)
    _apply(model)
    ids = torch.randint(0, 512, (2, 20))
    kw = dict(max_new_tokens=4, do_sample=False, cache_implementation=cache,
              disable_compile=True, return_dict_in_generate=True, output_logits=True)
    out, ref = model.generate(ids, **kw), reference.generate(ids, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(ref.logits), rtol=1e-4,
                               atol=1e-4)
    assert spies["attention"] and "decode_attention" not in spies
    assert len(spies["fused_moe"]) == 4  # its MoE layer: the prefill and 3 decode steps
