"""Position-encoding family: rotary embeddings (RoPE), training and serving forms.

- `apply_rotary(q, k, cos, sin, unsqueeze_dim=1, interleaved=False)`: Hugging Face's
  apply_rotary_pos_emb, differentiable. q [B, H, S, D] (unsqueeze_dim=1, HF's default) or
  [B, S, H, D] (unsqueeze_dim=2), any strides whose last one is 1 (HF's q is a transposed view
  of the projection: read in place, no copy); k the same with its own head count (GQA, MQA).
  cos and sin are [B, S, R], [1, S, R] or [S, R] (shared by the batch), as HF's rotary
  module returns them (position_ids applied). R = cos.shape[-1] <= D: the first R elements of
  each head rotate (partial rotary, as GPT-NeoX/Phi/GLM do), the rest pass through.
  interleaved=False rotates (x[j], x[j + R/2]) as rotate_half does; True rotates (x[2i],
  x[2i + 1]) as GPT-J/Cohere do (their cos is repeat-interleaved). The outputs are new
  tensors, contiguous in q's and k's shapes. cos/sin get no gradient (HF builds them
  under no_grad); asking for one is an error.
- `apply_rotary_with_cache(positions, q, k, cos_sin_cache, interleaved=False)`: vLLM's
  rotary_embedding on packed tokens, in place. q [T, Hq, D], k [T, Hk, D] (views into a
  fused qkv buffer are fine: any strides whose last one is 1), cos_sin_cache [max_pos, R]
  with cos in the first R/2 columns and sin in the rest, positions int64 [T]. Positions
  outside [0, max_pos) read the nearest row (vLLM leaves them undefined). The Op object
  (`RotaryWithCacheFwdOp`) returns new tensors instead; both run the same kernel.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..errors import TileOpsUnsupportedError, op_error
from ..kernels.base import Kernel
from ..kernels.position_encoding import RotaryKernel
from ..manifest.spec import DTYPE_NAMES
from .base import LIBRARY, Op


def _vector_ready(t: torch.Tensor, vec: int) -> torch.Tensor:
    """`t` itself when its base address and every stride but the last (1) split into
    `vec`-element vectors, else a contiguous copy (the kernels read 16-byte vectors)."""
    strides = t.stride()
    if (strides[-1] == 1 and t.data_ptr() % (vec * t.element_size()) == 0
            and all(s % vec == 0 for s in strides[:-1])):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _head_planes(q: torch.Tensor, unsqueeze_dim: int) -> bool:
    """Whether [B, H, S, D] q lies in memory head plane by head plane (its head stride past
    its token stride), not as HF's transposed view of the [B, S, H, D] projection."""
    return unsqueeze_dim == 1 and q.shape[2] > 1 and q.stride(1) > q.stride(2)


class RotaryFwdOp(Op):
    """(q_out, k_out) = (q * cos + rotate(q) * sin, k * cos + rotate(k) * sin) on the first
    cos.shape[-1] elements of each head (transformers' apply_rotary_pos_emb); see the module
    docstring for shapes and layouts."""

    kernel_map = {"rotary": RotaryKernel}
    backward = False

    def __init__(self, *, unsqueeze_dim: int = 1, interleaved: bool = False,
                 kernel_map: Mapping[str, type[Kernel]] | None = None, tune: bool = False):
        super().__init__(unsqueeze_dim=unsqueeze_dim, interleaved=interleaved,
                         kernel_map=kernel_map, tune=tune)

    def forward(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._launch(q, k, cos, sin)

    def _launch(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        seq_dim = 3 - self.unsqueeze_dim
        tokens = q.shape[0] * q.shape[seq_dim]
        if tokens == 0:
            return q_out, k_out
        if cos.dim() == 2:
            cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
        key = self._kernel_key(q.dtype, q.shape[self.unsqueeze_dim], k.shape[self.unsqueeze_dim],
                               q.shape[3], cos.shape[-1], _head_planes(q, self.unsqueeze_dim))
        kernel = self.get_kernel("rotary", q.device, **key)
        vec = kernel.vec
        kernel(tokens, _vector_ready(q, vec), _vector_ready(k, vec), _vector_ready(cos, vec),
               _vector_ready(sin, vec), q_out, k_out)
        return q_out, k_out

    def _kernel_key(self, dtype: torch.dtype, q_heads: int, k_heads: int, head_dim: int,
                    rotary_dim: int, planes: bool) -> dict[str, Any]:
        name = DTYPE_NAMES[dtype]
        return {"form": "hf", "dtype": name, "table_dtype": name, "q_heads": q_heads,
                "k_heads": k_heads, "head_dim": head_dim, "rotary_dim": rotary_dim,
                "interleaved": self.interleaved, "backward": self.backward,
                "bhsd": self.unsqueeze_dim == 1, "inplace": False, "planes": planes}

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        first = ns[self.spec.input_names[0]]
        key = self._kernel_key(first.dtype, ns["Hq"], ns["Hk"], ns["D"], ns["R"],
                               _head_planes(first, self.unsqueeze_dim))
        return [("rotary", key, ns["B"] * ns["S"])]


class RotaryBwdOp(RotaryFwdOp):
    """(dq, dk) of RotaryFwdOp from (dq_out, dk_out): the rotation's transpose,
    dx = dy * cos - rotate(dy * sin) (a rotation by -sin when the two cos/sin entries of each
    pair agree, as they do for every RoPE table); pass-through elements copy dy."""

    backward = True

    def forward(self, dq_out: torch.Tensor, dk_out: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._launch(dq_out, dk_out, cos, sin)


def _save_tables(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, cos, sin, *params = inputs
    ctx.save_for_backward(cos, sin)
    ctx.params = params
    ctx.shapes = (q.shape, k.shape)


def _rotary_backward(ctx: Any, dq_out: torch.Tensor | None,
                     dk_out: torch.Tensor | None) -> tuple:
    if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
        raise op_error(TileOpsUnsupportedError, "RotaryFwdOp", "cos",
                       "cos and sin that do not require grad (no gradient flows to them)",
                       "a tensor that requires grad")
    cos, sin = ctx.saved_tensors
    q_shape, k_shape = ctx.shapes
    if dq_out is None:
        dq_out = cos.new_zeros(q_shape)
    if dk_out is None:
        dk_out = cos.new_zeros(k_shape)
    dq, dk = RotaryBwdOp.torch_op(dq_out, dk_out, cos, sin, *ctx.params)
    return (dq, dk, None, None) + (None,) * len(ctx.params)


RotaryFwdOp.register_autograd(_rotary_backward, setup_context=_save_tables)


class RotaryWithCacheFwdOp(Op):
    """vLLM's rotary_embedding on packed tokens, returning new tensors (q_out, k_out); the
    functional `apply_rotary_with_cache` is the in-place form. See the module docstring."""

    kernel_map = {"rotary": RotaryKernel}

    def __init__(self, *, interleaved: bool = False,
                 kernel_map: Mapping[str, type[Kernel]] | None = None, tune: bool = False):
        super().__init__(interleaved=interleaved, kernel_map=kernel_map, tune=tune)
        self.inplace = False

    @classmethod
    def index_bounds(cls, inputs: Mapping[str, Any],
                     params: Mapping[str, Any] | None = None) -> dict[str, int]:
        return {"positions": inputs["cos_sin_cache"].shape[0]}  # rows of the cache

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, q_heads, head_dim = q.shape
        if self.inplace:
            q_out, k_out = q, k
        else:
            q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        if tokens == 0:
            return q_out, k_out
        key = self._kernel_key(q.dtype, cos_sin_cache.dtype, q_heads, k.shape[1], head_dim,
                               cos_sin_cache.shape[1])
        kernel = self.get_kernel("rotary", q.device, **key)
        vec = kernel.vec
        table = cos_sin_cache if cos_sin_cache.is_contiguous() else cos_sin_cache.contiguous()
        if self.inplace:
            q_in, k_in = _vector_ready(q, vec), _vector_ready(k, vec)
            kernel(tokens, positions.contiguous(), q_in, k_in, table)
            if q_in is not q:  # an unaligned view was rotated in a copy
                q.copy_(q_in)
            if k_in is not k:
                k.copy_(k_in)
        else:
            kernel(tokens, positions.contiguous(), _vector_ready(q, vec), _vector_ready(k, vec),
                   table, q_out, k_out)
        return q_out, k_out

    def _kernel_key(self, dtype: torch.dtype, table_dtype: torch.dtype, q_heads: int,
                    k_heads: int, head_dim: int, rotary_dim: int) -> dict[str, Any]:
        return {"form": "cache", "dtype": DTYPE_NAMES[dtype],
                "table_dtype": DTYPE_NAMES[table_dtype], "q_heads": q_heads,
                "k_heads": k_heads, "head_dim": head_dim, "rotary_dim": rotary_dim,
                "interleaved": self.interleaved, "backward": False, "bhsd": False,
                "inplace": self.inplace}

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        key = self._kernel_key(ns["q"].dtype, ns["cos_sin_cache"].dtype, ns["Hq"], ns["Hk"],
                               ns["D"], ns["R"])
        return [("rotary", key, ns["T"])]


_inplace_ops: dict[bool, RotaryWithCacheFwdOp] = {}


def _inplace_op(interleaved: bool) -> RotaryWithCacheFwdOp:
    op = _inplace_ops.get(interleaved)
    if op is None:
        op = _inplace_ops[interleaved] = RotaryWithCacheFwdOp(interleaved=interleaved)
        op.inplace = True
    return op


@torch.library.custom_op(f"{LIBRARY}::rotary_with_cache_inplace", mutates_args=("q", "k"))
def _rotary_with_cache_inplace(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                               cos_sin_cache: torch.Tensor, interleaved: bool) -> None:
    _inplace_op(interleaved).run(positions, q, k, cos_sin_cache)


@_rotary_with_cache_inplace.register_fake
def _(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
      interleaved: bool) -> None:
    _inplace_op(interleaved).check((positions, q, k, cos_sin_cache))


# -- functional API -----------------------------------------------------------------------
def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 unsqueeze_dim: int = 1,
                 interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim) on TileOPs kernels
    (differentiable in q and k); `interleaved` selects GPT-J pairs. Returns (q_out, k_out)."""
    return RotaryFwdOp.apply(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim,
                             interleaved=interleaved)


def apply_rotary_with_cache(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                            cos_sin_cache: torch.Tensor,
                            interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's rotary_embedding(positions, q, k, head_size, cos_sin_cache, is_neox=not
    interleaved): rotates q [T, Hq, D] and k [T, Hk, D] in place and returns them (forward
    only). int32 positions are widened to int64 first (one small copy)."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        raise op_error(TileOpsUnsupportedError, "RotaryWithCacheFwdOp", "q",
                       "q and k that do not require grad (the in-place serving form has no "
                       "backward; apply_rotary is differentiable)", "a tensor that requires grad")
    if positions.dtype == torch.int32:
        positions = positions.long()
    if torch.compiler.is_compiling():
        torch.ops.tileops.rotary_with_cache_inplace(positions, q, k, cos_sin_cache,
                                                    interleaved)
    else:
        _inplace_op(interleaved).run(positions, q, k, cos_sin_cache)
    return q, k
