"""The `tileops` command: list, validate, compile, doctor, tune, bench and report.

Each subcommand is a thin shell over the package: the checks live in `validate.py`, the
compile plan in `prebuild.py`, the autotuner in the Kernel base class.

torch and TileLang take seconds to import, so this module imports them only inside the
subcommands that need them: `--help` and `list` read nothing but the manifest. Arguments are
checked against the manifest before anything heavy is imported or any device is asked for,
and a bad argument or file is answered by one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn

from .errors import ManifestError, TileOpsError

# Exit codes: 0 success, 1 the checked thing failed, 2 cannot run here (usage, no nvcc/GPU).
EXIT_OK, EXIT_FAILED, EXIT_UNAVAILABLE = 0, 1, 2


class UsageError(Exception):
    """A bad argument or input file; `main` prints it as one line and exits 2."""


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the `tileops` command; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_UNAVAILABLE
    try:
        return args.handler(args)
    except UsageError as e:
        return _fail(f"{e}", EXIT_UNAVAILABLE)
    except ManifestError as e:
        return _fail(f"{e}", EXIT_FAILED)
    except (TileOpsError, OSError) as e:
        return _fail(f"{e}", EXIT_UNAVAILABLE)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    finally:
        if argv is None and "torch" in sys.modules:
            # The command line (argv None): the process ends next. The interpreter's exit-time
            # garbage collections would walk torch's and TileLang's millions of objects, for
            # a second or more; frozen, they are left to the OS. Never in a caller's process.
            import gc

            gc.freeze()


def _fail(message: str, status: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return status


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (argparse prints the whole usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_UNAVAILABLE, f"{self.prog}: error: {message} "
                                    f"(`{self.prog} --help` lists the options)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _arch(text: str) -> str:
    if not re.fullmatch(r"sm_\d+a?", text):
        raise argparse.ArgumentTypeError(f"expected a CUDA architecture such as sm_90a, "
                                         f"got {text!r}")
    return text


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="tileops", description="TileOPs: spec-driven LLM operators for NVIDIA Hopper.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("list", help="the ops of the manifest, their status and promises")
    p.set_defaults(handler=cmd_list)

    p = sub.add_parser("validate", help="check that the code and the manifest agree")
    p.add_argument("--manifest-only", action="store_true",
                   help="stop after the manifest-level checks (schema, shape rules, "
                        "rooflines, labels, source paths: well under a second, no torch); "
                        "the default goes on to compare the Op classes with the manifest")
    p.set_defaults(handler=cmd_validate)

    p = sub.add_parser("compile", help="compile every kernel the workloads need (needs nvcc, "
                                       "no GPU)")
    p.add_argument("--arch", type=_arch, default="sm_90a",
                   help="target architecture (default: sm_90a)")
    p.add_argument("--op", nargs="+", metavar="NAME", help="only these ops (default: all)")
    p.add_argument("--tier", choices=("smoke", "full"), default="smoke",
                   help="smoke: the workloads CI compiles (default); full: every workload")
    p.add_argument("--jobs", type=_positive_int, default=os.cpu_count() or 1,
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
    p.add_argument("--tier", choices=("smoke", "full", "models"), default="full",
                   help="smoke: the workloads marked smoke; full: every workload (default); "
                        "models: the GEMM, attention, norm, activation and loss shapes of "
                        "public models (perf/models.yaml), bfloat16 unless --dtype says "
                        "otherwise")
    p.add_argument("--dtype", nargs="+", metavar="D", help="only these dtypes")
    p.add_argument("--workload", metavar="TEXT", action="append",
                   help="only workloads whose label contains TEXT (repeatable)")
    p.add_argument("--models", metavar="TEXT", action="append",
                   help="with --tier models: only shapes of models whose name contains TEXT "
                        "(repeatable)")
    p.add_argument("--out", default="bench-results", metavar="DIR",
                   help="report folder (default: %(default)s)")
    p.add_argument("--history", metavar="FILE",
                   help="append the run to this history (JSON lines) and compare with it")
    p.add_argument("--repeat", type=_positive_int, default=1, metavar="N",
                   help="run every case N times; rows report the median and the spread")
    p.add_argument("--baseline", metavar="NAME", action="append",
                   help="time only these baselines (repeatable; default: all of each op's), "
                        "e.g. to leave out a per-expert loop that makes a case take minutes")
    p.add_argument("-v", "--verbose", action="store_true", help="keep TileLang's build log")
    p.set_defaults(handler=cmd_bench)

    p = sub.add_parser("bench-model", help="end-to-end training and generation speed of "
                       "Hugging Face models, patched and not (needs a GPU and transformers)")
    p.add_argument("--model", nargs="+", default=["llama-3.1-8b"], metavar="NAME",
                   help="configs to build (random init): %(default)s; see "
                        "tileops.transformers.bench.MODELS")
    p.add_argument("--variant", nargs="+", metavar="V",
                   default=["eager", "compile", "liger", "tileops", "tileops-compile"],
                   help="eager, compile, liger, tileops, tileops-compile (default: all)")
    p.add_argument("--layers", action="append", default=[], metavar="MODEL=N",
                   help="reduce a model's layer count (default: llama-3.1-8b=8, "
                        "qwen3-30b-a3b=8, others 8)")
    p.add_argument("--batch", type=_positive_int, default=1, help="training sequences per step")
    p.add_argument("--seq", type=_positive_int, default=4096, help="training tokens per sequence")
    p.add_argument("--steps", type=_positive_int, default=3, help="timed training steps")
    p.add_argument("--gen-batch", type=_positive_int, nargs="+", default=[1, 8, 64],
                   metavar="B", help="decode batches (default: 1 8 64)")
    p.add_argument("--prompt", type=_positive_int, default=512, help="prompt tokens")
    p.add_argument("--new-tokens", type=_positive_int, default=64, help="decoded tokens")
    p.add_argument("--no-train", action="store_true", help="skip the training step")
    p.add_argument("--no-generate", action="store_true", help="skip generation")
    p.add_argument("--decode", nargs="+", choices=["generate", "graph"],
                   default=["generate", "graph"],
                   help="decode speed through transformers' generate loop and/or, for the "
                        "compiled variants, the decode step alone (compiled with CUDA "
                        "graphs, step after step, no generate loop) (default: both)")
    p.add_argument("--optimizer", choices=["tileops", "torch"], default="tileops",
                   help="the tileops variants' training optimizer: tileops.optim.AdamW "
                        "(default) or torch's fused AdamW, which the other variants always "
                        "step with (the model's patching alone)")
    p.add_argument("--timeout", type=_positive_int, default=540,
                   help="seconds per (model, variant) subprocess")
    p.add_argument("--out", default="bench-results", metavar="DIR",
                   help="report folder (default: %(default)s)")
    p.add_argument("--compile-only", action="store_true",
                   help="build the TileOPs programs these cases run (their steps recorded on "
                        "the meta device) into the kernel cache; needs nvcc, no GPU")
    p.add_argument("--jobs", type=_positive_int, default=os.cpu_count() or 1,
                   help="with --compile-only: programs compiled in parallel (default: the "
                        "CPU count)")
    p.set_defaults(handler=cmd_bench_model)

    p = sub.add_parser("report", help="compare a bench run with the history; flag regressions")
    p.add_argument("run", metavar="RUN_JSON", help="bench.json written by `tileops bench`")
    p.add_argument("--history", metavar="FILE", required=True,
                   help="the history (JSON lines) that `tileops bench --history` appends to")
    p.set_defaults(handler=cmd_report)
    return parser


def _quiet_tilelang(verbose: bool) -> None:
    import logging

    # TileLang logs two INFO lines per build, which would bury our one-line results.
    if not verbose:
        logging.getLogger("tilelang").setLevel(logging.WARNING)


def _print_table(rows: list[list[str]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def _implemented_ops() -> dict[str, dict[str, Any]]:
    """The manifest's implemented entries (the ops with code), read without torch."""
    from .manifest import load_manifest

    return {n: e for n, e in load_manifest().items() if e["status"] == "implemented"}


def _check_op_names(names: Sequence[str] | None) -> None:
    implemented = _implemented_ops()
    unknown = [n for n in names or () if n not in implemented]
    if unknown:
        what = "unknown op" if len(unknown) == 1 else "unknown ops"
        raise UsageError(f"{what} {', '.join(map(repr, unknown))}; implemented: "
                         f"{', '.join(sorted(implemented))}")


def _filters(**options: Any) -> str:
    """'--dtype fp8 --workload 8k' for the options that were given."""
    given = []
    for name, value in options.items():
        if value:
            values = value if isinstance(value, list | tuple) else [value]
            given.append(f"--{name} {' '.join(map(str, values))}")
    return " ".join(given) or "the defaults"


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
    """Runs the validator; exit 1 when the code and the manifest disagree.

    The manifest level's verdict comes first, in well under a second; the code level then
    loads the op layer (torch and TileLang, seconds) and compares it with the manifest.
    """
    from .manifest import load_manifest
    from .validate import Validation

    start = time.perf_counter()
    run = Validation(load_manifest())  # a manifest that does not parse is one line, from `main`
    n_workloads = sum(len(e["workloads"]) for e in run.manifest.values())
    counts = f"{len(run.manifest)} ops, {n_workloads} workloads"
    result = run.manifest_level()
    for note in result.notes:
        print(f"note: {note}")
    _print_errors(result)
    print(f"manifest level: {counts}: {_verdict(result)} (schema, shape rules, rooflines, "
          f"labels, source paths; {time.perf_counter() - start:.1f} s)", flush=True)
    errors = len(result)
    if args.manifest_only:
        print("code level: not checked (--manifest-only; `tileops validate` compares the Op "
              "classes with the manifest)")
    else:
        start = time.perf_counter()
        result = run.code_level()
        _print_errors(result)
        print(f"code level: {_verdict(result)} (Op signatures and kernel maps, the Ops' own "
              f"checks, dtypes; {time.perf_counter() - start:.1f} s, loading torch and "
              "TileLang included)")
        errors += len(result)
    if errors:
        print(f"{errors} error{'s' if errors != 1 else ''}")
        return EXIT_FAILED
    print(f"{counts}: OK{' (manifest level only)' if args.manifest_only else ''}")
    return EXIT_OK


def _print_errors(errors: Sequence[Exception]) -> None:
    for error in errors:
        print(f"error: {error}")


def _verdict(errors: Sequence[Exception]) -> str:
    return f"{len(errors)} error{'s' if len(errors) != 1 else ''}" if errors else "OK"


# -- compile ----------------------------------------------------------------------------------
def cmd_compile(args: argparse.Namespace) -> int:
    """Compiles every kernel the chosen workloads need, in parallel; no GPU needed."""
    _check_op_names(args.op)
    if shutil.which("nvcc") is None:
        print("error: nvcc not found on PATH; `tileops compile` needs the CUDA toolkit "
              "(a GPU is not needed)", file=sys.stderr)
        return EXIT_UNAVAILABLE
    from .prebuild import build_plan

    _quiet_tilelang(args.verbose)
    plan = build_plan(args.op, args.tier, target={"kind": "cuda", "arch": args.arch})
    return _compile_plan(plan, args.arch, args.jobs)


def _compile_plan(plan: list[Any], arch: str, jobs: int) -> int:
    """Compiles prebuild.BuildItems on `jobs` threads, a line each; the exit code."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    from .kernels.gemm import GemmKernel

    print(f"compiling {len(plan)} programs for {arch} with {jobs} jobs")
    start = time.perf_counter()
    failed = warnings = 0
    with ThreadPoolExecutor(max_workers=jobs) as pool:
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
    """Prints what this machine has and what TileOPs can do on it; always exit 0.

    What needs no import comes first; then the op layer is loaded (torch and TileLang, the
    seconds every new process pays) and tried on meta tensors, so "meta-tensor shape
    checks" and "run kernels" report what happened, not what should happen.
    """
    import importlib.metadata
    import platform

    from .kernels.base import TUNED_DIR, cache_root

    def line(what: str, value: object) -> None:
        print(f"{what + ':':<22}{value}", flush=True)

    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    line("python", f"{platform.python_version()} ({sys.executable})")
    line("tileops", f"{version('tileops')} ({os.path.dirname(os.path.abspath(__file__))})")
    nvcc = shutil.which("nvcc")
    line("nvcc", f"{nvcc} ({_nvcc_version(nvcc)})" if nvcc else "not found on PATH")
    driver = _run_quietly(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    line("NVIDIA driver", driver.splitlines()[0] if driver else "not found (no nvidia-smi)")
    line("TILELANG_CACHE_DIR", os.environ.get("TILELANG_CACHE_DIR", "unset"))
    line("TILEOPS_CACHE_DIR", os.environ.get("TILEOPS_CACHE_DIR", f"unset (using {cache_root()})"))
    tables = sorted(p.stem for p in TUNED_DIR.glob("*.json"))
    line("shipped tuned tables", ", ".join(tables) or f"none (in {TUNED_DIR})")

    # torch's line as soon as torch is in, TileLang's after the op layer loads: the seconds
    # of imports show as progress rather than as a pause.
    start = time.perf_counter()
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - doctor reports, never crashes
        torch = None
        error = e
    else:
        line("torch", f"{torch.__version__} (CUDA build: {torch.version.cuda or 'none'})")
        try:
            from . import ops  # noqa: F401 - loads TileLang and registers torch.ops.tileops
        except Exception as e:  # noqa: BLE001 - doctor reports, never crashes
            error = e
        else:
            error = None
    if error is not None:
        if torch is None:
            line("torch", version("torch"))
        line("tilelang", version("tilelang"))
        line("op layer", f"does not load: {type(error).__name__}: {error}")
        why = f"no (the op layer does not load: {type(error).__name__})"
        _doctor_summary(nvcc, validate=f"`--manifest-only` only (the op layer does not load: "
                                       f"{type(error).__name__})", meta=why, run=why)
        return EXIT_OK
    load_s = time.perf_counter() - start
    line("tilelang", version("tilelang"))
    line("op layer load", f"{load_s:.1f} s (torch and TileLang; every new process pays it)")
    cuda = torch.cuda.is_available()
    line("CUDA available", "yes" if cuda else "no")
    supported_gpus = []
    for index in range(torch.cuda.device_count() if cuda else 0):
        name = torch.cuda.get_device_name(index)
        major, minor = torch.cuda.get_device_capability(index)
        ok = (major, minor) == (9, 0)
        if ok:
            supported_gpus.append(name)
        line(f"GPU {index}", f"{name}, compute capability {major}.{minor} "
                             f"({'supported, sm_90a' if ok else 'not supported: needs 9.0'})")
        _doctor_tuned_tables(name)
    if not cuda:
        why = ("a CPU-only build of torch" if not torch.version.cuda
               else "no CUDA device visible to torch")
        run = f"no ({why})"
    elif not supported_gpus:
        run = "no (no Hopper GPU: kernels need compute capability 9.0)"
    elif not nvcc:
        run = "only kernels already in the disk cache (nvcc missing, nothing new compiles)"
    else:
        run = f"yes ({', '.join(supported_gpus)})"
    _doctor_summary(nvcc, validate="yes", meta=_try_meta_call(), run=run)
    return EXIT_OK


def _doctor_tuned_tables(gpu_name: str) -> None:
    from .kernels.base import TUNED_DIR, cache_root, gpu_slug

    slug = gpu_slug(gpu_name)
    shipped = TUNED_DIR / f"{slug}.json"
    user = cache_root() / "tuned" / f"{slug}.json"
    print(f"{'  tuned table:':<22}{shipped} ({'present' if shipped.exists() else 'absent'})")
    print(f"{'  user tuned table:':<22}{user} ({'present' if user.exists() else 'absent'})")


def _try_meta_call() -> str:
    """'yes' when a functional op returns a meta output of the right shape here."""
    try:
        import torch

        from .ops import gemm

        a = torch.empty(16, 64, dtype=torch.bfloat16, device="meta")
        b = torch.empty(32, 64, dtype=torch.bfloat16, device="meta")
        out = gemm(a, b)
        if out.shape != (16, 32) or out.device.type != "meta":
            return f"no (tileops.gemm returned {tuple(out.shape)} on {out.device})"
    except Exception as e:  # noqa: BLE001 - doctor reports, never crashes
        return f"no ({type(e).__name__}: {e})"
    return "yes (tileops.gemm on meta tensors ran)"


def _doctor_summary(nvcc: str | None, validate: str, meta: str, run: str) -> None:
    print("\nwhat will work:")
    print("  list: yes")
    print(f"  validate: {validate}")
    print(f"  meta-tensor shape checks: {meta}")
    print(f"  compile kernels for sm_90a: {'yes' if nvcc else 'no (needs nvcc on PATH)'}")
    print(f"  run kernels: {run}")


def _write_reports(rows: list[dict], out: Any, meta: dict[str, Any]) -> str:
    """JSON, JUnit and Markdown of `rows` under `out`; returns the Markdown table."""
    from .perf import report

    report.write_json(rows, out / "bench.json", meta)
    report.write_junit(rows, out / "bench.junit.xml")
    table = report.markdown_table(rows)
    if meta.get("tier") == "models":  # per op: worst and geomean speed-up, refused shapes
        table += "\n" + report.speedup_summary_markdown(rows, meta.get("refused", []))
    note = f"partial: {meta['partial']}\n\n" if "partial" in meta else ""
    (out / "bench.md").write_text(f"{meta['gpu']}\n\n{note}{table}\n")
    return table


def _tilelang_version() -> str:
    try:
        import tilelang
    except Exception as e:  # noqa: BLE001 - a bench run reports it, never crashes on it
        return f"not importable ({type(e).__name__}: {e})"
    return getattr(tilelang, "__version__", "unknown")


def _nvcc_version(nvcc: str) -> str:
    out = _run_quietly([nvcc, "--version"])
    release = [ln for ln in (out or "").splitlines() if "release" in ln]
    return release[-1].strip() if release else "version unknown"


def _run_quietly(cmd: list[str]) -> str | None:
    """A command's stdout, or None when it is missing, fails or hangs."""
    import subprocess

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
    from .manifest import select_workloads

    _check_op_names([args.op])
    workloads = _implemented_ops()[args.op]["workloads"]
    cases = select_workloads(workloads, args.workload, args.dtype)
    if not cases:
        labels = "; ".join(f"{w['label']} ({', '.join(w['dtypes'])})" for w in workloads)
        raise UsageError(f"{args.op} has no workload matching "
                         f"{_filters(workload=args.workload, dtype=args.dtype)}; "
                         f"its workloads: {labels}")
    import torch

    if not torch.cuda.is_available():
        print("error: `tileops tune` times kernels on the GPU; no CUDA device is visible "
              "(run `tileops doctor`)", file=sys.stderr)
        return EXIT_UNAVAILABLE
    from .ops import OP_CLASSES

    cls = OP_CLASSES[args.op]
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
def cmd_bench_model(args: argparse.Namespace) -> int:
    """Random-init models of real configs: training step and generation, per variant."""
    import importlib.util
    import pathlib

    from .transformers import bench

    unknown = [m for m in args.model if m not in bench.MODELS]
    if unknown:
        raise UsageError(f"unknown model {', '.join(unknown)}; known: "
                         f"{', '.join(bench.MODELS)}")
    bad = [v for v in args.variant if v not in bench.VARIANTS]
    if bad:
        raise UsageError(f"unknown variant {', '.join(bad)}; known: {', '.join(bench.VARIANTS)}")
    layers = {name: 8 for name in bench.MODELS}
    for item in args.layers:
        name, _, count = item.partition("=")
        if name not in bench.MODELS or not count.isdigit() or int(count) < 1:
            raise UsageError(f"--layers expects MODEL=N with a known model, got {item!r}")
        layers[name] = int(count)
    if importlib.util.find_spec("transformers") is None:
        print("error: `tileops bench-model` needs transformers (pip install 'tileops[hf]')",
              file=sys.stderr)
        return EXIT_UNAVAILABLE
    if args.compile_only:
        if shutil.which("nvcc") is None:
            print("error: `tileops bench-model --compile-only` needs nvcc (not a GPU)",
                  file=sys.stderr)
            return EXIT_UNAVAILABLE
        plan = bench.recorded_programs(args.model, layers, args.batch, args.seq,
                                       tuple(args.gen_batch), args.prompt, args.new_tokens,
                                       not args.no_train, not args.no_generate)
        _quiet_tilelang(False)  # (after the import of TileLang that sets its level)
        return _compile_plan(plan, "sm_90a", args.jobs)
    import torch

    if not torch.cuda.is_available():
        print("error: `tileops bench-model` needs a CUDA device (run `tileops doctor`)",
              file=sys.stderr)
        return EXIT_UNAVAILABLE
    variants = list(args.variant)
    if "liger" in variants and importlib.util.find_spec("liger_kernel") is None:
        print("note: liger_kernel is not importable; its rows are skipped", file=sys.stderr)
        variants.remove("liger")
    rows = bench.run(args.model, variants, layers, args.batch, args.seq,
                     tuple(args.gen_batch), args.prompt, args.new_tokens, args.steps,
                     not args.no_train, not args.no_generate, pathlib.Path(args.out),
                     args.timeout, tuple(args.decode), args.optimizer)
    print(f"wrote {args.out}/bench-model.md")
    return 1 if any("error" in r for r in rows) else 0


def _chosen_baselines(names: list[str], wanted: list[str] | None) -> dict | None:
    """Each op's baselines among `wanted` (None: all of them); a name no selected op has is
    a usage error naming those it could have been."""
    if not wanted:
        return None
    from .perf.baselines import baselines_for

    tables = {name: baselines_for(name) for name in names}
    known = sorted({b for table in tables.values() for b in table})
    unknown = sorted(set(wanted) - set(known))
    if unknown:
        raise UsageError(f"--baseline {', '.join(unknown)}: not a baseline of the selected "
                         f"ops; theirs: {', '.join(known) or 'none'}")
    return {name: {b: fn for b, fn in table.items() if b in wanted}
            for name, table in tables.items()}


def cmd_bench(args: argparse.Namespace) -> int:
    """Times the chosen ops against their baselines; writes JSON, JUnit, Markdown and PNGs."""
    import dataclasses
    import pathlib

    from .manifest import select_workloads

    _check_op_names(args.op)
    names = [name for name, entry in sorted(_implemented_ops().items())
             if (not args.op or name in args.op)
             and (not args.family or entry["family"] in args.family)]
    if not names:
        families = sorted({e["family"] for e in _implemented_ops().values()})
        raise UsageError(f"no implemented op matches {_filters(op=args.op, family=args.family)}"
                         f"; families: {', '.join(families)}")
    tier = None if args.tier == "full" else args.tier
    names = _check_models_tier(args, names)
    if not any(select_workloads(_tier_workloads(n, tier, args.models), args.workload,
                                args.dtype) for n in names):
        dtypes = sorted({d for n in names for w in _tier_workloads(n, tier, args.models)
                         for d in w["dtypes"]})
        which = ", ".join(names) if args.op or args.family else "any op"
        raise UsageError(f"no workload of {which} matches "
                         f"{_filters(tier=args.tier, dtype=args.dtype, workload=args.workload)}"
                         f" (their dtypes: {', '.join(dtypes)})")
    chosen = _chosen_baselines(names, args.baseline)
    import torch

    if not torch.cuda.is_available():
        print("error: `tileops bench` needs a CUDA device (run `tileops doctor`)",
              file=sys.stderr)
        return EXIT_UNAVAILABLE
    from .ops import OP_CLASSES
    from .perf import report
    from .perf.baselines import available_libraries
    from .perf.bench import bench_cases, bench_workload, merge_repeats
    from .perf.profiles import load_profile

    _quiet_tilelang(args.verbose)
    cases = list(bench_cases([OP_CLASSES[n] for n in names], tier, args.dtype, args.workload,
                             args.models))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name()
    meta = {"gpu": gpu, "torch": torch.__version__, "tilelang": _tilelang_version(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": _git_commit(),
            "libraries": available_libraries()}
    if tier == "models":
        meta.update(tier="models", refused=_refused_model_shapes(names, args))
        print(f"{len(cases)} cases; {len(meta['refused'])} model workloads refused by the "
              "current ops (not timed; listed at the end of bench.md)")
    failed: set[tuple] = set()
    runs = []
    for run in range(max(1, args.repeat)):
        run_rows = {}
        runs.append(run_rows)
        for op_cls, workload, dtype in _progress(cases):
            case = (op_cls.__name__, workload["label"], dtype)
            try:
                row = bench_workload(op_cls, workload, dtype, log=print,
                                     baselines=chosen and chosen[op_cls.__name__])
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


def _tier_workloads(name: str, tier: str | None,
                    models: list[str] | None) -> list[dict[str, Any]]:
    """The workloads a bench tier offers for op `name` (reads YAML only, no torch)."""
    from .manifest import load_workloads

    if tier != "models":
        return load_workloads(name, tier)
    from .perf import models as model_shapes

    if name not in model_shapes.MODEL_OPS:
        return []
    return model_shapes.model_workloads(name, models)


def _check_models_tier(args: argparse.Namespace, names: list[str]) -> list[str]:
    """The ops a run covers: for --tier models, those of `names` with model shapes; a
    --models filter that cannot apply is a usage error."""
    from .perf import models as model_shapes

    if args.models and args.tier != "models":
        raise UsageError("--models selects model shapes: it needs --tier models")
    if args.tier != "models":
        return names
    if args.models and not model_shapes.select_models(args.models):
        raise UsageError(f"no model matches {_filters(models=args.models)}; models: "
                         f"{', '.join(model_shapes.load_models())}")
    covered = [n for n in names if n in model_shapes.MODEL_OPS]
    if not covered:
        raise UsageError(f"the models tier covers {', '.join(model_shapes.MODEL_OPS)}; "
                         f"none matches {_filters(op=args.op, family=args.family)}")
    return covered


def _refused_model_shapes(names: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    """The model workloads (of the run's ops, models and --workload filter) that the ops
    refuse: what the report lists instead of timing them."""
    from .manifest import select_workloads
    from .ops import OP_CLASSES
    from .perf import models as model_shapes

    refused = []
    for name in names:
        chosen = [w for w, _ in select_workloads(model_shapes.model_workloads(name, args.models),
                                                 args.workload)]
        refused += model_shapes.split_refused(OP_CLASSES[name], chosen)[1]
    return refused


def cmd_report(args: argparse.Namespace) -> int:
    """Compares a run with the runs before it in the history; exit 1 on a regression."""
    from .perf import report

    run = _read_run(args.run)
    if not os.path.isfile(args.history):
        raise UsageError(f"--history {args.history}: no such file (`tileops bench --history "
                         "FILE` creates it)")
    gpu = run["meta"].get("gpu")
    history = report.History(args.history).runs(gpu=gpu)
    for n, past in enumerate(history, 1):
        for i, row in enumerate(past["rows"], 1):
            problem = _row_problem(row)
            if problem:
                raise UsageError(f"{args.history}: run {n}, row {i}: {problem}")
    comparisons = report.compare(run["rows"], history)
    print(report.comparison_table(comparisons))
    return EXIT_FAILED if any(c.status == "regression" for c in comparisons) else EXIT_OK


def _read_run(path: str) -> dict[str, Any]:
    """The bench run at `path`, or a UsageError saying in one line why it is not one."""
    import json

    from .perf import report

    try:
        run = report.read_json(path)
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"{path}: not JSON ({e.msg} at line {e.lineno}, column {e.colno}); "
                         "expected the bench.json that `tileops bench` writes") from None
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not a text file; expected the bench.json that "
                         "`tileops bench` writes") from None
    except OSError as e:
        raise UsageError(f"{path}: cannot read it ({e.strerror})") from None
    except TileOpsError as e:
        raise UsageError(f"{e}; expected the bench.json that `tileops bench` writes") from None
    if not isinstance(run.get("meta"), dict):
        raise UsageError(f"{path}: 'meta' is not an object")
    for i, row in enumerate(run["rows"], 1):
        problem = _row_problem(row)
        if problem:
            raise UsageError(f"{path}: row {i}: {problem}")
    return run


def _row_problem(row: Any) -> str | None:
    """What makes `row` unusable for a comparison, or None."""
    if not isinstance(row, dict):
        return f"expected an object, got {type(row).__name__}"
    missing = [k for k in ("op", "label", "dtype", "latency_us") if k not in row]
    if missing:
        return f"no {', '.join(map(repr, missing))}"
    latency = row["latency_us"]
    if not isinstance(latency, int | float) or isinstance(latency, bool):
        return f"expected a number for 'latency_us', got {latency!r}"
    return None


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
