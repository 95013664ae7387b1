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
# toolkit's own copy, the same CUDA version as the GPU machine's, which may lack them. In its
# own folder (~5 MB), carried only by the calls that trace: with a SmolLM2 part and .carry/deps
# a call is near the 64 MiB the device tool takes.
cupti_h=$(ls /usr/local/cuda/include/cupti_activity.h \
  /usr/local/cuda/extras/CUPTI/include/cupti_activity.h 2>/dev/null | head -1 || true)
cupti_so=$(ls /usr/local/cuda/lib64/libcupti.so.* /usr/local/cuda/lib/libcupti.so.* \
  /usr/local/cuda/extras/CUPTI/lib64/libcupti.so.* 2>/dev/null | head -1 || true)
rm -rf .carry/cupti
if [ -n "$cupti_h" ] && [ -n "$cupti_so" ]; then
  mkdir -p .carry/cupti/include .carry/cupti/lib
  cp "$(dirname "$cupti_h")"/cupti*.h .carry/cupti/include/
  cp "$cupti_so" .carry/cupti/lib/
  du -sh .carry/cupti
else
  echo "fetch_gpu_deps: no CUPTI in the toolkit here; the kernel trace will look on the GPU machine"
fi
du -sh .carry/deps
