"""Baselines: what a user would run instead of TileOPs, independent of TileOPs' code.

Each entry maps an op name to {baseline name: fn(*inputs, **params)}. External libraries are
added only when importable; which ones were present is part of every benchmark result.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

Baseline = Callable[..., Any]

EXTERNAL_LIBRARIES = ("flashinfer", "flash_attn", "liger_kernel", "quack")


def available_libraries() -> dict[str, bool]:
    return {name: importlib.util.find_spec(name) is not None for name in EXTERNAL_LIBRARIES}


def _cublas(a, b, trans_a=False, trans_b=True):
    return torch.matmul(a.t() if trans_a else a, b.t() if trans_b else b)


def _rms_norm_eager(x, w, normalized_shape, eps):
    return F.rms_norm(x, normalized_shape, w, eps)


@functools.cache
def _compiled(fn: Baseline) -> Baseline:
    return torch.compile(fn, dynamic=False)


def _rms_norm_compiled(x, w, normalized_shape, eps):
    return _compiled(_rms_norm_eager)(x, w, normalized_shape, eps)


def _rms_norm_liger(x, w, normalized_shape, eps):
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    if w is None:
        raise NotImplementedError("Liger's RMSNorm needs a weight")
    return LigerRMSNormFunction.apply(x, w, eps if eps is not None else 1e-6)


def baselines_for(op_name: str) -> dict[str, Baseline]:
    """The baselines a benchmark of `op_name` times, best-known first."""
    libs = available_libraries()
    if op_name == "GemmFwdOp":
        return {"cublas": _cublas}
    if op_name == "RMSNormFwdOp":
        table = {"torch-eager": _rms_norm_eager, "torch-compile": _rms_norm_compiled}
        if libs["liger_kernel"]:
            table["liger"] = _rms_norm_liger
        return table
    return {}
