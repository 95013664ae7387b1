// The CPU backend's DeepSeek-V2 attention-side ops (batched_matmul, latent store_kv,
// mla_attention, YaRN rope) against float64 references written independently here, plus
// batch-invariance (bit-identical) checks. The MoE ops are in test_deepseek_moe.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

#include "backend/backend.h"
#include "backend/cpu/cpu_features.h"
#include "core/dtype.h"

namespace ds {
namespace {

std::unique_ptr<Backend> backend(int threads, const char* isa = "auto") {
  BackendOptions o;
  o.threads = threads;
  o.isa = isa;
  return make_cpu_backend(o);
}

std::vector<float> randn(size_t n, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

int64_t elem_size(DType t) {
  return t == DType::F32 ? 4 : 2;
}

// Stores v as element `elem` of a F32 / F16 / BF16 buffer; returns the value it now holds.
float put(std::vector<uint8_t>& buf, DType t, int64_t elem, float v) {
  if (t == DType::F32) {
    std::memcpy(&buf[size_t(elem * 4)], &v, 4);
    return v;
  }
  const uint16_t h = t == DType::F16 ? f32_to_fp16(v) : f32_to_bf16(v);
  std::memcpy(&buf[size_t(elem * 2)], &h, 2);
  return t == DType::F16 ? fp16_to_f32(h) : bf16_to_f32(h);
}

// A [B, rows, cols] strided F32 view into v with byte strides s0, s1.
TensorView view3(void* data, DType t, int64_t B, int64_t rows, int64_t cols, int64_t s0, int64_t s1,
                 int64_t s2) {
  TensorView v;
  v.data = data;
  v.dtype = t;
  v.ndim = 3;
  v.shape = {B, rows, cols, 0};
  v.stride = {s0, s1, s2, 0};
  return v;
}

// ---- batched_matmul -------------------------------------------------------------------

struct BmmCase {
  int B, M, K, N;
  DType wtype;
};

// x is the [H, T, d] view of a [T, H, d] buffer (heads as batches), out likewise; w's rows are
// padded by 3 elements (a strided view). Checks against float64 and across schedules.
void check_batched_matmul(const BmmCase& c, uint32_t seed) {
  SCOPED_TRACE("B " + std::to_string(c.B) + " M " + std::to_string(c.M) + " K " +
               std::to_string(c.K) + " N " + std::to_string(c.N) + " " +
               std::string(dtype_name(c.wtype)));
  std::mt19937 rng(seed);
  const int64_t B = c.B, M = c.M, K = c.K, N = c.N, es = elem_size(c.wtype), kp = K + 3;
  std::vector<float> x = randn(size_t(M * B * K), rng);  // [M, B, K]
  std::vector<uint8_t> wb(size_t(B * N * kp * es), 0);   // [B, N, K + 3]
  std::vector<double> w(size_t(B * N * K));              // the stored values
  for (int64_t b = 0; b < B; ++b)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k)
        w[size_t((b * N + n) * K + k)] =
            put(wb, c.wtype, (b * N + n) * kp + k, std::normal_distribution<float>()(rng));
  const TensorView xv = view3(x.data(), DType::F32, B, M, K, K * 4, B * K * 4, 4);
  const TensorView wv = view3(wb.data(), c.wtype, B, N, K, N * kp * es, kp * es, es);
  std::vector<float> ref_out;
  for (int threads : {1, 3}) {
    std::vector<float> out(size_t(M * B * N), NAN);  // [M, B, N]
    backend(threads)->batched_matmul(xv, wv,
                                     view3(out.data(), DType::F32, B, M, N, N * 4, B * N * 4, 4));
    if (ref_out.empty()) {
      ref_out = out;
      for (int64_t b = 0; b < B; ++b)
        for (int64_t m = 0; m < M; ++m)
          for (int64_t n = 0; n < N; ++n) {
            double s = 0, mag = 0;
            for (int64_t k = 0; k < K; ++k) {
              const double p =
                  double(x[size_t((m * B + b) * K + k)]) * w[size_t((b * N + n) * K + k)];
              s += p;
              mag += std::abs(p);
            }
            ASSERT_NEAR(out[size_t((m * B + b) * N + n)], s, 1e-6 * mag + 1e-6)
                << "b " << b << " m " << m << " n " << n;
          }
    } else {  // the batch-parallel and the matmul-parallel schedules agree bit for bit
      EXPECT_EQ(0, std::memcmp(out.data(), ref_out.data(), out.size() * 4));
    }
  }
}

TEST(DeepseekOps, BatchedMatmulOnPermutedViews) {
  const BmmCase cases[] = {{1, 1, 40, 8, DType::F32},     {3, 7, 40, 33, DType::F16},
                           {16, 97, 64, 16, DType::BF16}, {16, 1, 128, 40, DType::BF16},
                           {3, 97, 17, 5, DType::F32},    {2, 5, 512, 24, DType::F16}};
  uint32_t seed = 1;
  for (const BmmCase& c : cases) check_batched_matmul(c, seed++);
}

// Views the kernels cannot read in place: x rows broadcast (row stride 0), w shared by all
// batches (batch stride 0), out written transposed (element stride M floats).
TEST(DeepseekOps, BatchedMatmulFallbackStrides) {
  std::mt19937 rng(5);
  const int64_t B = 3, M = 6, K = 24, N = 10;
  std::vector<float> x = randn(size_t(B * K), rng), w = randn(size_t(N * K), rng);
  std::vector<float> out(size_t(B * N * M), NAN);  // [B, N, M]
  backend(2)->batched_matmul(view3(x.data(), DType::F32, B, M, K, K * 4, 0, 4),
                             view3(w.data(), DType::F32, B, N, K, 0, K * 4, 4),
                             view3(out.data(), DType::F32, B, M, N, N * M * 4, 4, M * 4));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double s = 0;
        for (int64_t k = 0; k < K; ++k) s += double(x[size_t(b * K + k)]) * w[size_t(n * K + k)];
        EXPECT_NEAR(out[size_t((b * N + n) * M + m)], s, 1e-5);
      }
}

// ---- store_kv into a latent cache ------------------------------------------------------

TEST(DeepseekOps, StoreKvLatentWritesOnlyK) {
  const int R = 40, P = 8, W = R + P, T = 7, bs = 16, blocks = 3;
  for (DType dt : {DType::F32, DType::F16, DType::BF16}) {
    std::mt19937 rng(11);
    // The source is the [T, 1, R + P] head view of a wider [T, W + 10] row (a column slice).
    std::vector<float> src = randn(size_t(T * (W + 10)), rng);
    const TensorView k = view3(src.data() + 3, DType::F32, T, 1, W, (W + 10) * 4, W * 4, 4);
    std::vector<int32_t> slots = {5, 0, 47, 16, 17, 33, 2};
    std::vector<uint8_t> cache(size_t(blocks * bs * W * elem_size(dt)), 0xAB), expect = cache;
    for (int t = 0; t < T; ++t)
      for (int i = 0; i < W; ++i)
        put(expect, dt, int64_t(slots[size_t(t)]) * W + i, src[size_t(t * (W + 10) + 3 + i)]);
    AttentionMeta meta;
    meta.num_tokens = T;
    meta.slot_mapping = slots.data();
    const PagedKv kv{cache.data(), nullptr, dt, blocks, bs, 1, W};
    backend(2)->store_kv(k, TensorView{}, kv, meta);
    EXPECT_EQ(cache, expect) << dtype_name(dt);
  }
}

TEST(DeepseekOps, StoreKvKeyValueCacheStillWorks) {
  const int T = 3, H = 2, D = 5;
  std::mt19937 rng(12);
  std::vector<float> k = randn(T * H * D, rng), v = randn(T * H * D, rng);
  std::vector<uint8_t> kc(size_t(4 * H * D * 2), 0), vc = kc, ek = kc, ev = kc;
  std::vector<int32_t> slots = {3, 1, 0};
  for (int t = 0; t < T; ++t)
    for (int i = 0; i < H * D; ++i) {
      put(ek, DType::F16, slots[size_t(t)] * H * D + i, k[size_t(t * H * D + i)]);
      put(ev, DType::F16, slots[size_t(t)] * H * D + i, v[size_t(t * H * D + i)]);
    }
  AttentionMeta meta;
  meta.num_tokens = T;
  meta.slot_mapping = slots.data();
  backend(1)->store_kv(TensorView::contiguous(k.data(), DType::F32, {T, H, D}),
                       TensorView::contiguous(v.data(), DType::F32, {T, H, D}),
                       {kc.data(), vc.data(), DType::F16, 1, 4, H, D}, meta);
  EXPECT_EQ(kc, ek);
  EXPECT_EQ(vc, ev);
}

// ---- mla_attention -----------------------------------------------------------------------

struct Seq {
  int ctx;    // cached tokens after this step
  int n_new;  // tokens of this step (the last n_new of ctx)
};

// A paged latent cache of some sequences and this step's queries. The queries live in a
// [T, H, R + P + 3] buffer of which q_latent and q_rope are strided views; out is written
// into a [T, H, R + 5] buffer.
struct MlaProblem {
  int heads, R, P, block_size;
  DType dtype;
  std::vector<Seq> seqs;
  int max_blocks = 0, num_blocks = 0, num_tokens = 0, qw = 0;
  std::vector<std::vector<float>> lat;  // per sequence [ctx, R + P], as stored
  std::vector<uint8_t> cache;
  std::vector<int32_t> tables, query_start, context_lens;
  std::vector<float> q;  // [T, H, qw]

  MlaProblem(int h, int r, int p, int bs, DType dt, std::vector<Seq> ss, uint32_t seed)
      : heads(h), R(r), P(p), block_size(bs), dtype(dt), seqs(std::move(ss)), qw(r + p + 3) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd;
    const int W = R + P;
    for (const Seq& s : seqs) max_blocks = std::max(max_blocks, (s.ctx + bs - 1) / bs);
    num_blocks = max_blocks * int(seqs.size()) + 2;
    std::vector<int32_t> order(static_cast<size_t>(num_blocks));
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);  // scattered, non-contiguous tables
    tables.assign(size_t(max_blocks) * seqs.size(), -1);
    cache.assign(size_t(int64_t(num_blocks) * bs * W * elem_size(dt)), 0);
    size_t next = 0;
    query_start.push_back(0);
    for (size_t s = 0; s < seqs.size(); ++s) {
      const int ctx = seqs[s].ctx;
      for (int b = 0; b < (ctx + bs - 1) / bs; ++b)
        tables[s * size_t(max_blocks) + size_t(b)] = order[next++];
      lat.emplace_back(size_t(ctx * W));
      for (int j = 0; j < ctx; ++j) {
        const int64_t slot = int64_t(tables[s * size_t(max_blocks) + size_t(j / bs)]) * bs + j % bs;
        for (int i = 0; i < W; ++i)
          lat[s][size_t(j * W + i)] = put(cache, dt, slot * W + i, nd(rng));
      }
      num_tokens += seqs[s].n_new;
      query_start.push_back(num_tokens);
      context_lens.push_back(ctx);
    }
    q = randn(size_t(num_tokens * heads * qw), rng);
  }

  // Runs the backend; returns out as [T, H, R].
  std::vector<float> run(Backend& be, float scale, bool causal = true) {
    AttentionMeta meta;
    meta.num_seqs = int(seqs.size());
    meta.num_tokens = num_tokens;
    meta.query_start = query_start.data();
    meta.context_lens = context_lens.data();
    meta.block_tables = tables.data();
    meta.max_blocks_per_seq = max_blocks;
    const int T = num_tokens, ow = R + 5;
    std::vector<float> ob(size_t(T * heads * ow), NAN);
    MlaAttentionParams p;
    p.q_latent = view3(q.data(), DType::F32, T, heads, R, heads * qw * 4, qw * 4, 4);
    p.q_rope = view3(q.data() + R + 1, DType::F32, T, heads, P, heads * qw * 4, qw * 4, 4);
    p.out = view3(ob.data(), DType::F32, T, heads, R, heads * ow * 4, ow * 4, 4);
    p.cache = {cache.data(), nullptr, dtype, num_blocks, block_size, 1, R + P};
    p.kv_lora_rank = R;
    p.scale = scale;
    p.causal = causal;
    be.mla_attention(p, meta);
    std::vector<float> out(size_t(T * heads * R));
    for (int t = 0; t < T * heads; ++t) std::copy_n(ob.begin() + t * ow, R, out.begin() + t * R);
    return out;
  }

  // Float64 result of token i of sequence s, head h.
  std::vector<double> reference(int s, int i, int h, double scale, bool causal) const {
    const int t = query_start[size_t(s)] + i, W = R + P;
    const int ctx = seqs[size_t(s)].ctx, pos = ctx - seqs[size_t(s)].n_new + i;
    const int n = causal ? pos + 1 : ctx;
    const float* ql = &q[size_t((t * heads + h) * qw)];
    const float* qr = ql + R + 1;
    const auto& L = lat[size_t(s)];
    std::vector<double> sc(static_cast<size_t>(n)), o(size_t(R), 0.0);
    double mx = -1e300, sum = 0;
    for (int j = 0; j < n; ++j) {
      double d = 0;
      for (int k = 0; k < R; ++k) d += double(ql[k]) * L[size_t(j * W + k)];
      for (int k = 0; k < P; ++k) d += double(qr[k]) * L[size_t(j * W + R + k)];
      sc[size_t(j)] = d * scale;
      mx = std::max(mx, sc[size_t(j)]);
    }
    for (auto& x : sc) sum += x = std::exp(x - mx);
    for (int j = 0; j < n; ++j)
      for (int k = 0; k < R; ++k) o[size_t(k)] += sc[size_t(j)] * L[size_t(j * W + k)];
    for (auto& x : o) x /= sum;
    return o;
  }

  void expect_matches_reference(Backend& be, float scale, bool causal = true) {
    const auto out = run(be, scale, causal);
    for (size_t s = 0; s < seqs.size(); ++s)
      for (int i = 0; i < seqs[s].n_new; ++i)
        for (int h = 0; h < heads; ++h) {
          const auto ref = reference(int(s), i, h, scale, causal);
          const int t = query_start[s] + i;
          for (int k = 0; k < R; ++k)
            ASSERT_NEAR(out[size_t((t * heads + h) * R + k)], ref[size_t(k)],
                        1e-6 * (1 + std::abs(ref[size_t(k)])))
                << "seq " << s << " token " << i << " head " << h << " dim " << k;
        }
  }
};

TEST(DeepseekOps, MlaAttentionMatchesFloat64) {
  struct Config {
    int heads, R, P, block_size;
    DType dtype;
    std::vector<Seq> seqs;
  };
  const std::vector<Config> configs = {
      // a decode, a prefill chunk on a cached prefix, a fresh 1-token prompt
      {3, 40, 8, 16, DType::F32, {{40, 1}, {53, 17}, {1, 1}}},
      {16, 40, 8, 1, DType::F16, {{7, 7}}},
      {1, 64, 16, 16, DType::BF16, {{130, 97}}},
      {16, 36, 8, 16, DType::F32, {{20, 1}, {9, 9}, {100, 3}}},
      {2, 512, 64, 16, DType::BF16, {{33, 2}, {1, 1}}},
  };
  uint32_t seed = 40;
  auto be = backend(2);
  for (const Config& c : configs) {
    SCOPED_TRACE("heads " + std::to_string(c.heads) + " R " + std::to_string(c.R) + " P " +
                 std::to_string(c.P) + " block " + std::to_string(c.block_size) + " " +
                 std::string(dtype_name(c.dtype)));
    MlaProblem pr(c.heads, c.R, c.P, c.block_size, c.dtype, c.seqs, seed++);
    pr.expect_matches_reference(*be, 1.0f / std::sqrt(float(c.R + c.P)));
  }
}

TEST(DeepseekOps, MlaAttentionNonCausalAndLargeScores) {
  MlaProblem pr(3, 40, 8, 4, DType::F16, {{25, 5}, {10, 1}}, 77);
  auto be = backend(3);
  pr.expect_matches_reference(*be, 0.2f, /*causal=*/false);
  MlaProblem wide(4, 40, 8, 16, DType::F32, {{300, 2}}, 78);
  for (auto& x : wide.q) x *= 4.0f;  // many weights underflow
  wide.expect_matches_reference(*be, 0.5f);
}

TEST(DeepseekOps, MlaAttentionIsBatchInvariant) {
  const int H = 16, R = 40, P = 8, W = R + P;
  // Sequence 0 (a decode token and, separately, a 5-token chunk) alone and inside a batch.
  for (const Seq first : {Seq{45, 1}, Seq{60, 5}}) {
    MlaProblem alone(H, R, P, 16, DType::BF16, {first}, 21);
    MlaProblem batch(H, R, P, 16, DType::BF16, {first, {120, 24}, {8, 8}, {1, 1}}, 22);
    const int64_t es = 2;
    for (int j = 0; j < first.ctx; ++j) {
      const int64_t sa = int64_t(alone.tables[size_t(j / 16)]) * 16 + j % 16;
      const int64_t sb = int64_t(batch.tables[size_t(j / 16)]) * 16 + j % 16;
      std::memcpy(&batch.cache[size_t(sb * W * es)], &alone.cache[size_t(sa * W * es)],
                  size_t(W * es));
    }
    std::copy(alone.q.begin(), alone.q.end(), batch.q.begin());
    const size_t n = size_t(first.n_new * H * R);
    const auto base = alone.run(*backend(1), 0.15f);
    for (int threads : {1, 2, 3}) {
      auto be = backend(threads);
      const auto a = alone.run(*be, 0.15f), b = batch.run(*be, 0.15f);
      EXPECT_EQ(0, std::memcmp(a.data(), base.data(), n * 4)) << "threads " << threads;
      EXPECT_EQ(0, std::memcmp(b.data(), base.data(), n * 4)) << "threads " << threads;
    }
  }
}

TEST(DeepseekOps, MlaAttentionSameBitsOnEveryIsaAndThreadCount) {
  struct Config {
    int R, P;
    DType dtype;
  };
  // Lane tails in both parts (36, 12), and DeepSeek-V2's sizes.
  for (const Config& c :
       {Config{36, 12, DType::F16}, Config{512, 64, DType::BF16}, Config{40, 8, DType::F32}}) {
    MlaProblem pr(16, c.R, c.P, 16, c.dtype, {{70, 1}, {33, 33}, {90, 5}}, 31);
    const auto base = pr.run(*backend(1, "scalar"), 0.15f);
    for (const char* isa : {"scalar", "avx2", "avx512-vnni"}) {
      if (!cpu::isa_supported(*cpu::isa_from_name(isa))) continue;
      for (int threads : {1, 3}) {
        const auto out = pr.run(*backend(threads, isa), 0.15f);
        EXPECT_EQ(0, std::memcmp(out.data(), base.data(), out.size() * 4))
            << "R " << c.R << " isa " << isa << " threads " << threads;
      }
    }
  }
}

// ---- YaRN rope ---------------------------------------------------------------------------

// DeepSeek-V2's yarn_find_correction_dim / _range / yarn_linear_ramp_mask and the blend of
// DeepseekV2YarnRotaryEmbedding, re-derived in float64.
std::vector<double> yarn_inv_freq_ref(int dim, double base, double factor, int orig_max,
                                      double beta_fast, double beta_slow) {
  auto corr_dim = [&](double rotations) {
    return dim * std::log(orig_max / (rotations * 2 * M_PI)) / (2 * std::log(base));
  };
  double low = std::max(std::floor(corr_dim(beta_fast)), 0.0);
  double high = std::min(std::ceil(corr_dim(beta_slow)), double(dim - 1));
  if (low == high) high += 0.001;
  std::vector<double> inv(size_t(dim / 2));
  for (int i = 0; i < dim / 2; ++i) {
    const double extra = 1.0 / std::pow(base, 2.0 * i / dim);
    const double inter = 1.0 / (factor * std::pow(base, 2.0 * i / dim));
    const double mask = 1.0 - std::clamp((i - low) / (high - low), 0.0, 1.0);
    inv[size_t(i)] = inter * (1.0 - mask) + extra * mask;
  }
  return inv;
}

RopeParams deepseek_rope(RopeStyle style) {
  RopeParams p;
  p.style = style;
  p.rotary_dim = 64;
  p.theta = 10000.0f;
  p.yarn_factor = 40.0f;
  p.yarn_original_max_position = 4096;
  p.yarn_beta_fast = 32.0f;
  p.yarn_beta_slow = 1.0f;
  return p;
}

TEST(DeepseekOps, YarnInverseFrequenciesMatchDeepseekFormulas) {
  const auto ref = yarn_inv_freq_ref(64, 10000.0, 40.0, 4096, 32.0, 1.0);
  const auto got = rope_inv_freq(deepseek_rope(RopeStyle::RotateHalf));
  ASSERT_EQ(got.size(), ref.size());
  for (size_t i = 0; i < ref.size(); ++i)
    EXPECT_NEAR(got[i], ref[i], 1e-6 * ref[i]) << "pair " << i;
  // The ramp runs from pair 10 to 23 here: the ends keep the original / the scaled frequency
  // and the middle blends them, so the check above covers all three regimes.
  EXPECT_NEAR(ref[0], 1.0, 1e-12);
  EXPECT_NEAR(ref[31], 1.0 / (40.0 * std::pow(10000.0, 62.0 / 64)), 1e-18);
  const double mid = 1.0 / std::pow(10000.0, 32.0 / 64);
  EXPECT_GT(ref[16], mid / 40 * 1.5);
  EXPECT_LT(ref[16], mid * 0.9);
}

// Float64 rotation of head vector v (rotary dims only) at position pos.
void rotate_ref(std::vector<double>& v, const std::vector<double>& inv, int rotary, RopeStyle st,
                double pos, double attn_factor) {
  const int half = rotary / 2;
  for (int i = 0; i < half; ++i) {
    const int a = st == RopeStyle::Adjacent ? 2 * i : i;
    const int b = st == RopeStyle::Adjacent ? 2 * i + 1 : i + half;
    const double c = std::cos(pos * inv[size_t(i)]) * attn_factor;
    const double s = std::sin(pos * inv[size_t(i)]) * attn_factor;
    const double x0 = v[size_t(a)], x1 = v[size_t(b)];
    v[size_t(a)] = x0 * c - x1 * s;
    v[size_t(b)] = x0 * s + x1 * c;
  }
}

// DeepSeek rotates the trailing 64 dims of each 192-dim query head (a strided [T, H, 64]
// view), and the 64 dims after the latent of the [T, R + 64] kv_a output. Dims outside the
// slice must keep their bits.
TEST(DeepseekOps, YarnRopeOnStridedSlices) {
  const int T = 7, R = 40;
  const std::vector<int32_t> pos = {0, 1, 5, 17, 63, 100, 250};
  const auto inv = yarn_inv_freq_ref(64, 10000.0, 40.0, 4096, 32.0, 1.0);
  for (RopeStyle st : {RopeStyle::Adjacent, RopeStyle::RotateHalf})
    for (int H : {1, 3, 16}) {
      const int width = H == 1 ? R + 64 : 192, offset = H == 1 ? R : 128;
      std::mt19937 rng(static_cast<uint32_t>(H));
      const auto orig = randn(size_t(T * H * width), rng);
      auto x = orig;
      RopeParams p = deepseek_rope(st);
      p.attn_factor = 0.75f;
      backend(2)->rope(view3(x.data() + offset, DType::F32, T, H, 64, H * width * 4, width * 4, 4),
                       pos.data(), p);
      for (int t = 0; t < T; ++t)
        for (int h = 0; h < H; ++h) {
          const size_t base = size_t((t * H + h) * width);
          std::vector<double> v(orig.begin() + long(base) + offset,
                                orig.begin() + long(base) + offset + 64);
          rotate_ref(v, inv, 64, st, pos[size_t(t)], 0.75);
          for (int i = 0; i < width; ++i) {
            if (i < offset) {
              ASSERT_EQ(x[base + size_t(i)], orig[base + size_t(i)]);
            } else {
              ASSERT_NEAR(x[base + size_t(i)], v[size_t(i - offset)], 2e-5 + 1e-6 * pos[size_t(t)])
                  << "style " << int(st) << " heads " << H << " token " << t << " dim " << i;
            }
          }
        }
    }
}

TEST(DeepseekOps, RopeRotatesOnlyTheLeadingRotaryDims) {
  const int T = 5, H = 3, D = 64, rot = 32;
  const std::vector<int32_t> pos = {0, 3, 9, 40, 1000};
  for (RopeStyle st : {RopeStyle::Adjacent, RopeStyle::RotateHalf}) {
    std::mt19937 rng(9);
    const auto orig = randn(size_t(T * H * D), rng);
    auto x = orig;
    RopeParams p;
    p.style = st;
    p.rotary_dim = rot;
    p.theta = 10000.0f;
    backend(1)->rope(TensorView::contiguous(x.data(), DType::F32, {T, H, D}), pos.data(), p);
    std::vector<double> inv(rot / 2);
    for (int i = 0; i < rot / 2; ++i) inv[size_t(i)] = std::pow(10000.0, -2.0 * i / rot);
    for (int t = 0; t < T * H; ++t) {
      std::vector<double> v(orig.begin() + t * D, orig.begin() + t * D + rot);
      rotate_ref(v, inv, rot, st, pos[size_t(t / H)], 1.0);
      for (int i = 0; i < D; ++i) {
        if (i >= rot)
          ASSERT_EQ(x[size_t(t * D + i)], orig[size_t(t * D + i)]);
        else
          ASSERT_NEAR(x[size_t(t * D + i)], v[size_t(i)], 2e-5 + 1e-6 * pos[size_t(t / H)]);
      }
    }
  }
}

TEST(DeepseekOps, SupportsTheNewOps) {
  auto be = backend(1);
  for (DType t : {DType::F32, DType::F16, DType::BF16}) {
    EXPECT_TRUE(be->supports(Op::BatchedMatMul, t));
    EXPECT_TRUE(be->supports(Op::MlaAttention, t));
    EXPECT_TRUE(be->supports(Op::MoeFfn, t));
  }
  EXPECT_TRUE(be->supports(Op::MoeFfn, DType::Q8_0));
  EXPECT_TRUE(be->supports(Op::MoeFfn, DType::Q4_K));
  EXPECT_FALSE(be->supports(Op::BatchedMatMul, DType::Q8_0));
  EXPECT_FALSE(be->supports(Op::MlaAttention, DType::Q8_0));
  EXPECT_FALSE(be->supports(Op::MoeFfn, DType::I32));
  EXPECT_TRUE(be->supports(Op::MoeRoute, DType::F32));
}

}  // namespace
}  // namespace ds
