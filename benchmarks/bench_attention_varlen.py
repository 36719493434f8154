"""GroupedQueryAttentionVarlenFwdOp against flash-attn's varlen kernel (when importable)."""

import pytest

from tileops import GroupedQueryAttentionVarlenFwdOp

OP = GroupedQueryAttentionVarlenFwdOp


@pytest.mark.gpu
def test_attention_varlen_fwd(bench, workload, dtype):
    bench(OP, workload, dtype)
