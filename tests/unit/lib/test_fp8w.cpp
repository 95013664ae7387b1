// FP8W (--quantize fp8, FP8 checkpoints) on the CPU: the e4m3 codec against the format's
// table, quantize_row error bounds, the dequantize-then-F32 matmul, FP8 checkpoint tensors
// (128 x 128 block scales, per channel) bound exactly, dummy + fp8, and the accuracy harness.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>

#include "../../hf_fixtures.h"
#include "backend/cpu/quants.h"
#include "backend/fp8w.h"
#include "backend/w4a16.h"
#include "dummy_model.h"
#include "model/accuracy.h"
#include "model/binder.h"
#include "quant_matmul_check.h"

namespace ds {
namespace {

TEST(FP8W, DecodeMatchesTheTableAndEncodeRoundTrips) {
  for (int c = 0; c < 256; ++c) {
    const float v = fp8w::decode(uint8_t(c)), ref = fp8_e4m3_to_f32(uint8_t(c));
    if (std::isnan(ref)) {
      EXPECT_TRUE(std::isnan(v)) << c;
      EXPECT_EQ(fp8w::encode(v) & 0x7f, 0x7f);
      continue;
    }
    EXPECT_EQ(v, ref) << c;
    EXPECT_EQ(fp8w::encode(v), uint8_t(c)) << c;
  }
  EXPECT_EQ(fp8w::encode(1000.0f), 0x7e);
  EXPECT_EQ(fp8w::encode(-1e30f), 0xfe);
  EXPECT_EQ(fp8w::encode(INFINITY), 0x7e);
}

TEST(FP8W, EncodeRoundsToNearestEven) {
  // Every midpoint of two adjacent positive codes goes to the even one; just off it, to the
  // nearer one.
  for (int c = 0; c < 0x7e; ++c) {
    const float a = fp8w::decode(uint8_t(c)), b = fp8w::decode(uint8_t(c + 1));
    const float mid = 0.5f * (a + b);
    EXPECT_EQ(fp8w::encode(mid), uint8_t(c % 2 == 0 ? c : c + 1)) << c;
    EXPECT_EQ(fp8w::encode(-mid), uint8_t(0x80 | (c % 2 == 0 ? c : c + 1))) << c;
    EXPECT_EQ(fp8w::encode(std::nextafter(mid, 0.0f)), uint8_t(c)) << c;
    EXPECT_EQ(fp8w::encode(std::nextafter(mid, 1e9f)), uint8_t(c + 1)) << c;
  }
}

TEST(FP8W, QuantizeRowErrorBoundAndLayout) {
  for (int64_t K : {1, 100, 128, 129, 1408}) {
    std::vector<float> x(static_cast<size_t>(K)), back(static_cast<size_t>(K));
    for (int64_t k = 0; k < K; ++k) x[size_t(k)] = std::sin(0.7f * float(k)) * (k % 5 + 1);
    if (K > 200) std::fill(x.begin() + 128, x.begin() + 256, 0.0f);  // an all-zero group
    std::vector<uint8_t> row(size_t(fp8w::row_stride(K)), 0xee);
    EXPECT_EQ(fp8w::row_stride(K) % 16, 0);
    quantize_fp8w_row(x.data(), K, row.data());
    dequantize_fp8w_row(row.data(), K, back.data());
    for (int64_t g = 0; g < fp8w::groups(K); ++g) {
      const float s = fp8w::scale(row.data(), K, g);
      for (int64_t k = g * 128; k < std::min<int64_t>(K, g * 128 + 128); ++k) {
        // half a step: 2^-4 relative for normals, 2^-10 * scale below 2^-6 * scale
        const double bound = std::max(std::fabs(x[size_t(k)]) / 16.0, double(s) / 1024.0);
        EXPECT_LE(std::fabs(back[size_t(k)] - x[size_t(k)]), bound * 1.0001) << K << " " << k;
      }
    }
    for (int64_t i = K; i < fp8w::code_bytes(K); ++i) EXPECT_EQ(row[size_t(i)], 0);
    for (int64_t i = fp8w::code_bytes(K) + fp8w::groups(K) * 4; i < fp8w::row_stride(K); ++i)
      EXPECT_EQ(row[size_t(i)], 0);
  }
}

// Rows take whole 128-byte lines where that pads at most 1/16 (DeepSeek-V2-Lite's expert rows:
// gate/up 2,112 -> 2,176 bytes, down 1,456 -> 1,536), else 16-byte units; a forced
// DEEPSERVE_FP8W_ROW_ALIGN changes these.
TEST(FP8W, RowStrideTakesWholeLinesWhereTheyAreCheap) {
  for (int64_t K = 1; K <= 20000; K += 37) {
    const int64_t bytes = fp8w::code_bytes(K) + fp8w::groups(K) * 4, stride = fp8w::row_stride(K);
    const int64_t unit16 = (bytes + 15) / 16 * 16;
    ASSERT_EQ(stride % 16, 0) << K;
    ASSERT_GE(stride, bytes) << K;
    ASSERT_LE((stride - unit16) * 16, unit16) << K;  // at most 1/16 over 16-byte units
    if (stride % 128 != 0) {  // whole lines only where they cost more than 1/16
      ASSERT_EQ(stride, unit16) << K;
      ASSERT_GT(((bytes + 127) / 128 * 128 - unit16) * 16, unit16) << K;
    }
  }
  EXPECT_EQ(fp8w::row_stride(2048), 2176);
  EXPECT_EQ(fp8w::row_stride(1408), 1536);
  EXPECT_EQ(fp8w::row_stride(100), 128);    // 112 code bytes, one scale
  EXPECT_EQ(fp8w::row_stride(40), 64);      // 48 + 4 bytes: a line would add more than 1/16
  EXPECT_EQ(fp8w::row_stride(5120), 5376);  // 5,280 bytes: +96 to whole lines
}

TEST(FP8W, CpuMatmulIsTheDequantizedProduct) {
  BackendOptions bo;
  bo.threads = 2;
  auto be = make_cpu_backend(bo);
  ASSERT_TRUE(be->supports(Op::MatMul, DType::FP8W));
  ASSERT_TRUE(be->supports(Op::MoeFfn, DType::FP8W));
  for (int64_t K : {1, 100, 128, 1408})
    for (int64_t N : {1, 7, 130}) {
      const int64_t M = 3;
      auto wb = be->alloc(fp8w_bytes(N, K));
      TensorView w = fp8w_view(wb->data(), N, K);
      RandomFill f;
      f.seed = uint64_t(N * 7 + K);
      be->fill_random(w, f);
      expect_matmul_is_dequantized_product(
          *be, w, M, N, K,
          [&](int64_t n, float* row) {
            for (int64_t k = 0; k < K; ++k)
              row[k] = fp8_e4m3_to_f32(w.row(n)[k]) * fp8w::scale(w.row(n), K, k / 128);
          },
          "K " + std::to_string(K) + " N " + std::to_string(N));
    }
}

TEST(FP8W, FillRandomQuantizesTheBf16Values) {
  BackendOptions bo;
  auto be = make_cpu_backend(bo);
  const int64_t N = 5, K = 300;
  auto packed = be->alloc(fp8w_bytes(N, K)), plain = be->alloc(size_t(N * K) * 4);
  TensorView w = fp8w_view(packed->data(), N, K);
  RandomFill f;
  f.seed = 3;
  f.std = 0.05f;
  be->fill_random(w, f);
  f.round_as = DType::BF16;
  be->fill_random(plain->view(DType::F32, {N, K}), f);
  std::vector<uint8_t> expect(size_t(fp8w::row_stride(K)));
  for (int64_t r = 0; r < N; ++r) {
    quantize_fp8w_row(static_cast<const float*>(plain->data()) + r * K, K, expect.data());
    EXPECT_EQ(0, std::memcmp(expect.data(), w.row(r), expect.size())) << r;
  }
}

// An FP8 checkpoint in memory: F8_E4M3 weights with scale tensors beside them, and a BF16 one.
class Fp8Source final : public WeightSource {
 public:
  void add(const std::string& name, DType dt, std::vector<int64_t> shape,
           std::vector<uint8_t> bytes) {
    store_[name] = std::move(bytes);
    TensorView v = shape.size() == 1
                       ? TensorView::contiguous(store_[name].data(), dt, {shape[0]})
                       : TensorView::contiguous(store_[name].data(), dt, {shape[0], shape[1]});
    views_[name] = v;
  }
  std::optional<TensorView> find(const std::string& n) const override {
    const auto it = views_.find(n);
    return it == views_.end() ? std::nullopt : std::optional(it->second);
  }
  std::string describe() const override { return "fp8 source"; }
  uint64_t total_bytes() const override { return 0; }
  void prefetch(int, const std::function<void(size_t, size_t)>&) const override {}

 private:
  std::map<std::string, std::vector<uint8_t>> store_;
  std::map<std::string, TensorView> views_;
};

std::vector<uint8_t> f32_bytes(const std::vector<float>& v) {
  std::vector<uint8_t> b(v.size() * 4);
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

TEST(FP8W, BinderBindsFp8CheckpointTensorsExactly) {
  const int64_t N = 200, K = 300;  // 2 x 3 blocks of 128, partial at both ends
  std::vector<uint8_t> codes(size_t(N * K));
  for (size_t i = 0; i < codes.size(); ++i) codes[i] = uint8_t((i * 37 + 11) % 256) & 0xf7;
  Fp8Source src;
  src.add("blk.weight", DType::F8_E4M3, {N, K}, codes);
  src.add("blk.weight_scale_inv", DType::F32, {2, 3}, f32_bytes({1, 2, 3, 0.5f, 0.25f, 4}));
  src.add("ch.weight", DType::F8_E4M3, {N, K}, codes);
  std::vector<float> ch(static_cast<size_t>(N));
  for (int64_t n = 0; n < N; ++n) ch[size_t(n)] = 0.01f * float(n + 1);
  src.add("ch.weight_scale", DType::F32, {N, 1}, f32_bytes(ch));
  src.add("bad.weight", DType::F8_E4M3, {N, K}, codes);
  BackendOptions bo;
  auto be = make_cpu_backend(bo);
  WeightBinder b(src, *be);
  const TensorView blk = b.linear("blk.weight", N, K), cw = b.linear("ch.weight", N, K);
  ASSERT_EQ(blk.dtype, DType::FP8W);
  ASSERT_EQ(cw.dtype, DType::FP8W);
  const float block[2][3] = {{1, 2, 3}, {0.5f, 0.25f, 4}};
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) {
      const float v = fp8_e4m3_to_f32(codes[size_t(n * K + k)]);
      ASSERT_EQ(fp8w::element(blk.row(n), K, k), v * block[n / 128][k / 128]) << n << " " << k;
      ASSERT_EQ(fp8w::element(cw.row(n), K, k), v * ch[size_t(n)]) << n << " " << k;
    }
  // Used other than as a big matmul: dequantized to F32.
  const TensorView f = b.linear("blk.weight", N, K, Op::MatMul, Quantizable::No);
  ASSERT_EQ(f.dtype, DType::F32);
  EXPECT_EQ(f.ptr<float>()[1 * K + 260], fp8_e4m3_to_f32(codes[size_t(K + 260)]) * 3.0f);
  EXPECT_THROW(b.linear("bad.weight", N, K), UnsupportedError);  // no scales
  EXPECT_GT(b.formats().at("FP8W").second, 0u);
}

// split_cols (the shared MLP's down as experts): every part of a W4A16 / FP8W weight holds
// that column range's values, bit for bit; plain dtypes give views.
TEST(FP8W, BinderSplitsPackedWeightsByColumns) {
  const int64_t N = 3, K = 512;
  std::vector<float> x(size_t(N * K));
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.7f * float(i)) * float(1 + i % 5);
  Fp8Source src;
  src.add("w.weight", DType::F32, {N, K}, f32_bytes(x));
  BackendOptions bo;
  auto be = make_cpu_backend(bo);
  for (WeightQuant q : {WeightQuant::W4A16, WeightQuant::FP8, WeightQuant::None}) {
    WeightBinder b(src, *be, q);
    const TensorView w = b.linear("w.weight", N, K);
    for (int parts : {2, 4}) {
      const std::vector<TensorView> p = b.split_cols(w, parts);
      ASSERT_EQ(p.size(), size_t(parts));
      const int64_t n = K / parts;
      for (int i = 0; i < parts; ++i) {
        ASSERT_EQ(p[size_t(i)].dtype, w.dtype);
        ASSERT_EQ(p[size_t(i)].cols(), n);
        for (int64_t r = 0; r < N; ++r)
          for (int64_t k = 0; k < n; ++k) {
            const int64_t c = i * n + k;
            const float want = w.dtype == DType::W4A16  ? w4a16::element(w.row(r), K, c)
                               : w.dtype == DType::FP8W ? fp8w::element(w.row(r), K, c)
                                                        : w.ptr<float>()[r * K + c];
            const float got =
                w.dtype == DType::W4A16 ? w4a16::element(p[size_t(i)].row(r), n, k)
                : w.dtype == DType::FP8W
                    ? fp8w::element(p[size_t(i)].row(r), n, k)
                    : p[size_t(i)].ptr<float>()[r * p[size_t(i)].row_stride() / 4 + k];
            ASSERT_EQ(got, want) << weight_quant_name(q) << " part " << i << " (" << r << ", " << k
                                 << ")";
          }
      }
    }
    EXPECT_THROW(b.split_cols(w, 3), Error);
  }
}

// GGUF blocks are converted only when --quantize asks: none keeps Q8_0 / Q4_1 as stored; bf16,
// fp8 and w4a16 convert the dequantized rows (the same bytes as quantizing those floats);
// w4a16 leaves a K that is not whole 128-groups as stored.
TEST(FP8W, BinderConvertsGgufBlocksOnlyWhenAsked) {
  const int64_t N = 3, K = 256, K_odd = 96;
  Fp8Source src;
  std::vector<float> x(size_t(N * K)), x_odd(size_t(N * K_odd));
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.37f * float(i)) * (1.0f + float(i % 5));
  for (size_t i = 0; i < x_odd.size(); ++i) x_odd[i] = std::cos(0.21f * float(i));
  auto blocks = [](DType t, const std::vector<float>& v) {
    std::vector<uint8_t> b(dtype_bytes(t, int64_t(v.size())));
    cpu::quantize_row_ref(t, v.data(), b.data(), int64_t(v.size()));
    return b;
  };
  src.add("q8.weight", DType::Q8_0, {N, K}, blocks(DType::Q8_0, x));
  src.add("q41.weight", DType::Q4_1, {N, K}, blocks(DType::Q4_1, x));
  src.add("odd.weight", DType::Q8_0, {N, K_odd}, blocks(DType::Q8_0, x_odd));
  BackendOptions bo;
  auto be = make_cpu_backend(bo);
  for (DType t : {DType::Q8_0, DType::Q4_1}) {
    const std::string name = t == DType::Q8_0 ? "q8.weight" : "q41.weight";
    const TensorView stored = src.get(name);
    std::vector<float> deq(size_t(N * K));
    for (int64_t r = 0; r < N; ++r)
      cpu::dequantize_row_ref(t, static_cast<const uint8_t*>(stored.data) + r * stored.row_stride(),
                              deq.data() + r * K, K);
    WeightBinder none(src, *be, WeightQuant::None), bf(src, *be, WeightQuant::BF16),
        f8(src, *be, WeightQuant::FP8), w4(src, *be, WeightQuant::W4A16);
    EXPECT_EQ(none.linear(name, N, K).dtype, t);
    const TensorView b = bf.linear(name, N, K), f = f8.linear(name, N, K),
                     q = w4.linear(name, N, K);
    ASSERT_EQ(b.dtype, DType::BF16);
    ASSERT_EQ(f.dtype, DType::FP8W);
    ASSERT_EQ(q.dtype, DType::W4A16);
    std::vector<uint8_t> want_f(size_t(f.row_stride())), want_q(size_t(q.row_stride()));
    for (int64_t r = 0; r < N; ++r) {
      for (int64_t k = 0; k < K; ++k)
        ASSERT_EQ(b.ptr<uint16_t>()[r * K + k], f32_to_bf16(deq[size_t(r * K + k)])) << r << k;
      quantize_fp8w_row(deq.data() + r * K, K, want_f.data());
      quantize_w4a16_row(deq.data() + r * K, K, want_q.data());
      EXPECT_EQ(0, std::memcmp(want_f.data(), f.row(r), want_f.size())) << dtype_name(t) << r;
      EXPECT_EQ(0, std::memcmp(want_q.data(), q.row(r), want_q.size())) << dtype_name(t) << r;
    }
    // Only big matmuls convert: a weight used otherwise stays as stored.
    EXPECT_EQ(bf.linear(name, N, K, Op::MatMul, Quantizable::No).dtype, t);
  }
  WeightBinder w4(src, *be, WeightQuant::W4A16);
  EXPECT_EQ(w4.linear("odd.weight", N, K_odd).dtype, DType::Q8_0);
}

TEST(FP8W, QuantizeFp8AtLoadAndDummyTrackBf16) {
  auto load = [](WeightQuant q) { return test::load_dummy(test::dummy_dir(), 11, q); };
  auto q = load(WeightQuant::FP8), w4 = load(WeightQuant::W4A16), f = load(WeightQuant::None);
  const auto& fm = q.m.model->weight_formats();
  ASSERT_TRUE(fm.count("FP8W"));
  const auto& [bytes, params] = fm.at("FP8W");
  EXPECT_GE(double(bytes) / double(params), 1.03);
  EXPECT_LT(double(bytes) / double(params), 1.2);  // small K pads rows
  const std::vector<int32_t> prompt = {5, 17, 300, 42, 99, 7, 250, 11};
  const auto ref = prefill_logits(*f.m.model, *f.backend, f.m.config, prompt, DType::F32);
  AccuracyStats s, s4;
  compare_logits(ref, prefill_logits(*q.m.model, *q.backend, q.m.config, prompt, DType::F32),
                 f.m.config.vocab, s);
  compare_logits(ref, prefill_logits(*w4.m.model, *w4.backend, w4.m.config, prompt, DType::F32),
                 f.m.config.vocab, s4);
  std::printf("fp8: top1 %.3f max diff %.4f (%.4f of range); w4a16: top1 %.3f, %.4f (%.4f)\n",
              s.top1(), s.max_abs_diff, s.max_rel_diff, s4.top1(), s4.max_abs_diff,
              s4.max_rel_diff);
  EXPECT_EQ(s.positions, 8);
  EXPECT_GT(s.max_abs_diff, 1e-5) << "quantization changed nothing?";
  // 8-bit weights track the reference more closely than 4-bit ones (sharp router: a flipped
  // expert moves a row by a large part of its range).
  EXPECT_LT(s.max_rel_diff, s4.max_rel_diff);
  EXPECT_LT(s.max_rel_diff, 0.3);
  EXPECT_GE(s.top1(), 0.75);
}

TEST(Accuracy, IdenticalModelsAgreeAndDifferencesCount) {
  const std::vector<float> ref = {0, 1, 5, 2, 3, 9, 0, 1};  // 2 rows of 4
  std::vector<float> var = ref;
  AccuracyStats same;
  compare_logits(ref, var, 4, same);
  EXPECT_EQ(same.top1(), 1.0);
  EXPECT_EQ(same.max_abs_diff, 0.0);
  var[1] = 6;  // row 0's argmax moves; diff 5 over range 5
  AccuracyStats s;
  compare_logits(ref, var, 4, s);
  EXPECT_EQ(s.positions, 2);
  EXPECT_EQ(s.agree, 1);
  EXPECT_DOUBLE_EQ(s.max_abs_diff, 5.0);
  EXPECT_DOUBLE_EQ(s.max_rel_diff, 1.0);
}

}  // namespace
}  // namespace ds
