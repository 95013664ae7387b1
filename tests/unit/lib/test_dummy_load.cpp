// --load-format dummy and --quantize w4a16 on the CPU: weights generated from a config.json
// alone, deterministic for a seed, sharp enough for non-flat logits; W4A16 packing, the
// dequantize-then-F32 reference matmul, quantization at load and dummy + quantize together.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "../../hf_fixtures.h"
#include "backend/fp8w.h"
#include "backend/w4a16.h"
#include "core/error.h"
#include "dummy_model.h"
#include "model/binder.h"
#include "model/loader.h"
#include "quant_matmul_check.h"

namespace ds {
namespace {

using test::dummy_dir;
using test::load_dummy;

const std::vector<int32_t> kPrompt = {5, 17, 300, 42, 99, 7, 250, 11};

// The gap between the two largest logits of the last row, over the row's range.
double top2_margin(const std::vector<float>& logits, int vocab) {
  std::vector<float> r(logits.end() - vocab, logits.end());
  std::sort(r.begin(), r.end(), std::greater<>());
  return double(r[0] - r[1]) / double(r.front() - r.back());
}

TEST(DummyLoad, DeepseekFromConfigFolderIsSharpAndDeterministic) {
  auto a = load_dummy(dummy_dir(), 7);
  EXPECT_EQ(a.m.format, "dummy");
  const auto la = test::prefill_rows(a, kPrompt);
  for (float v : la) ASSERT_TRUE(std::isfinite(v));
  const int V = a.m.config.vocab;
  const auto [mn, mx] = std::minmax_element(la.end() - V, la.end());
  EXPECT_GT(*mx - *mn, 2.0f) << "flat logits";
  EXPECT_GT(top2_margin(la, V), 0.005);
  auto b = load_dummy(dummy_dir(), 7);
  EXPECT_EQ(la, test::prefill_rows(b, kPrompt)) << "same seed, same weights";
  auto c = load_dummy(dummy_dir(), 8);
  EXPECT_NE(la, test::prefill_rows(c, kPrompt)) << "the seed changes the weights";
}

TEST(DummyLoad, LlamaFromConfigPathGenerates) {
  auto l = load_dummy(test::hf_root() / "llama_gqa_f16" / "config.json", 1);
  EngineConfig ec;
  ec.kv_cache_tokens = 256;
  Engine engine(*l.m.model, *l.backend, nullptr, ec);
  const auto out = test::greedy_generate(engine, {kPrompt, {3, 4}}, 12, true);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].size(), 12u);
  EXPECT_EQ(out[1].size(), 12u);
  std::map<int32_t, int> distinct;
  for (int32_t t : out[0]) ++distinct[t];
  EXPECT_GT(distinct.size(), 1u) << "a dummy model that repeats one token is suspicious";
}

TEST(DummyLoad, DeepseekGeneratesThroughTheEngine) {
  auto l = load_dummy(dummy_dir(), 3);
  EngineConfig ec;
  ec.kv_cache_tokens = 512;
  Engine engine(*l.m.model, *l.backend, nullptr, ec);
  const auto batched = test::greedy_generate(engine, {kPrompt, {9, 8, 7}}, 10, true);
  const auto alone = test::greedy_generate(engine, {kPrompt, {9, 8, 7}}, 10, false);
  EXPECT_EQ(batched, alone);
  EXPECT_EQ(batched[0].size(), 10u);
}

// A prefill step of more tokens than the model reserves latent rows for up front (512): the
// CPU backend runs the whole prompt through the absorbed form, which must grow its scratch for
// the step. The same prompt in 100-token chunks (each within the reserve) gives the same tokens.
TEST(DummyLoad, DeepseekPromptPastTheLatentReserve) {
  std::vector<int32_t> prompt(700);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = int32_t((i * 37 + 11) % 500);
  std::vector<std::vector<int32_t>> got;
  for (int chunk : {1024, 100}) {
    auto l = load_dummy(dummy_dir(), 5);
    EngineConfig ec;
    ec.kv_cache_tokens = 1024;
    ec.max_num_batched_tokens = chunk;
    Engine engine(*l.m.model, *l.backend, nullptr, ec);
    got.push_back(test::greedy_generate(engine, {prompt}, 6, false)[0]);
  }
  EXPECT_EQ(got[0].size(), 6u);
  EXPECT_EQ(got[0], got[1]) << "one 700-token step against 100-token chunks";
}

TEST(DummyLoad, MissingConfigIsAClearError) {
  BackendOptions bo;
  auto be = make_cpu_backend(bo);
  LoadOptions lo;
  lo.dummy = true;
  try {
    load_model(test::hf_root(), *be, lo);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("config.json"), std::string::npos) << e.what();
  }
  EXPECT_THROW(load_format_is_dummy("pt"), Error);
  EXPECT_THROW(weight_quant_from_name("int3"), Error);
}

TEST(W4A16, PackingRoundTripAndLayout) {
  const int64_t K = 384;
  EXPECT_EQ(w4a16::row_stride(K) % 16, 0);
  EXPECT_GE(w4a16::row_stride(K), K / 2 + K / 64);
  std::vector<float> x(static_cast<size_t>(K));
  for (int64_t k = 0; k < K; ++k) x[size_t(k)] = std::sin(0.37f * float(k)) * float(1 + k / 128);
  x[5] = 0.0f;
  std::vector<uint8_t> row(size_t(w4a16::row_stride(K)), 0xee);
  quantize_w4a16_row(x.data(), K, row.data());
  std::vector<float> back(static_cast<size_t>(K));
  dequantize_w4a16_row(row.data(), K, back.data());
  for (int64_t g = 0; g < K / 128; ++g) {
    float amax = 0;
    for (int i = 0; i < 128; ++i) amax = std::max(amax, std::fabs(x[size_t(g * 128 + i)]));
    const float s = amax / 7;
    for (int i = 0; i < 128; ++i) {
      const size_t k = size_t(g * 128 + i);
      EXPECT_LE(std::fabs(back[k] - x[k]), 0.5f * s * 1.01f + 1e-6f) << k;
    }
  }
  // Element 2j is byte j's low nibble, 2j + 1 its high one; code 8 is zero.
  EXPECT_EQ(row[2] >> 4, 8) << "x[5] is 0";
  EXPECT_FLOAT_EQ(back[5], 0.0f);
  for (int64_t i = K / 2 + K / 64; i < w4a16::row_stride(K); ++i) EXPECT_EQ(row[size_t(i)], 0);
}

// Rows start on a 128-byte L2 line where that pads a row by at most 1/16, else on 16 bytes:
// DeepSeek-V2.5's expert gate/up (K = 5120) and V2-Lite's down (K = 1408) take whole lines,
// V2.5's down (K = 1536) and V2-Lite's gate/up (K = 2048) would grow by 12% and 9%, and keep 16.
TEST(W4A16, RowStrideTakesWholeLinesWhereTheyAreCheap) {
  for (int64_t K = 128; K <= 32768; K += 128) {
    const int64_t bytes = K / 2 + K / 64, stride = w4a16::row_stride(K);
    ASSERT_EQ(stride % 16, 0) << K;
    ASSERT_GE(stride, bytes) << K;
    ASSERT_LE((stride - bytes) * 16, bytes + 16 * 16) << K;  // at most 1/16 and a 16-byte unit
  }
  EXPECT_EQ(w4a16::row_stride(5120), 2688);
  EXPECT_EQ(w4a16::row_stride(1408), 768);
  EXPECT_EQ(w4a16::row_stride(1536), 800);
  EXPECT_EQ(w4a16::row_stride(2048), 1056);
  EXPECT_EQ(w4a16::row_stride(16384), 8448);  // already whole lines
}

// Column slices of packed rows (the shared MLP's down split into experts): every value of
// the slice is the source row's, scales included, for odd and even group offsets.
TEST(W4A16, PackedColumnSlicesKeepEveryValue) {
  const int64_t K = 640;  // 5 groups
  std::vector<float> x(static_cast<size_t>(K));
  for (int64_t k = 0; k < K; ++k)
    x[size_t(k)] = std::sin(0.29f * float(k)) * float(1 + 3 * (k / 128));
  for (DType dt : {DType::W4A16, DType::FP8W}) {
    const bool w4 = dt == DType::W4A16;
    auto stride = [&](int64_t k) { return w4 ? w4a16::row_stride(k) : fp8w::row_stride(k); };
    std::vector<uint8_t> row(size_t(stride(K)));
    if (w4)
      quantize_w4a16_row(x.data(), K, row.data());
    else
      quantize_fp8w_row(x.data(), K, row.data());
    std::vector<float> full(static_cast<size_t>(K));
    (w4 ? dequantize_w4a16_row : dequantize_fp8w_row)(row.data(), K, full.data());
    for (auto [begin, n] :
         {std::pair<int64_t, int64_t>{0, 128}, {128, 256}, {384, 256}, {0, 640}}) {
      std::vector<uint8_t> dst(size_t(stride(n)), 0xee);
      slice_packed_row(dt, row.data(), K, begin, n, dst.data());
      std::vector<float> back(static_cast<size_t>(n));
      (w4 ? dequantize_w4a16_row : dequantize_fp8w_row)(dst.data(), n, back.data());
      for (int64_t k = 0; k < n; ++k)
        ASSERT_EQ(back[size_t(k)], full[size_t(begin + k)])
            << dtype_name(dt) << " " << begin << "+" << k;
      const int64_t used = w4 ? n / 2 + n / 64 : fp8w::code_bytes(n) + 4 * (n / 128);
      for (int64_t i = used; i < stride(n); ++i) EXPECT_EQ(dst[size_t(i)], 0) << "padding";
    }
    std::vector<uint8_t> dst(size_t(stride(K)));
    EXPECT_THROW(slice_packed_row(dt, row.data(), K, 64, 128, dst.data()), Error);
    EXPECT_THROW(slice_packed_row(dt, row.data(), K, 512, 256, dst.data()), Error);
  }
}

TEST(W4A16, FillRandomQuantizesTheBf16Values) {
  BackendOptions bo;
  auto be = make_cpu_backend(bo);
  const int64_t N = 5, K = 256;
  RandomFill f;
  f.seed = 1234;
  f.std = 0.05f;
  auto raw = be->alloc(size_t(N * K) * 2);
  TensorView bf = raw->view(DType::BF16, {N, K});
  be->fill_random(bf, f);
  auto packed = be->alloc(w4a16_bytes(N, K));
  TensorView w4 = w4a16_view(packed->data(), N, K);
  be->fill_random(w4, f);
  std::vector<float> row(static_cast<size_t>(K));
  std::vector<uint8_t> expect(size_t(w4a16::row_stride(K)));
  double sum = 0, sq = 0;
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t k = 0; k < K; ++k) row[size_t(k)] = host_element(bf, n * K + k);
    for (float v : row) {
      sum += v;
      sq += double(v) * v;
    }
    quantize_w4a16_row(row.data(), K, expect.data());
    EXPECT_EQ(0, std::memcmp(expect.data(), w4.row(n), expect.size())) << "row " << n;
  }
  const double mean = sum / double(N * K), sd = std::sqrt(sq / double(N * K) - mean * mean);
  EXPECT_NEAR(mean, 0.0, 0.01);
  EXPECT_NEAR(sd, 0.05, 0.005);
  // A permuted fill: element (a, b, c) of [2, 3, 4] = flat element a * 12 + c * 3 + b.
  auto pbuf = be->alloc(24 * 4), fbuf = be->alloc(24 * 4);
  RandomFill pf = f;
  pf.round_as = DType::F32;
  TensorView flat = fbuf->view(DType::F32, {24});
  be->fill_random(flat, pf);
  pf.map = {12, 1, 3};
  TensorView perm = pbuf->view(DType::F32, {2, 3, 4});
  be->fill_random(perm, pf);
  for (int a = 0; a < 2; ++a)
    for (int b = 0; b < 3; ++b)
      for (int c = 0; c < 4; ++c)
        EXPECT_EQ(perm.ptr<float>()[(a * 3 + b) * 4 + c], flat.ptr<float>()[a * 12 + c * 3 + b]);
}

TEST(W4A16, CpuMatmulIsTheDequantizedProduct) {
  BackendOptions bo;
  bo.threads = 2;
  auto be = make_cpu_backend(bo);
  ASSERT_TRUE(be->supports(Op::MatMul, DType::W4A16));
  ASSERT_TRUE(be->supports(Op::MoeFfn, DType::W4A16));
  for (int64_t N : {1, 7, 130}) {
    const int64_t M = 3, K = 384;
    auto wb = be->alloc(w4a16_bytes(N, K));
    TensorView w = w4a16_view(wb->data(), N, K);
    RandomFill f;
    f.seed = uint64_t(N);
    be->fill_random(w, f);
    expect_matmul_is_dequantized_product(
        *be, w, M, N, K, [&](int64_t n, float* row) { dequantize_w4a16_row(w.row(n), K, row); },
        "N " + std::to_string(N));
  }
}

// A checkpoint in memory: one BF16 [rows, cols] weight.
class OneWeight final : public WeightSource {
 public:
  OneWeight(int64_t rows, int64_t cols) : bytes_(size_t(rows * cols) * 2) {
    for (size_t i = 0; i < bytes_.size() / 2; ++i) {
      const uint16_t h = f32_to_bf16(std::sin(float(i)) * 0.1f);
      std::memcpy(&bytes_[2 * i], &h, 2);
    }
    view_ = TensorView::contiguous(bytes_.data(), DType::BF16, {rows, cols});
  }
  std::optional<TensorView> find(const std::string& n) const override {
    return n == "w" ? std::optional(view_) : std::nullopt;
  }
  std::string describe() const override { return "one weight"; }
  uint64_t total_bytes() const override { return bytes_.size(); }
  void prefetch(int, const std::function<void(size_t, size_t)>&) const override {}

 private:
  std::vector<uint8_t> bytes_;
  TensorView view_;
};

TEST(W4A16, BinderQuantizesCheckpointWeightsAtLoad) {
  BackendOptions bo;
  auto be = make_cpu_backend(bo);
  OneWeight src(3, 256);
  WeightBinder b(src, *be, WeightQuant::W4A16);
  const TensorView w = b.linear("w", 3, 256);
  ASSERT_EQ(w.dtype, DType::W4A16);
  EXPECT_EQ(w.row_stride(), w4a16::row_stride(256));
  std::vector<float> row(256);
  std::vector<uint8_t> expect(size_t(w4a16::row_stride(256)));
  for (int64_t r = 0; r < 3; ++r) {
    for (int64_t k = 0; k < 256; ++k) row[size_t(k)] = host_element(src.get("w"), r * 256 + k);
    quantize_w4a16_row(row.data(), 256, expect.data());
    EXPECT_EQ(0, std::memcmp(expect.data(), w.row(r), expect.size()));
  }
  EXPECT_EQ(b.formats().at("W4A16").second, 3u * 256u);
  WeightBinder keep(src, *be, WeightQuant::W4A16);
  EXPECT_EQ(keep.linear("w", 3, 256, Op::MatMul, Quantizable::No).dtype, DType::BF16);
}

TEST(W4A16, DummyQuantizedDeepseekTracksBf16) {
  auto q = load_dummy(dummy_dir(), 11, WeightQuant::W4A16);
  const auto& fm = q.m.model->weight_formats();
  ASSERT_TRUE(fm.count("W4A16"));
  ASSERT_TRUE(fm.count("BF16"));  // embeddings, lm_head, kv_b_proj
  const auto& [w4_bytes, w4_params] = fm.at("W4A16");
  // 66 bytes per 128 plus rows padded to 16 bytes (a lot at this config's K of 128..384).
  EXPECT_GE(double(w4_bytes) / double(w4_params), 66.0 / 128.0);
  EXPECT_LT(double(w4_bytes) / double(w4_params), 0.6);
  auto f = load_dummy(dummy_dir(), 11);
  EXPECT_LT(q.m.model->weight_bytes().total, f.m.model->weight_bytes().total);
  const auto lq = test::prefill_rows(q, kPrompt), lf = test::prefill_rows(f, kPrompt);
  double num = 0, den = 0;
  for (size_t i = 0; i < lq.size(); ++i) {
    num += double(lq[i] - lf[i]) * (lq[i] - lf[i]);
    den += double(lf[i]) * lf[i];
  }
  // 4-bit weights move logits, but the same model must still be recognisable.
  EXPECT_LT(std::sqrt(num / den), 0.5);
  EXPECT_GT(std::sqrt(num / den), 1e-4) << "quantization changed nothing?";
}

}  // namespace
}  // namespace ds
