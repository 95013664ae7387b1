// Tiny random DeepSeek-V2 and Llama checkpoints against Hugging Face transformers 5.17.
// tools/make_hf_fixtures.py builds each model with transformers' own DeepseekV2ForCausalLM /
// LlamaForCausalLM, saves it (BF16, F16 or F32 safetensors; config.json in the published or
// the transformers-5 layout; a byte-level BPE tokenizer.json) and records transformers'
// float32 prefill logits and greedy continuations on the saved weights. Each fixture folder
// under tests/fixtures/hf is loaded here exactly as a downloaded checkpoint would be.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "../../hf_fixtures.h"
#include "engine/engine.h"
#include "model/loader.h"

namespace ds {
namespace {

namespace fs = std::filesystem;

constexpr double kLogitTol = 1e-3;      // ours (F32) vs transformers (F32), max abs
constexpr double kExpandedTol = 1e-4;   // absorbed vs expanded MLA, max abs
constexpr double kFragile = 1e-3;       // a greedy step whose top-2 margin is this small may flip
constexpr double kHiddenRelTol = 1e-4;  // residual stream vs transformers, of the layer's range

using test::hf_root;
const auto fixture_names = test::hf_fixture_names;

struct Prompt {
  std::string name, text;
  bool add_bos = false;
  std::vector<int32_t> ids, text_ids, generated;
  std::vector<double> margins;  // reference top-2 margin at each greedy step
  std::vector<float> logits;    // [ids.size(), vocab]
  // The prefill's residual stream by debug-hook name ("token_embd", "blk.N.out"), in the
  // model's order: [ids.size(), hidden] each.
  std::vector<std::pair<std::string, std::vector<float>>> hidden;
};

struct Reference {
  std::string name, arch, layout, dtype;
  bool mla = false;
  int vocab = 0, bos = -1, eos = -1;
  int tokenizer_vocab = 0;  // < vocab: padded embedding / lm_head rows no token names
  std::vector<Prompt> prompts;
};

Reference read_reference(const std::string& name) {
  std::ifstream in(hf_root() / name / "reference.json");
  const auto j = nlohmann::json::parse(in);
  Reference r;
  r.name = name;
  r.arch = j.at("arch");
  r.layout = j.at("config_layout");
  r.dtype = j.at("weights_dtype");
  r.mla = j.at("mla");
  r.vocab = j.at("vocab");
  r.tokenizer_vocab = j.value("tokenizer_vocab", r.vocab);
  r.bos = j.at("bos_id");
  r.eos = j.at("eos_id");
  for (const auto& p : j.at("prompts")) {
    Prompt q;
    q.name = p.at("name");
    q.text = p.at("text");
    q.add_bos = p.at("add_bos");
    q.ids = p.at("ids").get<std::vector<int32_t>>();
    q.text_ids = p.at("text_ids").get<std::vector<int32_t>>();
    q.generated = p.at("generated_ids").get<std::vector<int32_t>>();
    q.margins = p.at("generated_top2_margin").get<std::vector<double>>();
    for (const auto& row : p.at("logits")) {
      EXPECT_EQ(int(row.size()), r.vocab);
      for (const auto& v : row) q.logits.push_back(v.get<float>());
    }
    if (p.contains("hidden_states")) {
      const auto& hs = p.at("hidden_states");
      std::vector<std::string> names{"token_embd"};
      for (int layer = 0; hs.contains("blk." + std::to_string(layer) + ".out"); ++layer)
        names.push_back("blk." + std::to_string(layer) + ".out");
      for (const auto& n : names) {
        std::vector<float> v;
        for (const auto& row : hs.at(n))
          for (const auto& x : row) v.push_back(x.get<float>());
        q.hidden.emplace_back(n, std::move(v));
      }
    }
    r.prompts.push_back(std::move(q));
  }
  return r;
}

// A loaded fixture with its own backend and a one-sequence KV cache.
using Loaded = test::CpuModel;

Loaded load(const std::string& name, bool mla_expanded = false) {
  return test::load_cpu_model(hf_root() / name, mla_expanded);
}

std::vector<float> step(Loaded& l, const std::vector<int32_t>& ids, int start, int count) {
  return test::forward_rows(l, ids, start, count);
}

std::vector<float> prefill(Loaded& l, const std::vector<int32_t>& ids) {
  return test::prefill_rows(l, ids);
}

// One token per forward: every position goes through the decode path and the cache.
std::vector<float> token_by_token(Loaded& l, const std::vector<int32_t>& ids) {
  std::vector<float> out;
  for (int i = 0; i < int(ids.size()); ++i) {
    const auto row = step(l, ids, i, 1);
    out.insert(out.end(), row.begin(), row.end());
  }
  return out;
}

struct Diff {
  double max = 0;
  size_t at = 0;
};
Diff max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  Diff d;
  EXPECT_EQ(a.size(), b.size());
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    const double x = std::fabs(double(a[i]) - double(b[i]));
    if (!(x <= d.max)) {  // NaN counts as the worst
      d.max = std::isnan(x) ? INFINITY : x;
      d.at = i;
    }
  }
  return d;
}

std::vector<std::vector<int32_t>> generate(Loaded& l, const Reference& ref, const EngineConfig& cfg,
                                           const std::vector<std::vector<int32_t>>& prompts,
                                           int max_tokens, bool concurrent) {
  Engine engine(*l.m.model, *l.backend, l.m.tokenizer.get(), cfg);
  return test::greedy_generate(engine, prompts, max_tokens, concurrent);
}

// The prefill's named intermediates, through the model's debug hook.
std::map<std::string, std::vector<float>> prefill_dumps(Loaded& l,
                                                        const std::vector<int32_t>& ids) {
  std::map<std::string, std::vector<float>> seen;
  l.m.model->set_debug_hook([&](const std::string& name, const TensorView& t) {
    std::vector<float> v(size_t(t.numel()));
    l.backend->synchronize();
    l.backend->download(v.data(), t, v.size() * sizeof(float));
    seen[name] = std::move(v);
  });
  prefill(l, ids);
  l.m.model->set_debug_hook(nullptr);
  return seen;
}

class HfGolden : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { ref_ = read_reference(GetParam()); }
  Reference ref_;
};

TEST(HfGoldenFixtures, Present) {
  if (fixture_names().empty())
    GTEST_SKIP() << hf_root() << " holds no fixtures (tools/make_hf_fixtures.py writes them)";
  EXPECT_GE(fixture_names().size(), 4u);
}

TEST_P(HfGolden, ConfigMatchesReference) {
  Loaded l = load(GetParam());
  const ModelConfig& c = l.m.config;
  EXPECT_EQ(c.arch, ref_.arch);
  EXPECT_EQ(c.vocab, ref_.vocab);
  EXPECT_EQ(c.bos_id, ref_.bos);
  EXPECT_EQ(c.eos_id, ref_.eos);
  EXPECT_EQ(c.is_mla(), ref_.mla);
  EXPECT_EQ(l.m.format, "safetensors");
}

TEST_P(HfGolden, PrefillLogitsMatchTransformers) {
  Loaded l = load(GetParam());
  ASSERT_EQ(l.m.config.vocab, ref_.vocab);
  for (const auto& p : ref_.prompts) {
    const Diff d = max_abs_diff(prefill(l, p.ids), p.logits);
    std::printf("  %s %s (%zu tokens, %s %s): max |logit diff| %.3g at position %zu\n",
                ref_.name.c_str(), p.name.c_str(), p.ids.size(), ref_.dtype.c_str(),
                ref_.layout.c_str(), d.max, d.at / size_t(ref_.vocab));
    EXPECT_LE(d.max, kLogitTol) << p.name << " position " << d.at / size_t(ref_.vocab) << " token "
                                << d.at % size_t(ref_.vocab);
  }
}

// The residual stream after the embedding and after every layer, so a failure names the
// first layer that departs from transformers.
TEST_P(HfGolden, HiddenStatesMatchTransformersLayerByLayer) {
  Loaded l = load(GetParam());
  int compared = 0;
  for (const auto& p : ref_.prompts) {
    if (p.hidden.empty()) continue;
    const auto got = prefill_dumps(l, p.ids);
    for (const auto& [name, want] : p.hidden) {
      const auto it = got.find(name);
      ASSERT_NE(it, got.end()) << "the model dumped no " << name;
      const auto [lo, hi] = std::minmax_element(want.begin(), want.end());
      const double range = double(*hi) - double(*lo);
      const Diff d = max_abs_diff(it->second, want);
      const size_t hidden = want.size() / p.ids.size();
      ASSERT_LE(d.max, kHiddenRelTol * range)
          << p.name << ": " << name << " is the first to differ (range " << range << "), position "
          << d.at / hidden << " element " << d.at % hidden;
      ++compared;
    }
  }
  EXPECT_GT(compared, 0) << "reference.json has no hidden_states";
}

// Every position through the decode path (absorbed MLA for DeepSeek) and the paged cache.
TEST_P(HfGolden, TokenByTokenLogitsMatchTransformers) {
  Loaded l = load(GetParam());
  ASSERT_EQ(l.m.config.vocab, ref_.vocab);
  for (const auto& p : ref_.prompts) {
    const Diff d = max_abs_diff(token_by_token(l, p.ids), p.logits);
    EXPECT_LE(d.max, kLogitTol) << p.name << " position " << d.at / size_t(ref_.vocab) << " token "
                                << d.at % size_t(ref_.vocab);
  }
}

TEST_P(HfGolden, GreedyContinuationMatchesTransformers) {
  Loaded l = load(GetParam());
  EngineConfig cfg;
  cfg.prefix_cache = false;
  for (const auto& p : ref_.prompts) {
    const int n = int(p.generated.size());
    const auto got = generate(l, ref_, cfg, {p.ids}, n, false)[0];
    ASSERT_EQ(int(got.size()), n) << p.name;
    // Identity is required up to the first step whose reference margin is a near-tie.
    int robust = 0;
    while (robust < n && p.margins[size_t(robust)] > kFragile) ++robust;
    if (robust < n)
      std::printf("  %s %s: reference near-tie at step %d, compared up to there\n",
                  ref_.name.c_str(), p.name.c_str(), robust);
    int same = 0;
    while (same < robust && got[size_t(same)] == p.generated[size_t(same)]) ++same;
    EXPECT_EQ(same, robust) << p.name << ": first difference at step " << same
                            << " (reference margin there " << p.margins[size_t(same)] << ")";
  }
}

TEST_P(HfGolden, BatchedEqualsAlone) {
  Loaded l = load(GetParam());
  std::vector<std::vector<int32_t>> prompts;
  for (const auto& p : ref_.prompts) prompts.push_back(p.ids);
  // Twice each, so equal prompts share steps (and, with the prefix cache, blocks).
  for (const auto& p : ref_.prompts) prompts.push_back(p.ids);
  EngineConfig alone_cfg;
  alone_cfg.prefix_cache = false;
  const auto alone = generate(l, ref_, alone_cfg, prompts, 32, false);
  EXPECT_EQ(generate(l, ref_, alone_cfg, prompts, 32, true), alone) << "batched";
  EngineConfig chunked = alone_cfg;
  chunked.max_num_seqs = 4;
  chunked.max_num_batched_tokens = 7;  // prompts split into chunks of a few tokens
  EXPECT_EQ(generate(l, ref_, chunked, prompts, 32, true), alone) << "chunked prefill";
  EngineConfig cached;
  cached.prefix_cache = true;
  EXPECT_EQ(generate(l, ref_, cached, prompts, 32, true), alone) << "prefix cache";
}

// Every token the model processes is routed to top_k experts in every MoE layer; the engine's
// statistics must account for all of them once it is idle.
TEST_P(HfGolden, ExpertLoadCountsEveryRoutedToken) {
  if (!ref_.mla) GTEST_SKIP() << "not a MoE model";
  Loaded l = load(GetParam());
  const ModelConfig& c = l.m.config;
  EngineConfig cfg;
  cfg.prefix_cache = false;
  Engine engine(*l.m.model, *l.backend, l.m.tokenizer.get(), cfg);
  int requests = 0;
  for (const auto& p : ref_.prompts) {
    EngineRequest r;
    r.prompt = p.ids;
    r.max_tokens = 5;
    r.sampling.temperature = 0;
    r.ignore_eos = true;
    engine.submit(r)->wait();
    ++requests;
  }
  int moe_layers = 0;
  for (int layer = 0; layer < c.layers; ++layer) moe_layers += c.is_moe_layer(layer) ? 1 : 0;
  // The idle refresh runs right after the last step: poll briefly for it.
  EngineStats st;
  int64_t routed = 0;
  for (int tries = 0; tries < 200; ++tries) {
    st = engine.stats();
    routed = 0;
    for (const auto& el : st.expert_load)
      for (int64_t n : el.tokens) routed += n;
    const int64_t processed = st.prompt_tokens_computed + st.tokens_generated - requests;
    if (routed == processed * c.moe_top_k * moe_layers) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_EQ(int(st.expert_load.size()), moe_layers);
  const int64_t processed = st.prompt_tokens_computed + st.tokens_generated - requests;
  EXPECT_EQ(routed, processed * c.moe_top_k * moe_layers);
}

// The expanded form is the straightforward per-head attention; the absorbed one (the
// default) folds kv_b_proj into the query and output and attends over the latent cache.
TEST_P(HfGolden, ExpandedMlaMatchesAbsorbed) {
  if (!ref_.mla) GTEST_SKIP() << "not an MLA model";
  Loaded absorbed = load(GetParam());
  Loaded expanded = load(GetParam(), true);
  for (const auto& p : ref_.prompts) {
    const auto e_prefill = prefill(expanded, p.ids);
    const auto e_decode = token_by_token(expanded, p.ids);
    const auto a_prefill = prefill(absorbed, p.ids);
    const auto a_decode = token_by_token(absorbed, p.ids);
    EXPECT_LE(max_abs_diff(e_decode, e_prefill).max, kExpandedTol) << p.name;
    EXPECT_LE(max_abs_diff(a_prefill, e_prefill).max, kExpandedTol) << p.name;
    EXPECT_LE(max_abs_diff(a_decode, e_prefill).max, kExpandedTol) << p.name;
    EXPECT_LE(max_abs_diff(a_decode, e_decode).max, kExpandedTol) << p.name;
  }
}

TEST_P(HfGolden, TokenizerMatchesTransformers) {
  Loaded l = load(GetParam());
  ASSERT_NE(l.m.tokenizer, nullptr) << "tokenizer.json was not loaded";
  const Tokenizer& t = *l.m.tokenizer;
  EXPECT_EQ(t.vocab_size(), ref_.tokenizer_vocab);
  EXPECT_EQ(t.bos_id(), ref_.bos);
  EXPECT_EQ(t.eos_id(), ref_.eos);
  EXPECT_TRUE(t.add_bos_default());
  for (const auto& p : ref_.prompts) {
    EXPECT_EQ(t.encode(p.text, false, true), p.text_ids) << p.name;
    EXPECT_EQ(t.encode(p.text, p.add_bos, true), p.ids) << p.name;
    EXPECT_EQ(t.decode(p.text_ids), p.text) << p.name;
  }
}

// A padded vocabulary (embedding and lm_head rows past the tokenizer): the fixture's greedy
// continuations reach those ids (GreedyContinuationMatchesTransformers compares them).
TEST(HfGoldenPaddedVocab, ReferenceGeneratesIdsPastTheTokenizer) {
  int padded_fixtures = 0;
  for (const auto& name : fixture_names()) {
    const Reference r = read_reference(name);
    if (r.tokenizer_vocab == r.vocab) continue;
    ++padded_fixtures;
    EXPECT_LT(r.tokenizer_vocab, r.vocab);
    int past = 0;
    for (const auto& p : r.prompts)
      for (int32_t t : p.generated) past += t >= r.tokenizer_vocab ? 1 : 0;
    EXPECT_GT(past, 0) << name;
    Loaded l = load(name);
    EXPECT_EQ(l.m.config.vocab, r.vocab) << name;
    ASSERT_NE(l.m.tokenizer, nullptr);
    EXPECT_EQ(l.m.tokenizer->vocab_size(), r.tokenizer_vocab) << name;
  }
  EXPECT_GE(padded_fixtures, 1);
}

GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(HfGolden);
INSTANTIATE_TEST_SUITE_P(Fixtures, HfGolden, ::testing::ValuesIn(fixture_names()),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

}  // namespace
}  // namespace ds
