"""Manifest loader: the public API and the errors a broken manifest directory gives."""

import subprocess
import sys
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


# -- spec.py: checks on stand-ins and on meta tensors --------------------------------------
def _outcome(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the message is what is compared
        return f"{type(e).__name__}: {e}"


def test_stand_ins_and_meta_tensors_give_the_same_checks_dims_and_rooflines():
    """The manifest level checks workloads on `ShapeTensor`s, the op layer on meta tensors:
    every shipped workload gives the same dims and roofline on both."""
    from tileops.manifest.spec import CompiledSpec

    for name, entry in load_manifest().items():
        spec = CompiledSpec(name, entry)
        for workload in entry["workloads"]:
            params = spec.workload_params(workload)
            for dtype in workload["dtypes"]:
                seen = []
                for stand_ins in (True, False):
                    tensors = spec.workload_tensors(workload, dtype, stand_ins=stand_ins)
                    spec.check_dtypes(tensors)
                    ns = spec.namespace(tensors, params)
                    spec.check_shapes(ns)
                    seen.append(([ns[d] for d in spec.dims], spec.eval_roofline(ns)))
                assert seen[0] == seen[1], (name, workload["label"], dtype)


@pytest.mark.parametrize("damage", ["dtype", "same_as", "combo", "shape", "rank", "rule"])
def test_stand_ins_and_meta_tensors_give_the_same_error_messages(damage):
    import torch

    from tileops.manifest.spec import CompiledSpec, ShapeTensor

    op = "RotaryWithCacheFwdOp" if damage == "combo" else "GroupedQueryAttentionFwdOp"
    spec = CompiledSpec(op, get_spec(op))
    workload = get_spec(op)["workloads"][0]
    name = {"dtype": "q", "same_as": "k", "combo": "cos_sin_cache"}.get(damage)
    dtype = {"dtype": "float32", "same_as": "float16", "combo": "float16"}.get(damage)
    shapes = {n: list(s) for n, s in workload["inputs"].items() if s is not None}
    if damage == "shape":
        shapes["k"][-1] += 1  # D of k differs from D of q
    elif damage == "rank":
        shapes["v"] = shapes["v"][1:]
    elif damage == "rule":
        shapes["q"][2] = 3 * shapes["k"][2] + 1  # H % Hkv != 0

    def check(tensors):
        spec.check_dtypes(tensors)
        spec.check_shapes(spec.namespace(tensors, spec.workload_params(workload)))

    messages = []
    for stand_ins in (True, False):
        tensors = spec.workload_tensors({**workload, "inputs": shapes}, "bfloat16",
                                        stand_ins=stand_ins)
        if name:
            tensors[name] = (ShapeTensor(shapes[name], dtype) if stand_ins else
                             torch.empty(shapes[name], dtype=getattr(torch, dtype),
                                         device="meta"))
        messages.append(_outcome(lambda t=tensors: check(t)))
    assert messages[0] == messages[1]
    assert messages[0].startswith("TileOps") and f"{op}: argument " in messages[0]


def test_dtype_tables_load_torch_on_first_use_only():
    code = textwrap.dedent("""\
        import sys
        from tileops.manifest import spec
        assert "torch" not in sys.modules
        from tileops.manifest.spec import DTYPE_NAMES, DTYPES
        import torch
        assert DTYPES["bfloat16"] is torch.bfloat16 and DTYPE_NAMES[torch.float16] == "float16"
        rule = spec.DtypeRule.parse("X", "f", "float16 | bfloat16")
        assert rule.names == ("float16", "bfloat16")
        assert rule.allowed == (torch.float16, torch.bfloat16)
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
