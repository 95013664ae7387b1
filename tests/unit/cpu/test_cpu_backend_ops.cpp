// CPU backend ops against direct formulas; paged attention against a contiguous reference.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <random>

#include "backend/backend.h"

namespace ds {
namespace {

std::vector<float> randn(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d;
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

TensorView view(std::vector<float>& v, std::initializer_list<int64_t> dims) {
  return TensorView::contiguous(v.data(), DType::F32, dims);
}

class CpuOps : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> be = make_cpu_backend({2});
};

TEST_F(CpuOps, RmsNormMatchesFormula) {
  const int rows = 7, n = 97;
  auto x = randn(rows * n, 1), w = randn(n, 2), out(x);
  be->rms_norm(view(x, {rows, n}), view(w, {n}), 1e-5f, view(out, {rows, n}));
  for (int r = 0; r < rows; ++r) {
    double ss = 0;
    for (int i = 0; i < n; ++i) ss += double(x[size_t(r * n + i)]) * x[size_t(r * n + i)];
    const double s = 1.0 / std::sqrt(ss / n + 1e-5);
    for (int i = 0; i < n; ++i)
      EXPECT_NEAR(out[size_t(r * n + i)], x[size_t(r * n + i)] * s * w[size_t(i)], 1e-5);
  }
}

// Rotate-half on x equals adjacent-pair rotation on x with its dims interleaved
// (that permutation is what GGUF conversion applies to Q/K rows).
TEST_F(CpuOps, RopeStylesAgreeUnderThePermutation) {
  const int T = 5, H = 3, D = 64;
  auto x = randn(T * H * D, 3);
  std::vector<float> y(x.size());
  for (int t = 0; t < T * H; ++t)
    for (int i = 0; i < D / 2; ++i) {
      y[size_t(t * D + 2 * i)] = x[size_t(t * D + i)];
      y[size_t(t * D + 2 * i + 1)] = x[size_t(t * D + i + D / 2)];
    }
  const std::vector<int32_t> pos = {0, 1, 17, 250, 4000};
  RopeParams p;
  p.rotary_dim = D;
  p.theta = 100000.0f;
  p.style = RopeStyle::RotateHalf;
  be->rope(view(x, {T, H, D}), pos.data(), p);
  p.style = RopeStyle::Adjacent;
  be->rope(view(y, {T, H, D}), pos.data(), p);
  for (int t = 0; t < T * H; ++t)
    for (int i = 0; i < D / 2; ++i) {
      EXPECT_FLOAT_EQ(y[size_t(t * D + 2 * i)], x[size_t(t * D + i)]);
      EXPECT_FLOAT_EQ(y[size_t(t * D + 2 * i + 1)], x[size_t(t * D + i + D / 2)]);
    }
  // Position 0 is the identity; a rotation keeps each pair's norm.
  auto z = randn(H * D, 4), z0 = z;
  const int32_t zero = 0;
  be->rope(view(z, {1, H, D}), &zero, p);
  for (size_t i = 0; i < z.size(); ++i) EXPECT_FLOAT_EQ(z[i], z0[i]);
}

// Two sequences with scattered blocks; each token's output must equal plain causal
// attention over that sequence's own keys.
TEST_F(CpuOps, PagedAttentionMatchesContiguousReference) {
  const int H = 6, KVH = 2, D = 16, bs = 4, blocks = 12;
  const std::vector<int> ctx = {9, 13};   // cached tokens after this step
  const std::vector<int> n_new = {3, 1};  // this step: a prefill chunk and a decode
  const std::vector<std::vector<int32_t>> tables = {{7, 2, 10}, {0, 5, 11, 3}};
  std::vector<float> kc(size_t(blocks * bs * KVH * D)), vc(kc.size());
  std::vector<std::vector<float>> keys(2), vals(2);  // [ctx, KVH, D] per sequence
  for (int s = 0; s < 2; ++s) {
    keys[size_t(s)] = randn(size_t(ctx[size_t(s)] * KVH * D), 10 + s);
    vals[size_t(s)] = randn(keys[size_t(s)].size(), 20 + s);
    for (int j = 0; j < ctx[size_t(s)]; ++j) {
      const int slot = tables[size_t(s)][size_t(j / bs)] * bs + j % bs;
      std::copy_n(&keys[size_t(s)][size_t(j * KVH * D)], KVH * D, &kc[size_t(slot * KVH * D)]);
      std::copy_n(&vals[size_t(s)][size_t(j * KVH * D)], KVH * D, &vc[size_t(slot * KVH * D)]);
    }
  }
  const int T = n_new[0] + n_new[1];
  auto q = randn(size_t(T * H * D), 30);
  std::vector<float> out(q.size());
  std::vector<int32_t> table(2 * 4, 0);
  for (int s = 0; s < 2; ++s)
    std::copy(tables[size_t(s)].begin(), tables[size_t(s)].end(), table.begin() + s * 4);
  const int32_t qs[3] = {0, n_new[0], T}, cl[2] = {ctx[0], ctx[1]};
  AttentionMeta meta;
  meta.num_seqs = 2;
  meta.num_tokens = T;
  meta.query_start = qs;
  meta.context_lens = cl;
  meta.block_tables = table.data();
  meta.max_blocks_per_seq = 4;
  AttentionParams p;
  p.q = view(q, {T, H, D});
  p.out = view(out, {T, H, D});
  p.kv = {kc.data(), vc.data(), DType::F32, blocks, bs, KVH, D};
  p.scale = 0.25f;
  be->attention(p, meta);
  for (int s = 0; s < 2; ++s)
    for (int i = 0; i < n_new[size_t(s)]; ++i) {
      const int t = qs[s] + i, pos = ctx[size_t(s)] - n_new[size_t(s)] + i;
      for (int h = 0; h < H; ++h) {
        const int kvh = h / (H / KVH);
        std::vector<double> w(size_t(pos + 1));
        double mx = -1e30, sum = 0;
        for (int j = 0; j <= pos; ++j) {
          double d = 0;
          for (int k = 0; k < D; ++k)
            d += double(q[size_t((t * H + h) * D + k)]) *
                 keys[size_t(s)][size_t((j * KVH + kvh) * D + k)];
          w[size_t(j)] = d * 0.25;
          mx = std::max(mx, w[size_t(j)]);
        }
        for (auto& v : w) sum += v = std::exp(v - mx);
        for (int k = 0; k < D; ++k) {
          double o = 0;
          for (int j = 0; j <= pos; ++j)
            o += w[size_t(j)] * vals[size_t(s)][size_t((j * KVH + kvh) * D + k)];
          EXPECT_NEAR(out[size_t((t * H + h) * D + k)], o / sum, 1e-5)
              << "seq " << s << " token " << i << " head " << h;
        }
      }
    }
}

TEST_F(CpuOps, SiluMulAddCopyAndEmbed) {
  const int T = 3, n = 10;
  auto gu = randn(T * 2 * n, 5);
  std::vector<float> out(T * n);
  be->silu_mul(view(gu, {T, 2 * n}), view(out, {T, n}));
  for (int t = 0; t < T; ++t)
    for (int i = 0; i < n; ++i) {
      const float g = gu[size_t(t * 2 * n + i)], u = gu[size_t(t * 2 * n + n + i)];
      EXPECT_NEAR(out[size_t(t * n + i)], g / (1 + std::exp(-g)) * u, 1e-6);
    }
  auto a = randn(T * n, 6), b = randn(T * n, 7), a0 = a;
  be->add(view(a, {T, n}), view(b, {T, n}));
  for (size_t i = 0; i < a.size(); ++i) EXPECT_FLOAT_EQ(a[i], a0[i] + b[i]);
  auto table = randn(5 * n, 8);
  const int32_t ids[3] = {4, 0, 4};
  be->embed(view(table, {5, n}), ids, 3, view(out, {T, n}));
  for (int t = 0; t < 3; ++t)
    for (int i = 0; i < n; ++i) EXPECT_EQ(out[size_t(t * n + i)], table[size_t(ids[t] * n + i)]);
  const int32_t bad[1] = {5};
  EXPECT_THROW(be->embed(view(table, {5, n}), bad, 1, view(out, {T, n})), Error);
}

}  // namespace
}  // namespace ds
