// Percentiles and mean/std against numpy's definitions; decode-step recovery from token
// timestamps against hand-built engine schedules.
#include <gtest/gtest.h>

#include <cmath>

#include "bench/stats.h"

namespace ds {
namespace {

TEST(BenchStats, PercentilesMatchNumpy) {
  // numpy.percentile(v, q) (linear interpolation) for these values: 1, 4, 6, 8.7, 9.
  const std::vector<double> v{3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5};
  EXPECT_DOUBLE_EQ(*percentile(v, 0), 1.0);
  EXPECT_DOUBLE_EQ(*percentile(v, 50), 4.0);
  EXPECT_DOUBLE_EQ(*percentile(v, 90), 6.0);
  EXPECT_NEAR(*percentile(v, 99), 8.7, 1e-12);
  EXPECT_DOUBLE_EQ(*percentile(v, 100), 9.0);
  // Between ranks: numpy gives 25, 37, 39.7 for [10, 20, 30, 40].
  const std::vector<double> w{40, 10, 30, 20};
  EXPECT_DOUBLE_EQ(*percentile(w, 50), 25.0);
  EXPECT_NEAR(*percentile(w, 90), 37.0, 1e-12);
  EXPECT_NEAR(*percentile(w, 99), 39.7, 1e-12);
  const auto s = summarize(v);
  ASSERT_TRUE(s);
  EXPECT_DOUBLE_EQ(s->mean, 4.0);
  EXPECT_DOUBLE_EQ(s->max, 9.0);
  EXPECT_EQ(s->count, v.size());
  const auto m = mean_std(v);  // numpy.std (population): 2.256304299271065
  ASSERT_TRUE(m);
  EXPECT_NEAR(m->std, 2.256304299271065, 1e-12);
}

TEST(BenchStats, EmptyAndSingle) {
  EXPECT_FALSE(percentile({}, 50));
  EXPECT_FALSE(summarize({}));
  EXPECT_FALSE(mean_std({}));
  const std::vector<double> one{7};
  EXPECT_DOUBLE_EQ(*percentile(one, 99), 7.0);
  EXPECT_DOUBLE_EQ(mean_std(one)->std, 0.0);
}

// Two requests submitted together: one step prefills both (first tokens at t=1), then decode
// steps of 10 ms and 20 ms.
TEST(BenchSteps, PureDecodeStepsOfABurst) {
  std::vector<TokenTrace> tr(2);
  tr[0] = {0.0, 100, {1.00, 1.01, 1.03}};
  tr[1] = {0.0, 50, {1.00, 1.01, 1.03}};
  const DecodeSteps d = decode_steps(tr, 64);
  ASSERT_EQ(d.step_s.size(), 2u);
  EXPECT_NEAR(d.step_s[0], 0.01, 1e-12);
  EXPECT_NEAR(d.step_s[1], 0.02, 1e-12);
  EXPECT_EQ(d.batch[0], 2);
  // Token j of a request attends to prompt + j positions.
  EXPECT_EQ(d.context[0], (100 + 1) + (50 + 1));
  EXPECT_EQ(d.context[1], (100 + 2) + (50 + 2));
  EXPECT_FALSE(d.mixed);
}

// A request arriving mid-run: the step that prefills it (its first token) is not a decode
// step, nor is a step during which it was waiting with room in the batch.
TEST(BenchSteps, StepsWithPrefillAreLeftOut) {
  std::vector<TokenTrace> tr(2);
  tr[0] = {0.0, 10, {1.0, 1.1, 1.2, 1.3, 1.4}};
  tr[1] = {1.15, 10, {1.3, 1.4}};  // submitted during step (1.1, 1.2]: prefilled in (1.2, 1.3]
  const DecodeSteps d = decode_steps(tr, 64);
  // (1.0,1.1] decode; (1.1,1.2] the newcomer may have been prefilled; (1.2,1.3] has its first
  // token; (1.3,1.4] decodes both.
  ASSERT_EQ(d.step_s.size(), 2u);
  EXPECT_NEAR(d.step_s[0], 0.1, 1e-12);
  EXPECT_EQ(d.batch[0], 1);
  EXPECT_EQ(d.batch[1], 2);
  EXPECT_EQ(d.context[1], (10 + 4) + (10 + 1));
  // With the batch full (max_num_seqs 1) the waiting request cannot have been in the step.
  const DecodeSteps full = decode_steps(tr, 1);
  EXPECT_EQ(full.step_s.size(), 3u);
}

TEST(BenchSteps, FallsBackToMixedWhenAQueueNeverDrains) {
  std::vector<TokenTrace> tr(2);
  tr[0] = {0.0, 10, {1.0, 1.1, 1.2}};
  tr[1] = {0.0, 10, {}};  // never got a token while the other ran
  const DecodeSteps d = decode_steps(tr, 64);
  EXPECT_EQ(d.step_s.size(), 2u);
  EXPECT_TRUE(d.mixed);
}

}  // namespace
}  // namespace ds
