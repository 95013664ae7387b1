// DeepSeek-V2 from llama.cpp `deepseek2` GGUF files. tools/make_gguf_deepseek_fixtures.py
// converts tiny Hugging Face checkpoints (tests/fixtures/hf) with llama.cpp's own
// convert_hf_to_gguf.py into tests/fixtures/gguf_deepseek/*.gguf, and records llama.cpp's
// logits on one of them. Here the GGUF must give the same config, tensors, tokens, logits and
// greedy continuations as the safetensors checkpoint it came from (which HfGolden checks
// against transformers), and agree with llama.cpp's own forward of the file.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "../../hf_fixtures.h"
#include "engine/engine.h"
#include "formats/safetensors.h"
#include "model/binder.h"
#include "model/loader.h"

namespace ds {
namespace {

namespace fs = std::filesystem;

constexpr double kRelTol = 1e-3;  // max abs logit difference / logit range
// An F16 conversion of an F32 checkpoint against that checkpoint: weight rounding alone moves
// transformers' logits by up to 2.3e-3 of their range on these prompts (ours: 2.7e-3).
constexpr double kRoundedRelTol = 5e-3;
constexpr int kGenerate = 16;

fs::path gguf_root() {
  return fs::path(DS_FIXTURES_DIR) / "gguf_deepseek";
}

struct Pair {
  const char* gguf;  // tests/fixtures/gguf_deepseek/<gguf>.gguf
  const char* hf;    // tests/fixtures/hf/<hf>
  bool lossless;     // converted to the checkpoint's own dtype
};
constexpr Pair kPairs[] = {
    {"deepseek_v2_qlora_bf16", "deepseek_v2_qlora_bf16", true},
    {"deepseek_v2_yarn_grouped_f16", "deepseek_v2_yarn_grouped_f32", false},  // F32 -> F16
};

using Loaded = test::CpuModel;
using test::prefill_rows;

Loaded load(const fs::path& path) {
  return test::load_cpu_model(path);
}

std::vector<int32_t> greedy(Loaded& l, const std::vector<int32_t>& prompt) {
  EngineConfig cfg;
  cfg.prefix_cache = false;
  Engine engine(*l.m.model, *l.backend, l.m.tokenizer.get(), cfg);
  return test::greedy_generate(engine, {prompt}, kGenerate, false)[0];
}

double range_of(const std::vector<float>& v) {
  const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
  return double(*hi) - double(*lo);
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double d = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    const double x = std::fabs(double(a[i]) - double(b[i]));
    d = std::isnan(x) ? INFINITY : std::max(d, x);
  }
  return d;
}

// The reference prompts of the Hugging Face fixture (ids as transformers tokenized them).
std::vector<std::pair<std::string, std::vector<int32_t>>> hf_prompts(const char* hf) {
  std::ifstream in(test::hf_root() / hf / "reference.json");
  const auto j = nlohmann::json::parse(in);
  std::vector<std::pair<std::string, std::vector<int32_t>>> out;
  for (const auto& p : j.at("prompts"))
    out.emplace_back(p.at("text").get<std::string>(), p.at("ids").get<std::vector<int32_t>>());
  return out;
}

class GgufDeepseek : public ::testing::TestWithParam<Pair> {
 protected:
  void SetUp() override {
    if (!fs::exists(gguf_path())) {
      GTEST_SKIP() << gguf_path() << " missing (tools/make_gguf_deepseek_fixtures.py)";
    }
  }
  fs::path gguf_path() const { return gguf_root() / (std::string(GetParam().gguf) + ".gguf"); }
  fs::path hf_path() const { return test::hf_root() / GetParam().hf; }
};

TEST_P(GgufDeepseek, ConfigMatchesSafetensors) {
  const LoadedModel g = open_model_metadata(gguf_path());
  const LoadedModel h = open_model_metadata(hf_path());
  const ModelConfig &a = g.config, &b = h.config;
  EXPECT_EQ(g.format, "gguf");
  EXPECT_EQ(a.arch, "deepseek_v2");
  EXPECT_EQ(a.arch, b.arch);
  for (auto [x, y, what] : {std::tuple{a.hidden, b.hidden, "hidden"},
                            {a.layers, b.layers, "layers"},
                            {a.heads, b.heads, "heads"},
                            {a.kv_heads, b.kv_heads, "kv_heads"},
                            {a.head_dim, b.head_dim, "head_dim"},
                            {a.intermediate, b.intermediate, "intermediate"},
                            {a.vocab, b.vocab, "vocab"},
                            {a.q_lora_rank, b.q_lora_rank, "q_lora_rank"},
                            {a.kv_lora_rank, b.kv_lora_rank, "kv_lora_rank"},
                            {a.qk_nope_dim, b.qk_nope_dim, "qk_nope_dim"},
                            {a.qk_rope_dim, b.qk_rope_dim, "qk_rope_dim"},
                            {a.v_head_dim, b.v_head_dim, "v_head_dim"},
                            {a.moe_experts, b.moe_experts, "moe_experts"},
                            {a.moe_top_k, b.moe_top_k, "moe_top_k"},
                            {a.moe_shared_experts, b.moe_shared_experts, "moe_shared_experts"},
                            {a.moe_intermediate, b.moe_intermediate, "moe_intermediate"},
                            {a.first_k_dense, b.first_k_dense, "first_k_dense"},
                            {a.moe_layer_freq, b.moe_layer_freq, "moe_layer_freq"},
                            {a.moe_n_group, b.moe_n_group, "moe_n_group"},
                            {a.moe_topk_group, b.moe_topk_group, "moe_topk_group"},
                            {a.rope.rotary_dim, b.rope.rotary_dim, "rotary_dim"},
                            {a.rope.yarn_original_max_position, b.rope.yarn_original_max_position,
                             "yarn_original_max_position"},
                            {a.bos_id, b.bos_id, "bos_id"},
                            {a.eos_id, b.eos_id, "eos_id"}})
    EXPECT_EQ(x, y) << what;
  EXPECT_EQ(a.max_context, b.max_context);
  EXPECT_EQ(a.moe_topk_method, b.moe_topk_method);
  EXPECT_EQ(a.moe_norm_topk_prob, b.moe_norm_topk_prob);
  EXPECT_EQ(a.tied_embeddings, b.tied_embeddings);
  EXPECT_EQ(a.rope.style, b.rope.style);
  for (auto [x, y, what] : {std::tuple{a.rms_eps, b.rms_eps, "rms_eps"},
                            {a.attn_scale, b.attn_scale, "attn_scale"},
                            {a.moe_routed_scaling, b.moe_routed_scaling, "routed_scaling"},
                            {a.rope.theta, b.rope.theta, "rope theta"},
                            {a.rope.freq_scale, b.rope.freq_scale, "freq_scale"},
                            {a.rope.attn_factor, b.rope.attn_factor, "attn_factor"},
                            {a.rope.yarn_factor, b.rope.yarn_factor, "yarn_factor"},
                            {a.rope.yarn_beta_fast, b.rope.yarn_beta_fast, "beta_fast"},
                            {a.rope.yarn_beta_slow, b.rope.yarn_beta_slow, "beta_slow"}})
    EXPECT_NEAR(x, y, 1e-6 * std::max(1.0f, std::fabs(y))) << what;
}

// Every tensor of the checkpoint, looked up by its Hugging Face name in the GGUF: stacked
// experts, the rebuilt kv_b_proj and the renamed rest hold the same values.
TEST_P(GgufDeepseek, TensorsMatchSafetensors) {
  const LoadedModel g = open_model_metadata(gguf_path());
  const auto ckpt = SafetensorsCheckpoint::open(hf_path());
  // F16 rounds to nearest: at most half an ulp, 2^-11 relative (plus subnormals' absolute).
  const double rel = GetParam().lossless ? 0.0 : 0.5 / 1024, abs = GetParam().lossless ? 0 : 1e-7;
  int checked = 0;
  for (const auto& name : ckpt.tensor_names()) {
    const TensorView want = ckpt.view(name);
    const auto got = g.weights->find(name);
    ASSERT_TRUE(got) << name;
    ASSERT_EQ(got->rows() * got->cols(), want.rows() * want.cols()) << name;
    const TensorView w2 = TensorView::contiguous(want.data, want.dtype, {want.rows(), want.cols()});
    // 1-D norms are [n] in both; matrices compare row by row.
    TensorView g2 = *got;
    if (g2.ndim == 1) g2 = TensorView::contiguous(got->data, got->dtype, {1, got->cols()});
    ASSERT_EQ(g2.rows(), w2.rows()) << name;
    double worst = 0;  // excess over the allowed rounding
    for (int64_t r = 0; r < w2.rows(); ++r)
      for (int64_t c = 0; c < w2.cols(); ++c) {
        const TensorView gr = TensorView::contiguous(g2.row(r), g2.dtype, {g2.cols()});
        const TensorView wr = TensorView::contiguous(w2.row(r), w2.dtype, {w2.cols()});
        const double x = host_element(gr, c), y = host_element(wr, c);
        worst = std::max(worst, std::fabs(x - y) - (rel * std::fabs(y) + abs));
      }
    EXPECT_LE(worst, 0.0) << name;
    ++checked;
  }
  EXPECT_GT(checked, 40);
}

TEST_P(GgufDeepseek, TokenizerMatchesTransformers) {
  const LoadedModel g = open_model_metadata(gguf_path());
  ASSERT_TRUE(g.tokenizer);
  for (const auto& [text, ids] : hf_prompts(GetParam().hf))
    EXPECT_EQ(g.tokenizer->encode(text, !ids.empty() && ids[0] == g.config.bos_id, false), ids)
        << text;
}

TEST_P(GgufDeepseek, LogitsAndGreedyMatchSafetensors) {
  Loaded g = load(gguf_path());
  Loaded h = load(hf_path());
  for (const auto& [text, ids] : hf_prompts(GetParam().hf)) {
    const auto want = prefill_rows(h, ids);
    const auto got = prefill_rows(g, ids);
    const double range = range_of(want), diff = max_abs_diff(got, want);
    EXPECT_LE(diff, (GetParam().lossless ? kRelTol : kRoundedRelTol) * range)
        << "prompt '" << text << "': range " << range;
    if (GetParam().lossless) {
      EXPECT_EQ(diff, 0.0) << "same weights, same ops";
    }
    EXPECT_EQ(greedy(g, ids), greedy(h, ids)) << "prompt '" << text << "'";
  }
}

// The F16 conversion against transformers on the same F16-rounded weights.
TEST_P(GgufDeepseek, MatchesTransformersOnRoundedWeights) {
  const fs::path ref = gguf_root() / (std::string(GetParam().gguf) + ".transformers.json");
  if (!fs::exists(ref)) {
    GTEST_SKIP() << "lossless conversion: the safetensors comparison covers it";
  }
  std::ifstream in(ref);
  const auto j = nlohmann::json::parse(in);
  Loaded g = load(gguf_path());
  int prompts = 0;
  for (const auto& p : j.at("prompts")) {
    const auto ids = p.at("ids").get<std::vector<int32_t>>();
    std::vector<float> want;
    for (const auto& row : p.at("logits"))
      for (const auto& v : row) want.push_back(v.get<float>());
    const auto got = prefill_rows(g, ids);
    const double range = range_of(want), diff = max_abs_diff(got, want);
    EXPECT_LE(diff, kRelTol * range) << "prompt " << prompts << ": range " << range;
    EXPECT_EQ(greedy(g, ids), p.at("generated_ids").get<std::vector<int32_t>>())
        << "prompt " << prompts;
    ++prompts;
  }
  EXPECT_GE(prompts, 3);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GgufDeepseek, ::testing::ValuesIn(kPairs),
                         [](const auto& info) { return std::string(info.param.gguf); });

// llama.cpp's own forward of the GGUF (an F32 conversion of the same checkpoint, so its
// matmuls keep F32 activations): prefill logits and greedy continuation.
TEST(GgufDeepseekLlamaCpp, MatchesLlamaCpp) {
  const fs::path ref = gguf_root() / "deepseek_v2_qlora_bf16.llamacpp.json";
  if (!fs::exists(ref)) {
    GTEST_SKIP() << ref << " missing";
  }
  std::ifstream in(ref);
  const auto j = nlohmann::json::parse(in);
  const auto ids = j.at("ids").get<std::vector<int32_t>>();
  std::vector<float> want;
  for (const auto& row : j.at("logits"))
    for (const auto& v : row) want.push_back(v.get<float>());
  Loaded g = load(gguf_root() / j.at("gguf").get<std::string>());
  ASSERT_EQ(want.size(), ids.size() * size_t(g.m.config.vocab));
  const auto got = prefill_rows(g, ids);
  const double range = range_of(want), diff = max_abs_diff(got, want);
  EXPECT_LE(diff, kRelTol * range) << "range " << range;
  // Greedy: equal up to the first step whose llama.cpp-side choice is a near tie.
  const auto ref_gen = j.at("generated_ids").get<std::vector<int32_t>>();
  const auto ours = greedy(g, ids);
  ASSERT_EQ(ours.size(), ref_gen.size());
  const auto last = std::vector<float>(got.end() - g.m.config.vocab, got.end());
  EXPECT_EQ(ours[0], int32_t(std::max_element(last.begin(), last.end()) - last.begin()));
  EXPECT_EQ(ours, ref_gen);
}

}  // namespace
}  // namespace ds
