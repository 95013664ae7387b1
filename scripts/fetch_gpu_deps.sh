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
du -sh .carry/deps
