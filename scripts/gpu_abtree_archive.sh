#!/usr/bin/env bash
# Writes .carry/abtree.tgz: the sources of <commit> that `gpu_run.sh abtree` builds as the base
# of an A/B between two builds on one machine (~0.7 MB; carry it with .carry/deps).
set -euo pipefail
commit=${1:?usage: scripts/gpu_abtree_archive.sh <commit>}
cd "$(git rev-parse --show-toplevel)"
short=$(git rev-parse --short "$commit")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
git archive "$short" src CMakeLists.txt cmake tests/unit tests/gpu tests/fuzz tests/hf_fixtures.h \
  tests/hf_diff_fixtures.h tests/request_tokens.h scripts | tar -x -C "$tmp"
echo "$short" >"$tmp/.commit"
mkdir -p .carry
tar -czf .carry/abtree.tgz -C "$tmp" .
echo "wrote .carry/abtree.tgz ($short, $(du -h .carry/abtree.tgz | cut -f1))"
