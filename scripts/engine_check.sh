#!/usr/bin/env bash
# Test moe_fp8's integration with a serving engine against the engine version pinned in pyproject.toml,
# in a virtualenv of its own, and write the result to docs/engines/<engine>-cpu-check.md.
#
#   bash scripts/engine_check.sh vllm|sglang     # venv: $ENGINE_VENV, else ~/.cache/moe_fp8-engine-venvs/vllm-<version>
#   ENGINE_VENV=/path/to/venv bash scripts/engine_check.sh vllm
#
# The default venv folder is deliberately outside the JIT cache (~/.cache/moe_fp8, $MOE_FP8_CACHE_DIR):
# the cache's entries, sizes and cleanup are its own, and a venv there is none of them.
#
# The venv is created if missing and gets the pinned engine (which brings its own torch), then this
# checkout with --no-deps plus moe_fp8's small dependencies, so the engine's pins are never disturbed.
# Needs no GPU: the tests drive the engine's layers on CPU (moe_fp8's reference backend). Exits non-zero
# if the engine cannot be imported, a test fails, or a test of the engine was skipped.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"

usage() {
  echo "usage: bash scripts/engine_check.sh vllm|sglang" >&2
  exit 2
}

pinned_spec() {  # pinned_spec EXTRA: the single requirement of [project.optional-dependencies].EXTRA
  python3 - "$1" <<'EOF'
import sys, tomllib
spec = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"][sys.argv[1]]
if len(spec) != 1 or "==" not in spec[0]:
    sys.exit(f"pyproject.toml: extra {sys.argv[1]!r} must pin exactly one version (name==x.y.z), got {spec}")
print(spec[0])
EOF
}

ensure_venv() {  # ensure_venv DIR SPEC IMPORT_NAME: DIR has SPEC installed, plus this checkout
  local venv=$1 spec=$2 module=$3 version=${2#*==}
  if [ ! -x "$venv/bin/python" ]; then
    echo "== creating $venv"
    "${PYTHON:-python3}" -m venv "$venv"
  fi
  local have
  have=$("$venv/bin/python" -c "import importlib.metadata as m; print(m.version('$module'))" 2>/dev/null || true)
  if [ "$have" != "$version" ]; then
    echo "== installing $spec into $venv (found: ${have:-none})"
    "$venv/bin/python" -m pip install -q "$spec"
  fi
  echo "== installing this checkout (--no-deps) and moe_fp8's small dependencies"
  "$venv/bin/python" -m pip install -q --no-deps -e "$repo"
  "$venv/bin/python" -m pip install -q safetensors filelock cuda-bindings nvidia-cuda-nvrtc pytest
  "$venv/bin/python" -c "import $module" || { echo "engine_check: cannot import $module in $venv" >&2; exit 1; }
}

run_check() {  # run_check ENGINE MODULE TEST_FILE...
  local engine=$1 module=$2
  shift 2
  local spec version venv out log rc=0
  spec=$(pinned_spec "$engine")
  version=${spec#*==}
  venv=${ENGINE_VENV:-$HOME/.cache/moe_fp8-engine-venvs/$engine-$version}
  ensure_venv "$venv" "$spec" "$module"

  out="docs/engines/$engine-cpu-check.md"
  log=$(mktemp)
  trap 'rm -f "$log"' RETURN
  local start=$SECONDS
  echo "== $venv/bin/python -m pytest -v -rs $*"
  "$venv/bin/python" -m pytest -v -rs -p no:cacheprovider "$@" 2>&1 | tee "$log" || rc=$?
  if grep -q "^SKIPPED" "$log"; then
    echo "engine_check: tests were skipped (see above): treated as a failure" >&2
    if [ "$rc" -eq 0 ]; then rc=1; fi
  fi

  local commit dirty=""
  commit=$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
  git diff --quiet HEAD -- . ':!docs/engines' 2>/dev/null || dirty=" (with uncommitted changes)"
  mkdir -p docs/engines
  {
    echo "# $engine integration check (CPU)"
    echo
    echo "Written by \`bash scripts/engine_check.sh $engine\`; do not edit by hand. Without a GPU the engine's"
    echo "layers, loaders and MoE forward run on CPU and moe_fp8's ops on their PyTorch reference backend;"
    echo "the engine's own GPU kernels, multi-process parallelism and CUDA graphs are not exercised."
    echo
    echo "| | |"
    echo "|---|---|"
    echo "| date | $(date -u +%Y-%m-%d) |"
    echo "| moe_fp8 commit | \`$commit\`$dirty |"
    echo "| $engine | $("$venv/bin/python" -c "import importlib.metadata as m; print(m.version('$module'))") (pinned: \`$spec\`) |"
    echo "| torch | $("$venv/bin/python" -c "import torch; print(torch.__version__, '(CUDA build)' if torch.version.cuda else '(CPU build)')") |"
    echo "| python | $("$venv/bin/python" -c "import platform; print(platform.python_version())") |"
    echo "| machine | $(uname -m), $(nproc) CPUs, $("$venv/bin/python" -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')") |"
    echo "| result | $([ "$rc" -eq 0 ] && echo passed || echo "FAILED (exit $rc)") in $((SECONDS - start)) s |"
    echo
    echo '```'
    echo "\$ python -m pytest -v -rs $*"
    # Drop pytest's per-test warnings block (deprecations inside the engine): the verdict is above it.
    sed -e '/^=* warnings summary =*$/,/^-- Docs:/d' "$log"
    echo '```'
  } > "$out"
  echo "== wrote $out"
  return "$rc"
}

case "${1:-}" in
  vllm) run_check vllm vllm tests/test_vllm_plugin.py tests/test_vllm_plugin_cpu.py ;;
  sglang) run_check sglang sglang tests/test_sglang_plugin.py tests/test_sglang_config.py ;;
  *) usage ;;
esac
