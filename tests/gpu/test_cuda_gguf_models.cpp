// Whole GGUF models with block-quantized weights on CUDA against the same file on the CPU:
// the DeepSeek-V2 GGUF fixture deepseek_v2_qlora_bf16 re-quantized to Q8_0 / Q4_0 / Q4_1 at
// test time (every matrix whose rows are whole blocks: token embedding, output, attention
// projections, the dense FFN; its experts' F = 24 keeps them BF16), and the real SmolLM2-135M Q4_1
// file (DS_SMOLLM2_GGUF). The CPU quantizes activations to 8 bits (llama.cpp's way) where the
// GPU keeps them F32, and the GPU caches KV in BF16: prefill logits must agree within 3% of
// the largest |logit|, and 32 greedy tokens must agree up to the first step whose CPU top-2
// margin is under max(1% of that scale, twice the worst prefill difference).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "../hf_fixtures.h"
#include "gguf_requant.h"
#include "gpu_models.h"
#include "gpu_test_util.h"

namespace ds {
namespace {

namespace fs = std::filesystem;

constexpr double kRelTol = 0.03;
constexpr int kGenTokens = 32;

std::vector<std::vector<int32_t>> cpu_greedy(test::CpuModel& l,
                                             const std::vector<std::vector<int32_t>>& ps, int n) {
  EngineConfig cfg;
  cfg.prefix_cache = false;
  cfg.kv_dtype = DType::F32;
  cfg.kv_cache_tokens = 2048;
  Engine engine(*l.m.model, *l.backend, l.m.tokenizer.get(), cfg);
  return test::greedy_generate(engine, ps, n, false);
}

void compare_on_gpu(const fs::path& path, const std::vector<std::vector<int32_t>>& prompts) {
  test::CpuModel c = test::load_cpu_model(path);
  test::OnGpu g = test::load_on_gpu(path);
  ASSERT_EQ(c.m.config.vocab, g.m.config.vocab);
  const size_t vocab = size_t(g.m.config.vocab);
  for (const auto& ids : prompts) {
    const auto want = test::prefill_rows(c, ids);
    const auto got = test::gpu_prefill(g, ids);
    ASSERT_EQ(want.size(), got.size());
    double scale = 1, worst = 0;
    for (float v : want) scale = std::max(scale, double(std::fabs(v)));
    size_t at = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      const double d = std::fabs(double(got[i]) - double(want[i]));
      if (!(d <= worst)) {
        worst = std::isnan(d) ? INFINITY : d;
        at = i;
      }
    }
    std::printf("  %s (%zu tokens): max |logit diff| %.4g of scale %.4g at position %zu\n",
                path.filename().c_str(), ids.size(), worst, scale, at / vocab);
    EXPECT_LE(worst, kRelTol * scale) << path.filename() << " at position " << at / vocab;

    // Greedy: the CPU's continuation, its margins (teacher-forced), the GPU's continuation.
    const auto ref = cpu_greedy(c, {ids}, kGenTokens)[0];
    std::vector<int32_t> full = ids;
    full.insert(full.end(), ref.begin(), ref.end() - 1);
    const auto logits = test::prefill_rows(c, full);
    int robust = 0;
    const double need = std::max(0.01 * scale, 2 * worst);
    for (; robust < int(ref.size()); ++robust) {
      const float* row = logits.data() + (ids.size() - 1 + size_t(robust)) * vocab;
      std::vector<float> r(row, row + vocab);
      std::partial_sort(r.begin(), r.begin() + 2, r.end(), std::greater<float>());
      if (!(double(r[0] - r[1]) > need)) break;
    }
    const auto out = test::gpu_greedy(g, {ids}, kGenTokens, false)[0];
    std::printf("  greedy: %d of %d steps above the margin\n", robust, kGenTokens);
    ASSERT_EQ(out.size(), ref.size());
    for (int i = 0; i < robust; ++i) ASSERT_EQ(out[size_t(i)], ref[size_t(i)]) << "step " << i;
    const auto batched = test::gpu_greedy(g, {ids, ids}, kGenTokens, true);
    EXPECT_EQ(batched[0], out) << "batch invariance";
  }
}

class CudaGgufDeepseek : public ::testing::TestWithParam<DType> {};

TEST_P(CudaGgufDeepseek, RequantizedFixtureMatchesTheCpu) {
  DS_REQUIRE_GPU();
  const fs::path src = fs::path(DS_FIXTURES_DIR) / "gguf_deepseek" / "deepseek_v2_qlora_bf16.gguf";
  const fs::path dst = fs::temp_directory_path() /
                       ("ds_gguf_" + std::string(dtype_name(GetParam())) + "_deepseek.gguf");
  test::requantize_gguf(src, dst, GetParam());
  compare_on_gpu(dst, {{17, 301, 44, 250, 99, 7, 408, 120, 65, 333, 12, 201}, {5}});
  fs::remove(dst);
}

INSTANTIATE_TEST_SUITE_P(Types, CudaGgufDeepseek,
                         ::testing::Values(DType::Q8_0, DType::Q4_0, DType::Q4_1),
                         [](const auto& p) { return std::string(dtype_name(p.param)); });

TEST(CudaGgufModels, SmolLm2Q41MatchesTheCpu) {
  DS_REQUIRE_GPU();
  const char* path = std::getenv("DS_SMOLLM2_GGUF");
  if (!path) GTEST_SKIP() << "DS_SMOLLM2_GGUF is not set";
  test::CpuModel probe = test::load_cpu_model(path);
  ASSERT_TRUE(probe.m.tokenizer);
  const auto ids = probe.m.tokenizer->encode("The capital of France is", true, false);
  compare_on_gpu(path, {ids});
}

}  // namespace
}  // namespace ds
