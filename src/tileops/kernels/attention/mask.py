"""Which tiles a bottom-right aligned (causal / sliding-window) mask lets a block reach.

Query i sees key j when j - i - (Skv - Sq) lies in [-window_left, window_right] (-1 means
unbounded). The same integer formulas run inside the TileLang programs (with `TIR_OPS`) and
in CPU tests against brute force (with `INT_OPS`).
"""

from types import SimpleNamespace

import tilelang.language as T

INT_OPS = SimpleNamespace(max=max, min=min, ceildiv=lambda a, b: -(-a // b),
                          floordiv=lambda a, b: a // b, floormod=lambda a, b: a % b,
                          select=lambda cond, a, b: a if cond else b, wide=lambda a: a)
TIR_OPS = SimpleNamespace(max=T.max, min=T.min, ceildiv=T.ceildiv, floordiv=T.floordiv,
                          floormod=T.floormod, select=T.if_then_else,
                          wide=lambda a: T.Cast("int64", a))


def key_tile_range(q_start, seq_q, seq_kv, block_m: int, block_n: int, window_left: int,
                   window_right: int, ops=TIR_OPS):
    """(first key tile, number of key tiles) the query rows [q_start, q_start + block_m)
    can see."""
    offset = seq_kv - seq_q
    end = ops.ceildiv(seq_kv, block_n)
    if window_right >= 0:
        end = ops.max(0, ops.min(end, ops.ceildiv(
            q_start + block_m + offset + window_right, block_n)))
    begin = 0
    if window_left >= 0:
        begin = ops.max(0, ops.floordiv(q_start + offset - window_left, block_n))
    return begin, ops.max(end - begin, 0)


def query_block_range(kv_start, seq_q, seq_kv, block_kv: int, block_q: int, window_left: int,
                      window_right: int, ops=TIR_OPS):
    """(first query block, number of query blocks) that see a key of
    [kv_start, kv_start + block_kv)."""
    offset = seq_kv - seq_q
    begin = 0
    if window_right >= 0:
        begin = ops.max(0, ops.floordiv(kv_start - offset - window_right, block_q))
    end = ops.ceildiv(seq_q, block_q)
    if window_left >= 0:
        end = ops.max(0, ops.min(end, ops.ceildiv(
            kv_start + block_kv - offset + window_left, block_q)))
    return begin, ops.max(end - begin, 0)


def tile_fully_visible(q_start, kv_start, seq_q, seq_kv, block_q: int, block_kv: int,
                       window_left: int, window_right: int):
    """Whether every query row of [q_start, q_start + block_q) sees every key of
    [kv_start, kv_start + block_kv): such a tile needs no mask. Rows past seq_q count as
    seeing (callers never store them), so the answer is exact for the rows that matter and
    conservative near the edges: a False only costs the masked path."""
    offset = seq_kv - seq_q
    seen = kv_start + block_kv <= seq_kv
    if window_right >= 0:  # the largest key - query distance: last key, first row
        seen = seen & (kv_start + block_kv - 1 - q_start - offset <= window_right)
    if window_left >= 0:  # the smallest: first key, last row
        seen = seen & (kv_start - (q_start + block_q - 1) - offset >= -window_left)
    return seen
