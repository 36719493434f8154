"""GPU exactness of tileops.transformers.apply: small random-init models of each family, bf16.

Tolerance (stated): for the logits, the training loss and every parameter's gradient, the
patched bf16 (or fp16) model's error against the unpatched model run in fp32 (same weights)
is at most 2x the unpatched bf16 model's own error against it, plus 2e-3, in relative
Frobenius norm:
    |patched - fp32| <= 2 |unpatched_bf16 - fp32| + 2e-3 |fp32|.
Both half-precision models round the same operands; TileOPs' kernels must not add more error than
transformers' PyTorch path has. Every op the patch installs must have run (call counts),
so a silent fallback to PyTorch fails the test.

Also: training under torch.compile (the patched model's losses follow the eager patched
model's), and greedy generation with a static KV cache under CUDA graphs (each generated
step's logits match a full forward of the fp32 reference over the same tokens).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

pytest.importorskip("transformers")

import tileops.ops  # noqa: E402
import tileops.transformers as tt  # noqa: E402
from tileops.transformers import _patch  # noqa: E402

from . import hf_models  # noqa: E402

pytestmark = pytest.mark.gpu

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "mixtral", "qwen3_moe",
            "deepseek_v3"]
BATCH, SEQ = 2, 203  # a ragged tail: 203 tokens per row, windows of 16
# the real models' head sizes where they differ from the small configs' 64
HEAD_DIM = {"llama": dict(head_dim=128), "qwen3": dict(head_dim=128),
            "gemma2": dict(head_dim=256, query_pre_attn_scalar=256)}


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _check(name: str, ours: torch.Tensor, bf16: torch.Tensor, fp32: torch.Tensor) -> None:
    assert torch.isfinite(ours).all(), f"{name}: non-finite values"
    err, base = _rel(ours, fp32), _rel(bf16, fp32)
    assert err <= 2 * base + 2e-3, f"{name}: patched error {err:.2e} vs bf16 PyTorch {base:.2e}"


@pytest.fixture
def counts(monkeypatch):
    """Counts the calls of each TileOPs op the patch uses (the real ops run)."""
    seen: dict[str, int] = {}

    def count(name, fn):
        def wrapped(*args, **kwargs):
            seen[name] = seen.get(name, 0) + 1
            return fn(*args, **kwargs)
        return wrapped

    for name in ("rms_norm", "swiglu", "geglu", "apply_rotary", "attention", "fused_moe",
                 "decode_attention", "chunked_prefill_attention", "attention_varlen",
                 "linear", "linear_group"):
        monkeypatch.setattr(tileops.ops, name, count(name, getattr(tileops.ops, name)))
    monkeypatch.setattr(_patch, "_flce", count("loss", _patch._flce))
    return seen


def _models(family: str, dtype: torch.dtype = torch.bfloat16, **overrides):
    fp32 = hf_models.model(family, device="cuda", **{**HEAD_DIM.get(family, {}), **overrides})
    bf16 = copy.deepcopy(fp32).to(dtype)
    ours = copy.deepcopy(bf16)
    tt.apply(ours, verbose=False)
    return ours, bf16, fp32


@pytest.mark.parametrize("family,dtype", [(f, torch.bfloat16) for f in FAMILIES]
                         + [("llama", torch.float16), ("qwen3", torch.float16)])
def test_logits_loss_and_gradients_match(family, dtype, counts):
    ours, bf16, fp32 = _models(family, dtype)
    torch.manual_seed(1)
    ids = torch.randint(0, 512, (BATCH, SEQ), device="cuda")
    ids[0, -7:] = -100  # ignored labels reach the loss as ignore_index
    labels = ids.clone()
    ids = ids.clamp_min(0)
    with torch.no_grad():
        for m in (ours, bf16, fp32):
            m.eval()
        logits = [m(input_ids=ids, use_cache=False).logits for m in (ours, bf16, fp32)]
    _check("logits", logits[0], logits[1], logits[2].float())
    results = []
    for m in (ours, bf16, fp32):
        m.train()
        m.zero_grad(set_to_none=True)
        out = m(input_ids=ids, labels=labels, use_cache=False)
        out.loss.backward()
        results.append((out.loss.detach().float(), {
            n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    (l_ours, g_ours), (l_bf16, g_bf16), (l_fp32, g_fp32) = results
    _check("loss", l_ours.reshape(1), l_bf16.reshape(1), l_fp32.reshape(1))
    assert g_ours.keys() == g_fp32.keys()
    for name in g_fp32:
        _check(f"grad {name}", g_ours[name], g_bf16[name], g_fp32[name].float())
    # every installed op ran
    assert counts.get("rms_norm") and counts.get("apply_rotary") and counts.get("attention")
    assert counts.get("loss") == 1
    patched = ours._tileops_report.patched
    gelu = family.startswith("gemma")  # GeLU-tanh MLPs run geglu
    assert bool(counts.get("geglu" if gelu else "swiglu")) == bool(patched.get("mlp")), counts
    assert patched.get("mlp") or family in ("mixtral", "qwen3_moe"), patched
    assert bool(counts.get("fused_moe")) == bool(patched.get("moe")), counts
    assert bool(patched.get("moe")) == (family in ("mixtral", "qwen3_moe", "deepseek_v3"))


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_padded_batch_matches(family):
    """Left padding: attention takes PyTorch's masked path; the rest stays on TileOPs."""
    ours, bf16, fp32 = _models(family)
    ids = torch.randint(0, 512, (BATCH, 64), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    with torch.no_grad():
        logits = [m.eval()(input_ids=ids, attention_mask=mask).logits for m in (ours, bf16, fp32)]
    keep = mask.bool()
    _check("logits", logits[0][keep], logits[1][keep], logits[2][keep].float())


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_padded_batch_on_attention_varlen(family, counts, monkeypatch):
    """TILEOPS_HF_PADDED_VARLEN: left and right padding and a hole, unpadded on the device
    onto attention_varlen (full-attention layers; gemma2's sliding ones stay on PyTorch):
    valid positions' logits, and the loss and gradients with no label predicted from a
    padded position, against the fp32 model."""
    from tileops.transformers import attention as hf_attention

    monkeypatch.setattr(hf_attention, "PADDED_VARLEN", True)
    ours, bf16, fp32 = _models(family)
    torch.manual_seed(5)
    ids = torch.randint(0, 512, (3, 203), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :37] = 0
    mask[1, 150:] = 0
    mask[2, 60:64] = 0
    keep = mask.bool()
    with torch.no_grad():
        logits = [m.eval()(input_ids=ids, attention_mask=mask).logits for m in (ours, bf16, fp32)]
    _check("logits", logits[0][keep], logits[1][keep], logits[2][keep].float())
    assert counts.get("attention_varlen")
    labels = ids.masked_fill(~(keep & torch.nn.functional.pad(keep, (1, 0))[:, :-1]), -100)
    results = []
    for m in (ours, bf16, fp32):
        m.train()
        m.zero_grad(set_to_none=True)
        out = m(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
        out.loss.backward()
        results.append((out.loss.detach().float(), {
            n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    (l_ours, g_ours), (l_bf16, g_bf16), (l_fp32, g_fp32) = results
    _check("loss", l_ours.reshape(1), l_bf16.reshape(1), l_fp32.reshape(1))
    for name in g_fp32:
        _check(f"grad {name}", g_ours[name], g_bf16[name], g_fp32[name].float())


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_trains_under_torch_compile(family):
    ours, _, _ = _models(family)
    eager = copy.deepcopy(ours)
    tt.apply(eager, verbose=False)  # deepcopy keeps the patch; apply is a no-op
    compiled = torch.compile(ours)
    opt_c = torch.optim.AdamW(ours.parameters(), lr=1e-3)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    torch.manual_seed(2)
    ids = torch.randint(0, 512, (BATCH, 128), device="cuda")  # one batch: the loss must fall
    losses_c, losses_e = [], []
    for _ in range(4):
        for model, opt, losses in ((compiled, opt_c, losses_c), (eager, opt_e, losses_e)):
            model.train()
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
    torch.testing.assert_close(torch.tensor(losses_c), torch.tensor(losses_e), rtol=2e-2,
                               atol=2e-2)
    assert all(map(math.isfinite, losses_c)) and losses_c[-1] < losses_c[0], losses_c


@pytest.mark.parametrize("family,batch,grouped", [
    ("llama", 2, False), ("qwen3", 2, False), ("gemma2", 2, False), ("mistral", 8, False),
    ("gemma3", 8, False), ("llama", 8, True), ("qwen2", 8, True),
    ("llama", 48, True)])  # (48 tokens a step: the grouped projections' m64 bucket)
def test_generates_with_static_cache_under_cuda_graphs(family, batch, grouped, monkeypatch):
    """transformers' automatic compile (reduce-overhead: CUDA graphs) of the decode step; the
    steps read the static layers' own [B, Hkv, S_max, D] tensors in place through
    tileops.decode_attention (kv_layout "HND"; gemma2:
    softcap; mistral/gemma: 16-token sliding layers that fill and roll); their Linear calls
    run tileops.linear, or with `grouped` (TILEOPS_HF_GROUP_PROJECTIONS=1) q/k/v and
    gate/up in one tileops.linear_group launch each (qwen2: with biases). No call counter
    here: a Python counter inside the compiled step would recompile it at every step; the
    route's conditions (cache layout, the prefill's marks) are checked instead, and the
    eager test below counts the calls."""
    from tileops.transformers import static_cache

    monkeypatch.setenv("TILEOPS_HF_GROUP_PROJECTIONS", "1" if grouped else "0")
    ours, _, fp32 = _models(family)
    ours.eval()
    torch.manual_seed(3)
    prompt = torch.randint(1, 512, (batch, 24), device="cuda")
    gen = ours.generate(prompt, max_new_tokens=12, do_sample=False,
                        cache_implementation="static", return_dict_in_generate=True,
                        output_logits=True, pad_token_id=0)
    seq = gen.sequences
    assert seq.shape == (batch, 36)
    step_logits = torch.stack(gen.logits, 1)  # [B, 12, V]: the logits of each new token
    with torch.no_grad():
        ref = fp32.eval()(input_ids=seq).logits[:, 23:35]
        bf16 = copy.deepcopy(fp32).to(torch.bfloat16)(input_ids=seq).logits[:, 23:35]
    _check("generation logits", step_logits, bf16, ref.float())
    cache = getattr(gen, "cache", None) or getattr(gen, "past_key_values", None)
    for layer in cache.layers:  # the kernels' HND cache: transformers' own tensors
        assert static_cache.hnd(layer.keys) and static_cache.hnd(layer.values)
        assert layer.keys.shape[:3] == (batch, ours.config.num_key_value_heads,
                                        layer.max_cache_len)
    marks = [getattr(m, static_cache.MARK) for m in ours.model._tileops_attn_modules]
    assert marks == [layer.max_cache_len for layer in cache.layers], marks


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "mistral", "gemma3"])
def test_static_cache_chunks_and_padding(family, counts):
    """Eager forwards on a static cache: a 24-token prefill, a 40-token continuation
    (chunked_prefill_attention), a 5-token step (decode_attention, Sq 5), 1-token steps; then
    a fresh cache filled by a left-padded batch (PyTorch's path). Each output checked
    against the fp32 model over the whole sequence; the kernels' calls counted per layer
    (a 16-token sliding layer past its window gets a fresh concatenated tensor from
    transformers on the 40- and 5-token forwards: PyTorch's path; its 1-token steps roll
    the cache in place: decode_attention). The cache goes in under the name this
    transformers version's forward takes (`cache=` on 5.17 lands in **kwargs, unused)."""
    from transformers import StaticCache

    from tileops.transformers import static_cache

    ours, bf16, fp32 = _models(family)
    cache_kw = static_cache.cache_kwarg(ours.model)
    layers = ours.config.num_hidden_layers
    types = getattr(ours.config, "layer_types", None) or ["full_attention"] * layers
    sliding = layers if family == "mistral" else types.count("sliding_attention")
    want = {"chunked_prefill_attention": layers - sliding,
            "decode_attention": 3 * (layers - sliding) + 2 * sliding}
    torch.manual_seed(4)
    ids = torch.randint(1, 512, (2, 72), device="cuda")
    bounds = [(0, 24), (24, 64), (64, 69), (69, 70), (70, 71)]
    for padded in (False, True):
        mask = torch.ones_like(ids)
        if padded:
            mask[1, :7] = 0
        caches = {id(m): StaticCache(config=m.config, max_cache_len=96) for m in (ours, bf16)}
        counts.clear()
        outs = {id(m): [] for m in (ours, bf16)}
        with torch.no_grad():
            for start, end in bounds:
                for m in (ours, bf16):
                    outs[id(m)].append(m.eval()(
                        input_ids=ids[:, start:end], attention_mask=mask[:, :end],
                        **{cache_kw: caches[id(m)]}).logits)
            full = fp32.eval()(input_ids=ids[:, :71], attention_mask=mask[:, :71]).logits
        keep = mask[:, :71].bool()
        got = torch.cat(outs[id(ours)], 1)
        base = torch.cat(outs[id(bf16)], 1)
        _check(f"static cache logits (padded={padded})", got[keep], base[keep],
               full[keep].float())
        got_calls = {k: counts.get(k, 0) for k in want}
        if padded:
            assert not any(got_calls.values()), counts
        else:
            assert got_calls == want, counts
        # linear="decode": eager forwards (these) keep F.linear, whatever their length
        assert not counts.get("linear"), counts
