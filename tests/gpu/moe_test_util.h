// Helpers shared by the CUDA MoE tests and benchmark: the ds::cuda launchers on a private
// stream (to force a moe_ffn path), random experts on both backends, random routings.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "backend/cuda/moe.cuh"
#include "gpu_test_util.h"

#define MOE_CUDA_OK(expr) ASSERT_EQ(cudaSuccess, (expr)) << #expr

namespace ds::moe_test {

using test::BackendTensor;

// The ds::cuda launchers called directly (to force a moe_ffn path) on a private stream with
// private scratch. Inputs come from the shared backend: synchronize it before ffn().
class DirectCuda {
 public:
  DirectCuda() {
    EXPECT_EQ(cudaSuccess, cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    ctx_.stream = stream_;
    cudaDeviceProp prop{};
    EXPECT_EQ(cudaSuccess, cudaGetDeviceProperties(&prop, 0));
    ctx_.sm_count = prop.multiProcessorCount;
    ctx_.scratch = [this](int slot, size_t bytes) { return scratch(slot, bytes); };
  }
  ~DirectCuda() {
    cudaStreamSynchronize(stream_);
    for (auto& [p, n] : bufs_) cudaFree(p);
    cudaStreamDestroy(stream_);
  }
  DirectCuda(const DirectCuda&) = delete;
  DirectCuda& operator=(const DirectCuda&) = delete;

  const cuda::Context& ctx() const { return ctx_; }
  cudaStream_t stream() const { return stream_; }
  void sync() const { EXPECT_EQ(cudaSuccess, cudaStreamSynchronize(stream_)); }
  void ffn(const MoeFfnParams& p, cuda::MoeFfnPath path) {
    cuda::moe_ffn(ctx_, p, path);
    sync();
  }

 private:
  void* scratch(int slot, size_t bytes) {
    if (size_t(slot) >= bufs_.size()) bufs_.resize(size_t(slot) + 1, {nullptr, 0});
    auto& [p, n] = bufs_[size_t(slot)];
    if (bytes > n) {
      if (cudaStreamSynchronize(stream_) != cudaSuccess) throw Error("scratch sync");
      cudaFree(p);
      p = nullptr;
      if (cudaMalloc(&p, bytes) != cudaSuccess) throw Error("scratch alloc");
      n = bytes;
    }
    return p;
  }

  cudaStream_t stream_ = nullptr;
  cuda::Context ctx_;
  std::vector<std::pair<void*, size_t>> bufs_;
};

// splitmix64: fast enough to fill a billion weights.
struct Rng {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  float uniform(float lo, float hi) {  // [lo, hi)
    return lo + (hi - lo) * float(next() >> 40) * (1.0f / 16777216.0f);
  }
  int below(int n) { return int(next() % uint64_t(n)); }
};

// ---- experts ---------------------------------------------------------------------------------

// E experts' weights, uniform in +-2/sqrt(K), on the host (for the CPU) and the GPU.
struct Experts {
  int E = 0, H = 0, F = 0;
  DType dtype = DType::BF16;
  std::vector<uint8_t> gate, up, down;  // [E, F, H], [E, F, H], [E, H, F]
  BackendTensor gate_d, up_d, down_d;
  std::vector<ExpertWeights> cpu, gpu;
};

inline std::vector<uint8_t> random_weights(size_t n, int K, DType t, Rng& rng) {
  const size_t es = test::element_bytes(t);
  std::vector<uint8_t> out(n * es);
  const float a = 2.0f / std::sqrt(float(K));
  for (size_t i = 0; i < n; ++i) {
    const float v = rng.uniform(-a, a);
    if (t == DType::F32) {
      std::memcpy(&out[i * 4], &v, 4);
    } else {
      const uint16_t h = t == DType::BF16 ? f32_to_bf16(v) : f32_to_fp16(v);
      std::memcpy(&out[i * 2], &h, 2);
    }
  }
  return out;
}

// stacked: each expert's gate and up rows back to back in one device block ([E, 2F, H]), as a
// checkpoint with fused gate_up weights would place them (the prefill path then runs one GEMM).
inline std::unique_ptr<Experts> make_experts(int E, int H, int F, DType t, uint64_t seed,
                                             bool stacked = false) {
  Backend& g = test::cuda_backend();
  auto x = std::make_unique<Experts>();
  x->E = E;
  x->H = H;
  x->F = F;
  x->dtype = t;
  Rng rng{seed};
  const size_t n = size_t(E) * size_t(F) * size_t(H);
  x->gate = random_weights(n, H, t, rng);
  x->up = random_weights(n, H, t, rng);
  x->down = random_weights(n, F, t, rng);
  const size_t mat = size_t(F) * size_t(H) * test::element_bytes(t);
  if (stacked) {
    std::vector<uint8_t> both(2 * x->gate.size());
    for (int e = 0; e < E; ++e) {
      std::memcpy(&both[2 * size_t(e) * mat], &x->gate[size_t(e) * mat], mat);
      std::memcpy(&both[(2 * size_t(e) + 1) * mat], &x->up[size_t(e) * mat], mat);
    }
    x->gate_d = test::upload_bytes(g, t, {E, 2 * F, H}, both.data(), both.size());
  } else {
    x->gate_d = test::upload_bytes(g, t, {E, F, H}, x->gate.data(), x->gate.size());
    x->up_d = test::upload_bytes(g, t, {E, F, H}, x->up.data(), x->up.size());
  }
  x->down_d = test::upload_bytes(g, t, {E, H, F}, x->down.data(), x->down.size());
  g.synchronize();
  for (int e = 0; e < E; ++e) {
    const size_t off = size_t(e) * mat;
    uint8_t* gate_gpu =
        stacked ? x->gate_d.ptr<uint8_t>() + 2 * off : x->gate_d.ptr<uint8_t>() + off;
    uint8_t* up_gpu = stacked ? gate_gpu + mat : x->up_d.ptr<uint8_t>() + off;
    x->cpu.push_back({TensorView::contiguous(x->gate.data() + off, t, {F, H}),
                      TensorView::contiguous(x->up.data() + off, t, {F, H}),
                      TensorView::contiguous(x->down.data() + off, t, {H, F})});
    x->gpu.push_back(
        {TensorView::contiguous(gate_gpu, t, {F, H}, g.device()),
         TensorView::contiguous(up_gpu, t, {F, H}, g.device()),
         TensorView::contiguous(x->down_d.ptr<uint8_t>() + off, t, {H, F}, g.device())});
  }
  return x;
}

// Routing of T tokens: k distinct experts each (from all E, or from the first k + 2 when
// skewed, so a few experts get most tokens), weights in [0.05, 1).
struct Routing {
  std::vector<int32_t> ids;
  std::vector<float> w;
};

inline Routing random_routing(int T, int E, int k, bool skewed, uint64_t seed) {
  Rng rng{seed};
  Routing r;
  const int pool = skewed ? std::min(E, k + 2) : E;
  std::vector<int> perm(static_cast<size_t>(pool));
  for (int t = 0; t < T; ++t) {
    for (int e = 0; e < pool; ++e) perm[size_t(e)] = e;
    for (int j = 0; j < k; ++j) {
      std::swap(perm[size_t(j)], perm[size_t(j + rng.below(pool - j))]);
      r.ids.push_back(perm[size_t(j)]);
      r.w.push_back(rng.uniform(0.05f, 1.0f));
    }
  }
  return r;
}

// Routing of T tokens to two of the first `routed` experts (weights 0.7 and 0.3 + 0.01 t), never
// expert 5, so one expert gets no tokens.
inline Routing routing_without_expert5(int64_t T, int routed) {
  const int k = 2;
  Routing r;
  r.ids.resize(size_t(T * k));
  r.w.resize(size_t(T * k));
  for (int64_t t = 0; t < T; ++t) {
    int a = int((t * 3) % routed), b = int((t * 5 + 1) % routed);
    if (a == 5) a = 0;
    if (b == 5 || b == a) b = (a + 1) % routed == 5 ? (a + 2) % routed : (a + 1) % routed;
    r.ids[size_t(t * k)] = a;
    r.ids[size_t(t * k + 1)] = b;
    r.w[size_t(t * k)] = 0.7f;
    r.w[size_t(t * k + 1)] = 0.3f + 0.01f * float(t);
  }
  return r;
}

// be.moe_ffn of contiguous F32 x [T, H] routed by ids / wts [T, k]; returns out [T, H].
inline std::vector<float> run_moe_ffn(Backend& be, std::span<const float> x,
                                      std::span<const int32_t> ids, std::span<const float> wts,
                                      std::span<const ExpertWeights> experts, int shared, int64_t T,
                                      int64_t H, int k) {
  auto xb = test::upload_floats(be, DType::F32, {T, H}, x);
  auto ib = test::upload_bytes(be, DType::I32, {T, k}, ids.data(), ids.size() * 4);
  auto wb = test::upload_floats(be, DType::F32, {T, k}, wts);
  auto ob = test::zeros(be, DType::F32, {T, H});
  MoeFfnParams p;
  p.x = xb.view;
  p.ids = ib.view;
  p.weights = wb.view;
  p.experts = experts;
  p.num_shared = shared;
  p.out = ob.view;
  be.moe_ffn(p);
  return test::download_floats(be, ob);
}

// One moe_ffn problem on both backends; x and out may have padded rows.
struct FfnCase {
  int T = 0, k = 0, H = 0, shared = 0;
  int64_t x_ld = 0, out_ld = 0;
  test::Twin x, ids, w, out;
  MoeFfnParams cpu, gpu;
};

// The last `shared` experts are shared ones (the routing names only the others).
inline std::unique_ptr<FfnCase> make_case(const Experts& ex, int T, int k, bool skewed,
                                          uint64_t seed, int pad = 0, int shared = 0) {
  auto c = std::make_unique<FfnCase>();
  c->T = T;
  c->k = k;
  c->shared = shared;
  c->H = ex.H;
  c->x_ld = ex.H + pad;
  c->out_ld = ex.H + 2 * pad;
  const Routing r = random_routing(T, ex.E - shared, k, skewed, seed);
  Rng rng{seed * 7 + 1};
  std::vector<float> x(size_t(T) * size_t(c->x_ld));
  for (float& v : x) v = rng.uniform(-1.0f, 1.0f);
  c->x = test::twin_floats(DType::F32, {T, c->x_ld}, x);
  c->ids = test::twin_ints(r.ids);
  c->w = test::twin_floats(DType::F32, {T, k}, r.w);
  c->out = test::twin_floats(DType::F32, {T, c->out_ld},
                             std::vector<float>(size_t(T) * size_t(c->out_ld), 7.25f));
  auto fill = [&](MoeFfnParams& p, const BackendTensor& x_t, const BackendTensor& ids_t,
                  const BackendTensor& w_t, const BackendTensor& out_t,
                  const std::vector<ExpertWeights>& experts) {
    p.x = test::view_of(x_t, {T, ex.H}, {c->x_ld, 1});
    p.ids = test::view_of(ids_t, {T, k}, {k, 1});
    p.weights = w_t.view;
    p.experts = experts;
    p.num_shared = shared;
    p.out = test::view_of(out_t, {T, ex.H}, {c->out_ld, 1});
  };
  fill(c->cpu, c->x.cpu, c->ids.cpu, c->w.cpu, c->out.cpu, ex.cpu);
  fill(c->gpu, c->x.gpu, c->ids.gpu, c->w.gpu, c->out.gpu, ex.gpu);
  return c;
}

}  // namespace ds::moe_test
