"""Fused linear cross-entropy: the LM head's GEMM and the loss, without the full logits.

`fused_linear_cross_entropy(hidden [T, H], weight [V, H], target [T], bias=None, ...)` is
`cross_entropy(hidden @ weight.T + bias, target, ...)`, computed over chunks of tokens:
per chunk, the logits GEMM, the one-pass loss-and-gradient kernel writing the gradient
over the chunk's logits, then the two gradient GEMMs: grad_hidden for the chunk's rows and
grad_weight += grad_logits^T @ hidden (a GEMM that accumulates into its output, so no
[V, H] temporary; the first chunk's writes it). Peak memory above inputs and outputs is one
chunk of logits plus per-token fp32 rows: the chunk is sized to at most 1/12 of the full
fp32 logits.

The op computes the gradients in the forward (as Liger-Kernel's does): those of the summed
per-token loss; autograd's backward scales them by the incoming gradient (and 1/n_valid for
'mean'), one multiply per gradient tensor, with no host synchronization. Reduction 'none'
cannot be differentiated this way (each row's weight in grad_weight would be needed) and
is refused when a gradient is wanted. Vocabulary and hidden sizes must be multiples of 8
(16-byte rows for the GEMMs' TMA); GPT-2's 50257 is refused, not padded silently.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..errors import TileOpsUnsupportedError, TileOpsValueError, op_error
from ..kernels.base import Kernel
from ..kernels.gemm import GemmKernel
from ..kernels.softmax import CrossEntropyKernel
from ..manifest.spec import DTYPE_NAMES
from .base import Op
from .cross_entropy import _REDUCTIONS, _CrossEntropy

MAX_CHUNK_ROWS = 2048
MIN_CHUNK_ROWS = 256
# Chunks whose gradient logits one grad_weight GEMM takes together (K = their tokens): each
# GEMM reads and writes all of grad_weight (2 GB at a 128K x 4K head), about as long as its
# tensor-core work at 512 tokens, so longer K is faster; the logits buffer holds them all.
WEIGHT_GRAD_CHUNKS = 1


def chunk_rows(tokens: int, vocab: int) -> int:
    """Tokens per chunk: the largest power of two whose 2-byte logits take at most 1/12 of
    the tokens' full fp32 logits (the memory bound; each chunk reads and writes grad_weight
    once more, so larger is faster), within [MIN_CHUNK_ROWS, MAX_CHUNK_ROWS].

    A power of two is a GEMM bucket's own row count, so the chunk GEMMs run the configs
    chosen for exactly their rows: grad_hidden's (K = the vocabulary) split-K fills the SMs.
    640-row chunks (the old multiple-of-128 rule at 4K tokens) fell in the 1024-row bucket,
    whose unsplit 128 x 256 tiles left grad_hidden 80 CTAs on 132 SMs (Llama-3.1-8B and
    Qwen3 both)."""
    bound = tokens * 4 // (2 * 12)
    rows = MIN_CHUNK_ROWS
    while rows * 2 <= min(bound, MAX_CHUNK_ROWS):
        rows *= 2
    return min(rows, max(tokens, 1))


class FusedLinearCrossEntropyFwdOp(_CrossEntropy, Op):
    """(loss, grad_hidden, grad_weight, grad_bias): the loss reduced as `reduction` says,
    and the gradients of the summed per-token loss (empty when `with_grad` is False)."""

    kernel_map = {"gemm": GemmKernel, "cross_entropy": CrossEntropyKernel}

    def __init__(self, *, ignore_index: int = -100, label_smoothing: float = 0.0,
                 softcap: float | None = None, lse_square_scale: float = 0.0,
                 reduction: str = "mean", with_grad: bool = True,
                 kernel_map: Mapping[str, type[Kernel]] | None = None, tune: bool = False):
        Op.__init__(self, ignore_index=ignore_index, label_smoothing=float(label_smoothing),
                    softcap=None if softcap is None else float(softcap),
                    lse_square_scale=float(lse_square_scale), reduction=reduction,
                    with_grad=with_grad, kernel_map=kernel_map, tune=tune)

    @classmethod
    def index_bounds(cls, inputs: Mapping[str, Any],
                     params: Mapping[str, Any] | None = None) -> dict[str, int]:
        return {"target": inputs["weight"].shape[0]}

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                bias: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        tokens, width = hidden.shape
        vocab = weight.shape[0]
        dev, dtype = hidden.device, hidden.dtype
        hidden, weight, target = hidden.contiguous(), weight.contiguous(), target.contiguous()
        grads = self.with_grad
        loss = torch.empty(tokens, dtype=torch.float32, device=dev)
        lse = torch.empty(tokens, dtype=torch.float32, device=dev)
        grad_hidden = torch.empty((tokens, width) if grads else 0, dtype=dtype, device=dev)
        # the first chunk's GEMM writes grad_weight, the later ones add to it: no zero fill
        # and no read of zeros (2 GB of HBM traffic at a 128K x 4K head); no chunk, zeros
        grad_weight = (torch.zeros if grads and tokens == 0 else torch.empty)(
            (vocab, width) if grads else 0, dtype=dtype, device=dev)
        grad_bias = torch.zeros(vocab if grads and bias is not None else 0,
                                dtype=torch.float32, device=dev)
        rows = chunk_rows(tokens, vocab)
        group = rows * (WEIGHT_GRAD_CHUNKS if grads else 1)
        logits = torch.empty((min(group, tokens), vocab), dtype=dtype, device=dev)
        mode = "loss_and_grad" if grads else "loss"
        for first in range(0, tokens, group):
            last = min(first + group, tokens)
            for start in range(first, last, rows):
                stop = min(start + rows, last)
                n = stop - start
                chunk = logits[start - first:stop - first]
                self._gemm(dev, dtype, vocab, width, False, True)(n, hidden[start:stop],
                                                                  weight, chunk)
                if bias is not None:
                    chunk += bias
                extra = (chunk,) if grads else ()
                self.get_kernel("cross_entropy", dev, **self._key(mode, dtype, vocab))(
                    n, chunk, target[start:stop], loss[start:stop], lse[start:stop], *extra,
                    *self._scalars())
                if not grads:
                    continue
                # grad_hidden rows = grad_logits @ weight
                self._gemm(dev, dtype, width, vocab, False, False)(n, chunk, weight,
                                                                   grad_hidden[start:stop])
                if bias is not None:
                    grad_bias += chunk.sum(0, dtype=torch.float32)
            if grads:  # grad_weight (+)= grad_logits^T @ hidden over the group's tokens
                self._gemm(dev, dtype, width, last - first, True, False,
                           accumulate=first > 0)(vocab, logits[:last - first],
                                                 hidden[first:last], grad_weight)
        total = self._reduced(loss, target)
        return total, grad_hidden, grad_weight, grad_bias.to(dtype)

    def _reduced(self, loss: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.reduction == "none":
            return loss
        total = loss.sum()
        if self.reduction == "mean":
            total = total / (target != self.ignore_index).sum()
        return total

    def _gemm(self, device: torch.device, dtype: torch.dtype, n: int, k: int, trans_a: bool,
              trans_b: bool, accumulate: bool = False) -> Kernel:
        key = {"dtype": DTYPE_NAMES[dtype], "n": n, "k": k, "trans_a": trans_a,
               "trans_b": trans_b}
        if accumulate:
            key["accumulate"] = True
        return self.get_kernel("gemm", device, **key)

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        tokens, vocab, width = ns["T"], ns["V"], ns["H"]
        dtype = DTYPE_NAMES[ns["hidden"].dtype]
        rows = chunk_rows(tokens, vocab)
        gemm = {"dtype": dtype, "trans_b": True, "trans_a": False}
        found = [("gemm", {**gemm, "n": vocab, "k": width}, rows),
                 ("cross_entropy", self._key("loss_and_grad" if self.with_grad else "loss",
                                             ns["hidden"].dtype, vocab), rows)]
        if self.with_grad:
            found.append(("gemm", {**gemm, "n": width, "k": vocab, "trans_b": False}, rows))
            weight_grad = {**gemm, "n": width, "trans_a": True, "trans_b": False}
            group = rows * WEIGHT_GRAD_CHUNKS
            groups = [group] * (tokens // group) + ([tokens % group] if tokens % group else [])
            if groups:  # the first group's GEMM writes grad_weight, the others add to it
                found.append(("gemm", {**weight_grad, "k": groups[0]}, vocab))
            for n in sorted(set(groups[1:])):
                found.append(("gemm", {**weight_grad, "k": n, "accumulate": True}, vocab))
        return found


# -- autograd ------------------------------------------------------------------------------
_OP = FusedLinearCrossEntropyFwdOp


def _setup(ctx, inputs, output):
    args = dict(zip(_OP.spec.call_order, inputs, strict=True))
    ctx.reduction = args["reduction"]
    ctx.has_bias = args["bias"] is not None
    n_valid = (args["target"] != args["ignore_index"]).sum()
    ctx.save_for_backward(output[1], output[2], output[3], n_valid)
    # The gradient outputs are the backward's own buffers, not quantities to differentiate.
    # Left differentiable, autograd materialized a zero gradient of each for the backward's
    # unused arguments: 1034 MiB of zeros (grad_weight + grad_hidden) at Llama-3.1-8B's 4K
    # tokens, the whole excess the H200 measured above inputs and outputs.
    ctx.mark_non_differentiable(output[1], output[2], output[3])
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_loss, *_unused_output_grads):
    grad_hidden, grad_weight, grad_bias, n_valid = ctx.saved_tensors
    if grad_loss is None:  # the loss was not used (no materialized zeros: see _setup)
        return _OP.grads_in_call_order()
    scale = grad_loss.float()
    if ctx.reduction == "mean":
        scale = scale / n_valid
    scale = scale.to(grad_hidden.dtype)
    # in place: the forward's gradient buffers become the gradients, so the backward
    # allocates nothing the size of the weight
    grads = {"hidden": grad_hidden.mul_(scale), "weight": grad_weight.mul_(scale),
             "bias": grad_bias.mul_(scale) if ctx.has_bias else None}
    return _OP.grads_in_call_order(**grads)


_OP.register_autograd(_backward, setup_context=_setup)


# -- functional API -----------------------------------------------------------------------
def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor,
                               target: torch.Tensor, bias: torch.Tensor | None = None, *,
                               ignore_index: int = -100, reduction: str = "mean",
                               label_smoothing: float = 0.0, softcap: float | None = None,
                               lse_square_scale: float = 0.0) -> torch.Tensor:
    """cross_entropy(hidden @ weight.T + bias, target, ...) without materializing the logits
    [T, V] (differentiable w.r.t. hidden, weight and bias; see the module doc)."""
    name = _OP.spec.op_name
    if reduction not in _REDUCTIONS:
        raise op_error(TileOpsValueError, name, "reduction", "'mean', 'sum' or 'none'",
                       repr(reduction))
    wants_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias))
    if wants_grad and reduction == "none":
        raise op_error(TileOpsUnsupportedError, name, "reduction",
                       "'mean' or 'sum' when a gradient is needed (the weight gradient is "
                       "summed over tokens in the forward)", "'none'")
    params = {"ignore_index": ignore_index, "label_smoothing": label_smoothing,
              "softcap": softcap, "lse_square_scale": lse_square_scale,
              "reduction": reduction, "with_grad": wants_grad}
    loss = _OP.apply(hidden, weight, target, bias, **params)[0]
    return loss.to(hidden.dtype)
