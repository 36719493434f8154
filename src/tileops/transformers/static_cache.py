"""Static KV caches on TileOPs' decode attention: the per-forward check that a cache holds no
padding.

transformers' StaticLayer (and StaticSlidingWindowLayer) keeps each layer's keys and values
in contiguous [B, Hkv, S_max, D] tensors, written in place (index_copy_ along dim 2; a full
sliding layer rolls and copies back) and returned by `update` as they are. That is
`tileops.decode_attention`'s and `chunked_prefill_attention`'s kv_layout="HND" contiguous
cache, read in place: the attention function hands the layer's key/value tensors to the
kernel as they come, and nothing here touches the cache (its tensors, their static
addresses and transformers' own update, reset, reorder and masks stay transformers').

The kernel's cache holds keys 0 .. cache_seqlens[b] - 1 of request b, so it serves a
cache without padding only. A forward pre-hook on the base model reads the 2D
attention mask on the host once per prefill (a forward of more than one token, or the
cache's first forward; transformers' own mask path reads it there too) and marks each
attention module with its static layer's length (S_max) when the batch has no padding, 0
otherwise (padding, a dynamic cache, no cache, a layer of another type). Decode steps (one
token, the cache already filled) are not read: they keep the prefill's mark, so a
CUDA-graph-captured or compiled decode step never syncs (the hook does nothing while
torch.compile traces). The attention function takes the kernel only when the mark equals
the key tensor's length and key/value are contiguous [B, Hkv, S_max, D] tensors (a sliding
layer that concatenates past its window returns a fresh tensor of another length);
anything else runs PyTorch's attention on the mask.

The cache reaches the base model's forward as `cache` (transformers 5.24, which still maps
the deprecated `past_key_values` onto it) or `past_key_values` (5.17); the hook reads the
names the forward's signature takes (`cache_kwarg`): a `cache=` passed to a 5.17 forward
lands in its **kwargs, unused, and the model runs a DynamicCache of its own.
"""

from __future__ import annotations

from typing import Any

import torch

MARK = "_tileops_static_len"  # on attention modules: S_max of a static layer without padding
_DENSE = "_tileops_dense"  # on cache layers: the last prefill had no padding
_HOOK = "_tileops_cache_hook"  # on the base model: the pre-hook's id (deepcopy-safe)
CACHE_KWARGS = ("cache", "past_key_values")  # the cache argument's name across 5.x


def hnd(t: torch.Tensor | None) -> bool:
    """Whether `t` is a contiguous [B, H, S, D] tensor (the kernels' kv_layout="HND")."""
    return t is not None and t.dim() == 4 and t.is_contiguous()


def cache_kwarg(model: torch.nn.Module) -> str:
    """The name under which `model`'s forward takes its KV cache ("cache" or
    "past_key_values", by transformers version)."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return next((n for n in CACHE_KWARGS if n in params), CACHE_KWARGS[-1])


def _layer_types() -> tuple[type, ...]:
    from transformers import cache_utils as cu

    return tuple(getattr(cu, n) for n in ("StaticLayer", "StaticSlidingWindowLayer")
                 if hasattr(cu, n))


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
    # only the names the forward takes: a `cache=` that a 5.17 forward swallows into
    # **kwargs is not the cache it runs on (5.24 takes `cache` and still maps the older name)
    name = getattr(module, "_tileops_cache_kwarg", CACHE_KWARGS[0])
    cache = next((kwargs[n] for n in CACHE_KWARGS[CACHE_KWARGS.index(name):]
                  if kwargs.get(n) is not None), None)
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
        setattr(m, MARK, int(layer.max_cache_len) if getattr(layer, _DENSE) else 0)
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
        base._tileops_cache_kwarg = cache_kwarg(base)
        setattr(base, _HOOK, base.register_forward_pre_hook(_pre_hook, with_kwargs=True).id)


def uninstall(model: torch.nn.Module) -> None:
    for base in model.modules():
        hook = base.__dict__.pop(_HOOK, None)
        if hook is not None:
            base._forward_pre_hooks.pop(hook, None)
            base._forward_pre_hooks_with_kwargs.pop(hook, None)
            base.__dict__.pop("_tileops_cache_kwarg", None)
            for m in base.__dict__.pop("_tileops_attn_modules", ()):
                m.__dict__.pop(MARK, None)
