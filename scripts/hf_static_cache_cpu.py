"""CPU harness of tileops.transformers' static-cache decode route (issue 23).

Small random-init models (llama, qwen3, gemma2, mistral, gemma3) in float32 on the CPU,
patched for attention only, with tileops.attention / decode_attention /
chunked_prefill_attention replaced by PyTorch references that enforce the kernels'
kv_layout="HND" contract (k/v the contiguous [B, Hkv, S_max, D] cache, cache_seqlens int32
[B] counting each request's keys, the new ones included) and count their calls. `served`
is forced true (the kernels' CUDA/half-precision guard). Per family:

- eager: a static cache fed a 24-token prefill, a 40-token continuation, a 5-token step and
  two 1-token steps (the GPU test's scenario), against the unpatched model on its own
  static cache: logits equal, chunked_prefill_attention and decode_attention called on
  every layer that can take them; then a left-padded batch on the same scenario: no
  decode/chunked call. The cache goes to the model's forward under the name that
  transformers version takes (`cache` or `past_key_values`); --wrong-kwarg passes
  `cache=` always (what the GPU test did: on 5.17 it is swallowed by **kwargs and the
  model runs a DynamicCache).
- generate: `model.generate(..., cache_implementation="static", disable_compile=True)`
  greedy, tokens and logits against the unpatched model's, decode_attention on each step;
  with --compile eager inductor, also with transformers' automatic compile of the decode
  step (fullgraph) on those backends. The decode stub is a torch custom op, opaque to
  torch.compile like tileops' ops, whose real and fake implementations refuse a
  non-contiguous cache: under inductor, the in-place cache update is functionalized and
  the op gets inductor's own buffer in its default (contiguous [B, Hkv, S, D]) layout,
  which is what broke the old [B, S_max, Hkv, D] re-layout on the GPU.

Run with the installed transformers and with another one (e.g. a venv):
    PYTHONPATH=src python3 scripts/hf_static_cache_cpu.py
    PYTHONPATH=src /tmp/tf517/bin/python scripts/hf_static_cache_cpu.py --compile eager inductor
Exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.hf_models

import transformers  # noqa: E402
from tests import hf_models  # noqa: E402

import tileops.ops  # noqa: E402
import tileops.transformers as tt  # noqa: E402
from tileops.transformers import attention as hf_attention  # noqa: E402
from tileops.transformers import static_cache  # noqa: E402

FAMILIES = ["llama", "qwen3", "gemma2", "mistral", "gemma3"]
CALLS: dict[str, list] = {}


def ref_attention(q, k, v, is_causal=False, scale=None, window_size=(-1, -1), softcap=0.0):
    """tileops.attention: q [B, Sq, H, D], k/v [B, Skv, Hkv, D], bottom-right causal."""
    sq, heads, d = q.shape[1:]
    skv = k.shape[1]
    rep = heads // k.shape[2]
    kh = k.transpose(1, 2).repeat_interleave(rep, 1)
    vh = v.transpose(1, 2).repeat_interleave(rep, 1)
    s = q.transpose(1, 2) @ kh.transpose(-1, -2) * (scale if scale is not None else d ** -0.5)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq)[:, None] + (skv - sq)
    j = torch.arange(skv)[None, :]
    ok = torch.ones(sq, skv, dtype=torch.bool)
    if is_causal:
        ok &= j <= i
    if window_size[0] >= 0:
        ok &= j >= i - window_size[0]
    return (torch.softmax(s.masked_fill(~ok, -math.inf), -1) @ vh).transpose(1, 2)


def _cache_check(k: torch.Tensor, v: torch.Tensor) -> None:
    """The kernels' refusal (DecodeAttentionFwdOp checks it in its fake implementation too,
    so inductor's layouts are checked at compile time)."""
    if not (k.is_contiguous() and v.is_contiguous()):
        raise RuntimeError(f"k_cache: expected a contiguous tensor, got strides {k.stride()}")


@torch.library.custom_op("tileops_hf_harness::decode", mutates_args=())
def _decode_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
               sm_scale: float, softcap: float, window_left: int,
               is_causal: bool) -> torch.Tensor:
    """q [B, Sq, H, D] over the contiguous HND cache k/v [B, Hkv, S_max, D]; an opaque op
    to torch.compile, as tileops' ops are (its real implementation counts the call)."""
    _cache_check(k, v)
    CALLS.setdefault("decode_op", []).append(tuple(k.shape))
    batch, sq, heads, d = q.shape
    assert k.dim() == 4 and k.shape == v.shape and k.shape[0] == batch and k.shape[3] == d
    assert lengths.dtype == torch.int32 and tuple(lengths.shape) == (batch,)
    assert bool(((lengths >= sq) & (lengths <= k.shape[2])).all()), lengths
    rep = heads // k.shape[1]
    kh, vh = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q.transpose(1, 2) @ kh.transpose(-1, -2) * sm_scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    pos = lengths.long()[:, None] - sq + torch.arange(sq)  # [B, Sq]: each query's position
    j = torch.arange(k.shape[2])
    ok = (j < lengths.long()[:, None, None]).expand(batch, sq, -1).clone()
    if is_causal:
        ok &= j <= pos[..., None]
    if window_left >= 0:
        ok &= j >= pos[..., None] - window_left
    p = torch.softmax(s.masked_fill(~ok[:, None], -math.inf), -1)
    return (p @ vh).transpose(1, 2).contiguous()


@_decode_op.register_fake
def _(q, k, v, lengths, sm_scale, softcap, window_left, is_causal):
    _cache_check(k, v)
    return q.new_empty(q.shape)


def ref_decode(q, k, v, lengths, block_table=None, sm_scale=None, softcap=None,
               window_left=None, is_causal=True, return_lse=False, kv_layout="NHD"):
    """decode_attention on a contiguous HND cache: q [B, Sq, H, D], k/v [B, Hkv, S_max, D]."""
    assert kv_layout == "HND", kv_layout
    assert block_table is None and not return_lse
    return _decode_op(q, k, v, lengths, float(sm_scale or q.shape[-1] ** -0.5),
                      float(softcap or 0.0), -1 if window_left is None else int(window_left),
                      is_causal)


def ref_chunked(q, k, v, cu, lengths, max_q, **kw):
    """chunked_prefill_attention where every request brings max_q new tokens."""
    batch = lengths.shape[0]
    assert torch.equal(cu, torch.arange(batch + 1, dtype=torch.int32) * max_q)
    return ref_decode(q.view(batch, max_q, *q.shape[1:]), k, v, lengths, **kw).reshape(
        q.shape)


def install_stubs() -> None:
    def spy(name, fn, real):
        def wrapped(*args, **kwargs):
            if any(isinstance(a, torch.Tensor) and a.is_meta for a in args):
                return real(*args, **kwargs)  # apply's meta probes: the real op's checks
            if not torch.compiler.is_compiling():
                CALLS.setdefault(name, []).append(kwargs)
            return fn(*args, **kwargs)
        return wrapped

    for name, fn in (("attention", ref_attention), ("decode_attention", ref_decode),
                     ("chunked_prefill_attention", ref_chunked)):
        setattr(tileops.ops, name, spy(name, fn, getattr(tileops.ops, name)))
    hf_attention.served = lambda *ts: True


def models(family):
    reference = hf_models.model(family).eval()
    ours = copy.deepcopy(reference)
    tt.apply(ours, rms_norm=False, rope=False, mlp=False, cross_entropy=False, moe=False,
             linear=False, verbose=False)
    return ours, reference


def n(name):
    return len(CALLS.get(name, []))


def eager(family, wrong_kwarg) -> list[str]:
    from transformers import StaticCache

    fails = []
    ours, reference = models(family)
    layers = ours.config.num_hidden_layers
    torch.manual_seed(4)
    ids = torch.randint(1, 512, (2, 72))
    bounds = [(0, 24), (24, 64), (64, 69), (69, 70), (70, 71)]
    for padded in (False, True):
        mask = torch.ones_like(ids)
        if padded:
            mask[1, :7] = 0
        outs = []
        for m in (ours, reference):
            CALLS.clear()
            cache = StaticCache(config=m.config, max_cache_len=96)
            name = "cache" if wrong_kwarg else static_cache.cache_kwarg(m.model)
            with torch.no_grad():
                outs.append([m(input_ids=ids[:, a:b], attention_mask=mask[:, :b],
                               **{name: cache}).logits for a, b in bounds])
            if m is ours:
                seen = {k: n(k) for k in ("attention", "chunked_prefill_attention",
                                          "decode_attention")}
                kinds = sorted({type(la).__name__ for la in getattr(cache, "layers", [])})
                marks = [getattr(a, static_cache.MARK, None)
                         for a in ours.model._tileops_attn_modules]
        err = max((a - b).abs().max().item() for a, b in zip(*outs, strict=True))
        tag = f"{family} eager padded={padded}"
        print(f"  {tag}: calls {seen} layers {kinds} marks {marks} max|dlogits| {err:.1e}")
        if err > 1e-4:
            fails.append(f"{tag}: logits differ by {err:.2e}")
        if padded and (seen["decode_attention"] or seen["chunked_prefill_attention"]):
            fails.append(f"{tag}: a padded batch reached the cache kernels {seen}")
        # unpadded: every layer's 40-token continuation is chunked; the 5- and 1-token steps
        # decode on every layer (a 16-token sliding layer past its window takes PyTorch's
        # path on the 40/5-token forwards: transformers concatenates a fresh tensor then)
        if not padded:
            sliding = sum(t == "sliding_attention" for t in
                          (getattr(ours.config, "layer_types", None) or ["full_attention"]
                           * layers))
            if family == "mistral":
                sliding = layers
            full = layers - sliding
            want = {"chunked_prefill_attention": full, "decode_attention": 3 * full + 2 * sliding}
            if any(seen[k] != v for k, v in want.items()):
                fails.append(f"{tag}: calls {seen}, expected {want}")
    return fails


def generate(family, backend=None) -> list[str]:
    """Greedy generate on a static cache; backend: None (eager), or transformers' automatic
    compile of the decode step on that torch.compile backend ("eager": dynamo only;
    "inductor": inductor's own buffers and layouts, no CUDA graphs on the CPU)."""
    ours, reference = models(family)
    layers = ours.config.num_hidden_layers
    torch.manual_seed(3)
    ids = torch.randint(1, 512, (2, 24))
    kw = dict(max_new_tokens=12, do_sample=False, cache_implementation="static",
              return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    if backend:
        from transformers import CompileConfig

        config = CompileConfig(backend=backend, mode=None, fullgraph=True)
        config._compile_all_devices = True  # the CPU too
        torch._dynamo.reset()
        mode = dict(compile_config=config)
    else:
        mode = dict(disable_compile=True)
    CALLS.clear()
    try:
        out = ours.generate(ids, **mode, **kw)
    except Exception as e:  # noqa: BLE001 - reported as a failure
        return [f"{family} generate({backend}): {type(e).__name__}: {str(e)[:400]}"]
    seen = {k: n(k) for k in ("attention", "decode_op", "chunked_prefill_attention")}
    ref = reference.generate(ids, disable_compile=True, **kw)
    err = (torch.stack(out.logits) - torch.stack(ref.logits)).abs().max().item()
    same = torch.equal(out.sequences, ref.sequences)
    print(f"  {family} generate(static, compile={backend}): calls {seen} tokens equal {same} "
          f"max|dlogits| {err:.1e}")
    fails = []
    if not same or err > 1e-4:
        fails.append(f"{family} generate: tokens equal {same}, logits differ by {err:.2e}")
    if seen["decode_op"] != 11 * layers:
        fails.append(f"{family} generate({backend}): {seen['decode_op']} decode kernel calls "
                     f"run, expected {11 * layers}")
    return fails


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="*", default=FAMILIES)
    parser.add_argument("--wrong-kwarg", action="store_true",
                        help="pass the cache as cache= whatever the version takes")
    parser.add_argument("--compile", nargs="*", default=[], choices=["eager", "inductor"],
                        help="also generate with the decode step compiled on these backends")
    args = parser.parse_args()
    install_stubs()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    fails = []
    for family in args.families:
        fails += eager(family, args.wrong_kwarg)
        fails += generate(family)
        for backend in args.compile:
            fails += generate(family, backend)
    for f in fails:
        print("FAIL", f)
    print("OK" if not fails else f"{len(fails)} failure(s)")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
