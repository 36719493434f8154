"""Kernel base: one TileLang program family, its configs, and the one compile helper.

A Kernel instance is specialized on everything that changes the program (dtypes, static
sizes, flags: `self.key`). Sizes that vary per call (token counts) are symbolic in the
program; they only pick a *bucket*, and each bucket has one config, so a stream of new
sizes compiles at most one program per bucket.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import threading
from collections.abc import Callable
from typing import Any, ClassVar

from ..errors import TileOpsUnsupportedError
from .launch_shared_memory import check_launch_shared_memory

SM90A = {"kind": "cuda", "arch": "sm_90a"}
# `Kernel.bind`'s stand-in where it finds no direct call (`bind(size) or UNBOUND`): a
# planned launch whose `current()` is never true calls the kernel as usual
UNBOUND: tuple[Any, tuple, Any] = (None, (), lambda: False)
TUNED_DIR = pathlib.Path(__file__).parent / "tuned"


def cache_root() -> pathlib.Path:
    """Root of TileOPs' on-disk caches (compiled kernels, tuning results)."""
    return pathlib.Path(os.environ.get("TILEOPS_CACHE_DIR",
                                       pathlib.Path.home() / ".cache" / "tileops"))


# Compiled kernels persist under our cache root unless the user pointed TileLang elsewhere.
# TileLang reads this when it first compiles, so it must be set before that.
os.environ.setdefault("TILELANG_CACHE_DIR", str(cache_root() / "tilelang"))

_ARCH_BY_CAPABILITY = {(9, 0): "sm_90a"}
_target_cache: dict[int, dict[str, str]] = {}


def target_for_device(device: Any, op: str = "tileops") -> dict[str, str]:
    """The TileLang target for a CUDA device; only Hopper (sm_90) is supported."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    target = _target_cache.get(index)
    if target is None:
        cap = torch.cuda.get_device_capability(index)
        if cap not in _ARCH_BY_CAPABILITY:
            raise TileOpsUnsupportedError(
                f"{op}: device cuda:{index} has compute capability {cap[0]}.{cap[1]}; "
                f"TileOPs kernels need Hopper (9.0, sm_90a)")
        target = _target_cache[index] = {"kind": "cuda", "arch": _ARCH_BY_CAPABILITY[cap]}
    return target


_sm_counts: dict[Any, int] = {}


def sm_count(device: Any, default: int = 132) -> int:
    """The device's SM count (132 on an H200), read once per device; `default` off CUDA."""
    count = _sm_counts.get(device)
    if count is None:
        import torch

        count = _sm_counts[device] = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda" else default)
    return count


def gpu_slug(device_name: str) -> str:
    """'NVIDIA H200' -> 'h200': the name of a GPU's tuned table."""
    return device_name.lower().replace("nvidia", "").strip().split()[0].replace("-", "_")


# TileLang builds a prim_func by parsing and recompiling the kernel's Python source; CPython's
# AST conversion keeps a per-interpreter recursion counter, so two threads building at once
# fail with "AST constructor recursion depth mismatch". Building is milliseconds; lowering and
# nvcc (the seconds) stay parallel.
_PROGRAM_BUILD_LOCK = threading.RLock()


def default_compile_jobs() -> int:
    """Parallel compiles for `compile_many`: the machine's cores, but under pytest-xdist,
    where every worker may compile a config space at once, 4 x cores / workers (a worker
    died "not properly terminated" with 16 workers each compiling 37 configs on 16 threads
    on the H200 machine's 16 cores and 128 GB: 256 concurrent lowerings and nvcc runs)."""
    cores = os.cpu_count() or 1
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    return max(1, min(cores, 4 * cores // workers))


class TunedTable:
    """Winning configs per (kernel, key, bucket): the shipped table overlaid by the user's."""

    _lock = threading.Lock()

    def __init__(self, gpu: str):
        self.gpu = gpu
        self.shipped_path = TUNED_DIR / f"{gpu}.json"
        self.user_path = cache_root() / "tuned" / f"{gpu}.json"
        self.entries: dict[str, dict[str, Any]] = {}
        for path in (self.shipped_path, self.user_path):
            if path.exists():
                self.entries.update(json.loads(path.read_text()))

    def get(self, entry_key: str) -> dict[str, Any] | None:
        return self.entries.get(entry_key)

    def put(self, entry_key: str, config: dict[str, Any]) -> None:
        with self._lock:
            self.entries[entry_key] = config
            user = json.loads(self.user_path.read_text()) if self.user_path.exists() else {}
            user[entry_key] = config
            self.user_path.parent.mkdir(parents=True, exist_ok=True)
            self.user_path.write_text(json.dumps(user, indent=1, sort_keys=True))


_tables: dict[str, TunedTable] = {}


def tuned_table(gpu: str) -> TunedTable:
    if gpu not in _tables:
        _tables[gpu] = TunedTable(gpu)
    return _tables[gpu]


def launchers(compiled: tuple) -> tuple:
    """The TVM-FFI executables behind compiled kernels, called with every buffer in order.

    They run the same host-side argument checks as the JITKernel wrapper, minus a Python
    layer that costs several microseconds per launch.
    """
    return tuple(k.adapter._get_executable() if hasattr(k.adapter, "_get_executable") else k
                 for k in compiled)


def agrees(results: list, reference: list, tol: float = 2e-2) -> bool:
    """Whether a candidate config's tensors match the default config's: the same non-finite
    entries, and floats within `tol` of the reference's largest magnitude (configs differ in
    summation order and split-K, never by more); integers exactly."""
    import torch

    for got, want in zip(results, reference, strict=True):
        if not got.is_floating_point():
            if not torch.equal(got, want):
                return False
            continue
        got, want = got.float(), want.float()
        finite = torch.isfinite(want)
        if not torch.equal(finite, torch.isfinite(got)) or not torch.equal(
                got[~finite].nan_to_num(), want[~finite].nan_to_num()):  # NaN == NaN here
            return False
        if finite.any():
            scale = want[finite].abs().max().item()
            if (got[finite] - want[finite]).abs().max().item() > tol * scale + tol:
                return False
    return True


class Kernel:
    """Base of every TileLang kernel family.

    Subclasses set `name` and `Config` (a frozen dataclass of tunables) and implement
    `program(config, bucket)` (a pure builder returning one prim_func or a tuple of them),
    `run(config, compiled, *tensors)` (the launch), `heuristic_config(bucket, arch)`,
    `config_space(bucket)` and `bucket_of(size)` (runtime size -> bucket).
    """

    name: ClassVar[str]
    Config: ClassVar[type]
    # positions among `run`'s tensors (after config and compiled) of work buffers whose
    # contents differ between configs (a schedule, split partials): the tuner compares
    # the rest
    workspace_args: ClassVar[frozenset[int]] = frozenset()
    compile_count: ClassVar[int] = 0  # programs compiled in this process, all kernels
    _compiled: ClassVar[dict[tuple, Any]] = {}

    def __init__(self, target: dict[str, str] = SM90A, gpu: str | None = None,
                 tune: bool = False, **key: Any):
        self.key = key
        self.target = target
        self.gpu = gpu
        self.tune = tune
        self._by_bucket: dict[Any, tuple[Any, tuple]] = {}
        self.rejected: list[Any] = []  # configs the last autotune dropped for wrong results
        self.timings: list[tuple[float, Any]] = []  # (ms, config) of the last autotune, best first

    # -- to implement ---------------------------------------------------------------------
    def program(self, config: Any, bucket: Any) -> Any:
        raise NotImplementedError

    def run(self, config: Any, compiled: tuple, *tensors: Any) -> None:
        raise NotImplementedError

    def heuristic_config(self, bucket: Any, arch: str) -> Any:
        raise NotImplementedError

    def config_space(self, bucket: Any) -> list[Any]:
        return [self.heuristic_config(bucket, self.target["arch"])]

    def bucket_of(self, size: int) -> Any:
        return "all"

    def direct_args(self, config: Any) -> tuple | None:
        """The arguments `run(config, ...)` adds after the tensors where it is one call of
        the first executable with the tensors that are not None, then these (a planned
        launch may then make that call itself: `bind`); None where run does more."""
        return None

    def pass_configs(self, config: Any, program_index: int) -> dict[str, Any]:
        """TileLang pass configs for program `program_index` of `program()` (none by
        default, which keeps TileLang's cache keys of every other kernel as they were)."""
        return {}

    # -- shared machinery -----------------------------------------------------------------
    def key_string(self, bucket: Any) -> str:
        parts = [f"{k}={v}" for k, v in sorted(self.key.items())]
        return f"{self.name}|{','.join(parts)}|{bucket}"

    def config_for(self, bucket: Any) -> Any:
        """Tuned winner for this GPU if known, else the rule-based default."""
        if self.gpu is not None:
            found = tuned_table(self.gpu).get(self.key_string(bucket))
            if found is not None:
                return self.Config(**found)
        return self.heuristic_config(bucket, self.target["arch"])

    def compile(self, config: Any, bucket: Any) -> tuple:
        """The one compile helper: memoized in memory, persisted by TileLang's disk cache."""
        import tilelang

        memo_key = (type(self).__name__, tuple(sorted(self.key.items())), bucket, config,
                    tuple(sorted(self.target.items())))
        compiled = Kernel._compiled.get(memo_key)
        if compiled is None:
            with _PROGRAM_BUILD_LOCK:
                programs = self.program(config, bucket)
            if not isinstance(programs, tuple):
                programs = (programs,)
            compiled = tuple(tilelang.compile(p, target=self.target,
                                              pass_configs=self.pass_configs(config, i) or None)
                             for i, p in enumerate(programs))
            for program in compiled:
                check_launch_shared_memory(self.name, config, program)
            Kernel._compiled[memo_key] = compiled
            Kernel.compile_count += len(compiled)
        return compiled

    def compile_many(self, configs: list[Any], bucket: Any, jobs: int | None = None) -> None:
        """Compiles configs in parallel (nvcc runs outside the GIL); failures are left out."""
        from concurrent.futures import ThreadPoolExecutor

        def build(config: Any) -> None:
            try:
                self.compile(config, bucket)
            except Exception:  # noqa: BLE001 - an invalid config is skipped by the caller
                pass

        with ThreadPoolExecutor(jobs or default_compile_jobs()) as pool:
            list(pool.map(build, configs))

    def results_of(self, config: Any, bucket: Any, tensors: tuple) -> list:
        """Every tensor argument but the work buffers after one run of `config` on copies of
        `tensors`."""
        copies = [t.clone() if hasattr(t, "clone") else t for t in tensors]
        self.run(config, launchers(self.compile(config, bucket)), *copies)
        return [t for i, t in enumerate(copies)
                if hasattr(t, "clone") and i not in self.workspace_args]

    def use(self, config: Any, bucket: Any) -> tuple[Any, tuple]:
        """Pins `config` for `bucket` (the default on first use, the tuner's winner, a test's
        pick): compiled now, used by every later call that falls in the bucket."""
        found = self._by_bucket[bucket] = (config, launchers(self.compile(config, bucket)))
        return found

    def select(self, size: int) -> tuple[Any, tuple]:
        """(config, launchers) for a runtime size; compiles on first use of a bucket."""
        bucket = self.bucket_of(size)
        found = self._by_bucket.get(bucket)
        if found is None:
            found = self.use(self.config_for(bucket), bucket)
        return found

    def bind(self, size: int) -> tuple[Any, tuple, Callable[[], bool]] | None:
        """A planned launch's fast path (an op's `plan`): (call, trailing arguments, current)
        where `size`'s bucket runs as one call (`direct_call`); `current()` says whether the
        bucket still holds that pick (pin_config, the tuner or a test may pin another: the
        plan then calls the kernel as usual). None for a tuning kernel (its first call in a
        bucket times the space) and where run does more."""
        if self.tune:
            return None
        found = self.select(size)
        direct = self.direct_call(found[0], found[1], size)
        if direct is None:
            return None
        bucket, pinned = self.bucket_of(size), self._by_bucket
        return direct[0], direct[1], lambda: pinned.get(bucket) is found

    def direct_call(self, config: Any, compiled: tuple,
                    size: int) -> tuple[Callable[..., Any], tuple] | None:
        """(call, trailing arguments) doing what `run(config, compiled, ...)` does for calls
        of `size`: by default the first executable where `direct_args` gives its trailing
        arguments, None where run does more."""
        extra = self.direct_args(config)
        return None if extra is None else (compiled[0], extra)

    def __call__(self, size: int, *tensors: Any) -> None:
        found = self._by_bucket.get(self.bucket_of(size))  # select()'s hit, inlined
        if found is None:
            if self.tune:
                self.autotune(size, *tensors)
            found = self.select(size)
        self.run(found[0], found[1], *tensors)

    def autotune(self, size: int, *tensors: Any) -> Any:
        """Times the config space on these tensors and keeps the fastest.

        Every candidate's results must first agree with the rule-based default's on the same
        inputs (`agrees`), so a config that races or indexes wrong can never win on speed;
        those rejected are kept in `rejected`. The winner is stored in the user's tuned
        table for this GPU and used from then on.
        """
        from ..perf.timing import time_cuda

        bucket = self.bucket_of(size)
        default = self.heuristic_config(bucket, self.target["arch"])
        candidates = self.config_space(bucket)
        self.compile_many(candidates, bucket)
        reference = self.results_of(default, bucket, tensors)
        results, self.rejected = [], []
        for config in candidates:
            try:
                compiled = self.compile(config, bucket)
                if config != default and not agrees(
                        self.results_of(config, bucket, tensors), reference):
                    self.rejected.append(config)
                    continue
                ms = time_cuda(lambda c=config, k=compiled: self.run(c, k, *tensors))
            except Exception:  # noqa: BLE001 - a config that fails to build or launch loses
                continue
            results.append((ms, config))
        if not results:
            raise TileOpsUnsupportedError(
                f"{self.name}: no config for {self.key} built and ran on {self.gpu}")
        self.timings = sorted(results, key=lambda r: r[0])
        best = self.timings[0][1]
        if self.gpu is not None:
            tuned_table(self.gpu).put(self.key_string(bucket), dataclasses.asdict(best))
        self.use(best, bucket)
        return best
