"""Choosing among an op's baselines (compare_configs.py and kernel_breakdown.py --baseline;
CPU)."""

import pytest

from tileops.perf.baselines import baselines_for, select_baselines


def test_select_baselines_keeps_the_named_in_order_and_refuses_unknown_names():
    every = baselines_for("RMSNormBwdOp")
    assert select_baselines("RMSNormBwdOp", None).keys() == every.keys()
    assert list(select_baselines("RMSNormBwdOp", ["torch-eager"])) == ["torch-eager"]
    assert select_baselines("RMSNormBwdOp", []) == {}  # the op alone
    with pytest.raises(ValueError, match=r"\['nope'\]: RMSNormBwdOp's baselines are"):
        select_baselines("RMSNormBwdOp", ["nope", "torch-eager"])
