// Matmul at SmolLM2-135M shapes: M = 1 (decode, memory-bound: GB/s of weights streamed)
// and M = 512 (prompt, compute-bound: GFLOP/s), on pools of 2 threads (wall time) and 1
// thread (CPU time of the caller: steadier on a machine shared with other work).
// Block-quantized weights run in both activation precisions: f32-act (precise, the
// default) and q8-act (llama.cpp-compatible 8-bit activations).
//
// F16 at one shape covers the float-weight path.
// Weights are spread over enough copies (>= 96 MiB, beyond the L3) that every decode
// iteration streams them from DRAM, as a real forward pass does.
#include <benchmark/benchmark.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/cpu_features.h"
#include "backend/cpu/matmul.h"
#include "core/dtype.h"
#include "core/thread_pool.h"

namespace ds::cpu {
namespace {

constexpr size_t kColdBytes = size_t(96) << 20;

struct Case {
  DType t;
  int64_t N, K, M;
  Isa isa;
  int threads;
  ActPrecision act;
};

void run_case(benchmark::State& state, Case c) {
  const size_t row_bytes = dtype_bytes(c.t, c.K), matrix = row_bytes * size_t(c.N);
  const size_t copies = c.M == 1 ? (kColdBytes + matrix - 1) / matrix : 1;
  std::mt19937 rng(42);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  // 64 distinct random rows, tiled over the matrix and its copies.
  const int64_t distinct = std::min<int64_t>(64, c.N);
  std::vector<uint8_t> rows(row_bytes * size_t(distinct));
  std::vector<float> f(static_cast<size_t>(c.K));
  for (int64_t r = 0; r < distinct; ++r) {
    for (auto& v : f) v = dist(rng) * 0.05f;
    quantize_row(c.t, f.data(), rows.data() + size_t(r) * row_bytes, c.K);
  }
  std::vector<uint8_t> w(matrix * copies);
  for (size_t r = 0; r < size_t(c.N) * copies; ++r)
    std::memcpy(w.data() + r * row_bytes, rows.data() + (r % size_t(distinct)) * row_bytes,
                row_bytes);
  std::vector<float> x(size_t(c.M * c.K)), out(size_t(c.M * c.N));
  for (auto& v : x) v = dist(rng);

  ThreadPool pool(c.threads);
  MatmulArgs a;
  a.x = x.data();
  a.M = c.M;
  a.K = c.K;
  a.ldx = c.K;
  a.wtype = c.t;
  a.N = c.N;
  a.w_row_bytes = row_bytes;
  a.out = out.data();
  a.ldo = c.N;
  a.act = c.act;
  size_t copy = 0;
  for (auto _ : state) {
    a.w = w.data() + copy * matrix;
    copy = (copy + 1) % copies;
    matmul(a, pool, c.isa);
    benchmark::DoNotOptimize(out.data());
  }
  if (c.M == 1)
    state.counters["GB/s"] =
        benchmark::Counter(double(matrix) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GFLOP/s"] = benchmark::Counter(2e-9 * double(c.M * c.N * c.K),
                                                 benchmark::Counter::kIsIterationInvariantRate);
}

void register_all() {
  struct Shape {
    int64_t N, K;
    const char* what;
  };
  const Shape shapes[] = {{576, 576, "attn_q/o"},
                          {960, 576, "qkv"},
                          {3072, 576, "gate_up"},
                          {576, 1536, "down"},
                          {49152, 576, "lm_head"}};
  std::vector<Isa> isas;
  for (Isa isa : {Isa::Avx512Vnni, Isa::Avx2})
    if (isa_supported(isa)) isas.push_back(isa);
  if (isas.empty()) isas.push_back(Isa::Scalar);
  for (Isa isa : isas)
    for (DType t : {DType::Q4_1, DType::Q8_0, DType::F16})
      for (const Shape& s : shapes) {
        if (s.N == 49152 && t != DType::Q8_0) continue;  // SmolLM2's lm_head is Q8_0
        if (t == DType::F16 && s.N != 3072) continue;    // the float path, one shape
        for (int64_t M : {1, 512})
          for (ActPrecision act : {ActPrecision::F32, ActPrecision::Q8})
            for (int threads : {2, 1}) {
              if (s.N == 49152 && M != 1) continue;  // prompts compute logits for one token
              if (t == DType::F16 && act == ActPrecision::Q8)
                continue;  // float weights: no act mode
              const std::string name = "matmul/" + std::string(dtype_name(t)) + "/" + s.what +
                                       "/N=" + std::to_string(s.N) + "/K=" + std::to_string(s.K) +
                                       "/M=" + std::to_string(M) + "/" +
                                       std::string(isa_name(isa)) +
                                       (t == DType::F16            ? ""
                                        : act == ActPrecision::F32 ? "/f32-act"
                                                                   : "/q8-act") +
                                       "/threads:" + std::to_string(threads);
              auto* b = benchmark::RegisterBenchmark(name.c_str(), run_case,
                                                     Case{t, s.N, s.K, M, isa, threads, act});
              b->Unit(benchmark::kMicrosecond);
              if (threads > 1) b->UseRealTime();
            }
      }
}

const int kRegistered = (register_all(), 0);

}  // namespace
}  // namespace ds::cpu
