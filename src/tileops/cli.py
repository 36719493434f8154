"""The `tileops` command: list, validate, compile, doctor, tune, bench and report.

Each subcommand is a thin shell over the package: the checks live in `validate.py`, the
compile plan in `prebuild.py`, the autotuner in the Kernel base class.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

from .errors import TileOpsError

# Exit codes: 0 success, 1 the checked thing failed, 2 cannot run here (usage, no nvcc/GPU).
EXIT_OK, EXIT_FAILED, EXIT_UNAVAILABLE = 0, 1, 2


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the `tileops` command; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_UNAVAILABLE
    return args.handler(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tileops", description="TileOPs: spec-driven LLM operators for NVIDIA Hopper.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("list", help="the ops of the manifest, their status and promises")
    p.set_defaults(handler=cmd_list)

    p = sub.add_parser("validate", help="check that the code and the manifest agree")
    p.set_defaults(handler=cmd_validate)

    p = sub.add_parser("compile", help="compile every kernel the workloads need (needs nvcc, "
                                       "no GPU)")
    p.add_argument("--arch", default="sm_90a", help="target architecture (default: sm_90a)")
    p.add_argument("--op", nargs="+", metavar="NAME", help="only these ops (default: all)")
    p.add_argument("--tier", choices=("smoke", "full"), default="smoke",
                   help="smoke: the workloads CI compiles (default); full: every workload")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="programs compiled in parallel (default: the CPU count)")
    p.add_argument("-v", "--verbose", action="store_true", help="keep TileLang's build log")
    p.set_defaults(handler=cmd_compile)

    p = sub.add_parser("doctor", help="what this machine has and what will work on it")
    p.set_defaults(handler=cmd_doctor)

    p = sub.add_parser("tune", help="autotune an op's kernels on its workloads (needs a GPU)")
    p.add_argument("op", metavar="OP", help="op class name, e.g. GemmFwdOp")
    p.add_argument("--workload", metavar="TEXT", action="append",
                   help="only workloads whose label contains TEXT (repeatable)")
    p.add_argument("--dtype", nargs="+", metavar="D", help="only these dtypes")
    p.add_argument("--out", metavar="DIR",
                   help="copy the GPU's tuned table here after every workload")
    p.add_argument("-v", "--verbose", action="store_true", help="keep TileLang's build log")
    p.set_defaults(handler=cmd_tune)

    p = sub.add_parser("bench", help="benchmark ops on their manifest workloads (needs a GPU)")
    p.add_argument("--op", nargs="+", metavar="NAME", help="only these ops")
    p.add_argument("--family", nargs="+", metavar="F", help="only these families")
    p.add_argument("--tier", choices=("smoke", "full"), default="full")
    p.add_argument("--dtype", nargs="+", metavar="D", help="only these dtypes")
    p.add_argument("--workload", metavar="TEXT", action="append",
                   help="only workloads whose label contains TEXT (repeatable)")
    p.add_argument("--out", default="bench-results", help="report folder (default: %(default)s)")
    p.add_argument("--history", metavar="FILE",
                   help="append the run to this history (JSON lines) and compare with it")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="run every case N times; rows report the median and the spread")
    p.add_argument("-v", "--verbose", action="store_true", help="keep TileLang's build log")
    p.set_defaults(handler=cmd_bench)

    p = sub.add_parser("report", help="compare a bench run with the history; flag regressions")
    p.add_argument("run", metavar="RUN_JSON", help="bench.json written by `tileops bench`")
    p.add_argument("--history", metavar="FILE", required=True)
    p.set_defaults(handler=cmd_report)
    return parser


def _quiet_tilelang(verbose: bool) -> None:
    # TileLang logs two INFO lines per build, which would bury our one-line results.
    if not verbose:
        logging.getLogger("tilelang").setLevel(logging.WARNING)


def _print_table(rows: list[list[str]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


# -- list -------------------------------------------------------------------------------------
def cmd_list(args: argparse.Namespace) -> int:
    """Prints one row per manifest op: family, status, reference API, promises."""
    from .manifest import load_manifest

    rows = [["op", "family", "status", "ref_api", "promises", "workloads"]]
    for name, entry in sorted(load_manifest().items(), key=lambda kv: (kv[1]["family"], kv[0])):
        promises = [p for p in ("torch_compile", "autograd") if entry.get(p)]
        rows.append([name, entry["family"], entry["status"], entry["ref_api"],
                     ", ".join(promises) or "-", str(len(entry["workloads"]))])
    _print_table(rows)
    return EXIT_OK


# -- validate ---------------------------------------------------------------------------------
def cmd_validate(args: argparse.Namespace) -> int:
    """Runs the validator; exit 1 when the code and the manifest disagree."""
    from .manifest import load_manifest
    from .validate import validate

    manifest = load_manifest()
    result = validate(manifest)
    for note in result.notes:
        print(f"note: {note}")
    for error in result:
        print(f"error: {error}")
    if result:
        print(f"{len(result)} error{'s' if len(result) != 1 else ''}")
        return EXIT_FAILED
    n_workloads = sum(len(e["workloads"]) for e in manifest.values())
    print(f"{len(manifest)} ops, {n_workloads} workloads: OK")
    return EXIT_OK


# -- compile ----------------------------------------------------------------------------------
def cmd_compile(args: argparse.Namespace) -> int:
    """Compiles every kernel the chosen workloads need, in parallel; no GPU needed."""
    if shutil.which("nvcc") is None:
        print("error: nvcc not found on PATH; `tileops compile` needs the CUDA toolkit "
              "(a GPU is not needed)", file=sys.stderr)
        return EXIT_UNAVAILABLE
    from .kernels.gemm import GemmKernel
    from .ops import OP_CLASSES
    from .prebuild import build_plan

    unknown = [n for n in args.op or () if n not in OP_CLASSES]
    if unknown:
        print(f"error: unknown op(s) {unknown}; implemented: {sorted(OP_CLASSES)}",
              file=sys.stderr)
        return EXIT_UNAVAILABLE
    _quiet_tilelang(args.verbose)
    plan = build_plan(args.op, args.tier, target={"kind": "cuda", "arch": args.arch})
    print(f"compiling {len(plan)} programs for {args.arch} with {args.jobs} jobs")
    start = time.perf_counter()
    failed = warnings = 0
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {pool.submit(_compile_one, item): item for item in plan}
        for future in as_completed(futures):
            item = futures[future]
            seconds, compiled, error = future.result()
            if error is not None:
                failed += 1
                print(f"FAILED  {item.describe()}: {error}")
                continue
            print(f"ok      {item.describe()} ({seconds:.1f} s)")
            if isinstance(item.kernel, GemmKernel):
                # TileLang falls back to mma.sync silently; that is a 2-3x slower GEMM.
                if "wgmma" not in compiled[0].get_kernel_source():
                    warnings += 1
                    print(f"warning {item.describe()}: no wgmma in the generated code")
    print(f"{len(plan)} programs in {time.perf_counter() - start:.1f} s: "
          f"{len(plan) - failed} ok, {failed} failed, {warnings} warnings")
    return EXIT_FAILED if failed else EXIT_OK


def _compile_one(item: Any) -> tuple[float, tuple, str | None]:
    """(seconds, compiled programs, error message or None) of one plan item."""
    start = time.perf_counter()
    try:
        compiled = item.kernel.compile(item.config, item.bucket)
    except Exception as e:  # noqa: BLE001 - one failed program must not stop the sweep
        return time.perf_counter() - start, (), f"{type(e).__name__}: {e}"
    return time.perf_counter() - start, compiled, None


# -- doctor -----------------------------------------------------------------------------------
def cmd_doctor(args: argparse.Namespace) -> int:
    """Prints what this machine has and what TileOPs can do on it; always exit 0."""
    import torch

    from .kernels.base import TUNED_DIR, cache_root, gpu_slug

    def line(what: str, value: object) -> None:
        print(f"{what + ':':<22}{value}")

    line("python", f"{platform.python_version()} ({sys.executable})")
    line("torch", f"{torch.__version__} (CUDA build: {torch.version.cuda or 'none'})")
    line("tilelang", _tilelang_version())
    cuda = torch.cuda.is_available()
    line("CUDA available", "yes" if cuda else "no")
    supported_gpus = []
    if cuda:
        line("driver", _run_quietly(["nvidia-smi", "--query-gpu=driver_version",
                                     "--format=csv,noheader"]) or "unknown")
        for index in range(torch.cuda.device_count()):
            name = torch.cuda.get_device_name(index)
            major, minor = torch.cuda.get_device_capability(index)
            ok = (major, minor) == (9, 0)
            if ok:
                supported_gpus.append(name)
            line(f"GPU {index}", f"{name}, compute capability {major}.{minor} "
                                 f"({'supported, sm_90a' if ok else 'not supported: needs 9.0'})")
            slug = gpu_slug(name)
            shipped = TUNED_DIR / f"{slug}.json"
            user = cache_root() / "tuned" / f"{slug}.json"
            line("  tuned table", f"{shipped} ({'present' if shipped.exists() else 'absent'})")
            line("  user tuned table", f"{user} ({'present' if user.exists() else 'absent'})")
    else:
        tables = sorted(p.stem for p in TUNED_DIR.glob("*.json"))
        line("shipped tuned tables", ", ".join(tables) or f"none (in {TUNED_DIR})")
    nvcc = shutil.which("nvcc")
    line("nvcc", f"{nvcc} ({_nvcc_version(nvcc)})" if nvcc else "not found on PATH")
    line("TILELANG_CACHE_DIR", os.environ.get("TILELANG_CACHE_DIR", "unset"))
    line("TILEOPS_CACHE_DIR", os.environ.get("TILEOPS_CACHE_DIR", f"unset (using {cache_root()})"))

    print("\nwhat will work:")
    print(f"  compile kernels for sm_90a: {'yes' if nvcc else 'no (needs nvcc on PATH)'}")
    if not cuda:
        run = "no (no CUDA device visible to torch)"
    elif not supported_gpus:
        run = "no (no Hopper GPU: kernels need compute capability 9.0)"
    elif not nvcc:
        run = "only kernels already in the disk cache (nvcc missing, nothing new compiles)"
    else:
        run = f"yes ({', '.join(supported_gpus)})"
    print(f"  run kernels: {run}")
    print("  list / validate / meta-tensor checks: yes")
    return EXIT_OK


def _write_reports(rows: list[dict], out: Any, meta: dict[str, Any]) -> str:
    """JSON, JUnit and Markdown of `rows` under `out`; returns the Markdown table."""
    from .perf import report

    report.write_json(rows, out / "bench.json", meta)
    report.write_junit(rows, out / "bench.junit.xml")
    table = report.markdown_table(rows)
    note = f"partial: {meta['partial']}\n\n" if "partial" in meta else ""
    (out / "bench.md").write_text(f"{meta['gpu']}\n\n{note}{table}\n")
    return table


def _tilelang_version() -> str:
    try:
        import tilelang
    except Exception as e:  # noqa: BLE001 - doctor reports, never crashes
        return f"not importable ({type(e).__name__}: {e})"
    return getattr(tilelang, "__version__", "unknown")


def _nvcc_version(nvcc: str) -> str:
    out = _run_quietly([nvcc, "--version"])
    release = [ln for ln in (out or "").splitlines() if "release" in ln]
    return release[-1].strip() if release else "version unknown"


def _run_quietly(cmd: list[str]) -> str | None:
    """A command's stdout, or None when it is missing, fails or hangs."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


# -- tune -------------------------------------------------------------------------------------
def cmd_tune(args: argparse.Namespace) -> int:
    """Autotunes the op's kernels on its workloads; winners go to the user cache."""
    import torch

    from .ops import OP_CLASSES

    if not torch.cuda.is_available():
        print("error: `tileops tune` times kernels on the GPU; no CUDA device is visible "
              "(run `tileops doctor`)", file=sys.stderr)
        return EXIT_UNAVAILABLE
    cls = OP_CLASSES.get(args.op)
    if cls is None:
        print(f"error: unknown op {args.op!r}; implemented: {sorted(OP_CLASSES)}",
              file=sys.stderr)
        return EXIT_UNAVAILABLE
    from .manifest import select_workloads

    cases = select_workloads(cls.spec.entry["workloads"], args.workload, args.dtype)
    if not cases:
        labels = "\n  ".join(f"{w['label']} {w['dtypes']}" for w in cls.spec.entry["workloads"])
        print(f"error: {args.op} has no workload matching --workload {args.workload} "
              f"--dtype {args.dtype}; workloads:\n  {labels}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    _quiet_tilelang(args.verbose)
    failed = 0
    timed_on: dict[str, str] = {}  # kernel key (with bucket) -> the workload it was timed on
    for w, dtypes in cases:
        for dtype in dtypes:
            try:
                for line in _tune_one(cls, w, dtype, timed_on):
                    print(line)
                    failed += line.startswith("FAILED")
            except Exception as e:  # noqa: BLE001 - report and go on with the next workload
                failed += 1
                print(f"FAILED  {args.op} [{w['label']}] {dtype}: {type(e).__name__}: {e}")
            if args.out:  # a run cut short still leaves what it found
                _copy_tuned_table(args.out)
    return EXIT_FAILED if failed else EXIT_OK


def _copy_tuned_table(out: str) -> None:
    import torch

    from .kernels.base import cache_root, gpu_slug

    table = cache_root() / "tuned" / f"{gpu_slug(torch.cuda.get_device_name())}.json"
    if table.exists():
        os.makedirs(out, exist_ok=True)
        shutil.copy(table, os.path.join(out, table.name))


def _tune_one(cls: Any, workload: dict[str, Any], dtype: str,
              timed_on: dict[str, str]) -> list[str]:
    """Runs the op once with `tune=True` (the Kernel base autotunes on first call). A kernel
    key an earlier workload of this run already tuned is not timed again: its line names
    that workload instead of repeating its timings."""
    import torch

    from .perf.bench import random_inputs

    inputs = random_inputs(cls, workload, dtype)  # the bench's: cu_seqlens kept as given
    op = cls(tune=True, **cls.spec.workload_params(workload))
    op(*inputs)
    torch.cuda.synchronize()
    ns = op.check(inputs)
    lines = []
    device = torch.device("cuda", torch.cuda.current_device())
    for dispatch_key, key, size in op.kernels_for(ns):
        kernel = op.get_kernel(dispatch_key, device, **key)
        bucket = kernel.bucket_of(size)
        config = kernel._by_bucket[bucket][0]
        key_string = kernel.key_string(bucket)
        lines.append(f"tuned   {cls.__name__} [{workload['label']}] {dtype} "
                     f"{key_string} -> {config}")
        if key_string in timed_on:
            lines.append(f"  (timed on [{timed_on[key_string]}], which shares this kernel key "
                         "and bucket; not timed again)")
            continue
        timed_on[key_string] = workload["label"]
        lines += [f"  {ms * 1e3:10.1f} us  {timed}" for ms, timed in kernel.timings]
        lines += [f"FAILED  {cls.__name__} [{workload['label']}] {dtype} {rejected}: results "
                  "disagree with the default config's (left out)" for rejected in kernel.rejected]
    return lines


# -- bench / report ---------------------------------------------------------------------------
def cmd_bench(args: argparse.Namespace) -> int:
    """Times the chosen ops against their baselines; writes JSON, JUnit, Markdown and PNGs."""
    import dataclasses
    import pathlib

    import torch

    from .ops import OP_CLASSES
    from .perf import report
    from .perf.baselines import available_libraries
    from .perf.bench import bench_cases, bench_workload, merge_repeats
    from .perf.profiles import load_profile

    if not torch.cuda.is_available():
        print("error: `tileops bench` needs a CUDA device (run `tileops doctor`)",
              file=sys.stderr)
        return EXIT_UNAVAILABLE
    ops = [cls for name, cls in sorted(OP_CLASSES.items())
           if (not args.op or name in args.op)
           and (not args.family or cls.spec.entry["family"] in args.family)]
    if not ops:
        print(f"error: no implemented op matches --op {args.op} --family {args.family}",
              file=sys.stderr)
        return EXIT_UNAVAILABLE
    _quiet_tilelang(args.verbose)
    cases = list(bench_cases(ops, None if args.tier == "full" else args.tier, args.dtype,
                             args.workload))
    if not cases:
        print(f"error: no workload matches --tier {args.tier} --dtype {args.dtype} "
              f"--workload {args.workload} (`tileops list` shows them)", file=sys.stderr)
        return EXIT_UNAVAILABLE
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name()
    meta = {"gpu": gpu, "torch": torch.__version__, "tilelang": _tilelang_version(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": _git_commit(),
            "libraries": available_libraries()}
    failed: set[tuple] = set()
    runs = []
    for run in range(max(1, args.repeat)):
        run_rows = {}
        runs.append(run_rows)
        for op_cls, workload, dtype in _progress(cases):
            case = (op_cls.__name__, workload["label"], dtype)
            try:
                row = bench_workload(op_cls, workload, dtype, log=print)
                run_rows[case] = dataclasses.asdict(row)
            except Exception as e:  # noqa: BLE001 - report and go on with the next case
                failed.add(case)
                print(f"FAILED  {case[0]} [{case[1]}] {dtype}: {type(e).__name__}: {e}")
            # a run cut short (a device time limit) still leaves every case it finished
            partial = dict(meta, partial=f"run {run + 1} of {args.repeat}: "
                                         f"{len(run_rows)} of {len(cases)} cases")
            # every case so far, merged over the runs that reached it, so a repeat cut short
            # keeps the earlier runs' rows and the spread of the cases it did repeat
            so_far = [merge_repeats([[r[c]] for r in runs if c in r])[0] for c in runs[0]]
            _write_reports(so_far, out, partial)
    good = [c for c in runs[0] if c not in failed]
    rows = merge_repeats([[run[c] for c in good] for run in runs])
    table = _write_reports(rows, out, meta)
    try:
        report.plot_roofline(rows, load_profile(gpu), out / "roofline.png")
        report.plot_speedups(rows, out / "speedup.png")
    except TileOpsError as e:
        print(f"note: {e}")
    print(table)
    status = EXIT_FAILED if failed else EXIT_OK
    if args.repeat > 1:
        over_50 = [r for r in rows if r["latency_us"] > 50]
        worst = max((r["run_to_run_pct"] for r in over_50), default=0.0)
        print(f"run-to-run agreement over {args.repeat} runs, cases over 50 us: worst spread "
              f"{worst:.1f}% ({'within' if worst <= 3 else 'OUTSIDE'} the 3% target)")
    if args.history:
        history = report.History(args.history)
        comparisons = report.compare(rows, history.runs(gpu=gpu))
        history.append({"meta": meta, "rows": rows})
        print(report.comparison_table(comparisons))
        if any(c.status == "regression" for c in comparisons):
            status = EXIT_FAILED
    print(f"reports in {out}/: bench.json, bench.junit.xml, bench.md, roofline.png, speedup.png")
    return status


def cmd_report(args: argparse.Namespace) -> int:
    """Compares a run with the runs before it in the history; exit 1 on a regression."""
    import json

    from .perf import report

    run = json.loads(open(args.run).read())
    gpu = run.get("meta", {}).get("gpu")
    comparisons = report.compare(run["rows"], report.History(args.history).runs(gpu=gpu))
    print(report.comparison_table(comparisons))
    return EXIT_FAILED if any(c.status == "regression" for c in comparisons) else EXIT_OK


def _progress(items: list) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc="bench", unit="case")


def _git_commit() -> str | None:
    """HEAD of the checkout the code runs from, '+dirty' when tracked files differ from it
    (a copied working tree can carry stale git metadata; the mark says so). TILEOPS_COMMIT,
    when set, names it instead: a device that got the tree without its history."""
    if os.environ.get("TILEOPS_COMMIT"):
        return os.environ["TILEOPS_COMMIT"]
    root = os.path.dirname(os.path.abspath(__file__))
    commit = _run_quietly(["git", "-C", root, "rev-parse", "--short", "HEAD"])
    changed = _run_quietly(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"])
    return commit and (commit + "+dirty" if changed else commit)


if __name__ == "__main__":
    sys.exit(main())
