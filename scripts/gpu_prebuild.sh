#!/usr/bin/env bash
# Builds the sm_90a binaries here (the development machine has the same nvcc as the GPU
# machine) and puts them in .carry/prebuilt with the shared libraries whose versions the GPU
# machine lacks (Debian 12's yaml-cpp 0.7: it has 0.8), so a device
# call that carries .carry/prebuilt skips its build (75-126 s of device time for deepserve, ~90 s
# more for the GPU tests). `gpu_run.sh build` takes them when they were built from the commit in
# .commit and their libraries resolve there, and builds as before otherwise.
#   scripts/gpu_prebuild.sh [targets]   default: deepserve deepserve_gpu_tests
#   DS_PREBUILD_DIR  build folder (default: build-sm90)
#   MUTATE_FILE, MUTATE_SED (and MUTATE2_* .. MUTATE9_*): also a GPU test binary built with that
#       sed applied to that file (then restored), as mutate<N>-deepserve_gpu_tests.xz, which
#       `gpu_run.sh mutate` runs instead of rebuilding there (~7 MB each: two fit a call)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${DS_PREBUILD_DIR:-build-sm90}
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(deepserve deepserve_gpu_tests)
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
  echo "gpu_prebuild: the working tree has uncommitted changes; commit first" >&2
  exit 1
fi
git rev-parse --short HEAD >.commit  # what build_commit.cmake compiles in, and gpu_run.sh checks
# The architectures of gpu_run.sh's own build, so a carried binary is the one it would build.
cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDEEPSERVE_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES="90a-real;90-virtual" >/dev/null
ninja -C "$dir" "${targets[@]}"
out=.carry/prebuilt
rm -rf "$out" && mkdir -p "$out/lib"
pack() {  # pack <built binary> <name>: stripped, xz-compressed, into $out
  strip --strip-unneeded -o "$out/$2" "$1"
  xz -T0 -6 "$out/$2"
}
for t in "${targets[@]}"; do
  # Stripped and xz-compressed (23 -> 7 MB each): the tracked files (~31 MB) and .carry/deps
  # (~5 MB) leave ~30 MB of the 64 MiB a device call carries.
  pack "$dir/$t" "$t"
  # The libraries the GPU machine has at another version (shared/GPU-MACHINE.md), by soname:
  # yaml-cpp today (spdlog and fmt link statically here, but would need the same).
  for so in $(ldd "$dir/$t" | awk '/libyaml-cpp|libspdlog|libfmt/ {print $3}'); do
    cp -L "$so" "$out/lib/"
  done
done
mutated=0
for m in "" 2 3 4 5 6 7 8 9; do
  f=MUTATE${m}_FILE e=MUTATE${m}_SED
  [ -n "${!f:-}" ] && [ -n "${!e:-}" ] || continue
  cp "${!f}" /tmp/prebuild-mutate.orig
  trap 'cp /tmp/prebuild-mutate.orig "${!f}"' EXIT
  sed -i "${!e}" "${!f}"
  if cmp -s "${!f}" /tmp/prebuild-mutate.orig; then
    echo "gpu_prebuild: mutate$m: the sed expression changed nothing in ${!f}" >&2
    exit 1
  fi
  ninja -C "$dir" deepserve_gpu_tests
  pack "$dir/deepserve_gpu_tests" "mutate$m-deepserve_gpu_tests"
  cp /tmp/prebuild-mutate.orig "${!f}"
  trap - EXIT
  mutated=1
done
[ "$mutated" = 0 ] || ninja -C "$dir" deepserve_gpu_tests  # the build folder as committed again
cat .commit >"$out/COMMIT"
pwd >"$out/SRCDIR"
du -sh "$out"/*
