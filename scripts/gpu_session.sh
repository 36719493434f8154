#!/usr/bin/env bash
# One device call: GPU tests, benchmarks and the host-overhead probe; logs and reports under
# $OUT (at most 8 files come back: bench/ holds 5), a short table last.
#   bash .gpu/remote.sh bash scripts/gpu_session.sh [tests|all]
#   bash .gpu/remote.sh bash scripts/gpu_session.sh bench [--family F ...] [--op OP] [--dtype D] [--workload TEXT] [--tier smoke]
#   bash .gpu/remote.sh bash scripts/gpu_session.sh bench --tier models [--models NAME]... [--op OP] [--workload TEXT]
#     (public models' GEMM, attention, norm, activation and loss shapes; bench.md ends with
#     the per-op summary and the shapes the ops refuse)
#   bash .gpu/remote.sh bash scripts/gpu_session.sh tune OP [--workload TEXT ...] [--dtype D]
#   bash .gpu/remote.sh bash scripts/gpu_session.sh bench-model [--model NAME] [--variant V ...] [tileops bench-model options]
#   bash .gpu/remote.sh bash scripts/gpu_session.sh calibrate
#   bash .gpu/remote.sh bash scripts/gpu_session.sh breakdown OP [--workload TEXT ...] [--dtype D]
#   bash .gpu/remote.sh bash scripts/gpu_session.sh compare OP --workload TEXT [--config JSON ...]
#   bash .gpu/remote.sh bash scripts/gpu_session.sh ncu KERNEL_REGEX OP --workload TEXT [--dtype D] [--config JSON]
# TEST_PATHS narrows the tests (default: tests), TEST_K selects by pytest -k expression (it may
# hold spaces: "edge or tile_store"); TEST_SECONDS caps each test run (the counts still
# print; a cut-off run exits 124) and BENCH_SECONDS a bench sweep; steps chain
# with && in one device call. The device's git metadata is stale: pass the local HEAD as
# TILEOPS_COMMIT=<hash> so the bench JSON names it.
# A new checkout first runs `bash scripts/stage_device.sh` (the kit, .whl, the excludes).
# Device time goes to timing, not compiling, when the kernels are built here first:
# `TILEOPS_CACHE_DIR=.tilecache python3 scripts/compare_configs.py ... --compile-only` or
# `TILEOPS_CACHE_DIR=.tilecache python3 -m tileops.cli compile --op ... --tier full`, then
# carry [".gpu", ".whl", ".tilecache"] (this script reads $PWD/.tilecache; leave out
# .tilecache/tilelang/*/cuda-binaries: each kernel's executable.so holds its cubin).
# Wheels the device image lacks (jsonschema and its deps) travel in .whl/ when present; make
# it with: mkdir .whl && cd .whl && pip download --no-deps jsonschema jsonschema-specifications
#   referencing attrs && pip download --no-deps --python-version 3.12 --only-binary=:all:
#   --platform manylinux2014_x86_64 rpds-py   (the device runs Python 3.12)
set -uo pipefail
what=${1:-all}; shift || true
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/wheels .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/wheels"
fi
export TILEOPS_CACHE_DIR=${TILEOPS_CACHE_DIR:-$PWD/.tilecache}
tileops() { python3 -m tileops.cli "$@"; }
export PYTHONUNBUFFERED=1  # a step cut short by `timeout` still shows what it printed
python3 -c "import torch; p=torch.cuda.get_device_properties(0); print(p.name, p.multi_processor_count, 'SMs', torch.__version__)"
rc=0
if [ "$what" = tune ]; then
  tileops tune "$@" --out "$OUT" 2>&1 | tee -a "$OUT/tune.log" | grep -E "^(tuned|FAILED|  )"
  exit "${PIPESTATUS[0]}"
fi
if [ "$what" = breakdown ]; then
  python3 scripts/kernel_breakdown.py "$@" 2>&1 | tee "$OUT/breakdown.log" | grep -v INFO
  exit "${PIPESTATUS[0]}"
fi
if [ "$what" = compare ]; then
  python3 scripts/compare_configs.py "$@" 2>&1 | tee -a "$OUT/compare.log" | grep -v INFO
  exit "${PIPESTATUS[0]}"
fi
if [ "$what" = ncu ]; then
  # Hardware counters (every section, per-instruction stall samples) of one launch of the
  # kernels whose name matches $1, in the op's second call; ncu replays it once per pass.
  kernel=$1; shift
  ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
  "$ncu_bin" --clock-control none --kernel-name "regex:$kernel" --launch-skip 1 \
    --launch-count 1 --set full --import-source yes -f -o "$OUT/profile" \
    python3 scripts/profile_op.py "$@" > "$OUT/ncu.log" 2>&1
  rc=$?
  "$ncu_bin" --import "$OUT/profile.ncu-rep" --page details > "$OUT/ncu-details.txt" 2>&1
  "$ncu_bin" --import "$OUT/profile.ncu-rep" --page source --csv --print-source sass \
    > "$OUT/ncu-sass.csv" 2>&1
  tail -n 3 "$OUT/ncu.log"
  grep -E "Duration|Throughput|Issue Slots Busy|No Eligible|Cycles Per Issued|Registers Per" \
    "$OUT/ncu-details.txt" | head -n 40
  exit "$rc"
fi
if [ "$what" = bench-model ]; then
  # Hugging Face models end to end (tileops bench-model; Liger from .whl/ when present)
  timeout "${BENCH_SECONDS:-0}" python3 -m tileops.cli bench-model --out "$OUT/bench-model" \
    "$@" 2>&1 | grep -v INFO | tee "$OUT/bench-model.log"
  rc=${PIPESTATUS[0]}
  cat "$OUT/bench-model/bench-model.md" 2>/dev/null
  exit "$rc"
fi
if [ "$what" = calibrate ]; then
  python3 scripts/calibrate.py --out "$OUT" 2>&1 | grep -v INFO
  exit "${PIPESTATUS[0]}"
fi
if [ "$what" = tests ] || [ "$what" = all ]; then
  # Correctness tests in one process per CPU core (compiling dominates); the timer's tests
  # alone afterwards (they measure).
  paths=${TEST_PATHS:-tests}
  # One line per test (-v), so a run cut short by TEST_SECONDS still says what passed;
  # faulthandler dumps the stacks of a test stuck for 150 s (a kernel that never returns).
  pytest_gpu() { timeout "${TEST_SECONDS:-0}" python3 -m pytest -v -m gpu \
      -o faulthandler_timeout=150 -p no:cacheprovider "$@"; }
  ( r1=0; [ "$paths" = tests/perf ] || { pytest_gpu -n "$(nproc)" $paths \
      ${TEST_K:+-k "$TEST_K"} --ignore tests/perf --junitxml "$OUT/junit.xml"; r1=$?; }
    r2=0; case " $paths " in *" tests "*|*" tests/perf "*)
      pytest_gpu tests/perf; r2=$? ;; esac
    exit $(( r1 | r2 )) ) > "$OUT/gpu-tests.log" 2>&1; rc=$?
  log="$OUT/gpu-tests.log"
  echo "tests: $(grep -c " PASSED " "$log") passed, $(grep -cE " (FAILED|ERROR) " "$log")" \
       "failed or errors$(grep -q "Timeout (0:" "$log" && echo ", a test ran past 150 s (a long compile or a hang: stacks in the log)")"
  grep -E "^=+ .*(passed|failed|error).* in [0-9.]+s" "$log" | tail -n 2
  grep -E "(^| )(FAILED|ERROR) " "$log" | head -n 40
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  # BENCH_SECONDS caps the sweep (0: none); the reports keep every case finished by then
  timeout "${BENCH_SECONDS:-0}" python3 -m tileops.cli bench --out "$OUT/bench" "$@" \
    > "$OUT/bench.log" 2>&1 || rc=1
  python3 scripts/host_overhead.py 2>&1 | grep -v INFO | tee -a "$OUT/bench.log"
  sed -n '/^| workload/,$p' "$OUT/bench/bench.md"
fi
exit $rc
