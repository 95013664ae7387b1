// Backend::sample's reference (cpu::sample_row) against an independent float64 computation of
// the kept set and of the draw's distribution, plus its edge cases and the backend entry
// points (CPU override and the base class's host round trip) on strided rows.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/sample.h"

namespace ds {
namespace {

SampleRow row(float temperature, int top_k, float top_p, float min_p, uint64_t seed = 7,
              uint64_t counter = 0) {
  return SampleRow{temperature, top_k, top_p, min_p, seed, counter};
}

int32_t first_max(const std::vector<float>& x) {
  int32_t best = 0;
  for (size_t i = 0; i < x.size(); ++i)
    if (x[i] > x[size_t(best)]) best = int32_t(i);
  return best;
}

// The kept set computed without sorting: each token's rank in (logit desc, index asc) by
// counting, then the filters over ranks, all in long double.
struct Expected {
  std::set<int32_t> kept;
  std::map<int32_t, double> prob;  // of each kept token at the temperature
  double margin = INFINITY;        // distance of top-p / min-p from flipping a token
};

Expected expected(const std::vector<float>& x, const SampleRow& p) {
  const size_t V = x.size();
  std::vector<size_t> rank(V);
  for (size_t i = 0; i < V; ++i) {
    size_t r = 0;
    for (size_t j = 0; j < V; ++j) r += x[j] > x[i] || (x[j] == x[i] && j < i);
    rank[i] = r;
  }
  std::vector<size_t> by_rank(V);
  for (size_t i = 0; i < V; ++i) by_rank[rank[i]] = i;
  const long double m = x[by_rank[0]];
  std::vector<long double> w(V);  // by rank
  for (size_t r = 0; r < V; ++r) w[r] = std::exp((long double)x[by_rank[r]] - m);
  size_t n = p.top_k > 0 ? std::min(V, size_t(p.top_k)) : V;
  Expected e;
  if (p.top_p < 1.0f) {
    long double z = 0, cum = 0;
    for (size_t r = 0; r < n; ++r) z += w[r];
    for (size_t r = 0; r < n; ++r) {
      const long double prev = cum;
      cum += w[r] / z;
      if (cum >= p.top_p) {
        e.margin = double(std::min(cum - (long double)p.top_p, (long double)p.top_p - prev));
        n = r + 1;
        break;
      }
    }
  }
  if (p.min_p > 0) {
    size_t keep = 0;
    for (size_t r = 0; r < n; ++r) {
      if (r == 0 || w[r] >= (long double)p.min_p) keep = r + 1;
      if (r > 0) e.margin = std::min(e.margin, double(std::abs(w[r] - (long double)p.min_p)));
    }
    n = keep;
  }
  long double total = 0;
  for (size_t r = 0; r < n; ++r) total += std::pow(w[r], 1.0L / p.temperature);
  for (size_t r = 0; r < n; ++r) {
    e.kept.insert(int32_t(by_rank[r]));
    e.prob[int32_t(by_rank[r])] = double(std::pow(w[r], 1.0L / p.temperature) / total);
  }
  return e;
}

std::vector<float> normal_logits(size_t n, uint32_t seed, float sd) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, sd);
  std::vector<float> x(n);
  for (float& v : x) v = d(rng);
  return x;
}

TEST(Sample, KeptSetMatchesAnIndependentFloat64Computation) {
  std::mt19937 rng(3);
  int checked = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const size_t V = 1 + rng() % 400;
    std::vector<float> x = normal_logits(V, uint32_t(trial), trial % 3 == 0 ? 0.5f : 3.0f);
    if (trial % 5 == 0)  // plant ties
      for (size_t i = 0; i + 3 < V; i += 4) x[i + 3] = x[i];
    const int top_k = std::array{0, 1, 2, 5, 40, 1000}[rng() % 6];
    const float top_p = std::array{1.0f, 0.95f, 0.5f, 0.1f}[rng() % 4];
    const float min_p = std::array{0.0f, 0.05f, 0.2f}[rng() % 3];
    const SampleRow p = row(0.8f, top_k, top_p, min_p, trial, 0);
    cpu::SampleTrace tr;
    cpu::sample_row(x, p, &tr);
    const Expected e = expected(x, p);
    if (e.margin < 1e-9) continue;  // rounding may legitimately decide this one
    ++checked;
    EXPECT_EQ(std::set<int32_t>(tr.kept.begin(), tr.kept.end()), e.kept)
        << "trial " << trial << " V " << V << " k " << top_k << " p " << top_p << " min_p "
        << min_p;
    EXPECT_TRUE(std::is_sorted(tr.kept.begin(), tr.kept.end()));
  }
  EXPECT_GT(checked, 250);
}

// Observed frequencies over 20k counters against the renormalised distribution of the kept set:
// a chi-square test (p = 0.001 critical values), and no draw outside the set.
TEST(Sample, FrequenciesFollowTheRenormalisedKeptDistribution) {
  const std::vector<float> x = {1.0f, 2.5f, 0.2f, 2.0f, -1.0f, 1.7f, 0.9f, 2.2f};
  // Critical chi-square values at p = 0.001 for 1..7 degrees of freedom.
  const double crit[] = {0, 10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32};
  const SampleRow cases[] = {row(1.0f, 0, 1.0f, 0.0f),  row(0.7f, 5, 1.0f, 0.0f),
                             row(1.3f, 0, 0.8f, 0.0f),  row(1.0f, 6, 0.9f, 0.0f),
                             row(2.0f, 0, 1.0f, 0.25f), row(0.5f, 4, 0.95f, 0.1f)};
  const int n = 20000;
  for (const SampleRow& base : cases) {
    const Expected e = expected(x, base);
    std::map<int32_t, int> counts;
    SampleRow p = base;
    for (int i = 0; i < n; ++i) {
      p.counter = uint64_t(i);
      ++counts[cpu::sample_row(x, p)];
    }
    double chi2 = 0;
    for (const auto& [id, c] : counts) EXPECT_TRUE(e.kept.count(id)) << "drew " << id;
    for (const auto& [id, prob] : e.prob) {
      const double want = prob * n;
      const double got = counts.count(id) ? counts[id] : 0;
      chi2 += (got - want) * (got - want) / want;
    }
    const size_t df = e.kept.size() - 1;
    ASSERT_GE(df, 1u);
    EXPECT_LT(chi2, crit[df]) << "T " << base.temperature << " k " << base.top_k << " p "
                              << base.top_p << " min_p " << base.min_p;
  }
}

TEST(Sample, DegenerateFiltersAreArgmax) {
  for (uint32_t seed = 0; seed < 20; ++seed) {
    const std::vector<float> x = normal_logits(500, seed, 2.0f);
    const int32_t want = first_max(x);
    for (uint64_t counter = 0; counter < 10; ++counter) {
      EXPECT_EQ(cpu::sample_row(x, row(1.0f, 1, 1.0f, 0.0f, seed, counter)), want);   // top_k 1
      EXPECT_EQ(cpu::sample_row(x, row(1.0f, 0, 1e-6f, 0.0f, seed, counter)), want);  // top_p
      EXPECT_EQ(cpu::sample_row(x, row(0.0f, 0, 1.0f, 0.0f, seed, counter)), want);   // greedy
      EXPECT_EQ(cpu::sample_row(x, row(-1.0f, 50, 0.5f, 0.1f, seed, counter)), want);
      EXPECT_EQ(cpu::sample_row(x, row(1.0f, 0, 1.0f, 1.0f, seed, counter)), want);  // min_p 1
    }
  }
}

TEST(Sample, TopKAtOrAboveTheVocabularyTruncatesNothing) {
  const std::vector<float> x = normal_logits(300, 11, 1.0f);
  for (uint64_t counter = 0; counter < 200; ++counter) {
    cpu::SampleTrace t0, t1, t2;
    const int32_t a = cpu::sample_row(x, row(1.0f, 0, 1.0f, 0.0f, 5, counter), &t0);
    const int32_t b = cpu::sample_row(x, row(1.0f, 300, 1.0f, 0.0f, 5, counter), &t1);
    const int32_t c = cpu::sample_row(x, row(1.0f, 100000, 1.0f, 0.0f, 5, counter), &t2);
    EXPECT_EQ(a, b);
    EXPECT_EQ(a, c);
    EXPECT_EQ(t1.kept.size(), x.size());
    EXPECT_EQ(t2.kept.size(), x.size());
  }
}

TEST(Sample, TiesGoToTheLowerIndex) {
  // Greedy: the first of the maxima.
  EXPECT_EQ(cpu::sample_row(std::vector<float>{0.5f, 3.0f, 3.0f, 1.0f}, row(0.0f, 0, 1.0f, 0.0f)),
            1);
  // top_k 2 over three equal maxima keeps the two lowest indices.
  cpu::SampleTrace tr;
  for (uint64_t c = 0; c < 100; ++c) {
    const int32_t id = cpu::sample_row(std::vector<float>{1.0f, 3.0f, 3.0f, 3.0f, 0.0f},
                                       row(1.0f, 2, 1.0f, 0.0f, 1, c), &tr);
    EXPECT_EQ(tr.kept, (std::vector<int32_t>{1, 2}));
    EXPECT_TRUE(id == 1 || id == 2);
  }
  // top_p 0.6 over four equal tokens: cumulative 0.25, 0.5, 0.75 -> the first three.
  cpu::sample_row(std::vector<float>{2.0f, 2.0f, 2.0f, 2.0f}, row(1.0f, 0, 0.6f, 0.0f), &tr);
  EXPECT_EQ(tr.kept, (std::vector<int32_t>{0, 1, 2}));
  // -0 and +0 are one value.
  cpu::sample_row(std::vector<float>{0.0f, -0.0f, 0.0f, -5.0f}, row(1.0f, 2, 1.0f, 0.0f), &tr);
  EXPECT_EQ(tr.kept, (std::vector<int32_t>{0, 1}));
}

TEST(Sample, MinusInfinityAndNaNAreNeverDrawn) {
  const float inf = INFINITY;
  const std::vector<float> x = {-inf, 1.0f, -inf, 2.0f, NAN, -inf};
  std::set<int32_t> seen;
  for (uint64_t c = 0; c < 2000; ++c) {
    seen.insert(cpu::sample_row(x, row(1.0f, 0, 1.0f, 0.0f, 3, c)));
    seen.insert(cpu::sample_row(x, row(5.0f, 4, 1.0f, 0.0f, 3, c)));  // k reaches the -infs
  }
  EXPECT_EQ(seen, (std::set<int32_t>{1, 3}));
  // A row with no finite maximum gives its argmax (index 0, like Backend::argmax).
  EXPECT_EQ(cpu::sample_row(std::vector<float>{-inf, -inf, -inf}, row(1.0f, 0, 0.9f, 0.0f)), 0);
}

TEST(Sample, DrawIsAPureFunctionOfSeedAndCounter) {
  const std::vector<float> x(1000, 0.0f);  // uniform: every token equally likely
  std::set<int32_t> by_counter, by_seed;
  for (uint64_t i = 0; i < 100; ++i) {
    const SampleRow a = row(1.0f, 0, 1.0f, 0.0f, 42, i);
    EXPECT_EQ(cpu::sample_row(x, a), cpu::sample_row(x, a));
    by_counter.insert(cpu::sample_row(x, a));
    by_seed.insert(cpu::sample_row(x, row(1.0f, 0, 1.0f, 0.0f, i, 5)));
  }
  // 100 draws from 1000 equally likely tokens: ~95 distinct; a stuck generator gives 1.
  EXPECT_GT(by_counter.size(), 80u);
  EXPECT_GT(by_seed.size(), 80u);
  // Uniforms: mean 1/2, variance 1/12, distinct.
  double sum = 0, sq = 0;
  std::set<double> us;
  const int n = 100000;
  for (int i = 0; i < n; ++i) {
    const double u = sample_uniform(9, uint64_t(i));
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    sum += u;
    sq += u * u;
    us.insert(u);
  }
  EXPECT_NEAR(sum / n, 0.5, 0.005);
  EXPECT_NEAR(sq / n - (sum / n) * (sum / n), 1.0 / 12, 0.002);
  EXPECT_EQ(us.size(), size_t(n));
}

// The CPU override and the base class's host round trip (called explicitly on the CPU
// backend) on rows with a stride: both equal sample_row on each row.
TEST(Sample, BackendOpsOnStridedRows) {
  auto be = make_cpu_backend(BackendOptions{});
  const int64_t R = 37, V = 333, ld = V + 13;
  auto buf = be->alloc(size_t(R * ld) * 4);
  auto ids_buf = be->alloc(size_t(R) * 4);
  auto rows_buf = be->alloc(size_t(R) * sizeof(SampleRow));
  const std::vector<float> all = normal_logits(size_t(R * ld), 5, 2.0f);
  std::copy(all.begin(), all.end(), static_cast<float*>(buf->data()));
  auto* rows = static_cast<SampleRow*>(rows_buf->data());
  for (int64_t r = 0; r < R; ++r)
    rows[r] = row(r % 4 == 0 ? 0.0f : 0.6f + 0.1f * float(r % 5), int(r % 7) * 10,
                  r % 3 ? 0.9f : 1.0f, r % 2 ? 0.02f : 0.0f, uint64_t(r), uint64_t(r * 3));
  TensorView logits = TensorView::contiguous(buf->data(), DType::F32, {R, V});
  logits.stride[0] = ld * 4;
  TensorView ids = ids_buf->view(DType::I32, {R});
  std::vector<int32_t> want(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r)
    want[size_t(r)] = cpu::sample_row(std::span(all.data() + r * ld, size_t(V)), rows[r]);
  be->sample(logits, rows, ids);
  EXPECT_EQ(std::vector<int32_t>(ids.ptr<int32_t>(), ids.ptr<int32_t>() + R), want);
  std::fill_n(ids.ptr<int32_t>(), R, -1);
  be->Backend::sample(logits, rows, ids);
  EXPECT_EQ(std::vector<int32_t>(ids.ptr<int32_t>(), ids.ptr<int32_t>() + R), want);
}

}  // namespace
}  // namespace ds
