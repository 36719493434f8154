"""GroupedQueryAttentionFwdOp against SDPA (cuDNN, flash, efficient) and flash-attn."""

import pytest

from tileops import GroupedQueryAttentionFwdOp

OP = GroupedQueryAttentionFwdOp


@pytest.mark.gpu
def test_attention_fwd(bench, workload, dtype):
    bench(OP, workload, dtype)
