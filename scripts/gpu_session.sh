#!/usr/bin/env bash
# One device call: GPU tests, then benchmarks; logs and results under $OUT, a short table last.
#   bash .gpu/remote.sh bash scripts/gpu_session.sh [tests|bench|all] [extra bench args]
# Wheels the device image lacks (jsonschema and its deps) travel in .whl/ when present.
set -uo pipefail
what=${1:-all}; shift || true
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/wheels .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/wheels"
fi
export TILEOPS_CACHE_DIR=${TILEOPS_CACHE_DIR:-$PWD/.tilecache}
python3 -c "import torch; p=torch.cuda.get_device_properties(0); print(p.name, p.multi_processor_count, 'SMs', torch.__version__)"
rc=0
if [ "$what" = tune ]; then  # tune the workloads named by the remaining args, then all
  python3 scripts/tune_h200.py --out "$OUT" "$@" > "$OUT/tune.log" 2>&1
  grep -v -E "INFO|WARN" "$OUT/tune.log" | tail -n 20; what=all; set --
fi
if [ "$what" = tests ] || [ "$what" = all ]; then
  python3 -m pytest -q -m gpu -n 8 tests -p no:cacheprovider --junitxml "$OUT/junit.xml" \
    > "$OUT/gpu-tests.log" 2>&1; rc=$?
  grep -E "passed|failed|error" "$OUT/gpu-tests.log" | tail -n 3
  grep -E "^(FAILED|ERROR)" "$OUT/gpu-tests.log" | head -n 40
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  python3 benchmarks/bench_normalization.py --out "$OUT" "$@" > "$OUT/bench-norm.log" 2>&1
  python3 benchmarks/bench_gemm.py --out "$OUT" "$@" > "$OUT/bench-gemm.log" 2>&1
  grep -E "^\| |Error|error" "$OUT/bench-norm.log" | tail -n 20
  grep -E "^\| |Error|error" "$OUT/bench-gemm.log" | tail -n 25
  python3 scripts/host_overhead.py > "$OUT/host.log" 2>&1; grep -v INFO "$OUT/host.log"
fi
exit $rc
