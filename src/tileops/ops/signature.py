"""Input signatures: what validation and planning depend on, built on every eager call.

A signature holds each input's shape, dtype and device index (`get_device()`, -1 off CUDA:
meta signatures are never kept; half the cost of a torch.device), or three Nones for an
absent input, flat in one tuple. Validated signatures key an op's cache of launches, so
building one is host time of every call of a decode-sized op: the builders are written out
per input count (no loop, no tuple per input: ~0.3 us less for two or three tensors than
a generic loop); a shape is never None, so signatures of different inputs differ.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def _one(inputs: Sequence[Any]) -> tuple:
    (a,) = inputs
    return a.shape, a.dtype, a.get_device()


def _two(inputs: Sequence[Any]) -> tuple:
    a, b = inputs
    if b is None:
        return a.shape, a.dtype, a.get_device(), None, None, None
    return a.shape, a.dtype, a.get_device(), b.shape, b.dtype, b.get_device()


def _three(inputs: Sequence[Any]) -> tuple:
    a, b, c = inputs
    return (a.shape, a.dtype, a.get_device(),
            None if b is None else b.shape, None if b is None else b.dtype,
            None if b is None else b.get_device(),
            None if c is None else c.shape, None if c is None else c.dtype,
            None if c is None else c.get_device())


def _any(inputs: Sequence[Any]) -> tuple:
    signature: tuple = ()
    for t in inputs:
        signature += (None, None, None) if t is None else (t.shape, t.dtype, t.get_device())
    return signature


def signature_of(inputs: Sequence[Any]) -> tuple:
    """The signature of `inputs` (AttributeError for one that is neither None nor a tensor)."""
    return _BY_COUNT.get(len(inputs), _any)(inputs)


def signature_builder(count: int) -> Callable[[Sequence[Any]], tuple]:
    """`signature_of` for `count` inputs, without the lookup (an op binds its own: ValueError
    for another count, AttributeError as `signature_of`)."""
    return _BY_COUNT.get(count, _any)


_BY_COUNT: dict[int, Callable[[Sequence[Any]], tuple]] = {1: _one, 2: _two, 3: _three}
