"""Serving attention: decode over a paged or contiguous KV cache and the cache write.

Baselines (perf/baselines.py): torch SDPA on the cache gathered per request into a padded
[B, Hkv, S, D] batch with a length mask (what a torch user without a paged kernel writes),
and flash-attn's flash_attn_with_kvcache when importable. Decode is memory-bound: the SOL %
counts the K/V rows each request's length reads, plus q and o.
"""

import pytest

from tileops import DecodeAttentionFwdOp, KVCacheAppendFwdOp

OPS = [DecodeAttentionFwdOp, KVCacheAppendFwdOp]


@pytest.mark.gpu
def test_serving_attention(bench, op_cls, workload, dtype):
    bench(op_cls, workload, dtype)
