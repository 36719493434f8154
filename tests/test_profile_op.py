"""scripts/profile_op.py picks exactly one workload or says which ones matched."""

import importlib.util
import pathlib

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "profile_op.py"


@pytest.fixture(scope="module")
def profile_op():
    spec = importlib.util.spec_from_file_location("profile_op", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_one_matching_workload_is_picked(profile_op):
    op_cls, workload = profile_op.pick_case("GroupedQueryAttentionBwdOp", "8 x 2k", "bfloat16")
    assert op_cls.__name__ == "GroupedQueryAttentionBwdOp"
    assert "8 x 2k" in workload["label"]


def test_several_or_no_matches_name_what_matched(profile_op):
    with pytest.raises(SystemExit, match="matched: .*4 x 4k.*8 x 2k"):
        profile_op.pick_case("GroupedQueryAttentionBwdOp", "training", "bfloat16")
    with pytest.raises(SystemExit, match="matched: none"):
        profile_op.pick_case("GroupedQueryAttentionBwdOp", "no such workload", "bfloat16")
