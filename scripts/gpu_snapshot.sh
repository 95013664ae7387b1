#!/usr/bin/env bash
# Copies the committed tree (HEAD) into .carry/src for a GPU run, so half-finished edits in the
# working tree never reach the H200 and the run knows its commit. Then, through the device tool
# with carry [".carry/deps", ".carry/src"]:
#   ln -s $PWD/.carry/deps .carry/src/.carry/deps && cd .carry/src && bash scripts/gpu_run.sh ...
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
rm -rf .carry/src
mkdir -p .carry/src/.carry
git archive HEAD | tar -x -C .carry/src
git rev-parse --short HEAD >.carry/src/.commit
echo "snapshot of $(cat .carry/src/.commit) in .carry/src ($(du -sh .carry/src | cut -f1))"
