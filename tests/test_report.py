"""Benchmark reports: JSON, JUnit XML, Markdown, charts, history and regressions (CPU only)."""

import copy
import json
import re
import sys
import xml.etree.ElementTree as ET

import pytest

from tileops import TileOpsError, TileOpsUnsupportedError, TileOpsValueError
from tileops.perf import report
from tileops.perf.profiles import load_profile

pytestmark = pytest.mark.smoke

H200 = "NVIDIA H200"

# Rows copied from docs/performance/h200-{gemm,normalization}.json (an H200 run); the
# RMSNorm row has the optional spread_pct and gpu keys, the GEMM rows do not.
GEMM_BF16 = {
    "op": "GemmFwdOp", "label": "llama3.1-8b prefill 4k tokens qkv_proj", "dtype": "bfloat16",
    "latency_us": 272.38398790359497, "tflops": 756.8669208300371,
    "tbps": 0.49275190158205545, "sol_us": 260.9600382379747, "sol_pct": 95.8059393455743,
    "bound": "compute", "baselines": {"cublas": 260.0640058517456},
    "best_baseline": "cublas", "speedup": 0.9547698007262828,
    "timing": "cuda-events, L2 flushed, median of 3 trials",
}
GEMM_FP16 = {
    "op": "GemmFwdOp", "label": "llama3.1-8b prefill 4k tokens qkv_proj", "dtype": "float16",
    "latency_us": 281.6319912672043, "tflops": 732.013537526008,
    "tbps": 0.4765713134934948, "sol_us": 260.9600382379747, "sol_pct": 92.65994145898834,
    "bound": "compute", "baselines": {"cublas": 269.19999718666077},
    "best_baseline": "cublas", "speedup": 0.955857308594078,
    "timing": "cuda-events, L2 flushed, median of 3 trials",
}
RMSNORM_BF16 = {
    "op": "RMSNormFwdOp", "label": "llama3.1-8b prefill 8k tokens", "dtype": "bfloat16",
    "latency_us": 37.80800104141235, "tflops": 3.5499821282005066,
    "tbps": 3.550198801914386, "sol_us": 31.50843192488263, "sol_pct": 83.33800004493864,
    "bound": "memory",
    "baselines": {"torch-eager": 46.959999948740005, "torch-compile": 41.919998824596405},
    "best_baseline": "torch-compile", "speedup": 1.1087599891536197,
    "timing": "cuda-events, L2 flushed, median of 3 trials",
    "spread_pct": 1.234, "gpu": H200,
}
ROWS = [GEMM_BF16, GEMM_FP16, RMSNORM_BF16]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# -- JSON -------------------------------------------------------------------------------------

def test_json_round_trip(tmp_path):
    meta = report.run_meta(gpu=H200, commit="d5b683a", timestamp="2026-12-01T00:00:00+00:00")
    path = report.write_json(ROWS, tmp_path / "out" / "gemm.json", meta)
    data = report.read_json(path)
    assert data == {"meta": meta, "rows": ROWS}
    assert json.loads(path.read_text()) == data
    assert meta["gpu"] == H200 and meta["commit"] == "d5b683a"
    assert {"torch", "tilelang", "tileops", "timestamp"} <= meta.keys()


def test_run_meta_without_commit_stamps_the_time():
    meta = report.run_meta(gpu=H200, tier="nightly")
    assert "commit" not in meta
    assert meta["tier"] == "nightly"
    assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00$", meta["timestamp"])


def test_read_json_accepts_the_older_report_shape(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"gpu": H200, "rows": ROWS}))
    assert report.read_json(path) == {"meta": {"gpu": H200}, "rows": ROWS}
    path.write_text("[1, 2]")
    with pytest.raises(TileOpsValueError, match="not a benchmark report"):
        report.read_json(path)


def test_row_helpers_recompute_flops_and_bytes():
    flops, nbytes = report.row_flops(GEMM_BF16), report.row_bytes(GEMM_BF16)
    assert flops == pytest.approx(2 * 4096 * 6144 * 4096, rel=1e-6)  # M=4096, N=6144, K=4096
    assert report.arithmetic_intensity(GEMM_BF16) == pytest.approx(flops / nbytes)
    assert report.arithmetic_intensity({**GEMM_BF16, "tbps": 0.0}) == float("inf")
    assert report.spread_pct([100.0, 101.0, 99.0]) == pytest.approx(2.0)
    assert report.spread_pct([5.0]) == 0.0


# -- JUnit XML --------------------------------------------------------------------------------

def _properties(case: ET.Element) -> dict[str, str]:
    props = case.findall("properties/property")
    names = [p.get("name") for p in props]
    assert len(names) == len(set(names)), names
    return {p.get("name"): p.get("value") for p in props}


def test_junit_has_a_suite_per_op_and_the_row_properties(tmp_path):
    path = report.write_junit(ROWS, tmp_path / "bench.xml")
    root = ET.parse(path).getroot()
    assert root.tag == "testsuites" and root.get("name") == "tileops-bench"
    assert root.get("tests") == "3"
    suites = root.findall("testsuite")
    assert [s.get("name") for s in suites] == ["GemmFwdOp", "RMSNormFwdOp"]
    assert [s.get("tests") for s in suites] == ["2", "1"]

    gemm_cases = suites[0].findall("testcase")
    assert [c.get("name") for c in gemm_cases] == [
        "llama3.1-8b prefill 4k tokens qkv_proj [bfloat16]",
        "llama3.1-8b prefill 4k tokens qkv_proj [float16]"]
    assert {c.get("classname") for c in gemm_cases} == {"GemmFwdOp"}
    assert float(gemm_cases[0].get("time")) == pytest.approx(272.384e-6, rel=1e-5)
    assert _properties(gemm_cases[0]) == {
        "tileops_latency_us": "272.384",
        "tflops": "756.867",
        "tbps": "0.4928",
        "sol_pct": "95.81",
        "bound": "compute",
        "timing": "cuda-events, L2 flushed, median of 3 trials",
        "best_baseline": "cublas",
        "speedup": "0.9548",
        "baseline_cublas_latency_us": "260.064",
        "baseline_cublas_ratio": "0.9548",
    }

    (norm_case,) = suites[1].findall("testcase")
    assert norm_case.get("name") == "llama3.1-8b prefill 8k tokens [bfloat16]"
    assert _properties(norm_case) == {
        "tileops_latency_us": "37.808",
        "tflops": "3.550",
        "tbps": "3.5502",
        "sol_pct": "83.34",
        "bound": "memory",
        "spread_pct": "1.23",
        "timing": "cuda-events, L2 flushed, median of 3 trials",
        "best_baseline": "torch-compile",
        "speedup": "1.1088",
        "baseline_torch-eager_latency_us": "46.960",
        "baseline_torch-eager_ratio": "1.2421",
        "baseline_torch-compile_latency_us": "41.920",
        "baseline_torch-compile_ratio": "1.1088",
    }


def test_junit_row_without_baselines_has_no_speedup(tmp_path):
    row = {**GEMM_BF16, "baselines": {}, "best_baseline": "", "speedup": 0.0}
    root = ET.parse(report.write_junit([row], tmp_path / "b.xml", suite_name="nightly")).getroot()
    assert root.get("name") == "nightly"
    props = _properties(root.find("testsuite/testcase"))
    assert set(props) == {"tileops_latency_us", "tflops", "tbps", "sol_pct", "bound", "timing"}


# -- Markdown ---------------------------------------------------------------------------------

def test_markdown_has_a_heading_per_op_and_a_line_per_row():
    text = report.markdown_table(ROWS)
    lines = text.splitlines()
    assert [line for line in lines if line.startswith("#")] == ["### GemmFwdOp",
                                                                 "### RMSNormFwdOp"]
    headers = [line for line in lines if line.startswith("| workload |")]
    assert len(headers) == 2
    assert headers[0].split(" | ")[1:] == ["dtype", "TileOPs us", "TFLOP/s", "TB/s",
                                           "SOL % (bound)", "best baseline (us)", "speed-up",
                                           "spread: trials / runs",
                                           "host us/call (baseline's) |"]
    body = [line for line in lines if line.startswith("| llama")]
    assert len(body) == len(ROWS)
    assert body[0] == ("| llama3.1-8b prefill 4k tokens qkv_proj | bfloat16 | 272.4 | 757 | "
                       "0.49 | 96% (compute) | cublas (260.1) | 0.95x | - | - |")
    assert body[2] == ("| llama3.1-8b prefill 8k tokens | bfloat16 | 37.8 | 3.55 | 3.55 | "
                       "83% (memory) | torch-compile (41.9) | 1.11x | 1.2% | - |")
    assert text.index("### RMSNormFwdOp") > text.index(body[1])


def test_markdown_shows_host_time_per_call_when_measured():
    row = {**ROWS[2], "host_us": 21.04, "baseline_host_us": 14.9}
    assert report.markdown_table([row]).splitlines()[-1].endswith("| 1.2% | 21.0 (14.9) |")


def test_repeated_runs_show_trial_and_run_to_run_spreads():
    row = {**ROWS[2], "spread_pct": 2.0, "run_to_run_pct": 0.5}
    (line,) = [ln for ln in report.markdown_table([row]).splitlines() if ln.startswith("| llama")]
    assert line.endswith("| 2.0% / 0.5% | - |")
    props = dict(report._row_properties(row))
    assert props["spread_pct"] == "2.00" and props["run_to_run_pct"] == "0.50"


def test_markdown_escapes_pipes_and_shows_missing_baselines():
    row = {**GEMM_BF16, "label": "a|b", "baselines": {}, "best_baseline": "", "speedup": 0.0}
    (line,) = [ln for ln in report.markdown_table([row]).splitlines() if ln.startswith("| a")]
    assert line.startswith("| a\\|b | bfloat16 |")
    assert line.endswith("| - | - | - |")
    assert report.markdown_table([]) == ""


# -- plots ------------------------------------------------------------------------------------

def test_plot_roofline_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = report.plot_roofline(ROWS, load_profile(H200), tmp_path / "plots" / "roofline.png")
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_plot_speedups_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = report.plot_speedups(ROWS, tmp_path / "speedups.png")
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_plots_refuse_rows_they_cannot_draw(tmp_path):
    pytest.importorskip("matplotlib")
    no_base = {**GEMM_BF16, "baselines": {}, "best_baseline": "", "speedup": 0.0}
    with pytest.raises(TileOpsValueError, match="no row has a baseline"):
        report.plot_speedups([no_base], tmp_path / "s.png")
    with pytest.raises(TileOpsValueError, match="roofline"):
        report.plot_roofline([{**GEMM_BF16, "tflops": 0.0}], load_profile(H200),
                             tmp_path / "r.png")


@pytest.mark.parametrize("plot", ["roofline", "speedups"])
def test_plots_without_matplotlib_say_how_to_install_it(monkeypatch, tmp_path, plot):
    # A None entry in sys.modules makes `import matplotlib` raise ImportError.
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(TileOpsUnsupportedError) as info:
        if plot == "roofline":
            report.plot_roofline(ROWS, load_profile(H200), tmp_path / "r.png")
        else:
            report.plot_speedups(ROWS, tmp_path / "s.png")
    assert isinstance(info.value, TileOpsError)
    assert str(info.value) == "plots need matplotlib: pip install 'tileops[bench]'"
    assert not list(tmp_path.iterdir())


# -- history ----------------------------------------------------------------------------------

def _run(gpu, *rows, **meta):
    return {"meta": {"gpu": gpu, **meta}, "rows": [dict(r) for r in rows]}


def test_history_appends_lines_and_filters_by_gpu(tmp_path):
    history = report.History(tmp_path / "hist" / "bench.jsonl")
    assert history.runs() == []
    runs = [_run(H200, GEMM_BF16, n=1), _run("NVIDIA A100", GEMM_BF16, n=2),
            _run(H200, RMSNORM_BF16, n=3)]
    for run in runs:
        history.append(run)
    assert len(history.path.read_text().splitlines()) == 3
    assert history.runs() == runs
    assert [r["meta"]["n"] for r in history.runs(gpu=H200)] == [1, 3]
    assert [r["meta"]["n"] for r in history.runs(gpu="NVIDIA A100")] == [2]
    assert history.runs(gpu="NVIDIA B200") == []


def test_history_falls_back_to_the_rows_gpu_and_rejects_bad_lines(tmp_path):
    history = report.History(tmp_path / "bench.jsonl")
    history.append({"meta": {}, "rows": [RMSNORM_BF16]})  # the row carries gpu=H200
    assert len(history.runs(gpu=H200)) == 1
    with pytest.raises(TileOpsValueError, match="'rows' list"):
        history.append({"meta": {"gpu": H200}})
    with history.path.open("a") as f:
        f.write("\n{not json\n")
    with pytest.raises(TileOpsValueError, match=r"bench.jsonl:3: not JSON"):
        history.runs()


# -- compare ----------------------------------------------------------------------------------

def _row(latency, spread=None, label="w", dtype="bfloat16", op="GemmFwdOp"):
    row = {**copy.deepcopy(GEMM_BF16), "op": op, "label": label, "dtype": dtype,
           "latency_us": latency}
    if spread is not None:
        row["spread_pct"] = spread
    return row


def _history(latencies, spread=1.0, label="w"):
    return [_run(H200, _row(lat, spread, label=label)) for lat in latencies]


def _compare_one(current, history, **kw):
    (result,) = report.compare([current], history, **kw)
    return result


def test_compare_flags_a_slowdown_beyond_noise():
    c = _compare_one(_row(110.0, 1.0), _history([100.0, 100.0, 100.0]))
    assert c.status == "regression"
    assert c.baseline_us == 100.0 and c.n_runs == 3 and c.gpu is None
    assert c.change_pct == pytest.approx(10.0)
    assert c.noise_pct == pytest.approx(1.0) and c.threshold_pct == pytest.approx(3.0)


def test_compare_ignores_a_slowdown_under_the_floor():
    c = _compare_one(_row(102.0, 0.1), _history([100.0, 100.0], spread=0.1))
    assert c.status == "ok"
    assert c.threshold_pct == pytest.approx(3.0)  # 3 x 0.1% noise is under the 3% floor


def test_compare_ignores_a_slowdown_within_a_noisy_rows_spread():
    c = _compare_one(_row(106.0, 4.0), _history([100.0, 100.0, 100.0]))
    assert c.status == "ok"
    assert c.noise_pct == pytest.approx(4.0) and c.threshold_pct == pytest.approx(12.0)


def test_compare_noise_includes_previous_spreads_and_latency_scatter():
    # The previous rows' own spread (5%) dominates a quiet current row.
    c = _compare_one(_row(110.0, 0.5), _history([100.0, 100.0], spread=5.0))
    assert (c.status, c.threshold_pct) == ("ok", pytest.approx(15.0))
    # So does the scatter of the previous latencies: (105 - 95) / 100 = 10% -> 30%.
    c = _compare_one(_row(120.0, 0.5), _history([95.0, 100.0, 105.0], spread=0.5))
    assert c.noise_pct == pytest.approx(10.0)
    assert (c.status, c.threshold_pct) == ("ok", pytest.approx(30.0))
    # Without any spread recorded, the floor applies.
    c = _compare_one(_row(104.0), _history([100.0], spread=None))
    assert (c.status, c.noise_pct, c.threshold_pct) == ("regression", 0.0, 3.0)


def test_compare_reports_improvements_and_new_rows():
    history = _history([100.0, 102.0, 98.0])
    faster, unseen = report.compare([_row(85.0, 1.0), _row(5.0, 1.0, label="other")], history)
    assert faster.status == "improvement" and faster.change_pct == pytest.approx(-15.0)
    assert faster.threshold_pct == pytest.approx(12.0)  # 3 x (102 - 98) / 100
    assert unseen.status == "new"
    assert (unseen.baseline_us, unseen.change_pct, unseen.n_runs) == (None, None, 0)
    # A new dtype of a known workload is new too.
    assert _compare_one(_row(100.0, dtype="float16"), history).status == "new"


def test_compare_uses_only_runs_of_the_same_gpu():
    history = _history([100.0, 100.0]) + [
        _run("NVIDIA A100", _row(50.0, 1.0), _row(50.0, 1.0, label="a100-only"))]
    current = [_row(101.0, 1.0), _row(50.0, 1.0, label="a100-only")]
    same, only_a100 = report.compare(current, history, gpu=H200)
    assert (same.status, same.baseline_us, same.n_runs, same.gpu) == ("ok", 100.0, 2, H200)
    assert only_a100.status == "new"
    # The GPU can come from the rows themselves.
    (from_row,) = report.compare([{**_row(101.0, 1.0), "gpu": H200}], history)
    assert (from_row.baseline_us, from_row.gpu) == (100.0, H200)
    # BenchRow's default gpu "" means unknown, in the history and in the current rows.
    quiet = [{"meta": {"gpu": H200}, "rows": [{**_row(100.0, 1.0), "gpu": ""}]}]
    (blank,) = report.compare([{**_row(101.0, 1.0), "gpu": ""}], quiet)
    assert (blank.status, blank.baseline_us, blank.gpu) == ("ok", 100.0, None)
    # Not knowing the current GPU against a mixed history is refused, not guessed.
    with pytest.raises(TileOpsValueError, match="GPU is unknown"):
        report.compare([_row(101.0, 1.0)], history)


def test_comparison_table_and_summary():
    history = _history([100.0, 100.0, 100.0])
    comparisons = report.compare(
        [_row(110.0, 1.0), _row(90.0, 1.0), _row(100.5, 1.0), _row(1.0, label="n|ew")],
        history + _history([100.0] * 3, label="w2") + _history([100.0] * 3, label="w3"))
    # Three rows compare against workload "w"; "n|ew" has no history.
    lines = report.comparison_table(comparisons).splitlines()
    assert lines[0].startswith("| op | workload | dtype | now us | history us (runs) |")
    assert len(lines) == 2 + len(comparisons)
    assert lines[2] == "| GemmFwdOp | w | bfloat16 | 110.0 | 100.0 (3) | +10.0% | ±3.0% | " \
                       "**regression** |"
    assert lines[3].endswith("| -10.0% | ±3.0% | **improvement** |")
    assert lines[4].endswith("| +0.5% | ±3.0% | ok |")
    assert lines[5] == "| GemmFwdOp | n\\|ew | bfloat16 | 1.0 | - | - | - | new |"
    assert report.comparison_summary(comparisons) == (
        "1 regression, 1 improvement, 1 ok, 1 new (4 rows)")
    assert report.comparison_summary([]) == (
        "0 regressions, 0 improvements, 0 ok, 0 new (0 rows)")


def test_bench_reports_of_a_sweep_cut_short_say_so(tmp_path):
    """`tileops bench` rewrites its reports after every case; until the sweep ends the
    Markdown and the JSON meta say how far it got."""
    from tileops import cli

    meta = {"gpu": H200, "commit": "abc1234"}
    cli._write_reports(ROWS[:1], tmp_path, dict(meta, partial="run 1 of 1: 1 of 3 cases"))
    assert "partial: run 1 of 1: 1 of 3 cases" in (tmp_path / "bench.md").read_text()
    assert report.read_json(tmp_path / "bench.json")["meta"]["partial"].endswith("of 3 cases")
    table = cli._write_reports(ROWS, tmp_path, meta)  # the sweep's end overwrites them
    markdown = (tmp_path / "bench.md").read_text()
    assert "partial" not in markdown and table in markdown
    assert len(report.read_json(tmp_path / "bench.json")["rows"]) == 3
    assert (tmp_path / "bench.junit.xml").exists()
