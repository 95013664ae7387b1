#!/usr/bin/env bash
# Fetches the Debian packages the GPU machine lacks (it has no package registry) and unpacks
# them into .carry/deps, which the device run carries (scripts/gpu_run.sh uses it).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .carry/debs
rm -rf .carry/deps && mkdir -p .carry/deps
(cd .carry/debs && apt-get download libpcre2-dev \
  libpcre2-8-0 libpcre2-16-0 libpcre2-32-0 libpcre2-posix3)
for d in .carry/debs/*.deb; do dpkg -x "$d" .carry/deps; done
# CUPTI's headers and library, for DEEPSERVE_KERNEL_TRACE (src/backend/cuda/kernel_trace.h): the
# toolkit's own copy, the same CUDA version as the GPU machine's, which may lack them (~5 MB).
cupti_h=$(ls /usr/local/cuda/include/cupti_activity.h \
  /usr/local/cuda/extras/CUPTI/include/cupti_activity.h 2>/dev/null | head -1 || true)
cupti_so=$(ls /usr/local/cuda/lib64/libcupti.so.* /usr/local/cuda/lib/libcupti.so.* \
  /usr/local/cuda/extras/CUPTI/lib64/libcupti.so.* 2>/dev/null | head -1 || true)
if [ -n "$cupti_h" ] && [ -n "$cupti_so" ]; then
  mkdir -p .carry/deps/cupti/include .carry/deps/cupti/lib
  cp "$(dirname "$cupti_h")"/cupti*.h .carry/deps/cupti/include/
  cp "$cupti_so" .carry/deps/cupti/lib/
else
  echo "fetch_gpu_deps: no CUPTI in the toolkit here; the kernel trace will look on the GPU machine"
fi
du -sh .carry/deps
