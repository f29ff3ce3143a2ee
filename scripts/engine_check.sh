#!/usr/bin/env bash
# Check an engine integration against the engine release moe-fp8 pins, in that engine's own virtualenv,
# on CPU, and record the result under docs/engines/ (commit it: it names the engine version and our commit).
#
#   bash scripts/engine_check.sh sglang    # VENV (default .venv/sglang) gets moe-fp8[sglang] (sglang==<pin>,
#                                          # with the CUDA torch SGLang pins), runs tests/test_sglang_*.py,
#                                          # writes docs/engines/sglang-cpu-check.md
#
# PYTHON picks the interpreter for a new virtualenv (default python3.11). The run needs PyPI (or a mirror)
# the first time; later runs reuse the virtualenv. Exit status: the tests'.
set -uo pipefail
cd "$(dirname "$0")/.."
engine=${1:-}
PYTHON=${PYTHON:-python3.11}
commit="$(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD -- . 2>/dev/null || echo -dirty)"

# record NAME REPORT TEST_FILE...: run the test files in $VENV and write REPORT (markdown).
record() {
  local name=$1 report=$2 status
  shift 2
  local tests="$*"
  local log
  log=$(mktemp)
  "$VENV/bin/python" -m pytest -v -p no:cacheprovider --disable-warnings "$@" >"$log" 2>&1
  status=$?
  mkdir -p "$(dirname "$report")"
  {
    echo "# $name CPU check"
    echo
    echo "Written by \`bash scripts/engine_check.sh $engine\` (no GPU: the integration's layers, loaders and"
    echo "forward run inside the real $name on CPU, on moe_fp8's reference backend)."
    echo
    "$VENV/bin/python" - "$engine" <<'EOF'
import sys, importlib.metadata as md
import torch
engine = sys.argv[1]
print(f"- {engine}: {md.version(engine)}")
print(f"- torch (as {engine} pins it): {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
print(f"- Python: {sys.version.split()[0]}")
EOF
    echo "- moe_fp8 commit: $commit"
    echo "- date: $(date -u +%Y-%m-%d)"
    echo "- result: $(grep -E '^=+ .*(passed|failed|error).* in ' "$log" | tail -n 1 | sed 's/=//g; s/^ *//; s/ *$//') (pytest exit status $status)"
    echo
    echo "\`\`\`text"
    echo "\$ python -m pytest -v -p no:cacheprovider --disable-warnings $tests"
    cat "$log"
    echo "\`\`\`"
  } >"$report"
  tail -n 5 "$log"
  rm -f "$log"
  echo "wrote $report"
  return $status
}

case "$engine" in
  sglang)
    VENV=${VENV:-.venv/sglang}
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV" || exit 1
    # The [sglang] extra pins the tested release; SGLang brings its own (CUDA) torch, which our
    # loose torch requirement accepts, so pip does not replace it.
    "$VENV/bin/python" -m pip install -q -e ".[sglang]" pytest || exit 1
    record SGLang docs/engines/sglang-cpu-check.md tests/test_sglang_plugin.py tests/test_sglang_config.py
    ;;
  *)
    echo "usage: bash scripts/engine_check.sh sglang" >&2
    exit 2
    ;;
esac
