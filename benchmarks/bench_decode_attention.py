"""Serving attention: decode and chunked prefill over a paged or contiguous KV cache, and
the cache write.

Baselines (perf/serving_baselines.py): for decode, torch SDPA on the cache gathered into a
padded [B, S, Hkv, D] batch with a per-request length mask (what a torch user without a
paged kernel writes), and flash-attn's flash_attn_with_kvcache when importable; for chunked
prefill, SDPA request by request on gathered keys, and flash-attn's paged varlen kernel
when importable; for the append, index_copy_. Decode is memory-bound: the SOL % counts the
K/V rows each request's length reads, plus q, o and lse. fp8 caches: our 16-bit kernel on
the cache widened once, and SDPA on the dequantized cache. MLA decode: SDPA (efficient
backend, one latent KV head for all query heads) on the gathered latent cache.
"""

import pytest

from tileops import (
    ChunkedPrefillAttentionFp8FwdOp,
    ChunkedPrefillAttentionFwdOp,
    DecodeAttentionFp8FwdOp,
    DecodeAttentionFwdOp,
    KVCacheAppendFp8FwdOp,
    KVCacheAppendFwdOp,
    MLADecodeFwdOp,
)

OPS = [DecodeAttentionFwdOp, ChunkedPrefillAttentionFwdOp, KVCacheAppendFwdOp,
       DecodeAttentionFp8FwdOp, ChunkedPrefillAttentionFp8FwdOp, KVCacheAppendFp8FwdOp,
       MLADecodeFwdOp]


@pytest.mark.gpu
def test_serving_attention(bench, op_cls, workload, dtype):
    bench(op_cls, workload, dtype)
