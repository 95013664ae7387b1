// 4-bit GPTQ and AWQ checkpoints (tests/fixtures/hf_gptq, tools/make_gptq_fixture.py): a GPTQ
// v1 sym group-128 llama (binds as W4A16 as stored) and an AWQ GEMM asymmetric llama
// (dequantized exactly, then BF16 / W4A16 / FP8W). The golden is transformers' float32 forward
// of the dequantized weights; the fixtures' scales are chosen so that W4A16 (GPTQ) and BF16
// (AWQ) hold those weights exactly. Also hand-packed 8 x 16 examples of both layouts.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "../../hf_diff_fixtures.h"
#include "../../hf_fixtures.h"
#include "backend/w4a16.h"
#include "core/error.h"
#include "engine/engine.h"
#include "model/config.h"
#include "model/gptq.h"

namespace ds {
namespace {

constexpr double kLogitRelTol = 1e-4;  // |ours - transformers| / logit range, every position

std::filesystem::path gptq_root() {
  return std::filesystem::path(DS_FIXTURES_DIR) / "hf_gptq";
}

// 7 linears x 2 layers of the fixtures: q 256x256, k/v 128x256, o 256x256, gate/up 512x256,
// down 256x512.
constexpr uint64_t kLinearParams = 2 * (256 * 256 * 2 + 128 * 256 * 2 + 512 * 256 * 3);
constexpr uint64_t kBf16Params = 2 * 96 * 256;  // embeddings and lm_head, stored BF16

test::CpuModel load(const std::filesystem::path& dir, WeightQuant q) {
  LoadOptions lo;
  lo.quantize = q;
  return test::load_cpu_model(dir, lo);
}

TEST(HfGptq, FixturesPresent) {
  EXPECT_EQ(test::hf_diff_index(gptq_root()).size(), 3u)
      << gptq_root() << " (tools/make_gptq_fixture.py writes it)";
}

// Loads `name` with --quantize q, checks the bound format of the 4-bit linears (their count
// for the llama fixtures) and the logits against transformers within tol (relative to the
// range); greedy tokens must agree when exact.
void check_fixture(const std::string& name, WeightQuant q, const char* format, double tol,
                   bool llama_counts = true) {
  for (const auto& entry : test::hf_diff_index(gptq_root())) {
    const test::DiffCase c = test::read_diff_case(entry, gptq_root());
    if (c.name != name) continue;
    SCOPED_TRACE(name + " --quantize " + weight_quant_name(q));
    test::CpuModel l = load(gptq_root() / name, q);
    ASSERT_TRUE(l.m.config.int4.has_value());
    const auto& formats = l.m.model->weight_formats();
    ASSERT_TRUE(formats.count(format)) << "no " << format << " weights";
    const uint64_t others = std::string(format) == "BF16" ? kBf16Params : 0;
    if (llama_counts) {
      EXPECT_EQ(formats.at(format).second, kLinearParams + others)
          << "a 4-bit linear did not bind as " << format;
    }
    EXPECT_FALSE(formats.count("I32")) << "packed tensors counted as bound weights";
    std::vector<std::vector<int32_t>> prompts;
    double worst = 0;
    for (size_t i = 0; i < c.prompts.size(); ++i) {
      const test::DiffPrompt& p = c.prompts[i];
      worst = std::max(
          worst, test::expect_prompt_logits(test::prefill_rows(l, p.ids), p, c.vocab, i, tol));
      prompts.push_back(p.ids);
    }
    if (tol > kLogitRelTol) return;  // a lossy conversion: logits within tol is the check
    EngineConfig cfg;
    cfg.prefix_cache = false;
    Engine engine(*l.m.model, *l.backend, nullptr, cfg);
    const auto got = test::greedy_generate(engine, prompts, 32, true);
    EXPECT_EQ(test::expect_greedy_matches(c, got, 0.0, 0.0, worst), 32 * int(c.prompts.size()));
    return;
  }
  FAIL() << name << " not in " << gptq_root() / "index.json";
}

TEST(HfGptq, GptqSymBindsW4a16AsStoredAndMatchesTransformers) {
  check_fixture("llama_gptq_sym", WeightQuant::None, "W4A16", kLogitRelTol);
  check_fixture("llama_gptq_sym", WeightQuant::W4A16, "W4A16", kLogitRelTol);
}

// DeepSeek-V2: MLA projections, the dense MLP, routed and shared experts as GPTQ; kv_b_proj
// (not a big matmul: the absorbed form reads it) is dequantized to F32.
TEST(HfGptq, DeepseekGptqSymBindsExpertsAsW4a16AndMatchesTransformers) {
  check_fixture("deepseek_v2_gptq_sym", WeightQuant::None, "W4A16", kLogitRelTol,
                /*llama_counts=*/false);
  test::CpuModel l = load(gptq_root() / "deepseek_v2_gptq_sym", WeightQuant::None);
  const auto& formats = l.m.model->weight_formats();
  // W4A16: per layer q_a 128x256, q_b 48x128, kv_a 136x256, o 256x128; layer 0's MLP 3 x
  // 256x256; layer 1's 4 routed + 1 shared experts 3 x 128x256 each.
  const uint64_t attn = 128 * 256 + 48 * 128 + 136 * 256 + 256 * 128;
  EXPECT_EQ(formats.at("W4A16").second, 2 * attn + 3 * 256 * 256 + 5 * 3 * 128 * 256);
  ASSERT_TRUE(formats.count("F32"));
  EXPECT_GE(formats.at("F32").second, uint64_t(2 * 2 * (16 + 64) * 128)) << "kv_b_proj as F32";
}

TEST(HfGptq, AwqBindsBf16ByDefaultAndMatchesTransformers) {
  check_fixture("llama_awq", WeightQuant::None, "BF16", kLogitRelTol);
}

TEST(HfGptq, AwqConvertsToW4a16AndFp8w) {
  // Requantized (lossy): measured 0.17 (W4A16's symmetric RTN of asymmetric 4-bit weights) and
  // 0.06 (FP8) of the logit range; the check here is mostly the bound format.
  check_fixture("llama_awq", WeightQuant::W4A16, "W4A16", 0.25);
  check_fixture("llama_awq", WeightQuant::FP8, "FP8W", 0.1);
}

TEST(HfGptq, TensorParallelIsRefused) {
  auto be = make_cpu_backend(BackendOptions{});
  LoadOptions lo;
  lo.tensor_parallel_size = 2;
  EXPECT_THROW(load_model(gptq_root() / "llama_awq", *be, lo), UnsupportedError);
}

// ---- hand-packed layouts: [N, K] = [16, 8] (GPTQ packs 8 k per word; AWQ 8 n per word) ----
constexpr int64_t kN = 16, kK = 8;
int q_of(int64_t k, int64_t n) {
  return int((k * 5 + n * 3) % 16);
}
int z_of(int64_t n) {
  return int((n * 7 + 1) % 16);
}
float s_of(int64_t n) {
  return 0.25f + 0.125f * float(n);
}

struct Packed {
  std::vector<int32_t> qweight, qzeros;
  std::vector<uint16_t> scales;  // F16
  Int4Checkpoint view(const Int4Format& f) {
    const bool gptq = f.kind == Int4Format::Kind::Gptq;
    return Int4Checkpoint(f, "t.",
                          TensorView::contiguous(qweight.data(), DType::I32,
                                                 {gptq ? kK / 8 : kK, gptq ? kN : kN / 8}),
                          TensorView::contiguous(qzeros.data(), DType::I32, {1, kN / 8}),
                          TensorView::contiguous(scales.data(), DType::F16, {1, kN}), TensorView{},
                          kN, kK);
  }
};

TEST(Int4Unpack, GptqRowsAndV1Zeros) {
  Packed p;
  p.qweight.assign(kN, 0);  // word (k/8, n): k at bits 4*(k%8)
  for (int64_t n = 0; n < kN; ++n)
    for (int64_t k = 0; k < kK; ++k)
      p.qweight[size_t(n)] |= int32_t(uint32_t(q_of(k, n)) << (4 * k));
  p.qzeros.assign(kN / 8, 0);  // v1: zero - 1, column n at bits 4*(n%8)
  for (int64_t n = 0; n < kN; ++n)
    p.qzeros[size_t(n / 8)] |= int32_t(uint32_t((z_of(n) + 15) % 16) << (4 * (n % 8)));
  for (int64_t n = 0; n < kN; ++n) p.scales.push_back(f32_to_fp16(s_of(n)));
  Int4Format f;
  f.group_size = -1;
  const Int4Checkpoint ck = p.view(f);
  for (int64_t n = 0; n < kN; ++n) {
    if (z_of(n) == 0) continue;  // v1 cannot store zero 0 (it wraps to 16 - 1 + 1)
    float row[kK];
    ck.row(n, row);
    for (int64_t k = 0; k < kK; ++k)
      EXPECT_EQ(row[k], float(q_of(k, n) - z_of(n)) * s_of(n)) << "n " << n << " k " << k;
  }
  EXPECT_FALSE(ck.w4a16_blocker().empty());  // K = 8: not a 128-group
}

TEST(Int4Unpack, AwqRowsInterleavedOrder) {
  constexpr int kOrder[8] = {0, 2, 4, 6, 1, 3, 5, 7};  // nibble i holds column 8c + kOrder[i]
  Packed p;
  p.qweight.assign(kK * kN / 8, 0);
  p.qzeros.assign(kN / 8, 0);
  for (int64_t c = 0; c < kN / 8; ++c)
    for (int i = 0; i < 8; ++i) {
      const int64_t n = 8 * c + kOrder[i];
      for (int64_t k = 0; k < kK; ++k)
        p.qweight[size_t(k * (kN / 8) + c)] |= int32_t(uint32_t(q_of(k, n)) << (4 * i));
      p.qzeros[size_t(c)] |= int32_t(uint32_t(z_of(n)) << (4 * i));
    }
  for (int64_t n = 0; n < kN; ++n) p.scales.push_back(f32_to_fp16(s_of(n)));
  Int4Format f;
  f.kind = Int4Format::Kind::Awq;
  f.group_size = -1;
  f.sym = false;
  f.zeros_minus_one = false;
  const Int4Checkpoint ck = p.view(f);
  for (int64_t n = 0; n < kN; ++n) {
    float row[kK];
    ck.row(n, row);
    for (int64_t k = 0; k < kK; ++k)
      EXPECT_EQ(row[k], float(q_of(k, n) - z_of(n)) * s_of(n)) << "n " << n << " k " << k;
  }
  EXPECT_EQ(ck.w4a16_blocker(), "AWQ (zero points)");
}

// GPTQ with act-order (g_idx a permutation of groups), v2 zeros (stored exactly), K = 256:
// rows follow g_idx, and W4A16 is refused although every zero is 8 (groups out of order).
TEST(Int4Unpack, GptqActOrderAndW4a16Rows) {
  constexpr int64_t N = 8, K = 256, G = 2;
  std::vector<int32_t> qweight(size_t(K / 8 * N), 0), qzeros(G, 0), g_idx(K);
  std::vector<uint16_t> scales;
  for (int64_t k = 0; k < K; ++k)
    for (int64_t n = 0; n < N; ++n)
      qweight[size_t(k / 8 * N + n)] |= int32_t(uint32_t(q_of(k, n)) << (4 * (k % 8)));
  for (int64_t g = 0; g < G; ++g)
    for (int64_t n = 0; n < N; ++n) qzeros[size_t(g)] |= int32_t(8u << (4 * n));
  for (int64_t g = 0; g < G; ++g)
    for (int64_t n = 0; n < N; ++n) scales.push_back(f32_to_fp16(s_of(n + 8 * g)));
  Int4Format f;
  f.zeros_minus_one = false;  // gptq_v2
  f.desc_act = true;
  auto make = [&] {
    return Int4Checkpoint(f, "t.", TensorView::contiguous(qweight.data(), DType::I32, {K / 8, N}),
                          TensorView::contiguous(qzeros.data(), DType::I32, {G, N / 8}),
                          TensorView::contiguous(scales.data(), DType::F16, {G, N}),
                          TensorView::contiguous(g_idx.data(), DType::I32, {K}), N, K);
  };
  for (int64_t k = 0; k < K; ++k) g_idx[size_t(k)] = int32_t((k * 7 / 3) % G);  // not k / 128
  const Int4Checkpoint act = make();
  EXPECT_NE(act.w4a16_blocker(), "");
  std::vector<float> row(K);
  for (int64_t n = 0; n < N; ++n) {
    act.row(n, row.data());
    for (int64_t k = 0; k < K; ++k)
      ASSERT_EQ(row[size_t(k)], float(q_of(k, n) - 8) * s_of(n + 8 * g_idx[size_t(k)]))
          << "n " << n << " k " << k;
  }
  for (int64_t k = 0; k < K; ++k) g_idx[size_t(k)] = int32_t(k / 128);  // trivial: W4A16
  const Int4Checkpoint plain = make();
  ASSERT_EQ(plain.w4a16_blocker(), "");
  std::vector<uint8_t> w4(size_t(w4a16::row_stride(K)));
  for (int64_t n = 0; n < N; ++n) {
    plain.row(n, row.data());
    plain.w4a16_row(n, w4.data());
    for (int64_t k = 0; k < K; ++k)  // these scales are exact in BF16
      ASSERT_EQ(w4a16::element(w4.data(), K, k), row[size_t(k)]) << "n " << n << " k " << k;
  }
}

// quantization_config: what is read, and the clear refusals (bits, AWQ version, format).
ModelConfig config_with(const std::string& quant) {
  const auto dir = std::filesystem::temp_directory_path() / "ds_gptq_config";
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "config.json")
      << R"({"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 1,
             "num_attention_heads": 4, "intermediate_size": 512, "vocab_size": 96,
             "quantization_config": )"
      << quant << "}";
  return config_from_hf_json((dir / "config.json").string());
}

TEST(Int4Config, ReadsGptqAndAwqAndRefusesOthers) {
  const ModelConfig g = config_with(
      R"({"quant_method": "gptq", "bits": 4, "group_size": -1, "sym": false, "desc_act": true,
          "checkpoint_format": "gptq_v2"})");
  ASSERT_TRUE(g.int4.has_value());
  EXPECT_EQ(g.int4->kind, Int4Format::Kind::Gptq);
  EXPECT_EQ(g.int4->group_size, -1);
  EXPECT_FALSE(g.int4->sym);
  EXPECT_TRUE(g.int4->desc_act);
  EXPECT_FALSE(g.int4->zeros_minus_one);
  const ModelConfig v1 = config_with(R"({"quant_method": "gptq", "bits": 4, "group_size": 128})");
  EXPECT_TRUE(v1.int4->zeros_minus_one);
  const ModelConfig a = config_with(
      R"({"quant_method": "awq", "bits": 4, "group_size": 64, "version": "GEMM",
          "zero_point": true})");
  EXPECT_EQ(a.int4->kind, Int4Format::Kind::Awq);
  EXPECT_EQ(a.int4->group_size, 64);
  EXPECT_THROW(config_with(R"({"quant_method": "gptq", "bits": 8, "group_size": 128})"),
               UnsupportedError);
  EXPECT_THROW(config_with(R"({"quant_method": "awq", "bits": 4, "version": "gemv"})"),
               UnsupportedError);
  EXPECT_THROW(config_with(R"({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"})"),
               UnsupportedError);
  EXPECT_FALSE(config_with(R"({"quant_method": "fp8"})").int4.has_value());
}

}  // namespace
}  // namespace ds
