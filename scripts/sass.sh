#!/usr/bin/env bash
# The sm_90a machine code (SASS) of one CUDA source, on a machine without a GPU: nvcc builds a
# cubin, cuobjdump disassembles it. The toolkit here ships neither cuobjdump nor nvdisasm, so
# both come from PyPI (nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm) into build-sass-tools/ on
# first use. Prints each kernel's registers, spills (STL / LDL) and HMMA count; the SASS goes
# to OUT (default /tmp/<source name>.sass), where a kernel's spills can be placed against its
# main loop (are the LDLs between the HMMAs?).
#   scripts/sass.sh src/backend/cuda/attention_mla_decode_regq.cu [OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
src=${1:?usage: scripts/sass.sh file.cu [out.sass]}
out=${2:-/tmp/$(basename "$src" .cu).sass}
tools=$PWD/build-sass-tools
nvcc=${NVCC:-/usr/local/cuda/bin/nvcc}
if [ ! -x "$tools/nvidia/cu13/bin/nvdisasm" ] || [ ! -x "$tools/nvidia/cu13/bin/cuobjdump" ]; then
  mkdir -p "$tools/wheels"
  python3 -m pip download --quiet --no-deps -d "$tools/wheels" nvidia-cuda-cuobjdump \
    nvidia-cuda-nvdisasm
  for w in "$tools"/wheels/*.whl; do python3 -m zipfile -e "$w" "$tools"; done
  chmod +x "$tools"/nvidia/cu13/bin/*
fi
cubin=$(mktemp --suffix=.cubin)
trap 'rm -f "$cubin"' EXIT
"$nvcc" -DDEEPSERVE_HAVE_CUDA=1 -I"$PWD/src" -O3 -DNDEBUG -arch=sm_90a -std=c++20 -cubin \
  -Xptxas -v -o "$cubin" "$src" 2>"$out.ptxas"
PATH=$tools/nvidia/cu13/bin:$PATH cuobjdump -sass "$cubin" >"$out"
# One line a kernel: registers (ptxas), spill stores / loads and HMMAs in its SASS.
python3 - "$out" "$out.ptxas" <<'EOF'
import re, sys
sass, ptxas = open(sys.argv[1]).read(), open(sys.argv[2]).read()
regs = dict(re.findall(r"Compiling entry function '(\S+)'.*?Used (\d+) registers", ptxas, re.S))
for name, body in re.findall(r"Function : (\S+)\n(.*?)(?=\n\s*Function : |\Z)", sass, re.S):
    print(f"{regs.get(name, '?'):>4} regs {body.count('STL'):>4} STL {body.count('LDL'):>4} LDL "
          f"{body.count('HMMA'):>5} HMMA  {name}")
EOF
echo "SASS: $out"
