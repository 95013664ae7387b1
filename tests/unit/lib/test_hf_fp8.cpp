// FP8 checkpoints as published (tests/fixtures/hf_fp8, tools/make_fp8_fixture.py): a DeepSeek-V2
// with DeepSeek-V3's 128 x 128 block scales (`weight_scale_inv`) and a Llama with per-channel
// scales (`weight_scale` [N, 1]), F8_E4M3 linear weights with partial 128-blocks along N and K.
// The golden is transformers' float32 forward of the dequantized weights (fp8 * scale), which
// FP8W holds exactly: only float32 summation order may differ.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "../../hf_diff_fixtures.h"
#include "../../hf_fixtures.h"
#include "engine/engine.h"
#include "formats/safetensors.h"

namespace ds {
namespace {

constexpr double kLogitRelTol = 1e-4;  // |ours - transformers| / logit range, every position

std::filesystem::path fp8_root() {
  return std::filesystem::path(DS_FIXTURES_DIR) / "hf_fp8";
}

// Parameters of the F8_E4M3 tensors that must bind as FP8W: every one but MLA's kv_b_proj,
// which the absorbed form reads dequantized to F32.
uint64_t fp8w_params(const std::filesystem::path& dir) {
  const auto f = SafetensorsFile::open(dir / "model.safetensors");
  uint64_t n = 0;
  for (const auto& t : f.tensors())
    if (t.dtype == DType::F8_E4M3 && t.name.find("kv_b_proj") == std::string::npos)
      n += uint64_t(t.shape[0] * t.shape[1]);
  return n;
}

TEST(HfFp8, FixturesPresent) {
  EXPECT_EQ(test::hf_diff_index(fp8_root()).size(), 2u)
      << fp8_root() << " (tools/make_fp8_fixture.py writes it)";
}

TEST(HfFp8, BindsFp8wAndMatchesTransformersOnDequantizedWeights) {
  const auto index = test::hf_diff_index(fp8_root());
  ASSERT_FALSE(index.empty());
  for (const auto& entry : index) {
    const test::DiffCase c = test::read_diff_case(entry, fp8_root());
    SCOPED_TRACE(c.name + " (" + c.arch + ", " + std::string(entry.at("scales")) + " scales)");
    const auto dir = fp8_root() / c.name;
    test::CpuModel l = test::load_cpu_model(dir);
    ASSERT_EQ(l.m.config.vocab, c.vocab);
    EXPECT_EQ(l.m.config.quant_method, "fp8");
    const auto& formats = l.m.model->weight_formats();
    ASSERT_TRUE(formats.count("FP8W"));
    EXPECT_EQ(formats.at("FP8W").second, fp8w_params(dir)) << "an FP8 linear did not bind as FP8W";
    std::vector<std::vector<int32_t>> prompts;
    double worst = 0;
    for (size_t i = 0; i < c.prompts.size(); ++i) {
      const test::DiffPrompt& p = c.prompts[i];
      const double d =
          test::expect_prompt_logits(test::prefill_rows(l, p.ids), p, c.vocab, i, kLogitRelTol);
      worst = std::max(worst, d);
      prompts.push_back(p.ids);
    }
    if (c.arch == "deepseek_v2") {  // the expanded MLA prefill reads kv_b_proj too
      test::CpuModel e = test::load_cpu_model(dir, /*mla_expanded=*/true);
      for (size_t i = 0; i < c.prompts.size(); ++i) {
        const double d = test::max_diff_over_range(test::prefill_rows(e, c.prompts[i].ids),
                                                   c.prompts[i].logits, c.vocab);
        EXPECT_LE(d, kLogitRelTol) << "mla_expanded, prompt " << i;
      }
    }
    EngineConfig cfg;
    cfg.prefix_cache = false;
    Engine engine(*l.m.model, *l.backend, nullptr, cfg);
    const auto got = test::greedy_generate(engine, prompts, 32, true);
    // Every greedy margin of these fixtures is >= 1e-4 of the range: all 32 tokens must agree.
    const int compared = test::expect_greedy_matches(c, got, 0.0, 0.0, worst);
    EXPECT_EQ(compared, 32 * int(c.prompts.size()));
  }
}

}  // namespace
}  // namespace ds
