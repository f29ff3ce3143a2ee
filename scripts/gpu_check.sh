#!/usr/bin/env bash
# One call on the GPU machine: install from the source tree (no downloads), environment report,
# GPU tests, JIT timings, benchmarks. Everything lands in $OUT (the device tool brings it back);
# commit the results under docs/benchmarks/ with the commit and device they name.
#
#   bash scripts/gpu_check.sh [tests] [smoke] [gemm] [grouped] [sweep]   (default: all but sweep)
# Each step writes at most 3 files; run it in two calls (tests smoke / gemm grouped) when the
# device tool limits how many files come back.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export MOE_FP8_CACHE_DIR=${MOE_FP8_CACHE_DIR:-/tmp/moe_fp8_cache}
steps=${*:-tests smoke gemm grouped}
has() { [[ " $steps " == *" $1 "* ]]; }

python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -n 3
{
  echo "# commit $(git rev-parse HEAD 2>/dev/null)$(git diff --quiet HEAD 2>/dev/null || echo -dirty)"
  nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv
  moe-fp8 info
} 2>&1 | tee "$OUT/info.txt"

if has tests; then
  # -n 3: the float32 reference of the big grouped cases needs a few GB per worker
  python3 -m pytest -q -p no:cacheprovider -n 3 -m "gpu or hopper" tests/ 2>&1 | tee "$OUT/gpu_tests.txt" | tail -n 30
fi
if has smoke; then
  python3 scripts/jit_smoke.py --json "$OUT/jit_smoke.json" 2>&1 | tee "$OUT/jit_smoke.txt" | tail -n 25
  python3 scripts/host_overhead.py 2>&1 | head -n 2 | tee -a "$OUT/jit_smoke.txt"
fi
if has gemm; then
  sweep_args=()
  has sweep && sweep_args=(--sweep 64x16 64x32 64x56 64x64 64x128 64x160 128x64 128x112 128x128 128x144 128x160)
  python3 -m moe_fp8.benchmarks.gemm --out-dir "$OUT" "${sweep_args[@]}" 2>&1 | tee "$OUT/bench_gemm.txt" | tail -n 60
fi
if has grouped && python3 -c "import moe_fp8.benchmarks.grouped" 2>/dev/null; then
  python3 -m moe_fp8.benchmarks.grouped --out-dir "$OUT" 2>&1 | tee "$OUT/bench_grouped.txt" | tail -n 40
fi
