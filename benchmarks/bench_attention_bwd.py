"""GroupedQueryAttentionBwdOp against SDPA backward (cuDNN, flash, efficient)."""

import pytest

from tileops import GroupedQueryAttentionBwdOp

OP = GroupedQueryAttentionBwdOp


@pytest.mark.gpu
def test_attention_bwd(bench, workload, dtype):
    bench(OP, workload, dtype)
