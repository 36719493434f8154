"""Benchmark reports: JSON, JUnit XML, Markdown, PNG charts, and regressions against history.

Every function takes benchmark rows as dicts, the shape `dataclasses.asdict(BenchRow)` gives
(BenchRow instances are accepted too). Three keys are optional everywhere: `spread_pct`, the
spread of the row's trials in percent (see `spread_pct()`), `run_to_run_pct`, the spread of
the medians of repeated runs (`tileops bench --repeat N`), and `gpu`.

This module needs no GPU and imports nothing heavy; matplotlib is imported only by the plot
functions (`pip install 'tileops[bench]'`).
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import math
import pathlib
import statistics
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import TileOpsUnsupportedError, TileOpsValueError

if TYPE_CHECKING:
    from .profiles import GpuProfile

PathLike = str | pathlib.Path
Row = Mapping[str, Any]

MATPLOTLIB_MISSING = "plots need matplotlib: pip install 'tileops[bench]'"

# Comparison statuses.
REGRESSION, IMPROVEMENT, OK, NEW = "regression", "improvement", "ok", "new"


# -- rows -------------------------------------------------------------------------------------

def _as_dicts(rows: Iterable[Any]) -> list[dict[str, Any]]:
    # Accept BenchRow instances as well as the dicts asdict() makes of them.
    return [dataclasses.asdict(r) if dataclasses.is_dataclass(r) else dict(r) for r in rows]


def _key(row: Row) -> tuple[str, str, str]:
    return row["op"], row["label"], row["dtype"]


def _spread(row: Row, key: str = "spread_pct") -> float | None:
    value = row.get(key)
    return None if value is None else float(value)


def _noise(row: Row) -> float | None:
    """The row's own noise estimate: the larger of its trial and run-to-run spreads."""
    values = [v for v in (_spread(row), _spread(row, "run_to_run_pct")) if v is not None]
    return max(values, default=None)


def spread_pct(values: Sequence[float]) -> float:
    """Run-to-run noise of repeated measurements: (max - min) / median, in percent.

    Args:
        values: the measurements, e.g. the per-trial median latencies of one row.

    Returns:
        The spread in percent; 0.0 for fewer than two values or a zero median.
    """
    if len(values) < 2:
        return 0.0
    mid = statistics.median(values)
    return 0.0 if mid == 0 else (max(values) - min(values)) / mid * 100


def row_flops(row: Row) -> float:
    """Floating-point operations of one call, recomputed from TFLOP/s and latency."""
    return row["tflops"] * 1e12 * row["latency_us"] * 1e-6


def row_bytes(row: Row) -> float:
    """Bytes moved by one call, recomputed from TB/s and latency."""
    return row["tbps"] * 1e12 * row["latency_us"] * 1e-6


def arithmetic_intensity(row: Row) -> float:
    """FLOPs per byte of one call; inf when the row moves no bytes."""
    nbytes = row_bytes(row)
    return math.inf if nbytes <= 0 else row_flops(row) / nbytes


def _ops(rows: Sequence[Row]) -> list[str]:
    return list(dict.fromkeys(r["op"] for r in rows))  # order of first appearance


# -- JSON -------------------------------------------------------------------------------------

def run_meta(gpu: str | None = None, commit: str | None = None,
             timestamp: str | None = None, **extra: Any) -> dict[str, Any]:
    """The `meta` of a run: GPU, package versions, time and commit.

    Versions come from the installed distributions, so nothing is imported.

    Args:
        gpu: device name, e.g. 'NVIDIA H200'.
        commit: git commit the run measured, if known.
        timestamp: ISO-8601 time; now (UTC) when omitted.
        **extra: further keys to store (e.g. `tier="nightly"`).

    Returns:
        A JSON-serializable dict.
    """
    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    meta: dict[str, Any] = {
        "gpu": gpu,
        "torch": version("torch"),
        "tilelang": version("tilelang"),
        "tileops": version("tileops"),
        "timestamp": timestamp or datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"),
    }
    if commit:
        meta["commit"] = commit
    meta.update(extra)
    return meta


def write_json(rows: Iterable[Any], path: PathLike, meta: Mapping[str, Any]) -> pathlib.Path:
    """Writes `{"meta": meta, "rows": rows}` to `path` (parent folders are created).

    Args:
        rows: benchmark rows.
        path: the file to write.
        meta: run metadata, e.g. from `run_meta()`.

    Returns:
        The path written.
    """
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": dict(meta), "rows": _as_dicts(rows)}, indent=1) + "\n")
    return path


def read_json(path: PathLike) -> dict[str, Any]:
    """Reads a report written by `write_json()`.

    Older files of the form `{"gpu": ..., "rows": [...]}` (see docs/performance) are
    returned with their GPU moved into `meta`.

    Raises:
        TileOpsValueError: the file is not a report.
    """
    data = json.loads(pathlib.Path(path).read_text())
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise TileOpsValueError(f"{path}: not a benchmark report (no 'rows' list)")
    if "meta" not in data:
        data = {"meta": {"gpu": data.get("gpu")}, "rows": data["rows"]}
    return data


# -- JUnit XML --------------------------------------------------------------------------------

def _num(value: float, digits: int) -> str:
    return f"{value:.{digits}f}"


def _row_properties(row: Row) -> list[tuple[str, str]]:
    latency = row["latency_us"]
    props = [
        ("tileops_latency_us", _num(latency, 3)),
        ("tflops", _num(row["tflops"], 3)),
        ("tbps", _num(row["tbps"], 4)),
        ("sol_pct", _num(row["sol_pct"], 2)),
        ("bound", str(row["bound"])),
    ]
    for key in ("spread_pct", "run_to_run_pct"):
        spread = _spread(row, key)
        if spread is not None:
            props.append((key, _num(spread, 2)))
    props.append(("timing", str(row.get("timing", ""))))
    for name, value in (row.get("device_state") or {}).items():  # clock, power, temperature
        props.append((name, str(value)))
    # A row without baselines has no meaningful speed-up (BenchRow stores 0.0).
    if row.get("best_baseline"):
        props.append(("best_baseline", str(row["best_baseline"])))
        props.append(("speedup", _num(row["speedup"], 4)))
    for name, base_us in row.get("baselines", {}).items():
        props.append((f"baseline_{name}_latency_us", _num(base_us, 3)))
        ratio = base_us / latency if latency > 0 else math.inf
        props.append((f"baseline_{name}_ratio", _num(ratio, 4)))
    return props


def write_junit(rows: Iterable[Any], path: PathLike,
                suite_name: str = "tileops-bench") -> pathlib.Path:
    """Writes the rows as JUnit XML, the numbers as properties CI systems can chart.

    One `<testsuite>` per op; one `<testcase>` per row, named "label [dtype]", whose time is
    the TileOPs latency in seconds. A benchmark never fails, so no case has a failure.

    Args:
        rows: benchmark rows.
        path: the file to write.
        suite_name: name of the `<testsuites>` root.

    Returns:
        The path written.
    """
    rows = _as_dicts(rows)
    root = ET.Element("testsuites", name=suite_name, tests=str(len(rows)),
                      time=_num(sum(r["latency_us"] for r in rows) * 1e-6, 9))
    for op in _ops(rows):
        op_rows = [r for r in rows if r["op"] == op]
        suite = ET.SubElement(root, "testsuite", name=op, tests=str(len(op_rows)),
                              failures="0", errors="0", skipped="0",
                              time=_num(sum(r["latency_us"] for r in op_rows) * 1e-6, 9))
        for row in op_rows:
            case = ET.SubElement(suite, "testcase", classname=op,
                                 name=f"{row['label']} [{row['dtype']}]",
                                 time=_num(row["latency_us"] * 1e-6, 9))
            props = ET.SubElement(case, "properties")
            for name, value in _row_properties(row):
                ET.SubElement(props, "property", name=name, value=value)
    tree = ET.ElementTree(root)
    ET.indent(tree)
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tree.write(path, encoding="utf-8", xml_declaration=True)
    return path


# -- Markdown ---------------------------------------------------------------------------------

MARKDOWN_HEADER = ("| workload | dtype | TileOPs us | TFLOP/s | TB/s | SOL % (bound) | "
                   "best baseline (us) | speed-up | spread: trials / runs | "
                   "host us/call (baseline's) |\n"
                   "|---|---|--:|--:|--:|--:|---|--:|--:|--:|")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _sig(value: float) -> str:
    # About three significant digits: 790, 35.5, 3.55.
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"


def _markdown_row(row: Row) -> str:
    best = row.get("best_baseline")
    if best:
        base = f"{_cell(best)} ({row['baselines'][best]:.1f})"
        speedup = f"{row['speedup']:.2f}x"
    else:
        base = speedup = "-"
    trials, runs = _spread(row), _spread(row, "run_to_run_pct")
    spread = "-" if trials is None else f"{trials:.1f}%"
    if runs is not None:  # a --repeat run: the run-to-run spread after the trials'
        spread += f" / {runs:.1f}%"
    host = "-"
    if row.get("host_us"):  # rows from before host time was measured have none
        host = f"{row['host_us']:.1f}"
        if row.get("baseline_host_us"):
            host += f" ({row['baseline_host_us']:.1f})"
    cells = [_cell(row["label"]), row["dtype"], f"{row['latency_us']:.1f}", _sig(row["tflops"]),
             f"{row['tbps']:.2f}", f"{row['sol_pct']:.0f}% ({row['bound']})", base, speedup,
             spread, host]
    return "| " + " | ".join(cells) + " |"


def markdown_table(rows: Iterable[Any]) -> str:
    """The rows as Markdown: a heading and a table per op, one table line per row.

    Args:
        rows: benchmark rows.

    Returns:
        Markdown text ending in a newline ("" for no rows).
    """
    rows = _as_dicts(rows)
    parts = []
    for op in _ops(rows):
        lines = [_markdown_row(r) for r in rows if r["op"] == op]
        parts.append(f"### {op}\n\n{MARKDOWN_HEADER}\n" + "\n".join(lines) + "\n")
    return "\n".join(parts)


# -- plots ------------------------------------------------------------------------------------

def _figure_class() -> Any:
    # Imported here: matplotlib is an optional extra. Figure (not pyplot) keeps no global
    # state and needs no GUI backend.
    try:
        import matplotlib  # noqa: F401 - fails first when the package is absent
        from matplotlib.figure import Figure
    except ImportError as e:
        raise TileOpsUnsupportedError(MATPLOTLIB_MISSING) from e
    return Figure


_MARKERS = "os^Dv<>pP*Xh"


def _peak_flops(profile: GpuProfile, dtype: str) -> float:
    # The same fallback as GpuProfile.sol_seconds.
    return profile.flops_per_s.get(dtype, profile.flops_per_s["float16"])


def plot_roofline(rows: Iterable[Any], profile: GpuProfile, path: PathLike) -> pathlib.Path:
    """Writes a log-log roofline chart: achieved TFLOP/s against arithmetic intensity.

    Each op gets its own marker; the roof `min(peak, intensity * bandwidth)` is drawn once per
    distinct compute peak among the rows' dtypes.

    Args:
        rows: benchmark rows; rows with no FLOPs or no bytes cannot be placed and are left out.
        profile: the GPU's peaks (`perf.profiles.load_profile`).
        path: the PNG to write.

    Returns:
        The path written.

    Raises:
        TileOpsUnsupportedError: matplotlib is not installed.
        TileOpsValueError: no row can be placed on the chart.
    """
    figure_cls = _figure_class()
    rows = [r for r in _as_dicts(rows) if r["tflops"] > 0 and r["tbps"] > 0
            and r["latency_us"] > 0]
    if not rows:
        raise TileOpsValueError("roofline: no row has positive TFLOP/s, TB/s and latency")
    bw_tbps = profile.bytes_per_s / 1e12
    peaks: dict[float, list[str]] = {}  # peak TFLOP/s -> dtypes with that peak
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        peaks.setdefault(_peak_flops(profile, dtype) / 1e12, []).append(dtype)

    intensities = [arithmetic_intensity(r) for r in rows]
    ridges = [p / bw_tbps for p in peaks]
    lo = min(intensities + ridges) / 4
    hi = max(intensities + ridges) * 4
    steps = 200
    xs = [lo * (hi / lo) ** (i / steps) for i in range(steps + 1)]

    fig = figure_cls(figsize=(9, 6), layout="constrained")
    ax = fig.add_subplot()
    for peak, dtypes in sorted(peaks.items()):
        ax.plot(xs, [min(peak, x * bw_tbps) for x in xs], color="0.3", linewidth=1.5,
                linestyle="-" if peak == max(peaks) else "--",
                label=f"roof {'/'.join(dtypes)}: {peak:.0f} TFLOP/s, {bw_tbps:.2f} TB/s")
    for i, op in enumerate(_ops(rows)):
        op_rows = [r for r in rows if r["op"] == op]
        ax.scatter([arithmetic_intensity(r) for r in op_rows], [r["tflops"] for r in op_rows],
                   marker=_MARKERS[i % len(_MARKERS)], color=f"C{i % 10}", s=45, alpha=0.85,
                   edgecolors="black", linewidths=0.5, label=op, zorder=3)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.set_title(f"Roofline on {profile.name}")
    ax.grid(True, which="both", linewidth=0.3, alpha=0.5)
    ax.legend(loc="upper left", fontsize="small")
    return _save(fig, path)


def plot_speedups(rows: Iterable[Any], path: PathLike) -> pathlib.Path:
    """Writes a horizontal bar chart of the speed-up over the best baseline of each row.

    Bars right of the line at 1.0 are faster than every baseline.

    Args:
        rows: benchmark rows; rows without a baseline are left out.
        path: the PNG to write.

    Returns:
        The path written.

    Raises:
        TileOpsUnsupportedError: matplotlib is not installed.
        TileOpsValueError: no row has a baseline.
    """
    figure_cls = _figure_class()
    rows = [r for r in _as_dicts(rows) if r.get("best_baseline")]
    if not rows:
        raise TileOpsValueError("speed-up chart: no row has a baseline")
    labels = [f"{r['op']}: {r['label']} [{r['dtype']}]" for r in rows]
    speedups = [r["speedup"] for r in rows]

    fig = figure_cls(figsize=(10, 1.5 + 0.32 * len(rows)), layout="constrained")
    ax = fig.add_subplot()
    ys = range(len(rows))
    ax.barh(ys, speedups, color=["tab:green" if s >= 1 else "tab:red" for s in speedups],
            height=0.7)
    ax.axvline(1.0, color="black", linewidth=1)
    for y, s, r in zip(ys, speedups, rows, strict=True):
        ax.text(s, y, f" {s:.2f}x vs {r['best_baseline']}", va="center", fontsize="small")
    ax.set_yticks(list(ys), labels, fontsize="small")
    ax.invert_yaxis()  # first row on top, as in the tables
    ax.set_xlim(0, max(speedups + [1.0]) * 1.3)  # room for the value labels
    ax.set_xlabel("speed-up over the best baseline (x, higher is better)")
    ax.set_title("TileOPs speed-up over the best baseline")
    ax.grid(True, axis="x", linewidth=0.3, alpha=0.5)
    return _save(fig, path)


def _save(fig: Any, path: PathLike) -> pathlib.Path:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=120)
    return path


# -- history and regressions ------------------------------------------------------------------

def _run_gpu(run: Mapping[str, Any]) -> str | None:
    gpu = (run.get("meta") or {}).get("gpu")
    if gpu:
        return gpu
    # Runs whose meta lacks the GPU: use the rows' own, if they agree ("" means unknown).
    gpus = {r.get("gpu") or None for r in run.get("rows", [])}
    return gpus.pop() if len(gpus) == 1 else None


class History:
    """The stored runs: a JSON-lines file, one `{"meta": ..., "rows": [...]}` per line."""

    def __init__(self, path: PathLike):
        """Opens (lazily) the history at `path`; the file need not exist yet."""
        self.path = pathlib.Path(path)

    def append(self, run: Mapping[str, Any]) -> None:
        """Adds one run as a line at the end of the file (creating it and its folder).

        Args:
            run: `{"meta": {...}, "rows": [...]}`; rows may be BenchRow instances.

        Raises:
            TileOpsValueError: `run` has no 'rows' list.
        """
        if not isinstance(run.get("rows"), list):
            raise TileOpsValueError("History.append: a run needs a 'rows' list")
        record = {"meta": dict(run.get("meta") or {}), "rows": _as_dicts(run["rows"])}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record, separators=(",", ":")) + "\n")

    def runs(self, gpu: str | None = None) -> list[dict[str, Any]]:
        """The stored runs, oldest first.

        Args:
            gpu: only the runs on this GPU (by `meta["gpu"]`, else the rows' `gpu`).

        Returns:
            The runs; [] when the file does not exist.

        Raises:
            TileOpsValueError: a line is not a JSON run.
        """
        if not self.path.exists():
            return []
        runs = []
        for n, line in enumerate(self.path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                run = json.loads(line)
            except json.JSONDecodeError as e:
                raise TileOpsValueError(f"{self.path}:{n}: not JSON: {e}") from e
            if not isinstance(run, dict) or not isinstance(run.get("rows"), list):
                raise TileOpsValueError(f"{self.path}:{n}: not a run (no 'rows' list)")
            if gpu is None or _run_gpu(run) == gpu:
                runs.append(run)
        return runs


@dataclass
class Comparison:
    """One current row against its history.

    Attributes:
        op, label, dtype: the row.
        gpu: the GPU compared on (None when unknown).
        status: 'regression', 'improvement', 'ok' or 'new' (no history).
        current_us: the current TileOPs latency.
        baseline_us: median TileOPs latency over the previous runs (not a baseline library).
        change_pct: (current - baseline) / baseline, in percent; positive is slower.
        noise_pct: the largest noise estimate seen (current spread, median previous spread,
            spread of the previous latencies).
        threshold_pct: the change beyond which the row is flagged.
        n_runs: how many previous runs had this row.
    """

    op: str
    label: str
    dtype: str
    gpu: str | None
    status: str
    current_us: float
    baseline_us: float | None = None
    change_pct: float | None = None
    noise_pct: float | None = None
    threshold_pct: float | None = None
    n_runs: int = 0


def compare(current_rows: Iterable[Any], history_runs: Sequence[Mapping[str, Any]],
            min_threshold_pct: float = 3.0, noise_factor: float = 3.0,
            gpu: str | None = None) -> list[Comparison]:
    """Compares each current row with the previous runs on the same GPU.

    The reference is the median latency over the previous runs. A change counts only beyond
    `max(min_threshold_pct, noise_factor * noise)`, where noise is the largest of: the row's
    current `spread_pct`, the median `spread_pct` of its previous rows, and the spread of its
    previous latencies (with two runs or more).

    Args:
        current_rows: the rows just measured.
        history_runs: previous runs (`History.runs()`), any GPU.
        min_threshold_pct: smallest change, in percent, ever flagged.
        noise_factor: how many noise widths a change must exceed.
        gpu: the current GPU; default: each row's `gpu` key. When neither is known the runs
            are taken as already filtered, which is refused if they span several GPUs.

    Returns:
        One Comparison per current row, in order.

    Raises:
        TileOpsValueError: the current GPU is unknown and the history has several GPUs.
    """
    samples: dict[tuple[str | None, str, str, str], list[tuple[float, float | None]]] = {}
    history_gpus = set()
    for run in history_runs:
        run_gpu = _run_gpu(run)
        for row in run.get("rows", []):
            row_gpu = row.get("gpu") or run_gpu  # BenchRow's "" means unknown
            history_gpus.add(row_gpu)
            samples.setdefault((row_gpu, *_key(row)), []).append(
                (float(row["latency_us"]), _noise(row)))

    out = []
    for row in _as_dicts(current_rows):
        row_gpu = gpu or row.get("gpu") or None
        if row_gpu is None:
            if len(history_gpus) > 1:
                raise TileOpsValueError(
                    f"compare: the current GPU is unknown and the history spans "
                    f"{sorted(map(str, history_gpus))}; pass gpu= or History.runs(gpu)")
            prev = [s for k, v in samples.items() if k[1:] == _key(row) for s in v]
        else:
            prev = samples.get((row_gpu, *_key(row)), [])
        out.append(_compare_row(row, row_gpu, prev, min_threshold_pct, noise_factor))
    return out


def _compare_row(row: Row, gpu: str | None, prev: list[tuple[float, float | None]],
                 min_threshold_pct: float, noise_factor: float) -> Comparison:
    current = float(row["latency_us"])
    spread_now = _noise(row)
    if not prev:
        return Comparison(*_key(row), gpu, NEW, current, noise_pct=spread_now)
    latencies = [lat for lat, _ in prev]
    baseline = statistics.median(latencies)
    change = (current - baseline) / baseline * 100 if baseline > 0 else 0.0
    noises = [] if spread_now is None else [spread_now]
    prev_spreads = [s for _, s in prev if s is not None]
    if prev_spreads:
        noises.append(statistics.median(prev_spreads))
    if len(latencies) >= 2:
        noises.append(spread_pct(latencies))
    noise = max(noises, default=0.0)
    threshold = max(min_threshold_pct, noise_factor * noise)
    status = REGRESSION if change > threshold else IMPROVEMENT if change < -threshold else OK
    return Comparison(*_key(row), gpu, status, current, baseline, change, noise, threshold,
                      len(prev))


def comparison_table(comparisons: Sequence[Comparison]) -> str:
    """The comparisons as one Markdown table, regressions and improvements in bold.

    Returns:
        Markdown text ending in a newline.
    """
    lines = ["| op | workload | dtype | now us | history us (runs) | change | threshold | "
             "status |", "|---|---|---|--:|--:|--:|--:|---|"]
    for c in comparisons:
        if c.status == NEW:
            hist = change = threshold = "-"
        else:
            hist = f"{c.baseline_us:.1f} ({c.n_runs})"
            change = f"{c.change_pct:+.1f}%"
            threshold = f"±{c.threshold_pct:.1f}%"
        status = f"**{c.status}**" if c.status in (REGRESSION, IMPROVEMENT) else c.status
        lines.append(f"| {c.op} | {_cell(c.label)} | {c.dtype} | {c.current_us:.1f} | {hist} | "
                     f"{change} | {threshold} | {status} |")
    return "\n".join(lines) + "\n"


def comparison_summary(comparisons: Sequence[Comparison]) -> str:
    """One line of counts per status.

    Returns:
        e.g. '1 regression, 2 improvements, 10 ok, 3 new (16 rows)'.
    """
    counts = {s: sum(c.status == s for c in comparisons)
              for s in (REGRESSION, IMPROVEMENT, OK, NEW)}
    plural = {REGRESSION: "regressions", IMPROVEMENT: "improvements"}
    parts = [f"{n} {plural.get(s, s) if n != 1 else s}" for s, n in counts.items()]
    return f"{', '.join(parts)} ({len(comparisons)} rows)"


# -- speed-up summary (the models tier) -------------------------------------------------------

@dataclass
class OpSpeedups:
    """One op's speed-ups over its best baseline across a run's rows.

    Attributes:
        op: the op.
        cases: rows with a baseline (the others have no speed-up and are only counted).
        geomean: geometric mean of their speed-ups (1.0 = as fast as the best baseline).
        worst: the lowest speed-up.
        worst_rows: the slowest rows, lowest first: label, dtype, speedup, best_baseline.
        no_baseline: rows without a baseline.
    """

    op: str
    cases: int
    geomean: float
    worst: float
    worst_rows: list[dict[str, Any]]
    no_baseline: int = 0


def speedup_summary(rows: Iterable[Any], worst_n: int = 3) -> list[OpSpeedups]:
    """Per op (in order of first appearance): the geometric-mean and the worst speed-up over
    the best baseline, naming the `worst_n` slowest rows. Reads only the rows' op, label,
    dtype, speedup and best_baseline, so a stored bench.json gives the same summary.

    An op whose rows all lack a baseline gets cases 0 and nan for its speed-ups.
    """
    rows = _as_dicts(rows)
    out = []
    for op in _ops(rows):
        op_rows = [r for r in rows if r["op"] == op]
        timed = sorted((r for r in op_rows if r.get("best_baseline") and r["speedup"] > 0),
                       key=lambda r: r["speedup"])
        speedups = [r["speedup"] for r in timed]
        geomean = (math.exp(sum(map(math.log, speedups)) / len(speedups)) if speedups
                   else math.nan)
        out.append(OpSpeedups(
            op, len(timed), geomean, speedups[0] if speedups else math.nan,
            [{k: r[k] for k in ("label", "dtype", "speedup", "best_baseline")}
             for r in timed[:worst_n]], len(op_rows) - len(timed)))
    return out


def group_refused(refused: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Refused workloads (`models.split_refused` records) grouped per (op, configuration):
    the models it comes from, how many workloads, and the first workload's reason."""
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for r in refused:
        g = groups.setdefault((r["op"], r["config"]), {
            "op": r["op"], "config": r["config"], "models": [], "workloads": 0,
            "reason": r["reason"]})
        g["workloads"] += 1
        g["models"] += [m for m in r["models"] if m not in g["models"]]
    return list(groups.values())


def _times(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}x"


def speedup_summary_markdown(rows: Iterable[Any], refused: Iterable[Mapping[str, Any]] = (),
                             worst_n: int = 3) -> str:
    """The summary as Markdown: a table of `speedup_summary` and one of `group_refused`.

    Returns:
        Markdown text ending in a newline.
    """
    lines = ["### Speed-up over the best baseline, per op", "",
             "| op | cases | geomean | worst | slowest shapes |", "|---|--:|--:|--:|---|"]
    for s in speedup_summary(rows, worst_n):
        worst = "; ".join(f"{_cell(w['label'])} [{w['dtype']}] {w['speedup']:.2f}x vs "
                          f"{_cell(w['best_baseline'])}" for w in s.worst_rows) or "-"
        if s.no_baseline:
            worst += f" ({s.no_baseline} rows without a baseline)"
        lines.append(f"| {s.op} | {s.cases} | {_times(s.geomean)} | {_times(s.worst)} | "
                     f"{worst} |")
    groups = group_refused(refused)
    if groups:
        total = sum(g["workloads"] for g in groups)
        lines += ["", f"### Refused by the current ops ({total} workloads, not timed)", "",
                  "| op | configuration | models | workloads | reason (first workload) |",
                  "|---|---|---|--:|---|"]
        lines += [f"| {g['op']} | {_cell(g['config'])} | {', '.join(g['models'])} | "
                  f"{g['workloads']} | {_cell(g['reason'])} |" for g in groups]
    return "\n".join(lines) + "\n"
