#!/usr/bin/env bash
# The GPU checks of issue 42 in one run, for a lent GPU machine (cuda, the default) or a rehearsal on Mesa's lavapipe
# (vulkan):
#   bash scripts/device-check.sh [cuda|vulkan]
# 1. install (npm ci, only when node_modules is missing) and build (scripts/build.mjs);
# 2. the GPU parity tests (test/gpu, node-llama-cpp's own build of the backend as the oracle) with the backend forced
#    by SWACTOR_GPU_TEST_BACKEND;
# 3. bench/gpuDecode.ts: swactor's decode against node-llama-cpp's on the same synthetic llama, failing under 0.9x.
#    The model (DEVICE_CHECK_SIZE: 7b for cuda, small for vulkan, since lavapipe is a CPU) is written by swactor synth
#    in the background while the tests run, into BENCH_GPU_DIR, and reused when it is there.
# Prints each step's time and a last line with every part's pass or fail; exits 0 only when all pass.
# stories260K.gguf comes from SWACTOR_MODELS_DIR, else ../shared/models, else .cache/models (a folder that can travel
# with a checkout).
set -uo pipefail

backend=${1:-cuda}
case "$backend" in
  cuda) size=${DEVICE_CHECK_SIZE:-7b} ;;
  vulkan)
    size=${DEVICE_CHECK_SIZE:-small}
    export VK_ICD_FILENAMES=/usr/share/vulkan/icd.d/lvp_icd.x86_64.json GGML_VK_VISIBLE_DEVICES=0
    ;;
  *)
    echo "usage: bash scripts/device-check.sh [cuda|vulkan]" >&2
    exit 2
    ;;
esac
export SWACTOR_GPU_TEST_BACKEND=$backend

cd "$(dirname "$0")/.." || exit 2
if [ -z "${SWACTOR_MODELS_DIR:-}" ] && [ ! -f ../shared/models/stories260K.gguf ] &&
  [ -f .cache/models/stories260K.gguf ]; then
  export SWACTOR_MODELS_DIR=.cache/models
fi
logs=$(mktemp -d "${TMPDIR:-/tmp}/swactor-device-check-XXXXXX")
started=$(date +%s)
declare -A result=()

# step NAME COMMAND...: runs it, prints its time and keeps pass/fail
step() {
  local name=$1 from
  shift
  from=$(date +%s)
  echo "== $name: $*"
  if "$@"; then result[$name]=pass; else result[$name]=fail; fi
  echo "== $name: ${result[$name]} in $(($(date +%s) - from)) s"
}

summary() {
  local line="device-check $backend:" part all=pass
  for part in install build tests bench; do
    line+=" $part ${result[$part]:-not run},"
    [ "${result[$part]:-}" = pass ] || all=fail
  done
  echo "$line $all in $(($(date +%s) - started)) s (logs in $logs)"
  [ "$all" = pass ]
}

install_packages() {
  [ -d node_modules ] && echo "node_modules present" && return 0
  npm ci --no-audit --no-fund
}

step install install_packages || true
[ "${result[install]}" = pass ] || { summary; exit 1; }
step build node scripts/build.mjs
[ "${result[build]}" = pass ] || { summary; exit 1; }

# the model is written while the tests run (swactor synth takes one core)
prepare_from=$(date +%s)
npx tsx bench/gpuDecode.ts --backend "$backend" --size "$size" --prepare >"$logs/prepare.log" 2>&1 &
prepare=$!

step tests npx vitest run test/gpu

echo "== bench: waiting for the model"
if wait "$prepare"; then
  echo "== model ready $(($(date +%s) - prepare_from)) s after its start: $(tail -n 1 "$logs/prepare.log")"
  step bench npx tsx bench/gpuDecode.ts --backend "$backend" --size "$size"
else
  cat "$logs/prepare.log"
  result[bench]=fail
fi
summary
