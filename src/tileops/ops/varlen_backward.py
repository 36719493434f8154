"""Gradients of varlen attention through the dense backward, on a left-padded batch.

Each packed sequence is copied into its own row block of a [B, max_seqlen] batch so that it
ends at the block's end. That keeps bottom-right masks aligned: query i and key j of a
sequence keep their relative offset (j - i) - (len_kv - len_q) under the shift, so the dense
backward sees exactly the sequence's causal or windowed pairs. The padding is harmless:
- padded query rows get lse = -inf, which the backward treats as rows that see no key;
- padded key rows are zero, so although a real query "sees" them (probability
  exp(-lse) from the saved statistics), their contributions to dq are (dS x 0) and their
  own dk and dv are dropped when unpadding; delta = rowsum(o * do) comes from real rows.
The cost is the padded tiles' work; a varlen backward kernel would skip it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch


def padded_rows(cu_seqlens: torch.Tensor, max_seqlen: int, total: int) -> torch.Tensor:
    """For each packed row, its row in the flattened [B * max_seqlen] left-padded batch."""
    token = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    ends = cu_seqlens[1:]
    seq = torch.searchsorted(ends, token, right=True)  # the sequence each row belongs to
    return seq * max_seqlen + max_seqlen - (ends[seq] - token).long()


def _pad(x: torch.Tensor, rows: torch.Tensor, batch: int, max_seqlen: int) -> torch.Tensor:
    """[T, heads, D] -> [B, max_seqlen, heads, D], zeros where no packed row lands."""
    out = x.new_zeros((batch * max_seqlen, *x.shape[1:]))
    out[rows] = x
    return out.view(batch, max_seqlen, *x.shape[1:])


def varlen_backward(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    o: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    cu_seqlens_kv: torch.Tensor, max_seqlen_q: int, max_seqlen_kv: int,
                    params: Sequence[Any], dense_backward: Callable[..., Any]) -> tuple:
    """(dq, dk, dv) in the packed layout; `dense_backward(do, q, k, v, o, lse, *params)` is
    the BSHD backward (lse [B, H, Sq]) with the same params order as the forward's."""
    batch = cu_seqlens_q.numel() - 1
    if batch == 0 or max_seqlen_q == 0 or max_seqlen_kv == 0 or q.shape[0] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    rows_q = padded_rows(cu_seqlens_q, max_seqlen_q, q.shape[0])
    rows_kv = padded_rows(cu_seqlens_kv, max_seqlen_kv, k.shape[0])
    heads = q.shape[1]
    lse_padded = lse.new_full((heads, batch * max_seqlen_q), -math.inf)
    lse_padded[:, rows_q] = lse
    lse_padded = lse_padded.view(heads, batch, max_seqlen_q).transpose(0, 1).contiguous()
    dq, dk, dv = dense_backward(
        _pad(grad_o, rows_q, batch, max_seqlen_q), _pad(q, rows_q, batch, max_seqlen_q),
        _pad(k, rows_kv, batch, max_seqlen_kv), _pad(v, rows_kv, batch, max_seqlen_kv),
        _pad(o, rows_q, batch, max_seqlen_q), lse_padded, *params)
    return (dq.reshape(-1, *q.shape[1:])[rows_q], dk.reshape(-1, *k.shape[1:])[rows_kv],
            dv.reshape(-1, *v.shape[1:])[rows_kv])
