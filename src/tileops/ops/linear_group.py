"""`tileops.linear_group(input, weights, biases=None)`: one input projected by two or three
weights, `tuple(F.linear(input, w, b) for w, b in zip(weights, biases))`: a decoder layer's
q / k / v and gate / up projections.

- Up to GROUP_ROWS tokens (decode steps, small prefill chunks): one launch streams every
  weight (kernels/gemm/weight_group.py), where separate calls pay a launch and a pipeline
  fill each and a small weight (a k_proj) never reaches HBM speed on its own.
- More tokens where the smallest weight's GEMM would not fill one wave (q / k / v up to
  ~4K tokens): one launch of the dense GEMM's tiles over every weight's columns, where a
  GEMM a weight leaves the small weights' launches a fraction of a wave.
- Otherwise (and N not a multiple of 8 past GROUP_ROWS): one linear GEMM a weight
  (LinearFwdOp's).
- Backward: each weight's linear backward (LinearBwdOp), the input gradients summed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..errors import TileOpsTypeError, op_error
from ..kernels.base import Kernel
from ..kernels.gemm import GemmKernel
from ..kernels.gemm.gemm import NUM_SMS_H200 as SMS
from ..kernels.gemm.weight_group import BUCKETS as WEIGHT_STREAM_BUCKETS
from ..kernels.gemm.weight_group import GemmGroupKernel
from ..manifest.spec import DTYPE_NAMES
from .base import Op
from .layout import as_rows, is_tma_ready, tma_ready
from .linear import LinearBwdOp, LinearFwdOp, _gemm_key

# the weight-streaming buckets' rows. H100, 2026-12-06, at 32 and 64 tokens on Llama-3.1-8B
# / 70B and Qwen3-32B q/k/v and gate/up: 1.02-1.44x a GEMM a weight (8B q/k/v 25.0 against
# 35.9 us), 0.93-1.04x cuBLAS on the concatenated weight
GROUP_ROWS = WEIGHT_STREAM_BUCKETS[-1]
# the tile the route prices a weight's own GEMM in (the dense GEMM's large-M tile)
TOKEN_TILE = (128, 256)


def _group_key(dtype: torch.dtype, ns: tuple[int, ...], k: int,
               has_bias: bool) -> dict[str, Any]:
    return {"dtype": DTYPE_NAMES[dtype], "ns": ns, "k": k, "has_bias": has_bias}


def _one_launch(rows: int, ns: tuple[int, ...], k: int) -> bool:
    """Whether the grouped kernel serves the call: weights it can load by TMA (K of whole
    16-byte rows, no empty weight) and a decode-size token count, or a prefill one where
    a GEMM of the smallest weight alone would not fill one wave of the SMs (its 128 x 256
    tiles), with outputs it can store by TMA (N of whole 16-byte rows). H100, 2026-12-06:
    the token tiles ran Llama-3.1-8B's q/k/v at 512 tokens in 41.8 us where a GEMM a
    weight took 55.7; where every weight fills the SMs alone (gate/up at 512 and 4096
    tokens) the dense GEMM's own tiles were faster (161.1 against 191.0 us at 512)."""
    if k <= 0 or k % 8 or min(ns) <= 0:
        return False
    if rows <= GROUP_ROWS:
        return rows > 0
    smallest_tiles = -(-rows // TOKEN_TILE[0]) * -(-min(ns) // TOKEN_TILE[1])
    return smallest_tiles < SMS and all(n % 8 == 0 for n in ns)


class LinearGroupFwdOp(Op):
    """(input @ weight_g^T (+ bias_g) for each weight) (torch.nn.functional.linear a weight);
    output2 is empty without a third weight."""

    kernel_map = {"gemm_group": GemmGroupKernel, "gemm": GemmKernel}

    def __init__(self, *, kernel_map: Mapping[str, type[Kernel]] | None = None,
                 tune: bool = False):
        super().__init__(kernel_map=kernel_map, tune=tune)
        self._linear = LinearFwdOp(kernel_map=kernel_map, tune=tune)

    def forward(self, input: torch.Tensor, weight0: torch.Tensor, weight1: torch.Tensor,
                weight2: torch.Tensor | None = None, bias0: torch.Tensor | None = None,
                bias1: torch.Tensor | None = None,
                bias2: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        weights = [w for w in (weight0, weight1, weight2) if w is not None]
        biases = [bias0, bias1, bias2][:len(weights)]
        k = weight0.shape[1]
        ns = tuple(w.shape[0] for w in weights)
        x = as_rows(input, k)
        rows = x.shape[0]
        if _one_launch(rows, ns, k):
            outs = [torch.empty((rows, n), dtype=input.dtype, device=input.device) for n in ns]
            has_bias = bias0 is not None
            kernel = self._group_kernel(input, ns, k, has_bias)
            extra = [tma_ready(b) for b in biases] if has_bias else []
            kernel(rows, x, *[tma_ready(w) for w in weights], *extra, *outs)
        else:
            outs = [self._linear.forward(x, w, b) for w, b in zip(weights, biases, strict=True)]
        if input.dim() != 2:
            outs = [y.view(*input.shape[:-1], y.shape[1]) for y in outs]
        if weight2 is None:
            outs.append(torch.empty(0, dtype=input.dtype, device=input.device))
        return tuple(outs)

    def _group_kernel(self, input: torch.Tensor, ns: tuple[int, ...], k: int,
                      has_bias: bool) -> Kernel:
        return self.memo_kernel(("gemm_group", input.device, input.dtype, ns, k, has_bias),
                                "gemm_group", input.device,
                                lambda: _group_key(input.dtype, ns, k, has_bias))

    def plan(self, input: torch.Tensor, weight0: torch.Tensor, weight1: torch.Tensor,
             weight2: torch.Tensor | None = None, bias0: torch.Tensor | None = None,
             bias1: torch.Tensor | None = None, bias2: torch.Tensor | None = None) -> Any:
        """A 2-D input: the allocations and the launch, sizes and kernel bound (the grouped
        kernel's, or each weight's planned linear launch); inputs it does not read as they
        are (strided, unaligned) go to forward. Host time per decode call is what an eager
        step is bound by."""
        if input.dim() != 2:
            return None
        weights = [w for w in (weight0, weight1, weight2) if w is not None]
        ns, (m, k) = tuple(w.shape[0] for w in weights), input.shape
        if not _one_launch(m, ns, k):
            return self._plan_per_weight(input, weights, [bias0, bias1, bias2])
        has_bias = bias0 is not None
        kernel = self._group_kernel(input, ns, k, has_bias)
        two, forward = len(ns) == 2, self.forward
        dtype, device = input.dtype, input.device

        def launch(*inputs: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
            tensors = [t for t in inputs if t is not None]
            if not all(map(is_tma_ready, tensors)):
                return forward(*inputs)
            outs = [torch.empty((m, n), dtype=dtype, device=device) for n in ns]
            kernel(m, *tensors, *outs)
            if two:  # (output2, empty: a tensor of its own each call, as forward's)
                outs.append(torch.empty(0, dtype=dtype, device=device))
            return tuple(outs)
        return launch

    def _plan_per_weight(self, input: torch.Tensor, weights: list[torch.Tensor],
                         biases: list[torch.Tensor | None]) -> Any:
        """The GEMM-a-weight route's launch: each weight's planned linear launch (which
        sends inputs it cannot read as they are to its own forward), called in turn."""
        launches = [self._linear.plan(input, w, b)
                    for w, b in zip(weights, biases[:len(weights)], strict=True)]
        if None in launches:  # (an empty dimension)
            return None
        dtype, device = input.dtype, input.device

        def launch(input: torch.Tensor, *rest: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
            g = len(launches)  # (rest: three weight slots, then the biases)
            ws, bs = rest[:g], [*rest[3:], None, None, None][:g]
            outs = [run(input, w, b) for run, w, b in zip(launches, ws, bs, strict=True)]
            if len(outs) == 2:  # (output2, empty: a tensor of its own each call)
                outs.append(torch.empty(0, dtype=dtype, device=device))
            return tuple(outs)
        return launch

    def kernels_for(self, ns: Mapping[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
        dtype, k, rows = ns["input"].dtype, ns["K"], ns["rows"]
        sizes = tuple(ns[f"N{g}"] for g in range(3) if ns[f"weight{g}"] is not None)
        has_bias = ns["bias0"] is not None
        if _one_launch(rows, sizes, k):
            return [("gemm_group", _group_key(dtype, sizes, k, has_bias), rows)]
        return [("gemm", _gemm_key(dtype, n, k, False, True, has_bias), rows) for n in sizes]


# -- autograd -----------------------------------------------------------------------------
def _setup(ctx, inputs, output):
    x, *weights = inputs[:4]
    ctx.has_bias = inputs[4] is not None
    ctx.save_for_backward(x, *[w for w in weights if w is not None])


def _backward(ctx, grad0, grad1, grad2):
    x, *weights = ctx.saved_tensors
    grads = {}
    dx = None
    for g, (w, dy) in enumerate(zip(weights, (grad0, grad1, grad2)[:len(weights)], strict=True)):
        dx_g, grads[f"weight{g}"], db = LinearBwdOp.through_custom_op(
            dy, x, w, has_bias=ctx.has_bias)
        dx = dx_g if dx is None else dx + dx_g
        if ctx.has_bias:
            grads[f"bias{g}"] = db
    return LinearGroupFwdOp.grads_in_call_order(input=dx, **grads)


LinearGroupFwdOp.register_autograd(_backward, setup_context=_setup)


def linear_group(input: torch.Tensor, weights: Sequence[torch.Tensor],
                 biases: Sequence[torch.Tensor | None] | None = None) -> tuple[torch.Tensor, ...]:
    """`tuple(F.linear(input, w, b) for w, b in zip(weights, biases))` for two or three
    weights of one in-features, in one launch at decode sizes (differentiable)."""
    name = LinearGroupFwdOp.spec.op_name
    if not isinstance(weights, (list, tuple)) or len(weights) not in (2, 3):
        raise op_error(TileOpsTypeError, name, "weights", "a list or tuple of 2 or 3 tensors",
                       f"{len(weights)} items" if isinstance(weights, (list, tuple))
                       else type(weights).__name__)
    if biases is None:
        biases = [None] * len(weights)
    elif not isinstance(biases, (list, tuple)) or len(biases) != len(weights):
        raise op_error(TileOpsTypeError, name, "biases",
                       f"None or a list or tuple of {len(weights)} (one a weight)",
                       f"{len(biases)} items" if isinstance(biases, (list, tuple))
                       else type(biases).__name__)
    padded = [*weights, None][:3], [*biases, None][:3]
    outs = LinearGroupFwdOp.apply(input, *padded[0], *padded[1])
    return tuple(outs[:len(weights)])
