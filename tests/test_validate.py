"""The validator: the shipped manifest is clean, and each kind of damage gives its error.

Broken inputs are deep copies of the shipped manifest with one thing damaged, or stand-in
Op classes (plain classes with `__init__`, `forward` and `kernel_map`: all L1 reads).
Except where a test is about source paths, paths resolve against a stub tree, so these
tests do not depend on which test and bench files exist in the checkout.
"""

import copy
import subprocess
import sys
import textwrap

import pytest

import tileops.validate as validate_module
from tileops import ManifestError, TileOpsValueError
from tileops.kernels.gemm import GemmKernel
from tileops.manifest import load_manifest
from tileops.ops import OP_CLASSES
from tileops.perf import formulas
from tileops.validate import Validation, validate

pytestmark = pytest.mark.smoke

GEMM_LABEL_0 = "llama3.1-8b prefill 4k tokens qkv_proj"


@pytest.fixture
def manifest():
    return copy.deepcopy(load_manifest())


@pytest.fixture
def stub_root(tmp_path):
    """A tree holding every source path of the shipped manifest (empty files)."""
    for entry in load_manifest().values():
        source = entry["source"]
        for rel in [source["op"], *source["kernels"], source["test"], source["bench"]]:
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / rel).touch()
    return tmp_path


@pytest.fixture
def check(manifest, stub_root):
    """Validates the (damaged) manifest copy; returns the error messages."""

    def run(op_classes=None, repo_root=stub_root):
        errors = validate(manifest, OP_CLASSES if op_classes is None else op_classes,
                          repo_root)
        assert all(isinstance(e, ManifestError) for e in errors)
        return [str(e) for e in errors]

    return run


def only(messages):
    assert len(messages) == 1, "\n".join(messages)
    return messages[0]


def with_class(cls):
    return {**OP_CLASSES, cls.__name__: cls}


# -- the shipped manifest -------------------------------------------------------------------
def test_shipped_manifest_and_code_agree(check):
    assert check() == []


def test_shipped_manifest_validates_clean_in_the_checkout():
    result = validate()
    assert [str(e) for e in result] == []
    assert result.notes == []


def test_source_check_is_skipped_with_a_note_outside_a_checkout(monkeypatch, manifest):
    monkeypatch.setattr(validate_module, "default_repo_root", lambda: None)
    manifest["GemmFwdOp"]["source"]["test"] = "tests/ops/test_nope.py"
    result = validate(manifest)
    assert list(result) == []
    assert len(result.notes) == 1 and "source paths not checked" in result.notes[0]


# -- the two levels ---------------------------------------------------------------------------
def test_manifest_level_needs_neither_torch_nor_tilelang():
    """In a fresh interpreter (this one has them loaded): the manifest level still finds a
    broken shape rule and a broken roofline on a damaged copy, with no torch loaded."""
    code = textwrap.dedent("""\
        import copy, sys
        from tileops.manifest import load_manifest
        from tileops.validate import Validation, validate
        manifest = copy.deepcopy(load_manifest())
        Validation(manifest).manifest_level()
        manifest["GemmFwdOp"]["workloads"][2]["inputs"]["b"] = [8192, 4096]
        manifest["RMSNormFwdOp"]["roofline"]["flops"] = "-rows"
        errors = [str(e) for e in validate(manifest, code_level=False)]
        assert any(e.startswith("GemmFwdOp: field 'workloads[2]'") and
                   "violates the signature: argument 'b'" in e for e in errors), errors
        assert any(e.startswith("RMSNormFwdOp: field 'roofline.flops': on workloads[0]")
                   for e in errors), errors
        print(sorted(m for m in ("torch", "tilelang", "tileops.ops") if m in sys.modules))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_manifest_level_alone_reports_what_the_full_run_reports(manifest, stub_root):
    manifest["GemmFwdOp"]["workloads"][2]["inputs"]["b"] = [8192, 4096]
    manifest["GemmFwdOp"]["workloads"][3]["label"] = manifest["GemmFwdOp"]["workloads"][1][
        "label"]
    alone = validate(manifest, repo_root=stub_root, code_level=False)
    assert len(alone) == 2
    assert [str(e) for e in alone] == [str(e) for e in validate(manifest, OP_CLASSES,
                                                                 stub_root)]


def test_code_level_only_after_the_manifest_level(manifest):
    with pytest.raises(RuntimeError, match="after manifest_level"):
        Validation(manifest).code_level(OP_CLASSES)


# -- L0: schema and spec compilation --------------------------------------------------------
def test_missing_required_field(manifest, check):
    del manifest["GemmFwdOp"]["roofline"]
    assert only(check()) == "GemmFwdOp: field '<entry>': 'roofline' is a required property"


def test_unknown_status(manifest, check):
    manifest["RMSNormFwdOp"]["status"] = "experimental"
    assert only(check()).startswith("RMSNormFwdOp: field 'status': 'experimental' is not one "
                                    "of ['spec-only', 'implemented']")


def test_bad_dtype_name_in_signature(manifest, check):
    manifest["GemmFwdOp"]["signature"]["inputs"]["a"]["dtype"] = "float16 | bfloat17"
    assert only(check()).startswith("GemmFwdOp: field 'signature.inputs.a.dtype': unknown "
                                    "dtype(s) ['bfloat17']")


def test_bad_dtype_name_in_workload(manifest, check):
    manifest["GemmFwdOp"]["workloads"][1]["dtypes"] = ["bf16"]
    assert only(check()).startswith("GemmFwdOp: field 'workloads.1.dtypes.0': 'bf16' is not "
                                    "one of")


def test_shape_rule_that_is_not_python(manifest, check):
    manifest["GemmFwdOp"]["signature"]["shape_rules"].append("a.ndim ==")
    assert only(check()).startswith("GemmFwdOp: field 'signature.shape_rules[3]': not a "
                                    "Python expression")


def test_same_as_naming_no_input(manifest, check):
    manifest["GemmFwdOp"]["signature"]["inputs"]["b"]["dtype"] = "same_as(x)"
    assert "same_as(x) names no input" in only(check())


# -- L1: the Op class -----------------------------------------------------------------------
def test_op_class_missing_for_implemented_entry(check):
    classes = {k: v for k, v in OP_CLASSES.items() if k != "GemmFwdOp"}
    assert only(check(classes)) == (
        "GemmFwdOp: field 'status': expected an Op class named 'GemmFwdOp' (the entry is "
        "'implemented'), found none")


def test_spec_only_entry_needs_no_class(manifest, check):
    manifest["GemmFwdOp"]["status"] = "spec-only"
    assert check({k: v for k, v in OP_CLASSES.items() if k != "GemmFwdOp"}) == []


def test_op_class_without_manifest_entry(manifest, check):
    del manifest["GemmFwdOp"]
    assert only(check()) == ("GemmFwdOp: field '<entry>': expected a manifest entry for this "
                             "Op class, found none")


def test_constructor_params_in_the_wrong_order(check):
    class GemmFwdOp:
        kernel_map = {"gemm": GemmKernel}

        def __init__(self, *, trans_b=True, trans_a=False, kernel_map=None, tune=False):
            pass

        def forward(self, a, b):
            pass

    assert only(check(with_class(GemmFwdOp))) == (
        "GemmFwdOp: field 'signature.params': expected GemmFwdOp.__init__ keyword-only params "
        "['trans_a', 'trans_b'] (manifest order), found ['trans_b', 'trans_a']")


def test_constructor_default_differs(check):
    class GemmFwdOp:
        kernel_map = {"gemm": GemmKernel}

        def __init__(self, *, trans_a=False, trans_b=False, kernel_map=None, tune=False):
            pass

        def forward(self, a, b):
            pass

    assert only(check(with_class(GemmFwdOp))) == (
        "GemmFwdOp: field 'signature.params.trans_b.default': expected GemmFwdOp.__init__ "
        "param 'trans_b' to default to True, found False")


def test_constructor_params_must_be_keyword_only(check):
    class GemmFwdOp:
        kernel_map = {"gemm": GemmKernel}

        def __init__(self, trans_a=False, *, trans_b=True, kernel_map=None, tune=False):
            pass

        def forward(self, a, b):
            pass

    messages = check(with_class(GemmFwdOp))
    assert any("found positional ['trans_a']" in m for m in messages), messages
    assert all(m.startswith("GemmFwdOp: field 'signature.params'") for m in messages)


def test_forward_input_renamed(check):
    class RMSNormFwdOp:
        kernel_map = {"rms_norm": OP_CLASSES["RMSNormFwdOp"].kernel_map["rms_norm"]}

        def __init__(self, *, normalized_shape, eps=None, kernel_map=None, tune=False):
            pass

        def forward(self, x, weight=None):
            pass

    assert only(check(with_class(RMSNormFwdOp))) == (
        "RMSNormFwdOp: field 'signature.inputs': expected RMSNormFwdOp.forward positional "
        "params ['input', 'weight'] (manifest order), found ['x', 'weight']")


def test_forward_optional_input_needs_default_none(check):
    class RMSNormFwdOp:
        kernel_map = {"rms_norm": OP_CLASSES["RMSNormFwdOp"].kernel_map["rms_norm"]}

        def __init__(self, *, normalized_shape, eps=None, kernel_map=None, tune=False):
            pass

        def forward(self, input, weight):
            pass

    assert only(check(with_class(RMSNormFwdOp))) == (
        "RMSNormFwdOp: field 'signature.inputs.weight.optional': expected RMSNormFwdOp.forward "
        "param 'weight' to default to None (the input is optional), found no default")


def test_kernel_class_name_mismatch(manifest, check):
    manifest["GemmFwdOp"]["source"]["kernel_map"] = {"gemm": "GemmKernelV2"}
    assert only(check()) == ("GemmFwdOp: field 'source.kernel_map.gemm': expected Kernel class "
                             "'GemmKernelV2', found 'GemmKernel'")


def test_kernel_map_keys_mismatch(manifest, check):
    manifest["GemmFwdOp"]["source"]["kernel_map"] = {"gemm": "GemmKernel",
                                                     "gemm_splitk": "GemmKernel"}
    assert only(check()) == ("GemmFwdOp: field 'source.kernel_map': expected dispatch keys "
                             "['gemm', 'gemm_splitk'], found ['gemm'] in GemmFwdOp.kernel_map")


# -- L2: workloads and shape rules ----------------------------------------------------------
def test_workload_violating_a_shape_rule_names_the_label(manifest, check):
    workload = manifest["GemmFwdOp"]["workloads"][2]
    workload["inputs"]["b"] = [8192, 4096]  # K of a is 28672
    message = only(check())
    assert message.startswith(f"GemmFwdOp: field 'workloads[2]': ({workload['label']!r}, "
                              "bfloat16) violates the signature: argument 'b': expected shapes "
                              "satisfying")
    assert "K=28672" in message and "b.shape=(8192, 4096)" in message


def test_workload_the_op_rejects_although_the_manifest_accepts(manifest, check):
    # The manifest drops the K rule; the code still enforces it: code and spec disagree.
    manifest["GemmFwdOp"]["signature"]["shape_rules"].pop()
    manifest["GemmFwdOp"]["workloads"][0]["inputs"]["b"] = [6144, 1024]
    message = only(check())
    assert message.startswith(f"GemmFwdOp: field 'workloads[0]': ({GEMM_LABEL_0!r}, bfloat16) "
                              "expected the Op to accept the workload, found TileOpsValueError")


def test_workload_unknown_input_name(manifest, check):
    manifest["GemmFwdOp"]["workloads"][0]["inputs"]["c"] = [4096, 4096]
    assert only(check()) == (f"GemmFwdOp: field 'workloads[0].inputs.c': ({GEMM_LABEL_0!r}) "
                             "expected an input of ['a', 'b'], found 'c'")


def test_workload_missing_required_input(manifest, check):
    del manifest["GemmFwdOp"]["workloads"][0]["inputs"]["b"]
    assert only(check()) == (f"GemmFwdOp: field 'workloads[0].inputs.b': ({GEMM_LABEL_0!r}) "
                             "expected a shape (the input is not optional), found none")


def test_workload_may_omit_an_optional_input(manifest, check):
    del manifest["RMSNormFwdOp"]["workloads"][0]["inputs"]["weight"]
    assert check() == []


def test_workload_missing_required_param(manifest, check):
    label = manifest["RMSNormFwdOp"]["workloads"][1]["label"]
    del manifest["RMSNormFwdOp"]["workloads"][1]["params"]["normalized_shape"]
    assert only(check()) == (f"RMSNormFwdOp: field 'workloads[1].params.normalized_shape': "
                             f"({label!r}) expected a value (the param has no default), "
                             "found none")


def test_workload_param_of_the_wrong_type(manifest, check):
    manifest["RMSNormFwdOp"]["workloads"][1]["params"]["eps"] = "tiny"
    assert "field 'workloads[1].params.eps'" in only(check())


def test_workload_dtype_not_declared(manifest, check):
    manifest["GemmFwdOp"]["workloads"][0]["dtypes"] = ["bfloat16", "float32"]
    assert only(check()) == (f"GemmFwdOp: field 'workloads[0].dtypes': ({GEMM_LABEL_0!r}) "
                             "expected declared dtypes (float16 | bfloat16), found float32")


# -- L3: accepted dtypes --------------------------------------------------------------------
def test_dtype_accepted_but_not_declared(manifest, check):
    gemm = manifest["GemmFwdOp"]
    gemm["signature"]["inputs"]["a"]["dtype"] = "float16"
    for workload in gemm["workloads"]:
        workload["dtypes"] = ["float16"]
    assert only(check()) == ("GemmFwdOp: field 'signature.inputs.a.dtype': expected the Op to "
                             "reject bfloat16 (declared: float16), found it accepted")


def test_dtype_declared_but_rejected(manifest, check):
    manifest["RMSNormFwdOp"]["signature"]["inputs"]["input"]["dtype"] = (
        "float16 | bfloat16 | float32")
    message = only(check())
    assert message.startswith("RMSNormFwdOp: field 'signature.inputs.input.dtype': expected the "
                              "Op to accept declared dtype float32")
    assert "found TileOpsTypeError" in message


def test_undeclared_dtype_must_raise_a_type_error(check):
    real = OP_CLASSES["GemmFwdOp"]

    class GemmFwdOp:  # the real op, except that a bad dtype raises the wrong exception type
        kernel_map = real.kernel_map

        def __init__(self, *, trans_a=False, trans_b=True, kernel_map=None, tune=False):
            self.op = real(trans_a=trans_a, trans_b=trans_b)

        def forward(self, a, b):
            pass

        def check(self, inputs):
            try:
                return self.op.check(inputs)
            except TypeError as e:
                raise TileOpsValueError(str(e)) from e

    messages = check(with_class(GemmFwdOp))
    assert len(messages) == 3, messages  # float32, float8_e4m3fn, int32
    assert messages[0].startswith("GemmFwdOp: field 'signature.inputs.a.dtype': expected "
                                  "TileOpsTypeError for undeclared dtype float32, found "
                                  "TileOpsValueError")


# -- L4: roofline ---------------------------------------------------------------------------
def test_roofline_negative(manifest, check):
    manifest["GemmFwdOp"]["roofline"]["flops"] = "-2 * M * N * K"
    messages = check()
    n_cases = sum(len(w["dtypes"]) for w in manifest["GemmFwdOp"]["workloads"])
    assert len(messages) == n_cases
    assert messages[0] == (f"GemmFwdOp: field 'roofline.flops': on workloads[0] "
                           f"({GEMM_LABEL_0!r}, bfloat16): expected a finite non-negative "
                           f"integer, found {-2 * 4096 * 6144 * 4096}")


def test_roofline_that_raises(manifest, check):
    manifest["RMSNormFwdOp"]["roofline"]["bytes"] = "rows * N * elem_bytes // 0"
    messages = check()
    assert messages and all(m.startswith("RMSNormFwdOp: field 'roofline.bytes': on workloads[")
                            for m in messages)
    assert "ZeroDivisionError" in messages[0]


def test_roofline_that_is_infinite(manifest, check):
    manifest["GemmFwdOp"]["roofline"]["bytes"] = "1e308 * M * N"
    messages = check()
    assert messages and messages[0].endswith("expected a finite non-negative integer, found inf")
    assert messages[0].startswith("GemmFwdOp: field 'roofline.bytes': on workloads[0]")


def test_roofline_that_reads_no_dtype_runs_once_per_element_size(manifest, check,
                                                                   monkeypatch):
    calls = []

    def counted(M, N, K, elem_bytes, **_):
        calls.append(elem_bytes)
        return 2 * M * N * K, (M * K + N * K + M * N) * elem_bytes

    monkeypatch.setattr(formulas, "counted", counted, raising=False)
    gemm = manifest["GemmFwdOp"]
    gemm["roofline"] = {"func": "tileops.perf.formulas.counted"}
    for workload in gemm["workloads"]:
        workload["dtypes"] = ["bfloat16", "float16"]  # one element size, one evaluation
    assert check() == []
    assert calls == [2] * len(gemm["workloads"])


def test_roofline_that_reads_the_dtype_runs_per_dtype(manifest, check, monkeypatch):
    def by_dtype(a, **_):
        return (0, -1) if str(a.dtype) == "torch.float16" else (0, 0)

    monkeypatch.setattr(formulas, "by_dtype", by_dtype, raising=False)
    gemm = manifest["GemmFwdOp"]
    gemm["roofline"] = {"func": "tileops.perf.formulas.by_dtype"}
    for workload in gemm["workloads"]:
        workload["dtypes"] = ["bfloat16", "float16"]
    messages = check()
    assert len(messages) == len(gemm["workloads"]), messages
    assert all(m.startswith("GemmFwdOp: field 'roofline.func': on workloads[") and
               m.endswith(", float16): expected a finite non-negative integer, found -1")
               for m in messages), messages


def test_roofline_name_unknown(manifest, check):
    manifest["GemmFwdOp"]["roofline"]["flops"] = "2 * M * N * K * heads"
    message = check()[0]
    assert message.startswith("GemmFwdOp: field 'roofline.flops': on workloads[0]")
    assert "NameError: name 'heads' is not defined" in message


# -- source paths and workload list ---------------------------------------------------------
def test_missing_source_path(manifest, check, stub_root):
    manifest["GemmFwdOp"]["source"]["test"] = "tests/ops/test_nope.py"
    assert only(check()) == ("GemmFwdOp: field 'source.test': expected an existing file "
                             f"tests/ops/test_nope.py (relative to {stub_root}), found none")


def test_missing_kernel_source_path(manifest, check):
    manifest["RMSNormFwdOp"]["source"]["kernels"].append("src/tileops/kernels/nope.py")
    assert only(check()).startswith("RMSNormFwdOp: field 'source.kernels[1]': expected an "
                                    "existing file src/tileops/kernels/nope.py")


def test_duplicate_workload_labels(manifest, check):
    workloads = manifest["GemmFwdOp"]["workloads"]
    workloads[3]["label"] = workloads[1]["label"]
    assert only(check()) == (f"GemmFwdOp: field 'workloads[3].label': expected a unique label, "
                             f"found {workloads[1]['label']!r} again (first at workloads[1])")


def test_implemented_op_needs_two_workloads(manifest, check):
    del manifest["RMSNormFwdOp"]["workloads"][1:]
    assert only(check()) == ("RMSNormFwdOp: field 'workloads': expected >= 2 workloads for an "
                             "implemented op, found 1")


def test_spec_only_op_may_have_one_workload(manifest, check):
    manifest["RMSNormFwdOp"]["status"] = "spec-only"
    del manifest["RMSNormFwdOp"]["workloads"][1:]
    assert check() == []


def test_roofline_func_that_does_not_exist(manifest, check):
    manifest["GemmFwdOp"]["roofline"] = {"func": "tileops.perf.formulas.no_such_formula"}
    assert only(check()).startswith("GemmFwdOp: field '<entry>': does not compile into a spec:")
