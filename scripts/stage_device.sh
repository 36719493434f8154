#!/usr/bin/env bash
# Readies a checkout for device calls, once per checkout (a new session's checkout has none
# of it): the TileLang kit in .gpu/ (../shared/gpu/stage.sh), the wheels the device image
# lacks in .whl/ (jsonschema and its dependencies; liger-kernel for its baselines; the device
# runs Python 3.12), and these paths git-ignored through .git/info/exclude. Then build what
# the call will run into .tilecache (e.g. `TILEOPS_CACHE_DIR=.tilecache bash
# scripts/norm_forward_compares.sh --compile-only`) and carry [".gpu", ".whl", ".tilecache"].
set -euo pipefail
cd "$(dirname "$0")/.."
bash ../shared/gpu/stage.sh
mkdir -p .whl
python3 -m pip download -q --no-deps -d .whl --python-version 3.12 --only-binary=:all: \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  jsonschema jsonschema-specifications referencing attrs rpds-py liger-kernel
exclude=.git/info/exclude
for path in /.gpu/ /.whl/ /.tilecache/; do
  grep -qxF "$path" "$exclude" 2>/dev/null || echo "$path" >> "$exclude"
done
echo "staged: $(du -sh .gpu .whl | tr '\n' ' ')"
