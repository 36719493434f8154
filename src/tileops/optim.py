"""`tileops.optim.AdamW`: torch.optim.AdamW with the update on TileOPs' kernel.

A drop-in for `torch.optim.AdamW(params, lr, betas, eps, weight_decay)` (same defaults, same
math as torch's fused update, same state names: `step`, `exp_avg`, `exp_avg_sq`, so state
dicts load either way). Each parameter with a gradient takes one launch of the AdamW op
(`AdamwStepFwdOp.update_`), 14 bytes an element in bf16/fp16; the bias corrections are
computed on the host from the step count, which is kept as a CPU tensor (torch's default,
non-capturable form), so a step never waits for the GPU.

Not supported, refused by name: amsgrad, sparse gradients, DTensor parameters (FSDP2,
tensor parallelism), non-contiguous parameters, learning rates held in CUDA tensors, and
stepping inside torch.compile or a CUDA graph capture (a replay would repeat the step's
scalars).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from .errors import TileOpsTypeError, TileOpsUnsupportedError, TileOpsValueError
from .ops.optimizer import AdamwStepFwdOp

_NAME = "tileops.optim.AdamW"


def _error(cls: type, arg: str, expected: str, got: Any) -> Exception:
    return cls(f"{_NAME}: argument '{arg}': expected {expected}, got {got}")


def _learning_rate(lr: Any) -> float:
    if isinstance(lr, torch.Tensor):
        if lr.device.type != "cpu" or lr.numel() != 1:
            raise _error(TileOpsValueError, "lr", "a float or a one-element CPU tensor "
                         "(a CUDA value would make every step wait for the GPU)",
                         f"a tensor of shape {tuple(lr.shape)} on {lr.device}")
        return float(lr)
    return float(lr)


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "to_local")


class AdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) whose update runs on TileOPs' AdamW kernel."""

    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 maximize: bool = False):
        if amsgrad:
            raise _error(TileOpsUnsupportedError, "amsgrad", "False (no amsgrad kernel; "
                         "use torch.optim.AdamW(amsgrad=True))", amsgrad)
        if not _learning_rate(lr) >= 0.0:
            raise _error(TileOpsValueError, "lr", "a value >= 0", lr)
        if not eps >= 0.0:
            raise _error(TileOpsValueError, "eps", "a value >= 0", eps)
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise _error(TileOpsValueError, "betas", "two values in [0, 1)", betas)
        if not weight_decay >= 0.0:
            raise _error(TileOpsValueError, "weight_decay", "a value >= 0", weight_decay)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        amsgrad=False, maximize=maximize)
        super().__init__(params, defaults)
        self._ops: dict[tuple, AdamwStepFwdOp] = {}

    def _op(self, group: dict[str, Any]) -> AdamwStepFwdOp:
        """The op object of a group's constant hyperparameters (made once)."""
        if group.get("amsgrad"):
            raise _error(TileOpsUnsupportedError, "amsgrad", "False in every param group",
                         True)
        beta1, beta2 = group["betas"]
        key = (float(beta1), float(beta2), float(group["eps"]),
               float(group["weight_decay"]), bool(group["maximize"]))
        op = self._ops.get(key)
        if op is None:
            op = self._ops[key] = AdamwStepFwdOp(beta1=key[0], beta2=key[1], eps=key[2],
                                                 weight_decay=key[3], maximize=key[4])
        return op

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        if torch.compiler.is_compiling():
            raise TileOpsUnsupportedError(
                f"{_NAME}: step() inside torch.compile is not supported; call it eagerly "
                "(its launches are already one a parameter)")
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise TileOpsUnsupportedError(
                f"{_NAME}: step() inside CUDA graph capture is not supported: the step's "
                "learning rate and bias corrections are kernel arguments, which a replay "
                "would repeat; use torch.optim.AdamW(capturable=True)")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            op = self._op(group)
            lr = _learning_rate(group["lr"])
            for p in group["params"]:
                grad = p.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise _error(TileOpsTypeError, "params", "dense gradients",
                                 "a sparse gradient")
                if _is_dtensor(p):
                    raise _error(TileOpsUnsupportedError, "params", "plain tensors (DTensor "
                                 "parameters of FSDP2 / tensor parallelism are not supported "
                                 "yet: use torch.optim.AdamW)", "a DTensor")
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(
                        p, memory_format=torch.preserve_format)
                step_count = state["step"]
                if step_count.device.type != "cpu":  # a state dict of a fused/capturable run
                    step_count = state["step"] = step_count.to("cpu", torch.float32)
                step_count += 1
                op.update_(p, grad, state["exp_avg"], state["exp_avg_sq"], lr,
                           int(step_count.item()))
        return loss


__all__ = ["AdamW"]
