"""The `tileops` command: each subcommand's output and exit status (CPU, no GPU needed)."""

import importlib
import shutil

import pytest

from tileops import cli

pytestmark = pytest.mark.smoke


def test_list_shows_every_op(capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    header, *rows = out.splitlines()
    assert header.split() == ["op", "family", "status", "ref_api", "promises", "workloads"]
    gemm = next(r for r in rows if r.startswith("GemmFwdOp"))
    assert gemm.split() == ["GemmFwdOp", "gemm", "implemented", "torch.matmul", "torch_compile",
                            "11"]
    assert any(r.startswith("RMSNormFwdOp") for r in rows)


def test_validate_passes_on_the_shipped_manifest(capsys):
    assert cli.main(["validate"]) == 0
    assert capsys.readouterr().out.strip().endswith("workloads: OK")


def test_validate_reports_errors(monkeypatch, capsys):
    from tileops import ManifestError, validate

    def broken(manifest=None):
        return validate.ValidationResult([ManifestError("GemmFwdOp: field 'x': broken")])

    monkeypatch.setattr(validate, "validate", broken)
    assert cli.main(["validate"]) == 1
    out = capsys.readouterr().out
    assert "error: GemmFwdOp: field 'x': broken" in out
    assert out.strip().endswith("1 error")


def test_doctor_always_succeeds(capsys):
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "tilelang" in out and "torch" in out and "nvcc" in out
    assert "what will work" in out and "run kernels:" in out


def test_compile_without_nvcc_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    assert cli.main(["compile"]) == 2
    assert "nvcc not found" in capsys.readouterr().err


def test_compile_unknown_op(monkeypatch, capsys):
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: "/usr/bin/nvcc")
    assert cli.main(["compile", "--op", "NoSuchFwdOp"]) == 2
    assert "unknown op(s) ['NoSuchFwdOp']" in capsys.readouterr().err


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
