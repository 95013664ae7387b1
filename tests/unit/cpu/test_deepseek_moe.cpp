// The CPU backend's DeepSeek-V2 MoE ops: moe_route on hand-checked cases (ties, group-limited
// selection, normalization, scaling, counts) and against a naive float64 MoEGate; moe_ffn
// against float64 SwiGLU experts, and bit-identical per-token results alone vs in a batch.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

#include "backend/backend.h"
#include "core/dtype.h"

namespace ds {
namespace {

std::unique_ptr<Backend> backend(int threads) {
  BackendOptions o;
  o.threads = threads;
  return make_cpu_backend(o);
}

// ---- moe_route ---------------------------------------------------------------------------

struct Routed {
  std::vector<int32_t> ids;  // [T, top_k]
  std::vector<float> w;      // [T, top_k]
};

Routed route(Backend& be, std::vector<float> logits, int E, const MoeRouteParams& p) {
  const int T = int(logits.size()) / E;
  Routed r{std::vector<int32_t>(size_t(T * p.top_k), -1),
           std::vector<float>(size_t(T * p.top_k), NAN)};
  be.moe_route(TensorView::contiguous(logits.data(), DType::F32, {T, E}), p,
               TensorView::contiguous(r.ids.data(), DType::I32, {T, p.top_k}),
               TensorView::contiguous(r.w.data(), DType::F32, {T, p.top_k}));
  return r;
}

std::vector<double> softmax(const float* l, int E) {
  double mx = -1e300, sum = 0;
  for (int e = 0; e < E; ++e) mx = std::max(mx, double(l[e]));
  std::vector<double> s(static_cast<size_t>(E));
  for (int e = 0; e < E; ++e) sum += s[size_t(e)] = std::exp(double(l[e]) - mx);
  for (auto& x : s) x /= sum;
  return s;
}

using Choice = std::vector<std::pair<int, double>>;  // (expert, weight)

// Token t's choice must be `expect` (in any order: the op leaves the order open).
void expect_route(const Routed& r, int t, int k, Choice expect) {
  Choice got;
  for (int i = 0; i < k; ++i) got.emplace_back(r.ids[size_t(t * k + i)], r.w[size_t(t * k + i)]);
  std::sort(got.begin(), got.end());
  std::sort(expect.begin(), expect.end());
  ASSERT_EQ(got.size(), expect.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].first, expect[i].first) << "token " << t << " choice " << i;
    EXPECT_NEAR(got[i].second, expect[i].second, 1e-6 * std::abs(expect[i].second) + 1e-30)
        << "token " << t << " expert " << got[i].first;
  }
}

TEST(DeepseekMoe, RouteGreedyTiesGoToTheLowerExpert) {
  auto be = backend(1);
  const std::vector<float> l = {3, 1, 3, 3};  // experts 0, 2 and 3 tie
  const auto s = softmax(l.data(), 4);
  MoeRouteParams p;
  p.top_k = 2;
  p.routed_scaling_factor = 1.5f;
  expect_route(route(*be, l, 4, p), 0, 2, {{0, 1.5 * s[0]}, {2, 1.5 * s[2]}});
  p.norm_topk_prob = true;
  expect_route(route(*be, l, 4, p), 0, 2, {{0, 0.5}, {2, 0.5}});
  p.top_k = 1;  // one expert is never normalized; it is scaled instead
  expect_route(route(*be, l, 4, p), 0, 1, {{0, 1.5 * s[0]}});
}

TEST(DeepseekMoe, RouteGroupLimitedChangesTheChoice) {
  auto be = backend(1);
  // Groups of two; group maxima 5.0, 5.1, 0, 5.05: the best two groups are 1 and 3.
  const std::vector<float> l = {5.0f, 4.9f, 5.1f, 0, 0, 0, 5.05f, 0};
  const auto s = softmax(l.data(), 8);
  MoeRouteParams p;
  p.top_k = 3;
  p.n_group = 4;
  p.topk_group = 2;
  p.norm_topk_prob = true;
  const double g = s[2] + s[6] + s[0];
  expect_route(route(*be, l, 8, p), 0, 3, {{2, s[2] / g}, {6, s[6] / g}, {0, s[0] / g}});
  p.method = MoeTopk::GroupLimitedGreedy;
  // Expert 0 is in a dropped group; experts 3 and 7 tie, so 3 is taken.
  const double gl = s[2] + s[6] + s[3];
  expect_route(route(*be, l, 8, p), 0, 3, {{2, s[2] / gl}, {6, s[6] / gl}, {3, s[3] / gl}});
  p.topk_group = 1;  // only group 1 = experts {2, 3}; the third pick is a zeroed expert
  p.norm_topk_prob = false;
  p.routed_scaling_factor = 2.0f;
  expect_route(route(*be, l, 8, p), 0, 3, {{2, 2 * s[2]}, {3, 2 * s[3]}, {0, 0.0}});
}

TEST(DeepseekMoe, RouteGroupTiesGoToTheLowerGroup) {
  auto be = backend(1);
  const std::vector<float> l = {1, 2, 2, 1};  // both groups of two peak at 2
  const auto s = softmax(l.data(), 4);
  MoeRouteParams p;
  p.top_k = 2;
  p.n_group = 2;
  p.topk_group = 1;
  expect_route(route(*be, l, 4, p), 0, 2, {{1, s[1]}, {2, s[2]}});  // greedy
  p.method = MoeTopk::GroupLimitedGreedy;
  expect_route(route(*be, l, 4, p), 0, 2, {{1, s[1]}, {0, s[0]}});
}

TEST(DeepseekMoe, RouteCountsEveryChosenExpert) {
  auto be = backend(2);
  // Token 0 as in RouteGroupLimitedChangesTheChoice -> {2, 6, 3}; token 1 is its mirror:
  // groups peak at 5.05, 0, 5.1, 5.0 -> groups 2 and 0 -> {5, 1, 0} (0 beats 4 on the tie).
  std::vector<float> l = {5.0f, 4.9f, 5.1f, 0, 0, 0, 5.05f, 0};
  for (int e = 7; e >= 0; --e) l.push_back(l[size_t(e)]);
  std::vector<int64_t> counts(8, 10);
  MoeRouteParams p;
  p.top_k = 3;
  p.method = MoeTopk::GroupLimitedGreedy;
  p.n_group = 4;
  p.topk_group = 2;
  p.expert_counts = counts.data();
  for (int call = 0; call < 2; ++call) {
    const Routed r = route(*be, l, 8, p);
    std::vector<int> ids0(r.ids.begin(), r.ids.begin() + 3), ids1(r.ids.begin() + 3, r.ids.end());
    std::sort(ids0.begin(), ids0.end());
    std::sort(ids1.begin(), ids1.end());
    EXPECT_EQ(ids0, (std::vector<int>{2, 3, 6}));
    EXPECT_EQ(ids1, (std::vector<int>{0, 1, 5}));
  }
  EXPECT_EQ(counts, (std::vector<int64_t>{12, 12, 12, 12, 10, 12, 12, 10}));
}

// MoEGate in float64, written plainly: stable sorts by descending score.
Choice naive_route(const float* l, int E, const MoeRouteParams& p) {
  std::vector<double> s = softmax(l, E);
  if (p.method == MoeTopk::GroupLimitedGreedy) {
    const int per = E / p.n_group;
    std::vector<double> gmax(size_t(p.n_group), 0.0);
    for (int e = 0; e < E; ++e)
      gmax[size_t(e / per)] = std::max(gmax[size_t(e / per)], s[size_t(e)]);
    std::vector<int> groups(size_t(p.n_group));
    std::iota(groups.begin(), groups.end(), 0);
    std::stable_sort(groups.begin(), groups.end(),
                     [&](int a, int b) { return gmax[size_t(a)] > gmax[size_t(b)]; });
    for (size_t i = size_t(p.topk_group); i < groups.size(); ++i)
      for (int e = groups[i] * per; e < (groups[i] + 1) * per; ++e) s[size_t(e)] = 0.0;
  }
  std::vector<int> order(static_cast<size_t>(E));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return s[size_t(a)] > s[size_t(b)]; });
  Choice c;
  double sum = 0;
  for (int k = 0; k < p.top_k; ++k) {
    c.emplace_back(order[size_t(k)], s[size_t(order[size_t(k)])]);
    sum += c.back().second;
  }
  for (auto& [e, w] : c)
    w = p.top_k > 1 && p.norm_topk_prob ? w / (sum + 1e-20) : w * p.routed_scaling_factor;
  return c;
}

TEST(DeepseekMoe, RouteMatchesNaiveMoeGate) {
  struct Config {
    int E, top_k;
    MoeTopk method;
    int n_group, topk_group;
    bool norm;
    float scale;
  };
  const Config configs[] = {
      {64, 6, MoeTopk::Greedy, 1, 1, false, 1.0f},                // DeepSeek-V2-Lite
      {160, 6, MoeTopk::GroupLimitedGreedy, 8, 3, false, 16.0f},  // DeepSeek-V2
      {64, 6, MoeTopk::GroupLimitedGreedy, 8, 3, true, 1.0f},
      {12, 1, MoeTopk::GroupLimitedGreedy, 4, 2, true, 2.5f},
  };
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  auto be1 = backend(1), be3 = backend(3);
  for (const Config& c : configs) {
    SCOPED_TRACE("E " + std::to_string(c.E) + " top_k " + std::to_string(c.top_k));
    const int T = 97;
    std::vector<float> l(size_t(T * c.E));
    for (auto& x : l) x = nd(rng);
    MoeRouteParams p;
    p.top_k = c.top_k;
    p.method = c.method;
    p.n_group = c.n_group;
    p.topk_group = c.topk_group;
    p.norm_topk_prob = c.norm;
    p.routed_scaling_factor = c.scale;
    const Routed r = route(*be3, l, c.E, p), r1 = route(*be1, l, c.E, p);
    EXPECT_EQ(r.ids, r1.ids);
    EXPECT_EQ(0, std::memcmp(r.w.data(), r1.w.data(), r.w.size() * 4));
    for (int t = 0; t < T; ++t)
      expect_route(r, t, c.top_k, naive_route(&l[size_t(t * c.E)], c.E, p));
  }
}

// ---- moe_ffn -----------------------------------------------------------------------------

// Writes Q8_0 blocks (F16 scale d = max|x| / 127, q = round(x / d)); `stored` gets d * q.
void quantize_q8_0(const float* x, int n, uint8_t* dst, double* stored) {
  for (int b = 0; b < n / 32; ++b, dst += 34) {
    float amax = 0;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::abs(x[b * 32 + i]));
    const uint16_t dh = f32_to_fp16(amax / 127.0f);
    const float d = fp16_to_f32(dh);
    std::memcpy(dst, &dh, 2);
    for (int i = 0; i < 32; ++i) {
      const int q = d == 0 ? 0 : std::clamp(int(std::lround(x[b * 32 + i] / d)), -127, 127);
      dst[2 + i] = uint8_t(int8_t(q));
      stored[b * 32 + i] = double(d) * q;
    }
  }
}

// Random experts stored in `dtype`, random tokens and routes.
// E experts; the last `shared` of them are shared ones (every token, weight 1).
struct MoeProblem {
  int T, hidden, F, E, top_k, shared;
  DType dtype;
  std::vector<float> x, w;                  // [T, hidden], [T, top_k]
  std::vector<int32_t> ids;                 // [T, top_k], distinct experts per token
  std::vector<std::vector<uint8_t>> bytes;  // 3 per expert: gate, up, down
  std::vector<std::vector<double>> vals;    // their stored values
  std::vector<ExpertWeights> experts;

  MoeProblem(int t, int h, int f, int e, int k, DType dt, uint32_t seed, int num_shared = 0)
      : T(t), hidden(h), F(f), E(e), top_k(k), shared(num_shared), dtype(dt) {
    std::mt19937 rng(seed);
    for (int ex = 0; ex < E; ++ex) {
      TensorView v[3];
      for (int m = 0; m < 3; ++m) {
        const int rows = m == 2 ? hidden : F, cols = m == 2 ? F : hidden;
        std::normal_distribution<float> nd(0.0f, 1.0f / std::sqrt(float(cols)));
        std::vector<float> src(size_t(rows * cols));
        for (auto& a : src) a = nd(rng);
        const size_t row_bytes = dtype_bytes(dt, cols);
        bytes.emplace_back(row_bytes * size_t(rows));
        vals.emplace_back(src.size());
        for (int r = 0; r < rows; ++r) {
          uint8_t* dst = bytes.back().data() + size_t(r) * row_bytes;
          double* st = vals.back().data() + size_t(r * cols);
          if (dt == DType::Q8_0) {
            quantize_q8_0(&src[size_t(r * cols)], cols, dst, st);
            continue;
          }
          for (int i = 0; i < cols; ++i) {
            const float a = src[size_t(r * cols + i)];
            if (dt == DType::F32) {
              std::memcpy(dst + 4 * i, &a, 4);
              st[i] = a;
            } else {
              const uint16_t hb = dt == DType::F16 ? f32_to_fp16(a) : f32_to_bf16(a);
              std::memcpy(dst + 2 * i, &hb, 2);
              st[i] = dt == DType::F16 ? fp16_to_f32(hb) : bf16_to_f32(hb);
            }
          }
        }
        v[m] = TensorView::contiguous(bytes.back().data(), dt, {rows, cols});
      }
      experts.push_back({v[0], v[1], v[2]});
    }
    std::normal_distribution<float> nd;
    x.resize(size_t(T * hidden));
    for (auto& a : x) a = nd(rng);
    std::uniform_real_distribution<float> ud(0.1f, 1.0f);
    std::vector<int32_t> perm(static_cast<size_t>(E - shared));
    std::iota(perm.begin(), perm.end(), 0);
    for (int i = 0; i < T; ++i) {
      std::shuffle(perm.begin(), perm.end(), rng);
      for (int j = 0; j < top_k; ++j) {
        ids.push_back(perm[size_t(j)]);
        w.push_back(ud(rng));
      }
    }
  }
  MoeProblem(const MoeProblem&) = delete;  // the expert views point into this object

  // Runs the tokens `rows` (all when empty) as one batch; returns their out rows.
  std::vector<float> run(Backend& be, std::vector<int> rows = {}) const {
    if (rows.empty()) {
      rows.resize(size_t(T));
      std::iota(rows.begin(), rows.end(), 0);
    }
    const int n = int(rows.size());
    std::vector<float> xs, ws, out(size_t(n * hidden), NAN);
    std::vector<int32_t> is;
    for (int r : rows) {
      xs.insert(xs.end(), x.begin() + r * hidden, x.begin() + (r + 1) * hidden);
      is.insert(is.end(), ids.begin() + r * top_k, ids.begin() + (r + 1) * top_k);
      ws.insert(ws.end(), w.begin() + r * top_k, w.begin() + (r + 1) * top_k);
    }
    MoeFfnParams p;
    p.x = TensorView::contiguous(xs.data(), DType::F32, {n, hidden});
    p.ids = TensorView::contiguous(is.data(), DType::I32, {n, top_k});
    p.weights = TensorView::contiguous(ws.data(), DType::F32, {n, top_k});
    p.experts = experts;
    p.num_shared = shared;
    p.out = TensorView::contiguous(out.data(), DType::F32, {n, hidden});
    be.moe_ffn(p);
    return out;
  }

  // Float64 sum over token t's experts of w * down(silu(gate x) * up x).
  std::vector<double> reference(int t) const {
    std::vector<double> o(size_t(hidden), 0.0), hmid(static_cast<size_t>(F));
    const float* xt = &x[size_t(t * hidden)];
    for (int k = 0; k < top_k + shared; ++k) {
      const int e = k < top_k ? ids[size_t(t * top_k + k)] : E - shared + (k - top_k);
      const auto &G = vals[size_t(3 * e)], &U = vals[size_t(3 * e + 1)],
                 &D = vals[size_t(3 * e + 2)];
      for (int f = 0; f < F; ++f) {
        double g = 0, u = 0;
        for (int i = 0; i < hidden; ++i) {
          g += G[size_t(f * hidden + i)] * xt[i];
          u += U[size_t(f * hidden + i)] * xt[i];
        }
        hmid[size_t(f)] = g / (1.0 + std::exp(-g)) * u;
      }
      for (int i = 0; i < hidden; ++i) {
        double d = 0;
        for (int f = 0; f < F; ++f) d += D[size_t(i * F + f)] * hmid[size_t(f)];
        o[size_t(i)] += (k < top_k ? double(w[size_t(t * top_k + k)]) : 1.0) * d;
      }
    }
    return o;
  }
};

void expect_ffn_matches(const MoeProblem& pr, Backend& be) {
  const auto out = pr.run(be);
  for (int t = 0; t < pr.T; ++t) {
    const auto ref = pr.reference(t);
    for (int i = 0; i < pr.hidden; ++i)
      ASSERT_NEAR(out[size_t(t * pr.hidden + i)], ref[size_t(i)],
                  2e-5 * (1 + std::abs(ref[size_t(i)])))
          << "token " << t << " dim " << i;
  }
}

TEST(DeepseekMoe, FfnMatchesFloat64) {
  struct Config {
    int T, hidden, F, E, top_k;
    DType dtype;
  };
  const Config configs[] = {
      {1, 40, 24, 4, 2, DType::F32},   {7, 40, 24, 5, 3, DType::BF16},
      {97, 64, 32, 6, 2, DType::Q8_0}, {97, 64, 48, 8, 6, DType::F16},
      {7, 96, 64, 3, 1, DType::Q8_0},
  };
  uint32_t seed = 60;
  auto be = backend(2);
  for (const Config& c : configs) {
    SCOPED_TRACE("T " + std::to_string(c.T) + " hidden " + std::to_string(c.hidden) + " " +
                 std::string(dtype_name(c.dtype)));
    const MoeProblem pr(c.T, c.hidden, c.F, c.E, c.top_k, c.dtype, seed++);
    expect_ffn_matches(pr, *be);
  }
}

TEST(DeepseekMoe, FfnWithSharedExpertsMatchesFloat64) {
  auto be = backend(2);
  for (DType dt : {DType::F32, DType::BF16, DType::Q8_0}) {
    SCOPED_TRACE(std::string(dtype_name(dt)));
    const MoeProblem pr(9, 64, 32, 7, 2, dt, 90, 2);  // 5 routed + 2 shared
    expect_ffn_matches(pr, *be);
    // A shared id in the routing is an error: ids name routed experts only.
    std::vector<float> xs(pr.x.begin(), pr.x.begin() + pr.hidden), out(size_t(pr.hidden));
    std::vector<int32_t> bad = {0, 5};
    std::vector<float> ws = {0.5f, 0.5f};
    MoeFfnParams p;
    p.x = TensorView::contiguous(xs.data(), DType::F32, {1, pr.hidden});
    p.ids = TensorView::contiguous(bad.data(), DType::I32, {1, 2});
    p.weights = TensorView::contiguous(ws.data(), DType::F32, {1, 2});
    p.experts = pr.experts;
    p.num_shared = 2;
    p.out = TensorView::contiguous(out.data(), DType::F32, {1, pr.hidden});
    EXPECT_THROW(be->moe_ffn(p), Error);
  }
}

TEST(DeepseekMoe, FfnWithMoreRowsPerExpertThanOneChunk) {
  const MoeProblem pr(600, 32, 16, 2, 2, DType::F32, 70);  // 600 rows on each expert
  auto be = backend(3);
  expect_ffn_matches(pr, *be);
}

TEST(DeepseekMoe, FfnTokenAloneEqualsTokenInBatch) {
  for (DType dt : {DType::BF16, DType::Q8_0}) {
    SCOPED_TRACE(std::string(dtype_name(dt)));
    const MoeProblem pr(97, 64, 32, 8, 3, dt, 80);
    const size_t row = size_t(pr.hidden);
    const auto batch = pr.run(*backend(1));
    for (int threads : {1, 2, 3}) {
      auto be = backend(threads);
      const auto again = pr.run(*be);
      EXPECT_EQ(0, std::memcmp(again.data(), batch.data(), batch.size() * 4)) << threads;
      for (int t : {0, 50, 96}) {
        const auto alone = pr.run(*be, {t});
        EXPECT_EQ(0, std::memcmp(alone.data(), &batch[size_t(t) * row], row * 4))
            << "token " << t << " threads " << threads;
      }
      const std::vector<int> some = {96, 3, 50, 4};  // another batch, another order
      const auto sub = pr.run(*be, some);
      for (size_t i = 0; i < some.size(); ++i)
        EXPECT_EQ(0, std::memcmp(&sub[i * row], &batch[size_t(some[i]) * row], row * 4))
            << "token " << some[i] << " threads " << threads;
    }
  }
}

}  // namespace
}  // namespace ds
