// The differential fixtures of tests/fixtures/hf_diff (many random DeepSeek-V2 / Llama
// configurations with transformers 5.17's float32 outputs, tools/make_hf_differential.py) on
// the CUDA backend: BF16 activations into the GEMMs and a BF16 KV cache, so greedy tokens
// must agree with transformers wherever the reference's top-2 margin exceeds 3% of the logit
// range (up to the first step where it does not, or where a routing so far was a near-tie).
// Logit differences are reported.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "../hf_diff_fixtures.h"
#include "gpu_models.h"

namespace ds {
namespace {

constexpr double kRobustMargin = 0.03;  // a greedy token may differ only below this margin
// Or once some routing so far had two experts (or groups) this close in router logits: BF16
// GEMM inputs move router logits by ~1e-3..1e-2, and another expert changes the logits by far
// more than rounding. (transformers itself in bfloat16 diverges from its float32 greedy at a
// margin of 7-22% on 4 of the 200 prompts, each after such a near-tie.)
constexpr double kRouteNearTie = 0.01;

TEST(CudaDifferential, GreedyMatchesTransformersWhereMarginExceeds3Percent) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device here";
  const auto index = test::hf_diff_index();
  ASSERT_GE(index.size(), 40u) << test::hf_diff_root();
  double worst = 0;
  int compared = 0, generated = 0, unsupported = 0;
  for (const auto& entry : index) {
    const test::DiffCase c = test::read_diff_case(entry);
    SCOPED_TRACE(c.name + " (" + c.arch + ", " + c.layout + ", " + c.dtype + ")");
    test::OnGpu g = test::load_on_gpu(test::hf_diff_root() / c.name);
    ASSERT_EQ(g.m.config.vocab, c.vocab);
    std::vector<std::vector<int32_t>> prompts;
    double case_worst = 0;
    try {
      for (const auto& p : c.prompts) {
        case_worst = std::max(
            case_worst, test::max_diff_over_range(test::gpu_prefill(g, p.ids), p.logits, c.vocab));
        prompts.push_back(p.ids);
      }
    } catch (const UnsupportedError& e) {
      // A shape the CUDA kernels refuse by name (rows not 16-byte aligned: hidden 36 in 16
      // bits), never a wrong answer; counted and bounded below.
      std::printf("  %s: unsupported on CUDA: %s\n", c.name.c_str(), e.what());
      ++unsupported;
      continue;
    }
    worst = std::max(worst, case_worst);
    const auto got = test::gpu_greedy(g, prompts, 32, true);
    compared += test::expect_greedy_matches(c, got, kRobustMargin, kRouteNearTie, case_worst);
    generated += 32 * int(c.prompts.size());
  }
  std::printf(
      "CudaDifferential: %zu configs (%d unsupported on CUDA): max |logit diff|/range %.3g; %d "
      "of %d greedy tokens compared along the reference (a different token fails where its "
      "margin > %g of the range)\n",
      index.size(), unsupported, worst, compared, generated, kRobustMargin);
  EXPECT_LE(unsupported, 8) << "the differential set should mostly run on CUDA";
}

}  // namespace
}  // namespace ds
