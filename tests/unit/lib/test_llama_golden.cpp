// SmolLM2-135M Q4_1 against golden outputs recorded from llama.cpp itself
// (tools/make_llamacpp_fixtures.py, llama-cpp-python built from source).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>

#include "engine/generator.h"
#include "engine/sampler.h"
#include "model/loader.h"

namespace ds {
namespace {

struct Golden {
  nlohmann::json j;
  std::unique_ptr<Backend> backend;
  LoadedModel m;
};

Golden* golden() {
  static Golden* g = [] {
    const char* path = std::getenv("DS_SMOLLM2_GGUF");
    if (!path) return static_cast<Golden*>(nullptr);
    auto* g = new Golden;
    std::ifstream in(std::string(DS_FIXTURES_DIR) + "/llamacpp/smollm2_q4_1.json");
    g->j = nlohmann::json::parse(in);
    BackendOptions bo;
    bo.threads = 2;
    g->backend = make_cpu_backend(bo);
    g->m = load_model(path, *g->backend, {});
    return g;
  }();
  return g;
}

#define NEED_MODEL()                                                     \
  Golden* g = golden();                                                  \
  if (!g) GTEST_SKIP() << "DS_SMOLLM2_GGUF is not set (scripts/test.sh sets it)"

TEST(LlamaGolden, TokenIdsMatchLlamaCpp) {
  NEED_MODEL();
  for (const auto& p : g->j["prompts"]) {
    const auto ids = g->m.tokenizer->encode(p["text"].get<std::string>(), false, true);
    EXPECT_EQ(ids, p["ids"].get<std::vector<int32_t>>()) << p["name"];
  }
}

// Runs every prompt once with logits at every position and compares them with llama.cpp's
// top-16, then continues greedily for as many tokens as the fixture holds.
TEST(LlamaGolden, LogitsAndGreedyContinuations) {
  NEED_MODEL();
  const int vocab = g->m.config.vocab;
  KvCacheConfig kvc;
  kvc.num_blocks = 128;
  KvCache cache(*g->backend, g->m.config, kvc);
  int positions = 0, top1_agree = 0, same_continuations = 0, prompts = 0;
  double max_diff = 0;
  std::string worst;
  for (const auto& p : g->j["prompts"]) {
    ++prompts;
    const auto ids = p["ids"].get<std::vector<int32_t>>();
    const int n = int(ids.size());
    std::vector<int32_t> rows(static_cast<size_t>(n)), pos(rows), table(static_cast<size_t>(kvc.num_blocks));
    for (int i = 0; i < n; ++i) rows[size_t(i)] = pos[size_t(i)] = i;
    for (int b = 0; b < kvc.num_blocks; ++b) table[size_t(b)] = b;
    const int32_t qs[2] = {0, n}, ctx[1] = {n};
    ForwardInput in;
    in.tokens = ids;
    in.meta.num_seqs = 1;
    in.meta.num_tokens = n;
    in.meta.query_start = qs;
    in.meta.context_lens = ctx;
    in.meta.block_tables = table.data();
    in.meta.max_blocks_per_seq = kvc.num_blocks;
    in.meta.slot_mapping = pos.data();
    in.meta.positions = pos.data();
    in.logit_rows = rows;
    auto buf = g->backend->alloc(size_t(n) * size_t(vocab) * 4);
    TensorView logits = buf->view(DType::F32, {n, vocab});
    g->m.model->forward(in, cache, logits);
    const float* lg = logits.ptr<float>();
    for (int i = 0; i < n; ++i) {
      const auto& top = p["positions"][size_t(i)]["top"];
      const float* row = lg + int64_t(i) * vocab;
      ++positions;
      top1_agree += argmax(std::span(row, size_t(vocab))) == top[0][0].get<int>();
      for (const auto& e : top) {
        const double d = std::fabs(double(row[e[0].get<int>()]) - e[1].get<double>());
        if (d > max_diff) {
          max_diff = d;
          worst = p["name"].get<std::string>() + " position " + std::to_string(i);
        }
      }
    }
    Generator gen(*g->m.model, *g->backend, g->m.tokenizer.get(), cache);
    GenerateRequest req;
    req.prompt = ids;
    const auto expect = p["generated_ids"].get<std::vector<int32_t>>();
    req.max_tokens = int(expect.size());
    req.sampling.temperature = 0;
    req.ignore_eos = true;
    const auto res = gen.generate(req);
    if (res.tokens == expect) {
      ++same_continuations;
    } else {
      size_t k = 0;
      while (k < expect.size() && k < res.tokens.size() && res.tokens[k] == expect[k]) ++k;
      std::printf("continuation of %s differs at step %zu (llama.cpp top-2 margin there %.4f)\n",
                  p["name"].get<std::string>().c_str(), k,
                  k < expect.size() ? p["generated_top2_margin"][k].get<double>() : 0.0);
    }
  }
  const double agree = double(top1_agree) / positions;
  std::printf("golden: %d prompts, %d positions, top-1 agreement %.4f, identical greedy "
              "continuations %d/%d, largest logit difference %.4f (%s)\n",
              prompts, positions, agree, same_continuations, prompts, max_diff, worst.c_str());
  ::testing::Test::RecordProperty("max_logit_diff", std::to_string(max_diff));
  ::testing::Test::RecordProperty("top1_agreement", std::to_string(agree));
  EXPECT_GE(prompts, 20);
  EXPECT_GE(agree, 0.99);
  EXPECT_GE(same_continuations, prompts - 2);
  // Both sides quantize activations to 8 bits the same way; differences are float rounding.
  EXPECT_LT(max_diff, 0.5);
}

}  // namespace
}  // namespace ds
