// The expanded MLA prefill path (Backend::mla_prefill on CUDA: latent gather, kv_b GEMM,
// flash attention on BF16 tensor cores) against float64 references: the expanded form from
// its definition in backend.h over awkward packed batches (lengths 1, 7, 97, 1000, 3000,
// prefixes before chunks, block sizes 1 and 16, 16 and 128 heads, causal and not, F32 / BF16
// caches), and the absorbed form (reference_mla, the existing reference path) projected
// through W_uv, so both forms provably compute the same attention. MlaPrefillBench times it.
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "attention_reference.h"

namespace ds {
namespace {

constexpr int kR = 512, kP = 64, kNope = 128, kV = 128, kQk = kNope + kP;

struct Case {
  int heads = 16;
  int block_size = 16;
  DType cache = DType::BF16;
  bool causal = true;
  float scale = 0.25f;  // sharper than 1/sqrt(192) so softmax is far from uniform
  float abs_tol = 1e-2f;
  std::vector<test::StepSeq> seqs;
};

struct Inputs {
  test::HostStep h;
  test::BackendStep step;
  test::BackendKv kv;
  std::vector<float> q;     // [T, H, 192]: q_nope then q_rope, as the model lays them out
  std::vector<float> kv_b;  // [H * 256, R], BF16-rounded
  test::BackendTensor q_dev, kv_b_dev, out_dev;
};

Inputs make_inputs(Backend& b, const Case& c, uint32_t seed) {
  Inputs in;
  int blocks = 0;
  for (const auto& s : c.seqs) blocks += (s.context_len + c.block_size - 1) / c.block_size;
  blocks += 3;
  in.h = test::make_step(c.seqs, c.block_size, blocks, seed);
  in.step = test::upload_step(b, in.h);
  test::KvSpec spec;
  spec.dtype = c.cache;
  spec.num_blocks = blocks;
  spec.block_size = c.block_size;
  spec.head_dim = kR + kP;
  spec.latent = true;
  in.kv = test::random_paged_kv(b, spec, seed + 1, kR);  // FP8: latent and rope scales apart
  const int64_t T = in.h.num_tokens, H = c.heads;
  in.q = test::random_floats(size_t(T * H * kQk), seed + 2);
  const float a = 1.5f / std::sqrt(float(kR));  // keys and values of std ~0.5
  in.kv_b = test::round_to(DType::BF16,
                           test::random_floats(size_t(H * (kNope + kV) * kR), seed + 3, -a, a));
  in.q_dev = test::upload_floats(b, DType::F32, {T, H, kQk}, in.q);
  in.kv_b_dev = test::upload_floats(b, DType::BF16, {H * (kNope + kV), kR}, in.kv_b);
  in.out_dev = test::zeros(b, DType::F32, {T, H, kV});
  return in;
}

MlaPrefillParams params(const Case& c, const Inputs& in) {
  MlaPrefillParams p;
  const TensorView q = in.q_dev.view;
  const std::vector<int64_t> st = {int64_t(c.heads) * kQk * 4, kQk * 4, 4};
  p.q_nope = test::strided_view(q, {q.shape[0], c.heads, kNope}, st);
  p.q_rope = test::strided_view(q, {q.shape[0], c.heads, kP}, st, kNope * 4);
  p.kv_b = in.kv_b_dev.view;
  p.out = in.out_dev.view;
  p.cache = in.kv.kv;
  p.kv_lora_rank = kR;
  p.scale = c.scale;
  p.causal = c.causal;
  return p;
}

// Per-head [k_nope | v] of every cached position of every sequence: [slots][H][256] doubles.
std::vector<double> expand_cache(const Case& c, const Inputs& in) {
  const size_t slots = in.kv.k_host.size() / size_t(kR + kP), H = size_t(c.heads);
  std::vector<double> kv(slots * H * size_t(kNope + kV), 0.0);
  std::vector<char> used(slots, 0);
  for (int s = 0; s < in.h.num_seqs; ++s)
    for (int j = 0; j < in.h.context_lens[size_t(s)]; ++j)
      used[size_t(in.h.slot(s, j, c.block_size))] = 1;
  test::HostStep rows;  // one "query" per used slot, to reuse the threaded loop
  rows.num_seqs = 1;
  rows.query_start = {0, int32_t(slots)};
  test::for_each_query(rows, [&](int, int slot) {
    if (!used[size_t(slot)]) return;
    const float* lat = &in.kv.k_host[size_t(slot) * size_t(kR + kP)];
    for (size_t o = 0; o < H * size_t(kNope + kV); ++o) {
      const float* w = &in.kv_b[o * size_t(kR)];
      double acc = 0.0;
      for (int d = 0; d < kR; ++d) acc += double(w[d]) * double(lat[d]);
      kv[size_t(slot) * H * size_t(kNope + kV) + o] = acc;
    }
  });
  return kv;
}

// Backend::mla_prefill from its definition: [T, H, 128].
std::vector<double> reference_expanded(const Case& c, const Inputs& in) {
  const std::vector<double> kv = expand_cache(c, in);
  const size_t H = size_t(c.heads), W = size_t(kNope + kV);
  std::vector<double> out(size_t(in.h.num_tokens) * H * size_t(kV));
  test::for_each_query(in.h, [&](int s, int i) {
    const int q0 = in.h.query_start[size_t(s)], n = in.h.query_start[size_t(s) + 1] - q0;
    const int ctx = in.h.context_lens[size_t(s)], t = q0 + i;
    const int nk = test::visible_keys(ctx, n, i, c.causal);
    std::vector<double> sc(static_cast<size_t>(nk)), w(static_cast<size_t>(nk));
    for (size_t hh = 0; hh < H; ++hh) {
      const float* q = &in.q[(size_t(t) * H + hh) * size_t(kQk)];
      double mx = -INFINITY;
      for (int j = 0; j < nk; ++j) {
        const size_t slot = size_t(in.h.slot(s, j, c.block_size));
        const double* k = &kv[(slot * H + hh) * W];
        const float* r = &in.kv.k_host[slot * size_t(kR + kP) + kR];
        double dot = 0.0;
        for (int d = 0; d < kNope; ++d) dot += double(q[d]) * k[d];
        for (int d = 0; d < kP; ++d) dot += double(q[kNope + d]) * double(r[d]);
        sc[size_t(j)] = dot * double(c.scale);
        mx = std::max(mx, sc[size_t(j)]);
      }
      double sum = 0.0;
      for (int j = 0; j < nk; ++j) sum += w[size_t(j)] = std::exp(sc[size_t(j)] - mx);
      double* o = &out[(size_t(t) * H + hh) * size_t(kV)];
      for (int j = 0; j < nk; ++j) {
        const size_t slot = size_t(in.h.slot(s, j, c.block_size));
        const double* v = &kv[(slot * H + hh) * W + kNope];
        for (int d = 0; d < kV; ++d) o[d] += w[size_t(j)] / sum * v[d];
      }
    }
  });
  return out;
}

std::string name(const Case& c) {
  std::string s = "heads " + std::to_string(c.heads) + " block " + std::to_string(c.block_size) +
                  " " + std::string(dtype_name(c.cache)) + (c.causal ? " causal" : " full") +
                  " seqs";
  for (const auto& q : c.seqs)
    s += " " + std::to_string(q.query_len) + "/" + std::to_string(q.context_len);
  return s;
}

// BF16 operands (Q, K, V, P) against float64: ~3 significant digits on outputs of ~0.1-0.5.
constexpr double kRelTol = 3e-2;

void check_case(const Case& c, uint32_t seed) {
  Backend& gpu = test::cuda_backend();
  Inputs in = make_inputs(gpu, c, seed);
  ASSERT_TRUE(gpu.mla_prefill(params(c, in), in.step.meta)) << name(c) << ": path not taken";
  const std::vector<float> got = test::download_floats(gpu, in.out_dev);
  const std::vector<double> want = reference_expanded(c, in);
  EXPECT_TRUE(test::all_close(got, want, {.abs = c.abs_tol, .rel = kRelTol}, name(c),
                              {in.h.num_tokens, c.heads, int64_t(kV)}));
}

TEST(CudaMlaPrefill, PackedBatchesAgainstExpandedReference) {
  DS_REQUIRE_GPU();
  const std::vector<test::StepSeq> packed = {{1, 1}, {7, 7}, {97, 97}, {1000, 1000}, {3000, 3000}};
  // A chunk with a prefix, plus prefills; few enough padded keys that the path is taken
  // (DeclinesDecodeSteps has a step where padding dominates).
  const std::vector<test::StepSeq> chunked = {{200, 700}, {64, 64}, {33, 97}, {130, 131}};
  const std::vector<test::StepSeq> small = {{1, 1}, {7, 7}, {97, 97}, {300, 300}, {65, 400}};
  uint32_t seed = 100;
  check_case({.heads = 16, .block_size = 16, .seqs = packed}, seed++);
  check_case({.heads = 16, .block_size = 1, .cache = DType::F32, .seqs = chunked}, seed++);
  check_case({.heads = 16, .block_size = 16, .causal = false, .seqs = chunked}, seed++);
  check_case({.heads = 128, .block_size = 16, .seqs = small}, seed++);
  check_case({.heads = 128, .block_size = 1, .seqs = {{150, 700}, {40, 40}}}, seed++);
  // FP8 cache (--kv-cache-dtype fp8): the gather dequantizes; the reference reads the same values.
  // Its rows are up to 6.25x larger (random_paged_kv varies the FP8 scales), so the scale is
  // 6.25x smaller: at 0.25 the scores reach ~26 and BF16 operands alone move outputs by ~0.2 (an
  // emulation of the kernel's roundings in numpy says so, matching the H200's 0.31), and
  // values up to ~6x larger get twice the absolute slack.
  check_case({.heads = 16,
              .block_size = 16,
              .cache = DType::F8_E4M3,
              .scale = 0.04f,
              .abs_tol = 2e-2f,
              .seqs = chunked},
             seed++);
}

// The same inputs through the absorbed-form reference (attention_reference.h): q_latent =
// W_uk^T q_nope, then out = W_uv . reference_mla. Ties the new path to the existing one.
TEST(CudaMlaPrefill, MatchesAbsorbedReference) {
  DS_REQUIRE_GPU();
  const Case c{.heads = 16, .block_size = 16, .seqs = {{40, 40}, {70, 170}}};
  Backend& gpu = test::cuda_backend();
  Inputs in = make_inputs(gpu, c, 7);
  ASSERT_TRUE(gpu.mla_prefill(params(c, in), in.step.meta));
  const std::vector<float> got = test::download_floats(gpu, in.out_dev);
  const size_t T = size_t(in.h.num_tokens), H = size_t(c.heads), W = size_t(kNope + kV);
  std::vector<float> q_lat(T * H * kR), q_rope(T * H * kP);
  for (size_t th = 0; th < T * H; ++th) {
    const float* q = &in.q[th * kQk];
    const size_t h = th % H;
    for (int d = 0; d < kR; ++d) {
      double acc = 0.0;
      for (int i = 0; i < kNope; ++i) acc += double(q[i]) * in.kv_b[(h * W + size_t(i)) * kR + d];
      q_lat[th * kR + size_t(d)] = float(acc);
    }
    for (int d = 0; d < kP; ++d) q_rope[th * kP + size_t(d)] = q[kNope + d];
  }
  const std::vector<double> lat = test::reference_mla(in.h, q_lat, q_rope, in.kv.k_host, c.heads,
                                                      kR, kP, c.block_size, c.scale, c.causal);
  std::vector<double> want(T * H * kV, 0.0);
  for (size_t th = 0; th < T * H; ++th)
    for (int d = 0; d < kV; ++d) {
      const float* w = &in.kv_b[((th % H) * W + size_t(kNope + d)) * kR];
      double acc = 0.0;
      for (int r = 0; r < kR; ++r) acc += double(w[r]) * lat[th * kR + size_t(r)];
      want[th * kV + size_t(d)] = acc;
    }
  EXPECT_TRUE(test::all_close(got, want, {.abs = 1e-2, .rel = kRelTol}, "absorbed vs expanded"));
}

// Steps the expanded path declines: decode-sized queries, a dtype it does not take.
TEST(CudaMlaPrefill, DeclinesDecodeSteps) {
  DS_REQUIRE_GPU();
  Backend& gpu = test::cuda_backend();
  const Case c{.seqs = {{1, 500}, {1, 20}}};
  Inputs in = make_inputs(gpu, c, 9);
  EXPECT_FALSE(gpu.mla_prefill(params(c, in), in.step.meta));
  EXPECT_FALSE(test::cpu_backend().mla_prefill(params(c, in), in.step.meta));
  // A 64-token chunk batched with long-context decodes: the gather would pad every sequence
  // to 1300 keys (4 x 1300 rows for 67 tokens), so the absorbed kernels keep it.
  const Case mixed{.seqs = {{64, 1300}, {1, 1300}, {1, 900}, {1, 40}}};
  Inputs im = make_inputs(gpu, mixed, 10);
  EXPECT_FALSE(gpu.mla_prefill(params(mixed, im), im.step.meta));
}

// Prefill attention TFLOP/s (causal FLOPs: 2 * (192 + 128) per visible (query, key, head)),
// timing the whole op (gather, kv_b GEMM, pack, flash kernel). gpu_run.sh stage attnbench.
TEST(MlaPrefillBench, DISABLED_Throughput) {
  DS_REQUIRE_GPU();
  Backend& gpu = test::cuda_backend();
  std::printf("%6s %8s %6s %10s %10s\n", "seqs", "len", "heads", "ms", "TFLOP/s");
  for (int heads : {16, 128})
    for (auto [n, len] : {std::pair{8, 1024}, std::pair{1, 32768}}) {
      Case c{.heads = heads, .scale = 0.07f};
      c.seqs.assign(size_t(n), {len, len});
      Inputs in = make_inputs(gpu, c, 11);
      const MlaPrefillParams p = params(c, in);
      if (!gpu.mla_prefill(p, in.step.meta)) {
        std::printf("path not taken\n");
        continue;
      }
      gpu.synchronize();
      const int iters = len > 4096 ? 3 : 10;
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < iters; ++i) gpu.mla_prefill(p, in.step.meta);
      gpu.synchronize();
      const double ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() /
          iters;
      const double flops =
          double(n) * double(len) * double(len + 1) / 2.0 * heads * 2.0 * double(kQk + kV);
      std::printf("%6d %8d %6d %10.3f %10.1f\n", n, len, heads, ms, flops / ms / 1e9);
    }
}

}  // namespace
}  // namespace ds
