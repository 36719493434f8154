"""Static KV caches laid out for TileOPs' decode attention, and the per-forward check that a
cache holds no padding.

transformers' StaticLayer stores each layer's keys and values as [B, Hkv, S_max, D]
tensors; `tileops.decode_attention` reads a contiguous [B, S_max, Hkv, D] cache in place
(a per-step copy into that layout would cost more than the attention saves). So the layers
of a static cache that a patched model uses get [B, S_max, Hkv, D] storage, exposed to
transformers as the [B, Hkv, S_max, D] transposed view: transformers' own `update`
(index_copy_ along dim 2), `reset`, masks and PyTorch attention work on the view
unchanged, and the attention function hands `key.transpose(1, 2)` (contiguous) to the
kernel.

The kernel's cache holds keys 0 .. cache_seqlens[b] - 1 of request b, so it serves a
cache without padding only. A forward pre-hook on the base model reads the 2D
attention mask on the host once per prefill (a forward of more than one token, or the
cache's first forward; transformers' own mask path reads it there too) and marks each
attention module with the static layer's length when the batch has no padding, 0
otherwise. Decode steps (one token, the cache already filled) are not read: they keep
the prefill's mark, so a CUDA-graph-captured or compiled decode step never syncs (the hook
does nothing while torch.compile traces). The attention function takes the kernel only
when the mark equals the key tensor's length and the key/value tensors are the
[B, S_max, Hkv, D] views; anything else (a padded batch, a dynamic cache, a layer of
another type, a cache reordered by beam search) runs PyTorch's attention on the mask.
"""

from __future__ import annotations

import types
from typing import Any

import torch

MARK = "_tileops_static_len"  # on attention modules: S_max of a dense, re-laid-out layer
_DENSE = "_tileops_dense"  # on cache layers: the last prefill had no padding
_HOOK = "_tileops_cache_hook"  # on the base model: the pre-hook's id (deepcopy-safe)


def bshd(t: torch.Tensor | None) -> bool:
    """Whether `t` [B, H, S, D] is the transposed view of a contiguous [B, S, H, D] tensor."""
    return t is not None and t.dim() == 4 and t.transpose(1, 2).is_contiguous()


def _layer_types() -> tuple[type, ...]:
    from transformers import cache_utils as cu

    return tuple(getattr(cu, n) for n in ("StaticLayer", "StaticSlidingWindowLayer")
                 if hasattr(cu, n))


def _relayout(layer: Any) -> None:
    """keys/values [B, Hkv, S, D] -> views of new [B, S, Hkv, D] storage, same values."""
    for name in ("keys", "values"):
        t = getattr(layer, name)
        if bshd(t):
            continue
        b, h, s, d = t.shape
        new = torch.empty((b, s, h, d), dtype=t.dtype, device=t.device).transpose(1, 2)
        new.copy_(t)
        if not torch.compiler.is_compiling():
            torch._dynamo.mark_static_address(new)
        setattr(layer, name, new)


def _lazy_initialization(self: Any, key_states: torch.Tensor,
                         value_states: torch.Tensor) -> None:
    """The layer's own lazy initialization, then its tensors re-laid out (a transient copy
    of one layer's empty cache)."""
    type(self).lazy_initialization(self, key_states, value_states)
    _relayout(self)


def _adopt(layer: Any) -> None:
    if getattr(layer, "is_initialized", False):
        _relayout(layer)
    elif "lazy_initialization" not in vars(layer):
        layer.lazy_initialization = types.MethodType(_lazy_initialization, layer)


def _no_padding(mask: Any) -> bool:
    """Whether the forward's mask leaves every request's keys a prefix of its cache rows
    (one host read). A 2D padding mask: all ones. The dict of 4D masks that generate
    builds for models with sliding layers (Gemma-2/3): each mask None (skipped: plain
    causal) or, on its last query row, a prefix of True (a sliding layer's window past
    its start reads as padding: PyTorch's path, never a wrong kernel call). A 4D mask of
    the caller's own: PyTorch's path."""
    if mask is None:
        return True
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        return bool(mask.all())
    if isinstance(mask, dict):
        rows = [m[:, 0, -1, :] for m in mask.values() if isinstance(m, torch.Tensor)
                and m.dtype == torch.bool and m.dim() == 4]
        if len(rows) != sum(m is not None for m in mask.values()):
            return False
        return all(bool((r.int().cummin(-1) == r.int()).all()) for r in rows)
    return False


def _pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    if torch.compiler.is_compiling():
        return None
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    layers = getattr(cache, "layers", None)
    attn = getattr(module, "_tileops_attn_modules", ())
    if not layers:
        for m in attn:
            setattr(m, MARK, 0)
        return None
    tokens = kwargs.get("input_ids")
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    if tokens is None and args:
        tokens = args[0]
    q_len = tokens.shape[1] if isinstance(tokens, torch.Tensor) and tokens.dim() >= 2 else 2
    kinds = _layer_types()
    dense = None
    for m in attn:
        idx = getattr(m, "layer_idx", None)
        layer = layers[idx] if isinstance(idx, int) and idx < len(layers) else None
        if type(layer) not in kinds:
            setattr(m, MARK, 0)
            continue
        if q_len > 1 or not getattr(layer, "is_initialized", False) or not hasattr(
                layer, _DENSE):
            if dense is None:
                dense = _no_padding(kwargs.get("attention_mask"))
            setattr(layer, _DENSE, dense)
            if dense:
                _adopt(layer)
        ok = getattr(layer, _DENSE) and (not getattr(layer, "is_initialized", False) or (
            bshd(layer.keys) and bshd(layer.values)))
        setattr(m, MARK, int(layer.max_cache_len) if ok else 0)
    return None


def install(model: torch.nn.Module) -> None:
    """Registers the pre-hook on each base model (a module holding the decoder `layers`)."""
    for base in model.modules():
        layers = getattr(base, "layers", None)
        if not isinstance(layers, torch.nn.ModuleList) or getattr(base, _HOOK, None) is not None:
            continue
        attn = [m for m in base.modules() if isinstance(getattr(m, "layer_idx", None), int)
                and type(m).__name__.endswith("Attention")]
        if not attn:
            continue
        for m in attn:
            setattr(m, MARK, 0)
        base._tileops_attn_modules = attn
        setattr(base, _HOOK, base.register_forward_pre_hook(_pre_hook, with_kwargs=True).id)


def uninstall(model: torch.nn.Module) -> None:
    for base in model.modules():
        hook = base.__dict__.pop(_HOOK, None)
        if hook is not None:
            base._forward_pre_hooks.pop(hook, None)
            base._forward_pre_hooks_with_kwargs.pop(hook, None)
            for m in base.__dict__.pop("_tileops_attn_modules", ()):
                m.__dict__.pop(MARK, None)
