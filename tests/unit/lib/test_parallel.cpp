// Tensor and expert parallelism on the CPU: the in-process communicator's collectives, and
// the sharp Hugging Face fixtures split over 2 ranks (TP, TP + EP) against one rank: logits
// within a tight tolerance, greedy tokens identical. Sums split over ranks round differently,
// so TP=2 is not bit-identical to TP=1 (docs/ARCHITECTURE.md, "Parallelism").
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "../../hf_fixtures.h"
#include "core/error.h"
#include "parallel/communicator.h"
#include "parallel/shard.h"

namespace ds {
namespace {

// Runs fn(rank, comm) on n threads, one per rank of a fresh in-process group.
template <typename Fn>
void on_ranks(int n, Fn fn) {
  auto comms = make_local_communicators(n);
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r) ts.emplace_back([&, r] { fn(r, *comms[size_t(r)]); });
  for (auto& t : ts) t.join();
}

TEST(LocalCommunicator, AllReduceSumsF32AndBf16InRankOrder) {
  for (int n : {1, 2, 3, 4}) {
    std::vector<std::vector<float>> f(static_cast<size_t>(n));
    std::vector<std::vector<uint16_t>> b(static_cast<size_t>(n));
    for (int r = 0; r < n; ++r)
      for (int i = 0; i < 37; ++i) {
        f[size_t(r)].push_back(float(r + 1) * 0.5f + float(i));
        b[size_t(r)].push_back(f32_to_bf16(float(r) - float(i) * 0.25f));
      }
    on_ranks(n, [&](int r, Communicator& c) {
      EXPECT_EQ(c.rank(), r);
      EXPECT_EQ(c.size(), n);
      c.all_reduce_sum(TensorView::contiguous(f[size_t(r)].data(), DType::F32, {37}));
      c.all_reduce_sum(TensorView::contiguous(b[size_t(r)].data(), DType::BF16, {37}));
    });
    for (int r = 0; r < n; ++r)
      for (int i = 0; i < 37; ++i) {
        float want = 0, wb = 0;
        for (int q = 0; q < n; ++q) {
          want += float(q + 1) * 0.5f + float(i);
          wb += bf16_to_f32(f32_to_bf16(float(q) - float(i) * 0.25f));
        }
        ASSERT_EQ(f[size_t(r)][size_t(i)], want) << "n " << n << " rank " << r << " i " << i;
        ASSERT_EQ(b[size_t(r)][size_t(i)], f32_to_bf16(wb)) << "n " << n << " i " << i;
      }
  }
}

TEST(LocalCommunicator, AllGatherAndAllToAllWithUnevenCounts) {
  const int n = 3;
  std::vector<std::vector<int32_t>> gathered(n, std::vector<int32_t>(6)), recv(n);
  on_ranks(n, [&](int r, Communicator& c) {
    const int32_t mine[2] = {10 * r, 10 * r + 1};
    c.all_gather(TensorView::contiguous(const_cast<int32_t*>(mine), DType::I32, {2}),
                 TensorView::contiguous(gathered[size_t(r)].data(), DType::I32, {6}));
    // Rank r sends q + r + 1 values (each 100 r + q) to rank q.
    std::vector<int64_t> sc, rc;
    std::vector<int32_t> send;
    for (int q = 0; q < n; ++q) {
      sc.push_back(q + r + 1);
      rc.push_back(r + q + 1);
      for (int k = 0; k < q + r + 1; ++k) send.push_back(100 * r + q);
    }
    int64_t total = 0;
    for (int64_t v : rc) total += v;
    recv[size_t(r)].resize(size_t(total));
    c.all_to_all(send.data(), sc, recv[size_t(r)].data(), rc, DType::I32);
    c.barrier();
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(gathered[size_t(r)], (std::vector<int32_t>{0, 1, 10, 11, 20, 21}));
    std::vector<int32_t> want;
    for (int q = 0; q < n; ++q)
      for (int k = 0; k < r + q + 1; ++k) want.push_back(100 * q + r);
    EXPECT_EQ(recv[size_t(r)], want) << "rank " << r;
  }
}

TEST(LocalCommunicator, AbortReleasesRanksWaitingInACollective) {
  auto comms = make_local_communicators(2);
  float x = 1;
  std::thread waiter([&] {
    EXPECT_THROW(comms[1]->all_reduce_sum(TensorView::contiguous(&x, DType::F32, {1})), Error);
  });
  comms[0]->abort();
  waiter.join();
  comms[0]->reset();
  on_ranks(1, [](int, Communicator& c) { c.barrier(); });
}

// ---- models ----------------------------------------------------------------------------

test::CpuModel load_path(const std::filesystem::path& path, int tp, bool ep) {
  LoadOptions lo;
  lo.tensor_parallel_size = tp;
  lo.expert_parallel = ep;
  lo.rank_backend = [](int) {
    BackendOptions bo;
    bo.threads = 1;
    return make_cpu_backend(bo);
  };
  return test::load_cpu_model(path, lo, /*threads=*/1);
}

test::CpuModel load_split(const std::string& fixture, int tp, bool ep) {
  return load_path(test::hf_root() / fixture, tp, ep);
}

std::vector<std::vector<int32_t>> prompts(int vocab) {
  std::vector<std::vector<int32_t>> out;
  uint32_t s = 12345;
  for (int len : {5, 17, 30}) {
    std::vector<int32_t> p;
    for (int i = 0; i < len; ++i) {
      s = s * 1664525u + 1013904223u;
      p.push_back(int32_t((s >> 8) % uint32_t(std::min(vocab, 250))));
    }
    out.push_back(p);
  }
  return out;
}

struct SplitCase {
  std::string fixture;
  int tp;
  bool ep;
};

std::string case_name(const ::testing::TestParamInfo<SplitCase>& i) {
  return i.param.fixture + "_tp" + std::to_string(i.param.tp) + (i.param.ep ? "_ep" : "");
}

class ParallelFixture : public ::testing::TestWithParam<SplitCase> {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists(test::hf_root() / GetParam().fixture / "config.json"))
      GTEST_SKIP() << "fixture " << GetParam().fixture << " missing";
  }
};

TEST_P(ParallelFixture, PrefillLogitsMatchOneRank) {
  const auto& c = GetParam();
  test::CpuModel one = load_split(c.fixture, 1, false);
  test::CpuModel split = load_split(c.fixture, c.tp, c.ep);
  EXPECT_EQ(split.m.model->ranks(), c.tp);
  for (const auto& p : prompts(one.m.config.vocab)) {
    one.cache = std::make_unique<KvCache>(*one.backend, one.m.model->config(),
                                          KvCacheConfig{test::kHarnessBlocks, 16, DType::F32});
    const auto a = test::prefill_rows(one, p);
    const auto b = test::prefill_rows(split, p);
    ASSERT_EQ(a.size(), b.size());
    float range = 0, diff = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      range = std::max(range, std::abs(a[i]));
      diff = std::max(diff, std::abs(a[i] - b[i]));
    }
    // Splitting a dot product over ranks reorders F32 sums: rounding-level differences only.
    EXPECT_LE(diff, 1e-5f * std::max(range, 1.0f)) << "prompt of " << p.size() << " tokens";
    EXPECT_GT(range, 1.0f);
    std::printf("max |logit diff| %.3g of range %.3g\n", double(diff), double(range));
  }
}

TEST_P(ParallelFixture, GreedyTokensEqualOneRankThroughTheEngine) {
  const auto& c = GetParam();
  auto run = [&](int tp, bool ep) {
    test::CpuModel l = load_split(c.fixture, tp, ep);
    EngineConfig ec;
    ec.kv_cache_tokens = 1024;
    ec.max_num_seqs = 4;
    ec.max_num_batched_tokens = 16;  // chunked prefill and mixed steps
    Engine engine(*l.m.model, *l.backend, nullptr, ec);
    return test::greedy_generate(engine, prompts(l.m.config.vocab), 24, /*concurrent=*/true);
  };
  const auto want = run(1, false);
  const auto got = run(c.tp, c.ep);
  EXPECT_EQ(got, want);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ParallelFixture,
                         ::testing::Values(SplitCase{"llama_gqa_f16", 2, false},
                                           SplitCase{"deepseek_v2_padded_vocab_bf16", 2, false},
                                           SplitCase{"deepseek_v2_padded_vocab_bf16", 2, true},
                                           SplitCase{"deepseek_v2_yarn_mscale_f16", 2, false},
                                           SplitCase{"deepseek_v2_yarn_mscale_f16", 2, true}),
                         case_name);

// A real checkpoint with block-quantized weights: SmolLM2-135M Q4_1 (9 heads, 3 KV heads) over
// 3 ranks, so o_proj / down_proj column shards cut whole Q4_1 blocks.
TEST(ParallelGguf, SmolLm2Q4OverThreeRanksGivesTheSameGreedyTokens) {
  const char* path = std::getenv("DS_SMOLLM2_GGUF");
  if (!path || !std::filesystem::exists(path)) GTEST_SKIP() << "DS_SMOLLM2_GGUF not set";
  auto run = [&](int tp) {
    test::CpuModel l = load_path(path, tp, false);
    EXPECT_EQ(l.m.model->ranks(), tp);
    EngineConfig ec;
    ec.kv_cache_tokens = 512;
    ec.max_num_seqs = 4;
    Engine engine(*l.m.model, *l.backend, nullptr, ec);
    return test::greedy_generate(engine, prompts(l.m.config.vocab), 12, /*concurrent=*/true);
  };
  EXPECT_EQ(run(3), run(1));
}

TEST(ParallelLoad, UnevenSplitsAreClearErrorsAtLoad) {
  struct Bad {
    const char* fixture;
    int tp;
    bool ep;
    const char* says;
  };
  for (const Bad& b : {Bad{"deepseek_v2_qlora_bf16", 2, false, "num_attention_heads (3)"},
                       Bad{"deepseek_v2_yarn_grouped_f32", 2, true, "num_attention_heads (5)"},
                       Bad{"llama_tied_theta500k_bf16", 2, false, "num_key_value_heads (1)"},
                       Bad{"llama_gqa_f16", 4, false, "num_attention_heads (6)"}}) {
    if (!std::filesystem::exists(test::hf_root() / b.fixture)) continue;
    try {
      load_split(b.fixture, b.tp, b.ep);
      ADD_FAILURE() << b.fixture << " loaded with tp " << b.tp;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(b.says), std::string::npos) << e.what();
    }
  }
}

TEST(ParallelLoad, ExpertParallelNeedsSeveralRanks) {
  try {
    load_split("deepseek_v2_padded_vocab_bf16", 1, true);
    ADD_FAILURE() << "EP with one rank loaded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--tensor-parallel-size"), std::string::npos);
  }
}

TEST(ParallelShard, SplitsOfEachWeight) {
  ParallelConfig tp{2, false}, ep{2, true};
  EXPECT_EQ(split_of("blk.0.attn_q.weight", tp), Split::Rows);
  EXPECT_EQ(split_of("blk.0.attn_output.weight", tp), Split::Cols);
  EXPECT_EQ(split_of("blk.0.ffn_down.weight", tp), Split::Cols);
  EXPECT_EQ(split_of("token_embd.weight", tp), Split::Replicate);
  EXPECT_EQ(split_of("model.layers.1.self_attn.kv_a_proj_with_mqa.weight", tp), Split::Replicate);
  EXPECT_EQ(split_of("model.layers.1.self_attn.kv_b_proj.weight", tp), Split::Rows);
  EXPECT_EQ(split_of("model.layers.1.mlp.gate.weight", tp), Split::Replicate);
  EXPECT_EQ(split_of("model.layers.1.mlp.experts.3.down_proj.weight", tp), Split::Cols);
  EXPECT_EQ(split_of("model.layers.1.mlp.experts.3.down_proj.weight", ep), Split::Replicate);
  EXPECT_EQ(split_of("model.layers.1.mlp.shared_experts.up_proj.weight", ep), Split::Rows);
  EXPECT_EQ(split_of("lm_head.weight", ep), Split::Replicate);
  ModelConfig cfg;
  cfg.arch = "deepseek_v2";
  cfg.layers = 2;
  cfg.heads = cfg.kv_heads = 4;
  cfg.kv_lora_rank = 8;
  cfg.intermediate = 64;
  cfg.moe_experts = 8;
  cfg.moe_intermediate = 16;
  cfg.moe_shared_experts = 2;
  cfg.first_k_dense = 1;
  const ModelConfig a = shard_config(cfg, ep, 1);
  EXPECT_EQ(a.heads, 2);
  EXPECT_EQ(a.intermediate, 32);
  EXPECT_EQ(a.moe_intermediate, 16);  // experts whole under EP
  EXPECT_EQ(a.moe_expert_begin, 4);
  EXPECT_EQ(a.local_experts(), 4);
  EXPECT_EQ(a.shared_ffn(), 16);  // shared experts split by columns
  const ModelConfig b = shard_config(cfg, tp, 1);
  EXPECT_EQ(b.moe_intermediate, 8);
  EXPECT_EQ(b.local_experts(), 8);
  EXPECT_EQ(b.shared_ffn(), 16);
}

}  // namespace
}  // namespace ds
