"""The `tileops` command: each subcommand's output and exit status (CPU, no GPU needed)."""

import argparse
import importlib
import json
import shutil
import subprocess
import sys

import pytest

from tileops import cli

pytestmark = pytest.mark.smoke


def test_list_shows_every_op(capsys):
    from tileops.manifest import get_spec

    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    header, *rows = out.splitlines()
    assert header.split() == ["op", "family", "status", "ref_api", "promises", "workloads"]
    gemm = next(r for r in rows if r.startswith("GemmFwdOp"))
    spec = get_spec("GemmFwdOp")
    assert gemm.split() == ["GemmFwdOp", "gemm", "implemented", spec["ref_api"],
                            "torch_compile", str(len(spec["workloads"]))]
    assert any(r.startswith("RMSNormFwdOp") for r in rows)


def test_manifest_commands_start_without_torch_or_tilelang():
    """`--help`, `list`, `validate --manifest-only`, `import tileops` and
    `tileops.list_ops()` read no more than the manifest: torch and TileLang (seconds of
    imports) stay unloaded. A fresh interpreter, since this one has them loaded already."""
    code = (
        "import contextlib, io, sys\n"
        "from tileops import cli\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        "    try:\n"
        "        cli.main(['--help'])\n"
        "    except SystemExit:\n"
        "        pass\n"
        "    assert cli.main(['list']) == 0\n"
        "    cli.main(['validate', '--manifest-only'])\n"
        "assert 'manifest level: ' in out.getvalue(), out.getvalue()\n"
        "import tileops, tileops.manifest\n"
        "assert tileops.list_ops()\n"
        "print(sorted(m for m in ('torch', 'tilelang', 'tileops.ops') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_every_option_has_help_text():
    parser = cli._parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = [f"{name} {action.dest}" for name, sub in subparsers.choices.items()
               for action in sub._actions if not action.help]
    assert missing == []


@pytest.mark.parametrize("argv, message", [
    (["compile", "--jobs", "0"], "argument --jobs: expected a positive integer, got '0'"),
    (["compile", "--arch", "hopper"], "argument --arch: expected a CUDA architecture such as "
                                      "sm_90a, got 'hopper'"),
    (["bench", "--repeat", "x"], "argument --repeat: expected a positive integer, got 'x'"),
    (["bench", "--tier", "huge"], "argument --tier: invalid choice: 'huge'"),
    (["report", "run.json"], "the following arguments are required: --history"),
    (["list", "--verbose"], "unrecognized arguments: --verbose"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
])
def test_bad_arguments_get_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and message in err and err.startswith("tileops")


def test_validate_passes_on_the_shipped_manifest(capsys):
    assert cli.main(["validate"]) == 0
    assert capsys.readouterr().out.strip().endswith("workloads: OK")


def test_validate_reports_errors(monkeypatch, capsys):
    from tileops import ManifestError, validate

    def broken(field):
        return lambda self, *args: validate.ValidationResult(
            [ManifestError(f"GemmFwdOp: field '{field}': broken")])

    monkeypatch.setattr(validate.Validation, "manifest_level", broken("x"))
    monkeypatch.setattr(validate.Validation, "code_level", broken("y"))
    assert cli.main(["validate"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["error: GemmFwdOp: field 'x': broken", lines[1],
                     "error: GemmFwdOp: field 'y': broken", lines[3], "2 errors"]
    assert lines[1].startswith("manifest level: ") and ": 1 error (schema" in lines[1]
    assert lines[3].startswith("code level: 1 error (")


def test_validate_prints_the_manifest_verdict_before_the_code_level_runs(monkeypatch, capsys):
    from tileops import validate

    seen_before = []

    def code_level(self, op_classes=None):
        seen_before.append(capsys.readouterr().out)
        return validate.ValidationResult()

    monkeypatch.setattr(validate.Validation, "manifest_level",
                        lambda self: validate.ValidationResult())
    monkeypatch.setattr(validate.Validation, "code_level", code_level)
    assert cli.main(["validate"]) == 0
    assert seen_before[0].startswith("manifest level: ")
    assert ": OK (schema, shape rules, rooflines, labels, source paths; " in seen_before[0]
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("code level: OK (")
    assert out[1].endswith(" workloads: OK")


def test_validate_manifest_only_stops_there_and_says_so(monkeypatch, capsys):
    from tileops import validate

    def code_level(self, op_classes=None):
        raise AssertionError("--manifest-only ran the code level")

    monkeypatch.setattr(validate.Validation, "manifest_level",
                        lambda self: validate.ValidationResult())
    monkeypatch.setattr(validate.Validation, "code_level", code_level)
    assert cli.main(["validate", "--manifest-only"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("code level: not checked (--manifest-only")
    assert out[2].endswith(" workloads: OK (manifest level only)")


def test_validate_manifest_only_fails_on_a_manifest_error(monkeypatch, capsys):
    from tileops import ManifestError, validate

    monkeypatch.setattr(validate.Validation, "manifest_level", lambda self: (
        validate.ValidationResult([ManifestError("GemmFwdOp: field 'x': broken")])))
    assert cli.main(["validate", "--manifest-only"]) == 1
    assert capsys.readouterr().out.strip().endswith("1 error")


def test_doctor_always_succeeds(capsys):
    import torch

    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "tilelang" in out and "torch" in out and "nvcc" in out
    assert "what will work" in out and "run kernels:" in out
    assert "meta-tensor shape checks: yes" in out
    if not torch.cuda.is_available():
        assert "run kernels: no (" in out


def test_doctor_reports_an_op_layer_that_does_not_load(monkeypatch, capsys):
    import tileops

    monkeypatch.setitem(sys.modules, "tileops.ops", None)  # an import of it fails
    monkeypatch.delattr(tileops, "ops", raising=False)
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "op layer:             does not load: ModuleNotFoundError" in out
    assert ("validate: `--manifest-only` only (the op layer does not load: "
            "ModuleNotFoundError)") in out
    assert "run kernels: no (the op layer does not load: ModuleNotFoundError)" in out


def test_compile_without_nvcc_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    assert cli.main(["compile"]) == 2
    assert "nvcc not found" in capsys.readouterr().err


def test_compile_unknown_op(monkeypatch, capsys):
    """The op name is checked before nvcc is looked for."""
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    assert cli.main(["compile", "--op", "NoSuchFwdOp"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown op 'NoSuchFwdOp'; implemented: ")
    assert "GemmFwdOp" in err and len(err.splitlines()) == 1


def test_compile_reports_failures_and_missing_wgmma(monkeypatch, capsys):
    from tileops.kernels.gemm import GemmKernel
    from tileops.kernels.normalization import RMSNormKernel

    class MmaSyncProgram:
        def get_kernel_source(self):
            return "mma.sync.aligned.m16n8k16"

    def broken_build(config, bucket):
        raise RuntimeError("nvcc: ptxas fatal")

    gemm = GemmKernel(dtype="float16", n=4096, k=4096, trans_a=False, trans_b=True)
    norm = RMSNormKernel(dtype="float16", n=4096, has_weight=True)
    warmup = importlib.import_module("tileops.prebuild")
    monkeypatch.setattr(gemm, "compile", lambda config, bucket: (MmaSyncProgram(),))
    monkeypatch.setattr(norm, "compile", broken_build)
    plan = [warmup.BuildItem("GemmFwdOp", "g", "float16", gemm, "m16", None),
            warmup.BuildItem("RMSNormFwdOp", "r", "float16", norm, "all", None)]
    monkeypatch.setattr(warmup, "build_plan", lambda *args, **kwargs: plan)
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: "/usr/bin/nvcc")

    assert cli.main(["compile", "--jobs", "1"]) == 1
    out = capsys.readouterr().out
    assert "ok      GemmFwdOp [g] float16 gemm m16" in out
    assert "warning GemmFwdOp [g] float16 gemm m16: no wgmma in the generated code" in out
    assert "FAILED  RMSNormFwdOp [r] float16 rms_norm all: RuntimeError: nvcc: ptxas fatal" in out
    assert out.strip().endswith("1 ok, 1 failed, 1 warnings")


def test_tune_without_a_gpu_is_a_clear_error(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["tune", "GemmFwdOp"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["tune", "NoSuchOp"], "error: unknown op 'NoSuchOp'; implemented: "),
    (["tune", "GemmFwdOp", "--workload", "no such label"],
     "error: GemmFwdOp has no workload matching --workload no such label; its workloads: "),
    (["bench", "--op", "NoSuchOp"], "error: unknown op 'NoSuchOp'; implemented: "),
    (["bench", "--family", "nope"], "error: no implemented op matches --family nope; families: "),
    (["bench", "--dtype", "fp8"], "error: no workload of any op matches --tier full --dtype fp8"),
    (["bench", "--op", "GroupedGemmFp8FwdOp", "--baseline", "torch-loop"],
     "error: --baseline torch-loop: not a baseline of the selected ops; theirs: "
     "tileops-bf16-grouped-gemm, "),
])
def test_arguments_are_checked_before_the_gpu(argv, message, monkeypatch, capsys):
    import torch

    def no_gpu_question():
        pytest.fail("the GPU was asked for before the arguments were checked")

    monkeypatch.setattr(torch.cuda, "is_available", no_gpu_question)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and len(err.splitlines()) == 1


def test_no_command_prints_help(capsys):
    assert cli.main([]) == 2
    assert "validate" in capsys.readouterr().out


@pytest.mark.compile
def test_compile_sweep_builds_rms_norm_smoke_kernels(capsys):
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc to compile TileLang kernels for sm_90a")
    assert cli.main(["compile", "--op", "RMSNormFwdOp", "--tier", "smoke"]) == 0
    out = capsys.readouterr().out
    assert "FAILED" not in out and ", 0 failed" in out


def test_bench_without_gpu_is_a_clear_error(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", "--tier", "smoke"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_report_flags_a_regression(tmp_path, capsys):
    import json

    from tileops.perf.report import History

    row = {"op": "GemmFwdOp", "label": "w", "dtype": "bfloat16", "latency_us": 100.0,
           "tflops": 1.0, "tbps": 1.0, "sol_us": 90.0, "sol_pct": 90.0, "bound": "compute",
           "baselines": {}, "best_baseline": "", "speedup": 0.0, "spread_pct": 0.5,
           "timing": "cupti", "gpu": "NVIDIA H200"}
    history = History(tmp_path / "history.jsonl")
    history.append({"meta": {"gpu": "NVIDIA H200"}, "rows": [row]})
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"meta": {"gpu": "NVIDIA H200"},
                               "rows": [{**row, "latency_us": 110.0}]}))
    assert cli.main(["report", str(run), "--history", str(history.path)]) == 1
    assert "regression" in capsys.readouterr().out
    run.write_text(json.dumps({"meta": {"gpu": "NVIDIA H200"},
                               "rows": [{**row, "latency_us": 101.0}]}))
    assert cli.main(["report", str(run), "--history", str(history.path)]) == 0


def _bench_row(**changes):
    row = {"op": "GemmFwdOp", "label": "w", "dtype": "bfloat16", "latency_us": 100.0,
           "gpu": "NVIDIA H200"}
    return {**row, **changes}


@pytest.mark.parametrize("content, message", [
    (None, "run.json: no such file"),
    ("{}", "run.json: not a benchmark report (no 'rows' list); expected the bench.json"),
    ("[1, 2]", "run.json: not a benchmark report (no 'rows' list)"),
    ("rows: 1", "run.json: not JSON (Expecting value at line 1, column 1)"),
    (b"\x89PNG\x00\xff", "run.json: not a text file"),
    (json.dumps({"meta": {}, "rows": [_bench_row(latency_us=None)]}),
     "run.json: row 1: expected a number for 'latency_us', got None"),
    (json.dumps({"meta": {}, "rows": [{"op": "GemmFwdOp"}]}),
     "run.json: row 1: no 'label', 'dtype', 'latency_us'"),
])
def test_report_answers_a_bad_run_file_in_one_line(content, message, tmp_path, capsys):
    run = tmp_path / "run.json"
    if isinstance(content, bytes):
        run.write_bytes(content)
    elif content is not None:
        run.write_text(content)
    history = tmp_path / "history.jsonl"
    history.write_text("")
    assert cli.main(["report", str(run), "--history", str(history)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith(f"error: {tmp_path}/") and message in err


@pytest.mark.parametrize("history_text, message", [
    (None, "no such file (`tileops bench --history FILE` creates it)"),
    ("not json\n", "history.jsonl:1: not JSON"),
    (json.dumps({"meta": {}, "rows": [{"op": "x"}]}) + "\n",
     "history.jsonl: run 1, row 1: no 'label', 'dtype', 'latency_us'"),
])
def test_report_answers_a_bad_history_in_one_line(history_text, message, tmp_path, capsys):
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"meta": {}, "rows": [_bench_row()]}))
    history = tmp_path / "history.jsonl"
    if history_text is not None:
        history.write_text(history_text)
    assert cli.main(["report", str(run), "--history", str(history)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and message in err


@pytest.mark.parametrize("command", ["list", "validate"])
def test_a_manifest_that_is_not_yaml_is_one_line(command, tmp_path, monkeypatch, capsys):
    from tileops import manifest

    (tmp_path / "gemm.yaml").write_text("GemmFwdOp:\n  family: [gemm\n  status: x\n")
    monkeypatch.setattr(manifest, "load_manifest",
                        lambda: manifest.read_manifest_dir(tmp_path))
    assert cli.main([command]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: gemm.yaml: not valid YAML: did not find expected ',' or ']' "
                          "(line 3, column ")
    assert len(err.splitlines()) == 1


def test_warmup_says_what_it_builds_and_counts(monkeypatch, capsys):
    """No compile: the plan is stubbed; the lines are what a user sees on stderr."""
    prebuild = importlib.import_module("tileops.prebuild")
    import tileops

    built = []

    class StubKernel:
        name = "stub"

        def compile(self, config, bucket):
            built.append(bucket)

    plan = [prebuild.BuildItem("GemmFwdOp", "w1", "bfloat16", StubKernel(), "m16", None),
            prebuild.BuildItem("RMSNormFwdOp", "w2", "float16", StubKernel(), "all", None)]
    monkeypatch.setattr(prebuild, "build_plan", lambda *args, **kwargs: plan)
    assert tileops.warmup() == 2 and built == ["m16", "all"]
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 4 and all(line.startswith("tileops.warmup: ") for line in lines)
    assert "2 programs for cuda sm_90a (compile only, nothing runs on a GPU; cache " in lines[0]
    assert lines[1].endswith("[1/2] GemmFwdOp [w1] bfloat16 stub m16")
    assert lines[2].endswith("[2/2] RMSNormFwdOp [w2] float16 stub all")
    assert "2 programs ready in " in lines[3]

    seen = []
    assert tileops.warmup(progress=seen.append) == 2
    assert len(seen) == 4 and seen[1] == "[1/2] GemmFwdOp [w1] bfloat16 stub m16"
    assert tileops.warmup(progress=None) == 2
    assert capsys.readouterr().err == ""


def test_warmup_names_an_unknown_op():
    import tileops

    with pytest.raises(tileops.TileOpsValueError, match=r"unknown op\(s\) \['NoSuchOp'\]"):
        tileops.warmup(["NoSuchOp"])


def test_bench_commit_comes_from_git_unless_the_caller_names_it(monkeypatch):
    monkeypatch.delenv("TILEOPS_COMMIT", raising=False)
    from_git = cli._git_commit()
    assert from_git is None or len(from_git.split("+")[0]) >= 7
    monkeypatch.setenv("TILEOPS_COMMIT", "abc1234")
    assert cli._git_commit() == "abc1234"


def test_workload_selection_filters_by_label_text_and_dtype():
    from tileops.manifest import select_workloads

    workloads = [{"label": "8k causal", "dtypes": ["bfloat16", "float16"]},
                 {"label": "2k causal", "dtypes": ["bfloat16", "float16"]},
                 {"label": "fp16 only", "dtypes": ["float16"]}]
    everything = select_workloads(workloads, None, None)
    assert [(w["label"], d) for w, d in everything] == [
        ("8k causal", ["bfloat16", "float16"]), ("2k causal", ["bfloat16", "float16"]),
        ("fp16 only", ["float16"])]
    bf16_causal = select_workloads(workloads, ["causal"], ["bfloat16"])
    assert [(w["label"], d) for w, d in bf16_causal] == [("8k causal", ["bfloat16"]),
                                                         ("2k causal", ["bfloat16"])]
    assert select_workloads(workloads, ["fp16 only"], ["bfloat16"]) == []
    # '=' asks for the whole label: "8k causal" alone, not a label it starts
    workloads.append({"label": "8k causal per head", "dtypes": ["bfloat16"]})
    assert [w["label"] for w, _ in select_workloads(workloads, ["=8k causal"], None)] == [
        "8k causal"]
    assert len(select_workloads(workloads, ["8k causal"], None)) == 2


def test_bench_cases_filter_by_tier_dtype_and_label_text():
    from tileops import GemmFwdOp
    from tileops.perf.bench import bench_cases

    every = [(w["label"], d) for _, w, d in bench_cases([GemmFwdOp])]
    assert len(every) == 22 and len({label for label, _ in every}) == 11
    decode_bf16 = [(w["label"], d) for _, w, d in bench_cases([GemmFwdOp], None, ["bfloat16"],
                                                              ["decode"])]
    assert decode_bf16 and all("decode" in label and d == "bfloat16"
                               for label, d in decode_bf16)
    assert len(decode_bf16) == len([1 for label, d in every
                                    if "decode" in label and d == "bfloat16"])
    assert list(bench_cases([GemmFwdOp], None, None, ["no such workload"])) == []


def test_tune_times_a_kernel_key_once_and_says_so_after(monkeypatch):
    """A second workload that shares the first one's kernel key and bucket is not timed
    again: its line names the workload the timings came from instead of repeating them."""
    import types

    import torch

    from tileops.perf import bench

    class FakeKernel:
        _by_bucket = {"all": ["winner"]}
        timings = [(0.5, "winner"), (0.6, "runner-up")]
        rejected = []

        def bucket_of(self, size):
            return "all"

        def key_string(self, bucket):
            return f"fake|{bucket}"

    class FakeOp:
        spec = types.SimpleNamespace(workload_params=lambda workload: {})

        def __init__(self, tune=False):
            pass

        def __call__(self, *inputs):
            pass

        def check(self, inputs):
            return {}

        def kernels_for(self, ns):
            return [("dispatch", {}, 1)]

        def get_kernel(self, dispatch_key, device, **key):
            return FakeKernel()

    monkeypatch.setattr(bench, "random_inputs", lambda *args, **kwargs: [])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    timed_on = {}
    first = cli._tune_one(FakeOp, {"label": "first"}, "bfloat16", timed_on)
    second = cli._tune_one(FakeOp, {"label": "second"}, "bfloat16", timed_on)
    assert first[0].startswith("tuned   FakeOp [first] bfloat16 fake|all -> winner")
    assert first[1:] == ["       500.0 us  winner", "       600.0 us  runner-up"]
    assert second[0].startswith("tuned   FakeOp [second] bfloat16 fake|all -> winner")
    assert second[1:] == ["  (timed on [first], which shares this kernel key and bucket; "
                          "not timed again)"]
