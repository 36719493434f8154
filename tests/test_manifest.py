"""Manifest loader: the public API and the errors a broken manifest directory gives."""

import textwrap

import pytest

from tileops import ManifestError
from tileops.manifest import get_spec, load_manifest, load_workloads, read_manifest_dir

pytestmark = pytest.mark.smoke

GOOD_ENTRY = """\
ToyScaleFwdOp:
  ref_api: none
  family: {family}
  status: spec-only
  signature:
    inputs:
      x: {{dtype: "float16 | bfloat16"}}
    outputs:
      y: {{dtype: "same_as(x)", shape: "tuple(x.shape)"}}
  roofline:
    flops: "numel(x)"
    bytes: "2 * numel(x) * elem_bytes"
  source:
    op: src/tileops/ops/toy.py
    kernels: []
    test: tests/ops/test_toy.py
    bench: benchmarks/bench_toy.py
    kernel_map: {{}}
  workloads:
    - {{label: "llama3.1-8b prefill 4k tokens", inputs: {{x: [4096, 4096]}}, dtypes: [bfloat16]}}
"""


def write(directory, name, text):
    (directory / name).write_text(textwrap.dedent(text))


def test_load_manifest_has_the_shipped_ops():
    manifest = load_manifest()
    assert {"GemmFwdOp", "RMSNormFwdOp"} <= set(manifest)
    assert manifest["GemmFwdOp"]["family"] == "gemm"
    assert manifest["RMSNormFwdOp"]["ref_api"] == "torch.nn.functional.rms_norm"
    # Signature order is part of the contract (it is the reference API's order).
    assert list(manifest["RMSNormFwdOp"]["signature"]["inputs"]) == ["input", "weight"]
    assert list(manifest["RMSNormFwdOp"]["signature"]["params"]) == ["normalized_shape", "eps"]


def test_get_spec_returns_the_entry():
    assert get_spec("GemmFwdOp") is load_manifest()["GemmFwdOp"]


def test_get_spec_unknown_op_names_it():
    with pytest.raises(ManifestError, match=r"NoSuchFwdOp: no such op in the manifest"):
        get_spec("NoSuchFwdOp")


def test_load_workloads_and_tier_filter():
    everything = load_workloads("GemmFwdOp")
    smoke = load_workloads("GemmFwdOp", tier="smoke")
    assert len(everything) == len(get_spec("GemmFwdOp")["workloads"])
    assert 0 < len(smoke) < len(everything)
    assert all(w["tier"] == "smoke" for w in smoke)
    assert load_workloads("GemmFwdOp", tier="full") == everything


def test_load_workloads_unknown_op():
    with pytest.raises(ManifestError, match="NoSuchFwdOp"):
        load_workloads("NoSuchFwdOp")


def test_read_manifest_dir_reads_a_good_file(tmp_path):
    write(tmp_path, "toy.yaml", GOOD_ENTRY.format(family="toy"))
    entries = read_manifest_dir(tmp_path)
    assert list(entries) == ["ToyScaleFwdOp"]
    assert entries["ToyScaleFwdOp"]["status"] == "spec-only"


def test_read_manifest_dir_missing_field_names_op_and_field(tmp_path):
    broken = GOOD_ENTRY.format(family="toy").replace("  ref_api: none\n", "")
    write(tmp_path, "toy.yaml", broken)
    with pytest.raises(ManifestError, match=r"ToyScaleFwdOp: field '<entry>': 'ref_api' is a "
                                            r"required property"):
        read_manifest_dir(tmp_path)


def test_read_manifest_dir_bad_value_names_the_field_path(tmp_path):
    broken = GOOD_ENTRY.format(family="toy").replace("dtypes: [bfloat16]", "dtypes: [bf16]")
    write(tmp_path, "toy.yaml", broken)
    with pytest.raises(ManifestError, match=r"ToyScaleFwdOp: field 'workloads.0.dtypes.0'"):
        read_manifest_dir(tmp_path)


def test_read_manifest_dir_family_must_match_file_name(tmp_path):
    write(tmp_path, "toy.yaml", GOOD_ENTRY.format(family="gemm"))
    with pytest.raises(ManifestError, match=r"ToyScaleFwdOp: field 'family': expected 'toy' "
                                            r"\(the file name\), got 'gemm'"):
        read_manifest_dir(tmp_path)


def test_read_manifest_dir_op_defined_twice(tmp_path):
    write(tmp_path, "toy.yaml", GOOD_ENTRY.format(family="toy"))
    write(tmp_path, "zoo.yaml", GOOD_ENTRY.format(family="zoo"))
    with pytest.raises(ManifestError, match=r"ToyScaleFwdOp: defined twice \(second time in "
                                            r"zoo.yaml\)"):
        read_manifest_dir(tmp_path)


def test_read_manifest_dir_bad_op_name(tmp_path):
    write(tmp_path, "toy.yaml", GOOD_ENTRY.format(family="toy").replace("ToyScaleFwdOp",
                                                                         "toy_scale"))
    with pytest.raises(ManifestError, match=r"toy_scale: op name: expected PascalCase"):
        read_manifest_dir(tmp_path)
