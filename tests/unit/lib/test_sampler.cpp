#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <random>

#include "core/argmax.h"
#include "core/error.h"
#include "engine/sampler.h"

namespace ds {
namespace {

SamplingParams plain(float temperature) {
  SamplingParams p;
  p.temperature = temperature;
  p.top_k = 0;
  p.top_p = 1.0f;
  p.min_p = 0.0f;
  p.seed = 42;
  return p;
}

TEST(Sampler, GreedyIsArgmaxLowestIndexOnTies) {
  Sampler s(plain(0));
  const std::vector<float> l = {0.5f, 2.0f, -1.0f, 2.0f};
  EXPECT_EQ(s.sample(l, {}), 1);
  EXPECT_EQ(argmax(l), 1);
}

// The eight-lane argmax against the one-chain loop it replaced: lengths around the lane and
// block sizes, heavy ties (values from a handful), NaNs anywhere including first.
TEST(Sampler, ArgmaxFirstMatchesTheScalarLoop) {
  auto scalar = [](const std::vector<float>& v) {
    size_t best = 0;
    for (size_t i = 1; i < v.size(); ++i)
      if (v[i] > v[best]) best = i;
    return int64_t(best);
  };
  std::mt19937 rng(7);
  int checked = 0;
  for (size_t n : {1, 2, 7, 8, 15, 16, 17, 23, 24, 31, 33, 100, 1000, 49152}) {
    for (int trial = 0; trial < 200; ++trial) {
      std::vector<float> v(n);
      const int levels = 1 + int(rng() % 6);  // few distinct values: ties everywhere
      for (auto& x : v) x = float(int(rng() % unsigned(levels)) - 2);
      if (trial % 7 == 0) v[rng() % n] = std::nanf("");
      if (trial % 11 == 0) v[0] = std::nanf("");
      if (trial % 5 == 0) v[rng() % n] = 100.0f;  // one clear winner somewhere
      ASSERT_EQ(argmax_first(v.data(), n), scalar(v)) << "n " << n << " trial " << trial;
      ++checked;
    }
  }
  EXPECT_EQ(checked, 14 * 200);
}

TEST(Sampler, FrequenciesFollowSoftmaxAtTemperature) {
  const std::vector<float> l = {1.0f, 2.0f, 0.0f, 1.5f};
  for (float temp : {0.5f, 1.0f, 2.0f}) {
    Sampler s(plain(temp));
    std::vector<int> counts(4);
    const int n = 40000;
    for (int i = 0; i < n; ++i) ++counts[size_t(s.sample(l, {}))];
    double z = 0;
    for (float v : l) z += std::exp(double(v) / temp);
    for (size_t i = 0; i < 4; ++i) {
      const double p = std::exp(double(l[i]) / temp) / z;
      const double sd = std::sqrt(p * (1 - p) / n);
      EXPECT_NEAR(double(counts[i]) / n, p, 5 * sd) << "temperature " << temp << " token " << i;
    }
  }
}

TEST(Sampler, TopKTopPMinPExcludeTheTail) {
  // softmax of these: ~0.64, 0.24, 0.09, 0.03
  const std::vector<float> l = {3.0f, 2.0f, 1.0f, 0.0f};
  auto support = [&](SamplingParams p) {
    Sampler s(p);
    std::map<int, int> seen;
    for (int i = 0; i < 5000; ++i) ++seen[s.sample(l, {})];
    std::vector<int> ids;
    for (auto& [k, v] : seen) ids.push_back(k);
    return ids;
  };
  SamplingParams k2 = plain(1.0f);
  k2.top_k = 2;
  EXPECT_EQ(support(k2), (std::vector<int>{0, 1}));
  SamplingParams p80 = plain(1.0f);
  p80.top_p = 0.8f;  // 0.64 < 0.8 <= 0.88
  EXPECT_EQ(support(p80), (std::vector<int>{0, 1}));
  SamplingParams m = plain(1.0f);
  m.min_p = 0.2f;  // keeps tokens with p >= 0.2 * 0.64
  EXPECT_EQ(support(m), (std::vector<int>{0, 1}));
  SamplingParams all = plain(1.0f);
  EXPECT_EQ(support(all), (std::vector<int>{0, 1, 2, 3}));
}

TEST(Sampler, SeedMakesRunsReproducible) {
  const std::vector<float> l = {1.0f, 1.1f, 0.9f, 1.05f, 0.7f};
  auto draw = [&](uint64_t seed) {
    SamplingParams p = plain(1.0f);
    p.seed = seed;
    Sampler s(p);
    std::vector<int32_t> out;
    for (int i = 0; i < 64; ++i) out.push_back(s.sample(l, {}));
    return out;
  };
  EXPECT_EQ(draw(7), draw(7));
  EXPECT_NE(draw(7), draw(8));
}

TEST(Sampler, PenaltiesChangeTheGreedyChoice) {
  const std::vector<float> l = {2.0f, 1.9f, -1.0f};
  const std::vector<int32_t> history = {0, 0, 2};
  SamplingParams rep = plain(0);
  rep.repetition_penalty = 1.1f;  // 2.0 / 1.1 = 1.82 < 1.9
  EXPECT_EQ(Sampler(rep).sample(l, history), 1);
  SamplingParams pres = plain(0);
  pres.presence_penalty = 0.05f;  // 2.0 - 0.05 = 1.95 > 1.9
  EXPECT_EQ(Sampler(pres).sample(l, history), 0);
  SamplingParams freq = plain(0);
  freq.frequency_penalty = 0.06f;  // 2.0 - 2 * 0.06 = 1.88 < 1.9
  EXPECT_EQ(Sampler(freq).sample(l, history), 1);
  SamplingParams window = freq;
  window.penalty_last_n = 1;  // only token 2 is in the window
  EXPECT_EQ(Sampler(window).sample(l, history), 0);
}

TEST(Sampler, LogitBiasForcesBansAndKeepsSamplingOnTheHost) {
  const std::vector<float> l = {2.0f, 1.9f, -1.0f, 0.5f};
  SamplingParams p = plain(0);
  EXPECT_TRUE(Sampler(p).device_sampleable());
  p.logit_bias = {{0, -100.0f}};  // bans the argmax
  EXPECT_EQ(Sampler(p).sample(l, {}), 1);
  EXPECT_FALSE(Sampler(p).device_sampleable());
  p.logit_bias = {{2, 100.0f}, {9, 100.0f}};  // ids past the vocabulary are ignored
  EXPECT_EQ(Sampler(p).sample(l, {}), 2);
  p.logit_bias = {{3, 1.6f}};  // 0.5 + 1.6 = 2.1 > 2.0: a bias, not only a ban or a force
  EXPECT_EQ(Sampler(p).sample(l, {}), 3);
  SamplingParams hot = plain(1.0f);
  hot.logit_bias = {{2, 100.0f}};
  Sampler s(hot);
  for (int i = 0; i < 200; ++i) ASSERT_EQ(s.sample(l, {}), 2);
  hot.logit_bias = {{0, -100.0f}, {1, -100.0f}};
  Sampler t(hot);
  for (int i = 0; i < 200; ++i) ASSERT_GE(t.sample(l, {}), 2);
}

TEST(Sampler, RejectsBadParameters) {
  SamplingParams p = plain(1.0f);
  p.top_p = 0;
  EXPECT_THROW(Sampler{p}, Error);
  p = plain(1.0f);
  p.repetition_penalty = 0;
  EXPECT_THROW(Sampler{p}, Error);
  p = plain(1.0f);
  p.logit_bias = {{1, NAN}};
  EXPECT_THROW(Sampler{p}, Error);
}

}  // namespace
}  // namespace ds
