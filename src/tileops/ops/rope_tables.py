"""RoPE tables on the host: inverse frequencies with the scalings of Hugging Face's
modeling_rope_utils (default, linear, dynamic NTK, Llama-3.1, YaRN, LongRoPE) and the cos/sin
tables the rotary kernels take.

- `rope_inv_freq(dim, base, rope_type, ...)` -> (inv_freq [dim / 2] float32, attention_factor):
  the same numbers as transformers' `_compute_*_parameters` (float32 math in the same order).
- `rope_inv_freq_from_config(config)`: the same from a model config (a transformers config
  or its config.json as a dict; `rope_parameters` or the older `rope_scaling`/`rope_theta`).
- `rope_cos_sin(position_ids, inv_freq, attention_factor)`: HF's rotary module output,
  cos/sin [*position_ids.shape, dim], for `apply_rotary` (repeat-interleaved when
  `interleaved`, as GPT-J-style models build them).
- `rope_cos_sin_cache(inv_freq, max_position, attention_factor)`: vLLM's [max_position, dim]
  cos|sin cache, for `apply_rotary_with_cache`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import TileOpsValueError, op_error

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def _require(rope_type: str, name: str, value: Any) -> Any:
    if value is None:
        raise op_error(TileOpsValueError, "rope_inv_freq", name,
                       f"a value (rope_type '{rope_type}' needs it)", None)
    return value


def _exponents(dim: int, device: Any) -> torch.Tensor:
    """arange(0, dim, 2) / dim in float32, as every HF RoPE type starts."""
    return torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(dim: int, base: float = 10000.0, rope_type: str = "default", *,
                  factor: float | None = None, max_position_embeddings: int | None = None,
                  original_max_position_embeddings: int | None = None,
                  low_freq_factor: float | None = None, high_freq_factor: float | None = None,
                  beta_fast: float | None = None, beta_slow: float | None = None,
                  mscale: float | None = None, mscale_all_dim: float | None = None,
                  truncate: bool = True, long_factor: Sequence[float] | None = None,
                  short_factor: Sequence[float] | None = None,
                  attention_factor: float | None = None, seq_len: int | None = None,
                  device: Any = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies of `dim` rotated elements (head_dim * partial_rotary_factor) and
    the factor HF multiplies cos and sin by (1.0 except for YaRN and LongRoPE).

    Args follow the keys of HF's `rope_parameters`; `seq_len` is the current length for the
    length-dependent types (dynamic NTK; LongRoPE picks long_factor past the original length).
    """
    if rope_type not in ROPE_TYPES:
        raise op_error(TileOpsValueError, "rope_inv_freq", "rope_type", f"one of {ROPE_TYPES}",
                       repr(rope_type))
    if dim < 2 or dim % 2:
        raise op_error(TileOpsValueError, "rope_inv_freq", "dim", "an even number >= 2", dim)
    if rope_type == "default":
        return 1.0 / (base ** _exponents(dim, device)), 1.0
    if rope_type == "linear":
        return 1.0 / (base ** _exponents(dim, device)) / _require(rope_type, "factor", factor), 1.0
    if rope_type == "dynamic":
        max_pos = _require(rope_type, "max_position_embeddings", max_position_embeddings)
        factor = _require(rope_type, "factor", factor)
        seq_len = seq_len if seq_len is not None and seq_len > max_pos else max_pos
        base = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (base ** _exponents(dim, device)), 1.0
    if rope_type == "llama3":
        return _llama3(dim, base, _require(rope_type, "factor", factor),
                       _require(rope_type, "low_freq_factor", low_freq_factor),
                       _require(rope_type, "high_freq_factor", high_freq_factor),
                       _require(rope_type, "original_max_position_embeddings",
                                original_max_position_embeddings), device), 1.0
    original = _require(rope_type, "original_max_position_embeddings",
                        original_max_position_embeddings)
    if factor is None:
        factor = _require(rope_type, "max_position_embeddings",
                          max_position_embeddings) / original
    if rope_type == "yarn":
        if attention_factor is None:
            attention_factor = (float(_yarn_mscale(factor, mscale)
                                      / _yarn_mscale(factor, mscale_all_dim))
                                if mscale and mscale_all_dim else _yarn_mscale(factor))
        return _yarn(dim, base, factor, original, beta_fast or 32, beta_slow or 1, truncate,
                     device), attention_factor
    # longrope
    if attention_factor is None:
        attention_factor = (1.0 if factor <= 1.0
                            else math.sqrt(1 + math.log(factor) / math.log(original)))
    scales = long_factor if seq_len and seq_len > original else short_factor
    scales = torch.tensor(_require(rope_type, "long_factor / short_factor", scales),
                          dtype=torch.float32, device=device)
    return 1.0 / (scales * base ** _exponents(dim, device)), attention_factor


def _llama3(dim: int, base: float, factor: float, low_freq_factor: float,
            high_freq_factor: float, old_context_len: int, device: Any) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by factor, short ones kept, a smooth blend between."""
    inv_freq = 1.0 / (base ** _exponents(dim, device))
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(dim: int, base: float, factor: float, original: int, beta_fast: float,
          beta_slow: float, truncate: bool, device: Any) -> torch.Tensor:
    """YaRN: interpolated (1 / factor) below the correction range, extrapolated above it,
    a linear ramp across it."""
    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as HF: no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp.to(device=device)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _get(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


def rope_inv_freq_from_config(config: Any, seq_len: int | None = None,
                              device: Any = None) -> tuple[torch.Tensor, float]:
    """rope_inv_freq for a model config (a transformers config object or a config.json dict)."""
    params = dict(_get(config, "rope_parameters") or _get(config, "rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    base = params.get("rope_theta", _get(config, "rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", _get(config, "partial_rotary_factor", 1.0))
    head_dim = _get(config, "head_dim") or (_get(config, "hidden_size")
                                            // _get(config, "num_attention_heads"))
    max_pos = _get(config, "max_position_embeddings")
    original = (_get(config, "original_max_position_embeddings")
                or params.get("original_max_position_embeddings") or max_pos)
    keys = ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
            "mscale", "mscale_all_dim", "long_factor", "short_factor", "attention_factor")
    extra = {k: params[k] for k in keys if params.get(k) is not None}
    return rope_inv_freq(int(head_dim * partial), base, rope_type, max_position_embeddings=max_pos,
                         original_max_position_embeddings=original,
                         truncate=params.get("truncate", True), seq_len=seq_len, device=device,
                         **extra)


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor,
                 attention_factor: float = 1.0, *, interleaved: bool = False,
                 dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [*position_ids.shape, 2 * len(inv_freq)] as HF's rotary modules return them:
    float32 angles, halves repeated (cat) or pairs repeated (interleaved), times
    attention_factor, cast to `dtype` (default float32)."""
    freqs = position_ids[..., None].float() * inv_freq.float().to(position_ids.device)
    emb = (freqs.repeat_interleave(2, dim=-1) if interleaved
           else torch.cat((freqs, freqs), dim=-1))
    cos, sin = emb.cos() * attention_factor, emb.sin() * attention_factor
    return cos.to(dtype or torch.float32), sin.to(dtype or torch.float32)


def rope_cos_sin_cache(inv_freq: torch.Tensor, max_position: int, attention_factor: float = 1.0,
                       *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """vLLM's cos_sin_cache [max_position, 2 * len(inv_freq)]: cos in the first half of each
    row, sin in the second, angles position * inv_freq in float32."""
    positions = torch.arange(max_position, dtype=torch.float32, device=inv_freq.device)
    freqs = torch.outer(positions, inv_freq.float())
    table = torch.cat((freqs.cos() * attention_factor, freqs.sin() * attention_factor), dim=-1)
    return table.to(dtype)
