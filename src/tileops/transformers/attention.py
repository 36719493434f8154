"""The "tileops" attention implementation of transformers' AttentionInterface, and its mask.

A model whose `config._attn_implementation` is "tileops" calls `tileops_attention` from
every attention layer (the modeling code looks the function up in the registry), and builds
its masks with `tileops_mask`:

- the mask function returns None when the layer's pattern is plain causal attention over keys
  at contiguous positions (no padding, no packed sequences, no custom mask function): the
  same cases in which transformers' SDPA path skips its mask (`_ignore_causal_mask_sdpa`),
  with sliding windows allowed, since the kernel takes the window itself. Otherwise it
  returns SDPA's boolean [B, 1, Sq, Skv] mask.
- the attention function runs `tileops.attention` (causal, bottom-right aligned; the
  layer's sliding window, softcap and scaling) when the mask is None;
  `tileops.decode_attention` (up to 16 new tokens per row; `chunked_prefill_attention`
  beyond) on a static cache without padding (static_cache.py's mark), reading the static
  layer's own [B, Hkv, S_max, D] key/value tensors in place (kv_layout="HND"), with
  cache_seqlens read from the mask on the device (CUDA-graph capturable, no host sync);
  with PADDED_VARLEN (env TILEOPS_HF_PADDED_VARLEN=1; off by
  default, see below) a padded batch's full-attention layers, eager and without a filled
  cache, on `tileops.attention_varlen`, unpadded on the device; and transformers' own SDPA
  (or, for a softcapped layer, the model's eager attention) on the explicit mask otherwise:
  padded batches compute what the unpatched model does, on PyTorch.

PADDED_VARLEN is off by default: its cu_seqlens are built on the device, but
GroupedQueryAttentionVarlenFwdOp checks them with a host read per call (two per layer),
and its backward pads each of the 2B packed sequences to the row length (twice the dense
backward's work); not yet measured against SDPA.

transformers is imported by the functions of this module only when they run.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from . import static_cache

NAME = "tileops"
KERNEL_DTYPES = (torch.float16, torch.bfloat16)
DECODE_HEAD_DIMS = (64, 128, 256)  # tileops.decode_attention's head sizes
MAX_DECODE_Q = 16  # its query tokens per request; longer chunks: chunked_prefill_attention
# Padded batches (no cache or an empty one, eager only) on tileops.attention_varlen: off by
# default until measured, since GroupedQueryAttentionVarlenFwdOp reads its cu_seqlens on the
# host to check them (one sync per call, per layer) although ours are valid by construction
PADDED_VARLEN = os.environ.get("TILEOPS_HF_PADDED_VARLEN", "0") == "1"
_VALID = "_tileops_valid"  # on a mask tensor (eager only): the [B, S] padding mask it holds


def served(*tensors: torch.Tensor | None) -> bool:
    """Whether TileOPs' kernels take these tensors: CUDA (or meta: the ops' shape checks, as
    in a `prebuild.recording()` run), fp16 or bf16, one dtype. Every patched forward runs
    the original PyTorch code otherwise (CPU, fp32, mixed dtypes)."""
    dtype = None
    for t in tensors:
        if t is None:
            continue
        if (not (t.is_cuda or t.is_meta) or t.dtype not in KERNEL_DTYPES
                or dtype not in (None, t.dtype)):
            return False
        dtype = t.dtype
    return True


# transformers' sdpa_mask, prepare_padding_mask and _ignore_causal_mask_sdpa (None where a
# version lacks one), looked up by `register()`, outside any trace: an import of the
# transformers package (a _LazyModule) inside the mask function stops torch.compile's
# fullgraph tracing on some torch versions ("Bad import result").
_MASK_HELPERS: list[tuple[Any, Any, Any]] = []


def _load_mask_helpers() -> tuple[Any, Any, Any]:
    from transformers import masking_utils as mu

    return mu.sdpa_mask, getattr(mu, "prepare_padding_mask", None), getattr(
        mu, "_ignore_causal_mask_sdpa", None)


def _hf_mask_helpers() -> tuple[Any, Any, Any]:
    return _MASK_HELPERS[0] if _MASK_HELPERS else _load_mask_helpers()


def tileops_mask(batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0,
                 kv_offset: int = 0, mask_function: Any = None, attention_mask: Any = None,
                 allow_is_causal_skip: bool = True, **kwargs: Any) -> torch.Tensor | None:
    """transformers' mask interface: None where `tileops_attention` can run its kernel, else
    SDPA's boolean mask (see the module doc)."""
    sdpa_mask, prepare_padding_mask, can_skip = _hf_mask_helpers()
    kwargs.pop("local_size", None)  # the kernel applies the window: it never forces a mask
    bidirectional = kwargs.get("allow_is_bidirectional_skip", False)  # not a causal mask
    if allow_is_causal_skip and not bidirectional and can_skip is not None \
            and prepare_padding_mask is not None:
        padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
        if can_skip(padding, q_length, kv_length, q_offset, kv_offset, None):
            return None
    plain_causal = mask_function is causal_mask_function() and not bidirectional
    if mask_function is not None:
        kwargs["mask_function"] = mask_function
    mask = sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset,
                     attention_mask=attention_mask, allow_is_causal_skip=False, **kwargs)
    if (PADDED_VARLEN and plain_causal and isinstance(mask, torch.Tensor)
            and not torch.compiler.is_compiling() and isinstance(attention_mask, torch.Tensor)
            and attention_mask.dim() == 2 and attention_mask.shape[-1] == kv_length == q_length
            and isinstance(q_offset, int) and q_offset == 0 and kv_offset == 0):
        # causal & padding, nothing else: the attention function may unpad it on the device
        setattr(mask, _VALID, attention_mask.bool())
    return mask


def causal_mask_function() -> Any:
    from transformers.masking_utils import causal_mask_function as fn

    return fn


def _eager_fallback(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, mask: torch.Tensor | None,
                    **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """The modeling file's own eager attention (the only transformers path with softcap), on
    an additive mask made from the boolean one."""
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as eager
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~mask, torch.finfo(query.dtype).min)
    return eager(module, query, key, value, mask, **kwargs)


def tileops_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, softcap: float | None = None,
                      is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query [B, H, Sq, D], key/value [B, Hkv, Skv, D]
    (the modeling code's layout); returns ([B, Sq, H, D], None)."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    q_len, kv_len = query.shape[2], key.shape[2]
    if attention_mask is None and causal and 1 < q_len < kv_len:
        # the mask was skipped for a prefill into an empty static cache (q_offset 0, the
        # keys past q_len are unwritten slots): causal over the first q_len keys
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    left = sliding_window - 1 if sliding_window else -1
    kernel_ok = (not dropout and causal and served(query, key, value)
                 and kwargs.get("s_aux") is None and kwargs.get("sinks") is None)
    if kernel_ok and _on_static_cache(module, query, key, value, attention_mask):
        return _static_cache_attention(query, key, value, attention_mask, scaling, left,
                                       softcap), None
    valid = getattr(attention_mask, _VALID, None) if isinstance(attention_mask,
                                                                torch.Tensor) else None
    if (kernel_ok and valid is not None and left < 0 and q_len == kv_len
            and tuple(valid.shape) == (query.shape[0], q_len)):
        return _padded_attention(query, key, value, valid, scaling, softcap), None
    if kernel_ok and attention_mask is None:
        from ..ops import attention

        out = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                        is_causal=True, scale=scaling, window_size=(left, 0),
                        softcap=float(softcap) if softcap else 0.0)
        return out, None
    if attention_mask is None and causal and (left >= 0 or softcap is not None):
        # the mask function skipped the mask that PyTorch's paths need for a window (and
        # the eager path for causality itself)
        attention_mask = _causal_mask(query.shape[2], key.shape[2], left, query.device)
    if softcap is not None:
        return _eager_fallback(module, query, key, value, attention_mask, dropout=dropout,
                               scaling=scaling, softcap=softcap, **kwargs)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, is_causal=is_causal, **kwargs)


def _on_static_cache(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, mask: Any) -> bool:
    """Whether this call reads a static layer without padding (static_cache.py's mark):
    key/value its contiguous [B, Hkv, S_max, D] tensors, with the mask transformers built
    for it: the decode kernels' case."""
    batch, heads, q_len, head_dim = query.shape
    s_max = key.shape[2]
    return (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.dim() == 4
            and mask.shape[0] in (1, batch) and tuple(mask.shape[-2:]) == (q_len, s_max)
            and q_len < s_max and getattr(module, static_cache.MARK, 0) == s_max
            and key.shape[0] == batch and value.shape == key.shape
            and static_cache.hnd(key) and static_cache.hnd(value)
            and head_dim in DECODE_HEAD_DIMS and heads % key.shape[1] == 0)


def cache_seqlens(mask: torch.Tensor, batch: int) -> torch.Tensor:
    """int32 [B]: 1 + the last key the last query may see, read from the boolean mask on the
    device (no host sync): the keys' count of a cache without padding."""
    row = mask[:, 0, -1, :]
    idx = torch.arange(1, row.shape[-1] + 1, dtype=torch.int32, device=row.device)
    lengths = torch.where(row, idx, 0).amax(-1).to(torch.int32)
    return lengths.expand(batch).contiguous() if lengths.shape[0] != batch else lengths


def _static_cache_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            mask: torch.Tensor, scaling: float | None, left: int,
                            softcap: float | None) -> torch.Tensor:
    """query [B, H, Sq, D] over the static layer's key/value [B, Hkv, S_max, D] (read in
    place, kv_layout="HND"): up to 16 new tokens per row through tileops.decode_attention,
    more (a prefill onto a filled cache) through chunked_prefill_attention; returns
    [B, Sq, H, D]."""
    from .. import ops

    batch, heads, q_len, head_dim = query.shape
    lengths = cache_seqlens(mask, batch)
    q = query.transpose(1, 2)
    cap = float(softcap) if softcap else 0.0
    if q_len <= MAX_DECODE_Q:
        return ops.decode_attention(q, key, value, lengths, sm_scale=scaling, softcap=cap,
                                    window_left=left, kv_layout="HND")
    cu = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device=q.device)
    o = ops.chunked_prefill_attention(q.reshape(batch * q_len, heads, head_dim), key, value,
                                      cu, lengths, q_len, sm_scale=scaling, softcap=cap,
                                      window_left=left, kv_layout="HND")
    return o.view(batch, q_len, heads, head_dim)


def _padded_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      valid: torch.Tensor, scaling: float | None,
                      softcap: float | None) -> torch.Tensor:
    """Causal attention of a padded batch (query/key/value [B, H, S, D], valid [B, S]) on
    tileops.attention_varlen, unpadded on the device with static shapes: each row's valid
    tokens are moved to its front in order (a stable sort), so that every row is two packed
    sequences, its valid tokens then its padding (cu_seqlens [2B + 1] from the counts), and
    the outputs are moved back. Exact for any 2D padding mask (holes included) on the valid
    tokens; padded positions get their own attention, not the reference's."""
    from .. import ops

    batch, heads, seq, head_dim = query.shape
    kv_heads = key.shape[1]
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
    rows = torch.arange(batch, device=query.device, dtype=torch.int64)[:, None] * seq
    index = (order + rows).reshape(-1)

    def packed(t: torch.Tensor, h: int) -> torch.Tensor:
        return t.transpose(1, 2).reshape(batch * seq, h, head_dim).index_select(0, index)

    counts = valid.sum(1, dtype=torch.int32)
    starts = rows[:, 0].to(torch.int32)
    cu = torch.cat([torch.stack([starts, starts + counts], 1).reshape(-1),
                    starts.new_full((1,), batch * seq)])
    o = ops.attention_varlen(packed(query, heads), packed(key, kv_heads),
                             packed(value, kv_heads), cu, cu, seq, seq, is_causal=True,
                             scale=scaling, softcap=float(softcap) if softcap else 0.0)
    out = torch.zeros_like(o).index_copy(0, index, o)
    return out.view(batch, seq, heads, head_dim)


def _causal_mask(q_len: int, kv_len: int, left: int, device: torch.device) -> torch.Tensor:
    """[1, 1, q_len, kv_len] boolean, True = attend: causal aligned bottom-right (the last
    query sees the last key), and at most `left` keys back when left >= 0."""
    i = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    j = torch.arange(kv_len, device=device)[None, :]
    keep = j <= i
    if left >= 0:
        keep &= j >= i - left
    return keep[None, None]


def register() -> None:
    """Registers "tileops" in transformers' attention and mask registries (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if not _MASK_HELPERS:
        _MASK_HELPERS.append(_load_mask_helpers())
    if AttentionInterface._global_mapping.get(NAME) is not tileops_attention:
        AttentionInterface.register(NAME, tileops_attention)
    if AttentionMaskInterface._global_mapping.get(NAME) is not tileops_mask:
        AttentionMaskInterface.register(NAME, tileops_mask)
