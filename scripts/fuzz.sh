#!/usr/bin/env bash
# Builds the parser fuzz targets (clang, libFuzzer + ASan + UBSan) and runs each one for a
# number of seconds on a fresh copy of its seed corpus. Exits non-zero on any crash, leak,
# UB report or timeout, leaving the failing input under <build dir>/fuzz-artifacts/.
#
# Usage: scripts/fuzz.sh [seconds per target, default 30]
# Env:   DS_FUZZ_BUILD_DIR (default <repo>/build-fuzz), DS_FUZZ_JOBS (build jobs, default 2)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
secs=${1:-30}
build=${DS_FUZZ_BUILD_DIR:-$root/build-fuzz}
targets=(gguf safetensors)

cmake -S "$root" -B "$build" -G Ninja -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDEEPSERVE_FUZZ=ON -DDEEPSERVE_FUZZ_ONLY=ON >/dev/null
cmake --build "$build" -j "${DS_FUZZ_JOBS:-2}" --target "${targets[@]/#/fuzz_}"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
failed=()
for t in "${targets[@]}"; do
  corpus="$work/corpus_$t"
  artifacts="$build/fuzz-artifacts/$t/"
  cp -r "$root/tests/fuzz/corpus/$t" "$corpus"
  mkdir -p "$artifacts"
  echo "== fuzz_$t for ${secs}s"
  if "$build/fuzz_$t" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 \
      -dict="$root/tests/fuzz/corpus/$t.dict" -print_final_stats=1 \
      -artifact_prefix="$artifacts" "$corpus" >"$work/log_$t" 2>&1; then
    grep -E "^Done|^stat::number_of_executed_units" "$work/log_$t" || true
    grep -E "DONE +cov" "$work/log_$t" | tail -n 1 || true
  else
    echo "fuzz_$t FAILED; log tail:"
    tail -n 60 "$work/log_$t"
    failed+=("$t")
  fi
done
if ((${#failed[@]})); then
  echo "fuzzing found problems in: ${failed[*]} (inputs under $build/fuzz-artifacts/)"
  exit 1
fi
echo "fuzzing: no problems found"
