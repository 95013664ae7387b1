// Differential test against Hugging Face transformers 5.17 over many random configurations
// (tests/fixtures/hf_diff, tools/make_hf_differential.py): DeepSeek-V2 with and without
// q_lora, v_head_dim equal to or apart from qk_nope_head_dim, greedy and group-limited
// routing, routed scaling, dense first layers, 1-2 shared experts, YaRN with mscale !=
// mscale_all_dim, both config.json layouts, F32/BF16/F16 weights; and Llama with GQA/MQA and
// tied embeddings. The whole prompt is one prefill (logits of every position); the greedy
// continuation runs through the engine (decode path, paged cache, sampler), all prompts of a
// model at once.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "../../hf_diff_fixtures.h"
#include "../../hf_fixtures.h"
#include "engine/engine.h"

namespace ds {
namespace {

constexpr double kLogitRelTol = 1e-4;   // |ours - transformers| / logit range, every position
constexpr double kRobustMargin = 0.01;  // a greedy token may differ only below this margin

TEST(HfDifferential, FixturesPresent) {
  EXPECT_GE(test::hf_diff_index().size(), 40u)
      << test::hf_diff_root() << " (tools/make_hf_differential.py writes it)";
}

TEST(HfDifferential, LogitsAndGreedyMatchTransformers) {
  const auto index = test::hf_diff_index();
  if (index.empty()) GTEST_SKIP() << "no differential fixtures";
  double worst = 0;
  std::string worst_at;
  int positions = 0, compared = 0, generated = 0;
  for (const auto& entry : index) {
    const test::DiffCase c = test::read_diff_case(entry);
    SCOPED_TRACE(c.name + " (" + c.arch + ", " + c.layout + ", " + c.dtype + ")");
    test::CpuModel l = test::load_cpu_model(test::hf_diff_root() / c.name);
    ASSERT_EQ(l.m.config.vocab, c.vocab);
    std::vector<std::vector<int32_t>> prompts;
    double case_worst = 0;
    for (size_t i = 0; i < c.prompts.size(); ++i) {
      const test::DiffPrompt& p = c.prompts[i];
      size_t row = 0;
      const double d = test::expect_prompt_logits(test::prefill_rows(l, p.ids), p, c.vocab, i,
                                                  kLogitRelTol, &row);
      case_worst = std::max(case_worst, d);
      if (!(d <= worst)) {
        worst = d;
        worst_at = c.name + " prompt " + std::to_string(i) + " position " + std::to_string(row);
      }
      positions += int(p.ids.size());
      prompts.push_back(p.ids);
    }
    EngineConfig cfg;
    cfg.prefix_cache = false;
    // No tokenizer: these models have none, and the comparison is of token ids.
    Engine engine(*l.m.model, *l.backend, nullptr, cfg);
    const auto got = test::greedy_generate(engine, prompts, 32, true);
    // Float32 throughout: no router gap excuses a difference.
    compared += test::expect_greedy_matches(c, got, kRobustMargin, 0.0, case_worst);
    generated += 32 * int(c.prompts.size());
  }
  std::printf(
      "HfDifferential: %zu configs, %d prompt positions: max |logit diff|/range %.3g (%s); "
      "%d of %d greedy tokens compared along the reference (a different token fails where its "
      "margin > %g of the range)\n",
      index.size(), positions, worst, worst_at.c_str(), compared, generated, kRobustMargin);
}

}  // namespace
}  // namespace ds
