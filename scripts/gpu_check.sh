#!/usr/bin/env bash
# One call on the GPU machine: install from the source tree (no downloads), environment report,
# GPU tests, JIT timings, benchmarks. Everything lands in $OUT (the device tool brings it back);
# commit the results under docs/benchmarks/ with the commit and device they name.
#
#   bash scripts/gpu_check.sh [tests] [smoke] [demo] [gemm] [grouped] [moe-data] [moe] [sweep] [tune]
#                                                       (default: all but sweep and tune)
#   TUNE="--model DIR --tp 8 ...[;...]" bash scripts/gpu_check.sh tune     (moe-fp8 tune's arguments; see below)
#   SWEEP="128x128b 128x112a" bash scripts/gpu_check.sh gemm sweep     (block shapes to sweep)
#   SHAPES="4096,7168,16384 ..."                                       (gemm shapes, default table)
# Results go to $OUT/gpu_check/ and, after every step, into one archive $OUT/gpu_check.tgz (the
# device tool brings back only a few files; the archive survives a run stopped at its time limit).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=${OUT:-$PWD/out}
OUT=$ROOT/gpu_check
mkdir -p "$OUT"
pack() { tar -C "$ROOT" -czf "$ROOT/gpu_check.tgz.tmp" gpu_check && mv "$ROOT/gpu_check.tgz.tmp" "$ROOT/gpu_check.tgz"; }
trap pack EXIT
export PYTHONUNBUFFERED=1
export MOE_FP8_CACHE_DIR=${MOE_FP8_CACHE_DIR:-/tmp/moe_fp8_cache}
steps=${*:-tests smoke demo gemm grouped moe-data moe}
has() { [[ " $steps " == *" $1 "* ]]; }

python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -n 3
{
  # the device tool copies the working tree with a stale .git: pass MOE_FP8_COMMIT=<sha> from here
  echo "# commit ${MOE_FP8_COMMIT:-$(git rev-parse HEAD 2>/dev/null)$(git diff --quiet HEAD 2>/dev/null || echo -dirty)}"
  nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv
  moe-fp8 info
} 2>&1 | tee "$OUT/info.txt"

if has tests; then
  # -n 3: the float32 reference of the big grouped cases needs a few GB per worker. `datapath`: the
  # data-path kernel tests that run in the interpreter on CPU run compiled here
  python3 -m pytest -q -p no:cacheprovider -n 3 -m "gpu or hopper or datapath" tests/ 2>&1 | tee "$OUT/gpu_tests.txt" | tail -n 30
  pack
fi
if has smoke; then
  python3 scripts/jit_smoke.py --json "$OUT/jit_smoke.json" 2>&1 | tee "$OUT/jit_smoke.txt" | tail -n 25
  python3 scripts/host_overhead.py --no-profile 2>&1 | tee -a "$OUT/jit_smoke.txt"
  pack
fi
if has demo; then
  moe-fp8 demo --device cuda --no-progress 2>&1 | tee "$OUT/demo.txt" | tail -n 25
  moe-fp8 demo --arch qwen3_moe --device cuda --no-progress 2>&1 | tee -a "$OUT/demo.txt" | tail -n 25
  moe-fp8 demo --arch kimi_k2 --device cuda --no-progress 2>&1 | tee -a "$OUT/demo.txt" | tail -n 25
  pack
fi
if has gemm; then
  args=()
  has sweep && args=(--sweep ${SWEEP:-64x16 64x32 64x56 64x64 64x128 64x160 128x64 128x112 128x128 128x144 128x160})
  [ -n "${SHAPES:-}" ] && args+=(--shapes $SHAPES)
  python3 -m moe_fp8.benchmarks.gemm --out-dir "$OUT" "${args[@]}" 2>&1 | tee "$OUT/bench_gemm.txt" | tail -n 60
  pack
fi
if has grouped && python3 -c "import moe_fp8.benchmarks.grouped" 2>/dev/null; then
  python3 -m moe_fp8.benchmarks.grouped --out-dir "$OUT" 2>&1 | tee "$OUT/bench_grouped.txt" | tail -n 40
  pack
fi
if has moe-data; then
  moe-fp8 bench moe-data --out-dir "$OUT" --no-progress 2>&1 | tee "$OUT/bench_moe-data.txt" | tail -n 40
  pack
fi
if has tune; then
  # a fresh table in $OUT (the machine's own table is left alone), then its picks re-timed independently; TUNE holds
  # moe-fp8 tune's arguments, several runs separated by ';' (default: DeepSeek-V3's linears at TP 8, up to 2048
  # tokens, and its experts at EP 8, up to 1024 tokens: the table shipped in moe_fp8/kernels/tuned/)
  IFS=';' read -ra runs <<< "${TUNE:---model scripts/models/deepseek-v3.json --tp 8 --max-tokens 2048 --layouts normal;--model scripts/models/deepseek-v3.json --ep 8 --max-tokens 1024 --layouts masked,contiguous}"
  for run in "${runs[@]}"; do
    # shellcheck disable=SC2086  # word splitting of the arguments is intended
    moe-fp8 tune $run --out "$OUT/tuned.json" --no-progress 2>&1 | tee -a "$OUT/tune.txt" | tail -n 3
  done
  python3 scripts/check_tuned.py "$OUT/tuned.json" --confirmed "$OUT/tuned_confirmed.json" 2>&1 \
    | tee "$OUT/tune_check.txt" | tail -n 4
  pack
fi
if has moe; then
  moe-fp8 bench moe --out-dir "$OUT" --no-progress 2>&1 | tee "$OUT/bench_moe.txt" | tail -n 40
fi
