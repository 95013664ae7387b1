// The tensor-core kernels for quantized weights (gemm_wq.cu), W4A16 and FP8W, against a
// dequantize-then-double reference on the host: the dense matmul over awkward M / N / K
// (N not a multiple of the 128-row tile, odd group counts, FP8W K not a multiple of 16,
// strided rows), its batch invariance over the decode range, and the MoE experts with top-6,
// shared experts, an expert without tokens and one with more tokens than a tile.
// Tolerances: the kernels round activations (and the MoE's SiLU * up) to BF16 (FP8W's to FP16;
// the BF16 expansions' cuBLAS products to BF16), so the sharp check uses a reference with the
// same rounded inputs (1e-4 of the row's sum of |w * x|), and the loose one the F32 inputs
// (2^-8 of it: a BF16 rounding is at most 2^-9 relative).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "backend/cuda/device_log.h"
#include "backend/cuda/gemm_wq.cuh"
#include "backend/cuda/moe.cuh"
#include "backend/cuda/switches.h"
#include "backend/cuda/wq_dequant.cuh"
#include "backend/fp8w.h"
#include "launch_context.h"
#include "moe_test_util.h"
#include "wq_test_util.h"

namespace ds {
namespace {

using test::cuda_backend;

const char* fmt_name(DType t) {
  if (t == DType::W4A16) return "W4A16";
  return "FP8W";
}

// The in-register kernels' quantized formats: for_formats(f) runs f(t) for W4A16 and FP8W.
template <typename Fn>
void for_formats(Fn&& f) {
  for (const DType t : {DType::W4A16, DType::FP8W}) f(t);
}

// out [M, N] (row stride ldo floats) of x [M, K] (row stride ldx) times w on the GPU.
std::vector<float> gpu_matmul(const TensorView& w, const std::vector<float>& x, int64_t M,
                              int64_t K, int64_t ldx, int64_t N, int64_t ldo) {
  Backend& be = cuda_backend();
  auto xd = be.alloc(size_t(M * ldx) * 4), od = be.alloc(size_t(M * ldo) * 4);
  be.upload(test::make_view(xd->data(), DType::F32, {M * ldx}, be.device()), x.data(),
            size_t(M * ldx) * 4);
  TensorView xv = test::make_view(xd->data(), DType::F32, {M, K}, be.device());
  xv.stride[0] = ldx * 4;
  TensorView ov = test::make_view(od->data(), DType::F32, {M, N}, be.device());
  ov.stride[0] = ldo * 4;
  be.matmul(xv, w, ov);
  std::vector<float> out(size_t(M * ldo));
  be.synchronize();
  be.download(out.data(), test::make_view(od->data(), DType::F32, {M * ldo}, be.device()),
              out.size() * 4);
  return out;
}

// A dense F32 tensor of the backend's, downloaded.
std::vector<float> download_f32(const TensorView& v) {
  Backend& be = cuda_backend();
  std::vector<float> host(size_t(v.numel()));
  be.download(host.data(), test::make_view(v.data, DType::F32, {v.numel()}, be.device()),
              host.size() * 4);
  return host;
}

// out = x . w^T through cuda::wq_matmul on the test's own stream (the backend's own choice of
// kernel bypassed), downloaded.
std::vector<float> wq_direct(const TensorView& x, const TensorView& w, const TensorView& out) {
  cuda::wq_matmul(launch_context().get(), x, w, out);
  EXPECT_EQ(cudaSuccess, cudaStreamSynchronize(launch_context().stream()));
  return download_f32(out);
}

// The in-register kernels at every M (prefill-sized M would take the BF16 expansion: below).
TEST(CudaWq, MatmulMatchesTheDequantizedProduct) {
  DS_REQUIRE_GPU();
  const test::Forced kernels_only(cuda::g_wq_dequant, 0);
  for_formats([&](DType t) {
    std::vector<int64_t> ks = {128, 384, 5120};
    if (t == DType::FP8W) ks = {100, 384, 1408, 5120};
    for (int64_t K : ks) {
      for (int64_t N : {1, 200, 1000}) {
        const test::QWeight w =
            test::make_qweight(cuda_backend(), t, N, K, uint32_t(K * 7 + N + int(t)));
        for (int64_t M : {1, 3, 8, 12, 17, 64, 200, 1000}) {
          if (M * N * K > int64_t(70) << 20) continue;  // keep the host reference quick
          const int64_t ldx = K + 4, ldo = N + 3;       // strided rows
          const auto x = test::random_floats(size_t(M * ldx), uint32_t(M + K + N));
          const auto out = gpu_matmul(w.dev, x, M, K, ldx, N, ldo);
          int bad = 0;
          for (int64_t m = 0; m < M && bad < 5; ++m) {
            std::vector<double> xb(static_cast<size_t>(K));
            for (int64_t k = 0; k < K; ++k)
              xb[size_t(k)] = test::act_round(t, x[size_t(m * ldx + k)]);
            for (int64_t n = 0; n < N && bad < 5; ++n) {
              const float* wr = w.deq.data() + n * K;
              double s = 0, s32 = 0, mag = 0;
              for (int64_t k = 0; k < K; ++k) {
                s += double(wr[k]) * xb[size_t(k)];
                s32 += double(wr[k]) * x[size_t(m * ldx + k)];
                mag += std::fabs(double(wr[k]) * x[size_t(m * ldx + k)]);
              }
              const double got = out[size_t(m * ldo + n)];
              if (std::fabs(got - s) > 1e-4 * mag + 1e-6 ||
                  std::fabs(got - s32) > mag / 256 + 1e-6) {
                ADD_FAILURE() << fmt_name(t) << " M " << M << " N " << N << " K " << K << " at ("
                              << m << ", " << n << "): " << got << " vs " << s << " (F32 x " << s32
                              << ", magnitude " << mag << ")";
                ++bad;
              }
            }
          }
        }
      }
    }
  });
}

// The BF16 expansion (wq_dequant.cuh) is each element rounded to nearest even, bit for bit, in
// one launch of three matrices of different K (an expert's gate, up and down).
TEST(CudaWq, ExpandedRowsAreTheRoundedElements) {
  DS_REQUIRE_GPU();
  Backend& be = cuda_backend();
  for (DType t : {DType::W4A16, DType::FP8W}) {
    SCOPED_TRACE(fmt_name(t));
    // W4A16: 9 groups and 1; FP8W: 10 whole groups and 8 columns, and 8 columns alone.
    const std::vector<std::pair<int64_t, int64_t>> shapes =
        t == DType::W4A16
            ? std::vector<std::pair<int64_t, int64_t>>{{37, 1152}, {5, 128}, {300, 384}}
            : std::vector<std::pair<int64_t, int64_t>>{{37, 1288}, {5, 8}, {300, 384}};
    std::vector<test::QWeight> ws;
    std::vector<std::unique_ptr<Buffer>> outs;
    cuda::WqDequantJob jobs[3];
    for (int i = 0; i < 3; ++i) {
      const auto [N, K] = shapes[size_t(i)];
      ws.push_back(test::make_qweight(be, t, N, K, uint32_t(40 + i)));
      outs.push_back(be.alloc(size_t(N * K) * 2));
      jobs[i] = {ws.back().dev.data, ws.back().dev.row_stride(), N, K, outs.back()->data()};
    }
    cuda::launch_wq_dequant(t, jobs, 3, launch_context().stream());
    ASSERT_EQ(cudaSuccess, cudaStreamSynchronize(launch_context().stream()));
    for (int i = 0; i < 3; ++i) {
      const test::QWeight& w = ws[size_t(i)];
      std::vector<uint16_t> got(size_t(w.n * w.k));
      be.download(got.data(),
                  test::make_view(outs[size_t(i)]->data(), DType::BF16, {w.n * w.k}, be.device()),
                  got.size() * 2);
      int bad = 0;
      for (size_t e = 0; e < got.size() && bad < 5; ++e)
        if (got[e] != w4a16::to_bf16(w.deq[e])) {
          ADD_FAILURE() << "matrix " << i << " row " << int64_t(e) / w.k << " col "
                        << int64_t(e) % w.k << ": " << w4a16::from_bf16(got[e]) << " vs "
                        << w.deq[e];
          ++bad;
        }
    }
  }
}

// The cap on one layer's expert expansion: 4 GiB unless DEEPSERVE_MOE_WQ_EXPAND_MAX_MB moves
// it. DeepSeek-V2.5's 162 experts (160 routed, 2 shared; H 5,120, F 1,536) take 7.1 GiB: over
// the default, within 8,192 MB (host only).
TEST(WqDequantPlan, ExpandCapMovesWithTheSwitch) {
  const int64_t v25 = int64_t(162) * 3 * 5120 * 1536 * 2;
  EXPECT_EQ(cuda::moe_wq_expand_max_bytes(), cuda::kMoeWqExpandMaxBytes);
  EXPECT_GT(v25, cuda::moe_wq_expand_max_bytes());
  {
    const test::Forced cap(cuda::g_moe_wq_expand_max_mb, 8192);
    EXPECT_EQ(cuda::moe_wq_expand_max_bytes(), int64_t(8192) << 20);
    EXPECT_LE(v25, cuda::moe_wq_expand_max_bytes());
  }
  EXPECT_EQ(cuda::moe_wq_expand_max_bytes(), cuda::kMoeWqExpandMaxBytes);
}

// The expansion's expert slots: all of a layer's experts where they fit the cap, else a ring
// of whole chunks (ceil(E / 8) experts each, at least two chunks) that does (host only).
TEST(WqDequantPlan, ExpandSlotsFormARingWhereTheLayerDoesNotFit) {
  // DeepSeek-V2-Lite: 66 experts of 2,048 x 1,408, 1.1 GiB: all of them.
  EXPECT_EQ(cuda::moe_wq_expand_slots(66, 2048, 1408, 8), 66);
  // V2.5: 162 of 5,120 x 1,536 (45 MiB each), 7.1 GiB: four chunks of 21 (3.7 GiB).
  EXPECT_EQ(cuda::moe_wq_expand_slots(162, 5120, 1536, 8), 84);
  {
    const test::Forced cap(cuda::g_moe_wq_expand_max_mb, 8192);
    EXPECT_EQ(cuda::moe_wq_expand_slots(162, 5120, 1536, 8), 162);
  }
  {
    const test::Forced cap(cuda::g_moe_wq_expand_max_mb, 1900);  // two chunks of 945 MiB
    EXPECT_EQ(cuda::moe_wq_expand_slots(162, 5120, 1536, 8), 42);
  }
  {
    const test::Forced cap(cuda::g_moe_wq_expand_max_mb, 1800);  // not two chunks: none
    EXPECT_EQ(cuda::moe_wq_expand_slots(162, 5120, 1536, 8), 0);
  }
}

// A step whose scratch would not fit what the pool can give takes fewer whole chunks, at least
// two, else no expansion (host only): V2.5's ring of 84 slots (4 chunks of 21, 45 MiB each)
// beside 2 GiB of other scratch.
TEST(WqDequantPlan, ExpandSlotsShrinkToThePoolsRoom) {
  const size_t mib = size_t(1) << 20, other = size_t(2048) * mib, expert = 45 * mib;
  const auto bytes_for = [&](int64_t slots) { return other + size_t(slots) * expert; };
  EXPECT_EQ(cuda::moe_wq_slots_within(84, 21, other + 84 * expert, bytes_for), 84);
  EXPECT_EQ(cuda::moe_wq_slots_within(84, 21, other + 83 * expert, bytes_for), 63);
  EXPECT_EQ(cuda::moe_wq_slots_within(84, 21, other + 50 * expert, bytes_for), 42);
  EXPECT_EQ(cuda::moe_wq_slots_within(84, 21, other + 41 * expert, bytes_for), 0);
  // All of V2-Lite's 66 (9 a chunk): the whole chunks below them, 63, then down to 18.
  EXPECT_EQ(cuda::moe_wq_slots_within(66, 9, other + 65 * expert, bytes_for), 63);
  EXPECT_EQ(cuda::moe_wq_slots_within(66, 9, other + 20 * expert, bytes_for), 18);
  EXPECT_EQ(cuda::moe_wq_slots_within(66, 9, other + 17 * expert, bytes_for), 0);
}

// Prefill-sized products go through the expansion and cuBLAS (forced here from one row): the
// result is the product with the weights rounded to BF16 (sharp), within 2^-8 of the exact
// one; a K the expansion cannot take (FP8W K = 100) stays with the kernels.
TEST(CudaWq, PrefillSizedMatmulTakesTheExpandedWeights) {
  DS_REQUIRE_GPU();
  const test::Forced from_one_row(cuda::g_wq_dequant_min_rows, 1);
  for (DType t : {DType::W4A16, DType::FP8W}) {
    const std::vector<int64_t> ks =
        t == DType::W4A16 ? std::vector<int64_t>{128, 1152} : std::vector<int64_t>{100, 1288};
    for (int64_t K : ks) {
      for (int64_t N : {200, 1000}) {
        const test::QWeight w = test::make_qweight(cuda_backend(), t, N, K, uint32_t(K + N));
        for (int64_t M : {17, 64, 700}) {  // past the BF16 skinny and streamed kernels' M
          const int64_t ldx = K + 4, ldo = N + 3;
          const auto x = test::random_floats(size_t(M * ldx), uint32_t(M * 3 + K + N));
          const auto out = gpu_matmul(w.dev, x, M, K, ldx, N, ldo);
          const bool expanded = cuda::wq_dequant_fits(t, K);
          int bad = 0;
          for (int64_t m = 0; m < M && bad < 5; m += (M > 64 ? 13 : 1)) {
            for (int64_t n = 0; n < N && bad < 5; ++n) {
              const float* wr = w.deq.data() + n * K;
              double s = 0, s32 = 0, mag = 0;
              for (int64_t k = 0; k < K; ++k) {
                const double xk = x[size_t(m * ldx + k)];
                s += double(expanded ? test::bf16_round(wr[k]) : wr[k]) *
                     test::act_round(expanded ? DType::BF16 : t, float(xk));
                s32 += double(wr[k]) * xk;
                mag += std::fabs(double(wr[k]) * xk);
              }
              const double got = out[size_t(m * ldo + n)];
              if (std::fabs(got - s) > 1e-4 * mag + 1e-6 ||
                  std::fabs(got - s32) > mag / 256 + 1e-6) {
                ADD_FAILURE() << fmt_name(t) << " M " << M << " N " << N << " K " << K << " at ("
                              << m << ", " << n << "): " << got << " vs " << s << " (exact " << s32
                              << ", magnitude " << mag << ")";
                ++bad;
              }
            }
          }
        }
      }
    }
  }
}

// Every e4m3 code through the FP8W kernel, exactly: one weight row holds codes 0..255 (the two
// NaN codes as 0) with scale 1, and token m is the one-hot row at column m, so out[m] is code
// m's value with nothing rounded: subnormals, zeros, the largest codes (-0 comes out +0: the
// sums start from +0).
TEST(CudaWq, Fp8wDecodesEveryCodeExactly) {
  DS_REQUIRE_GPU();
  Backend& be = cuda_backend();
  const int64_t K = 256, M = 256;
  std::vector<uint8_t> row(size_t(fp8w::row_stride(K)), 0);
  for (int c = 0; c < 256; ++c) row[size_t(c)] = (c & 0x7f) == 0x7f ? 0 : uint8_t(c);
  const float one = 1.0f;
  for (int g = 0; g < 2; ++g) std::memcpy(row.data() + fp8w::code_bytes(K) + 4 * g, &one, 4);
  auto wd = be.alloc(row.size());
  TensorView w = fp8w_view(wd->data(), 1, K, be.device());
  be.upload(w, row.data(), row.size());
  std::vector<float> x(size_t(M * K), 0.0f);
  for (int64_t m = 0; m < M; ++m) x[size_t(m * K + m)] = 1.0f;
  const auto out = gpu_matmul(w, x, M, K, K, 1, 1);
  for (int c = 0; c < 256; ++c) {
    const float want = fp8w::decode(row[size_t(c)]);
    EXPECT_EQ(out[size_t(c)], want) << "code 0x" << std::hex << c;
  }
}

// A token's output is the same bits alone and in any batch of the decode range (M <= 64,
// where the split count depends on N and K only).
TEST(CudaWq, MatmulIsBatchInvariantUpTo64Rows) {
  DS_REQUIRE_GPU();
  for (DType t : {DType::W4A16, DType::FP8W}) {
    const int64_t K = 5120, N = 1000;
    const test::QWeight w = test::make_qweight(cuda_backend(), t, N, K, 77, false);
    const auto x = test::random_floats(size_t(64 * K), 78);
    const auto batch = gpu_matmul(w.dev, x, 64, K, K, N, N);
    for (int64_t m : {0, 5, 63}) {
      const std::vector<float> one(x.begin() + m * K, x.begin() + (m + 1) * K);
      const auto alone = gpu_matmul(w.dev, one, 1, K, K, N, N);
      for (int64_t M : {int64_t(8), m + 1}) {
        const auto part = gpu_matmul(w.dev, x, M, K, K, N, N);
        if (m < M) {
          EXPECT_EQ(0, std::memcmp(part.data() + m * N, alone.data(), size_t(N) * 4))
              << fmt_name(t) << " row " << m << " in a batch of " << M;
        }
      }
      EXPECT_EQ(0, std::memcmp(batch.data() + m * N, alone.data(), size_t(N) * 4))
          << fmt_name(t) << " row " << m << " in a batch of 64";
    }
  }
}

// BF16 weights through the same kernel (the backend sends it the decode-sized products the
// skinny kernel does not take): against a double reference on BF16-rounded x over N not a
// multiple of the 128-row tile, K not a multiple of 128 (a partial last group) and strided rows
// whose padding is NaN (read one element too far and the row is NaN); each row the same bits
// alone and in every batch up to 16; and Backend::matmul takes this path for M = 8 on a 12 MB
// weight (same bits as the direct call).
TEST(CudaWq, Bf16MatmulMatchesTheReferenceAndIsBatchInvariant) {
  DS_REQUIRE_GPU();
  Backend& be = cuda_backend();
  struct Shape {
    int64_t n, k;
  };
  for (const Shape sh : {Shape{1, 8}, Shape{200, 136}, Shape{130, 1000}, Shape{3072, 2048}}) {
    const int64_t N = sh.n, K = sh.k, ldw = K + 8;
    const float amp = 0.6f / std::sqrt(float(K)) * 1.7f;
    const auto wr = test::random_floats(size_t(N * K), uint32_t(N + 3 * K), -amp, amp);
    std::vector<float> wpad(size_t(N * ldw), std::numeric_limits<float>::quiet_NaN());
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) wpad[size_t(n * ldw + k)] = wr[size_t(n * K + k)];
    const test::BackendTensor wb = test::upload_floats(be, DType::BF16, {N, ldw}, wpad);
    TensorView w = test::make_view(wb.view.data, DType::BF16, {N, K}, be.device());
    w.stride[0] = ldw * 2;
    ASSERT_TRUE(cuda::wq_bf16_fits(w));
    const int64_t ldx = K + 4;
    const auto x = test::random_floats(size_t(16 * ldx), uint32_t(K + 11));
    auto run = [&](int64_t M, int64_t row0, bool backend) {
      auto xd = be.alloc(size_t(M * ldx) * 4), od = be.alloc(size_t(M * N) * 4);
      be.upload(test::make_view(xd->data(), DType::F32, {M * ldx}, be.device()),
                x.data() + row0 * ldx, size_t(M * ldx) * 4);
      be.synchronize();
      TensorView xv = test::make_view(xd->data(), DType::F32, {M, K}, be.device());
      xv.stride[0] = ldx * 4;
      TensorView ov = test::make_view(od->data(), DType::F32, {M, N}, be.device());
      if (!backend) return wq_direct(xv, w, ov);
      be.matmul(xv, w, ov);
      be.synchronize();
      return download_f32(ov);
    };
    const auto all = run(16, 0, false);
    int bad = 0;
    for (int64_t m = 0; m < 16 && bad < 5; ++m)
      for (int64_t n = 0; n < N && bad < 5; ++n) {
        double s = 0, mag = 0;
        for (int64_t k = 0; k < K; ++k) {
          const double wv = test::bf16_round(wr[size_t(n * K + k)]);
          s += wv * test::bf16_round(x[size_t(m * ldx + k)]);
          mag += std::fabs(wv * x[size_t(m * ldx + k)]);
        }
        const double got = all[size_t(m * N + n)];
        if (!(std::fabs(got - s) <= 1e-4 * mag + 1e-6)) {
          ADD_FAILURE() << "BF16 N " << N << " K " << K << " at (" << m << ", " << n << "): " << got
                        << " vs " << s << " (magnitude " << mag << ")";
          ++bad;
        }
      }
    for (int64_t M : {1, 3, 8, 9}) {
      const int64_t row0 = 16 - M;  // the batch's last rows
      const auto part = run(M, row0, false);
      EXPECT_EQ(0, std::memcmp(part.data(), all.data() + row0 * N, size_t(M * N) * 4))
          << "BF16 N " << N << " K " << K << ": rows " << row0 << ".. in a batch of " << M;
    }
    if (N * K * 2 > (int64_t(6) << 20)) {
      const auto via_backend = run(8, 8, true);
      EXPECT_EQ(0, std::memcmp(via_backend.data(), all.data() + 8 * N, size_t(8 * N) * 4))
          << "Backend::matmul at M = 8 on a " << N << " x " << K << " BF16 weight";
    }
  }
}

// The one-launch decode path (F32 x rounded in the kernel, split-K partials summed across a
// thread-block cluster) against the three-launch one (conversion, kernel, reduce), and each
// half alone: the same bits for every format, M of both token variants, one split and up to
// 16, N not a multiple of the tile, FP8W K not a multiple of 8, and rows the kernel cannot
// stage (ld not a multiple of 4: those take the conversion). Each product runs twice.
TEST(CudaWq, OneLaunchDecodeMatchesTheStagedPath) {
  DS_REQUIRE_GPU();
  Backend& be = cuda_backend();
  struct Restore {
    ~Restore() {
      cuda::g_wq_stage_f32.force(-1);
      cuda::g_wq_cluster.force(-1);
    }
  } restore;
  struct Case {
    DType t;
    int64_t n, k;
  };
  const Case cases[] = {{DType::W4A16, 200, 384},   {DType::W4A16, 1000, 5120},
                        {DType::W4A16, 3072, 2048}, {DType::FP8W, 200, 100},
                        {DType::FP8W, 576, 2048},   {DType::FP8W, 1000, 1408},
                        {DType::BF16, 130, 1000},   {DType::BF16, 2048, 2048}};
  for (const Case& c : cases) {
    const int64_t N = c.n, K = c.k;
    std::unique_ptr<Buffer> wbuf;
    TensorView w;
    test::QWeight q;
    if (c.t == DType::BF16) {
      const float amp = 0.6f / std::sqrt(float(K)) * 1.7f;
      const auto wr = test::random_floats(size_t(N * K), uint32_t(N + K), -amp, amp);
      test::BackendTensor wb = test::upload_floats(be, DType::BF16, {N, K}, wr);
      wbuf = std::move(wb.buffer);
      w = wb.view;
    } else {
      q = test::make_qweight(be, c.t, N, K, uint32_t(N * 3 + K), false);
      w = q.dev;
    }
    for (const int64_t pad : {4, 1}) {
      const int64_t ldx = K + pad;
      const auto x = test::random_floats(size_t(16 * ldx), uint32_t(K + N + pad));
      auto xd = be.alloc(size_t(16 * ldx) * 4), od = be.alloc(size_t(16 * N) * 4);
      be.upload(test::make_view(xd->data(), DType::F32, {16 * ldx}, be.device()), x.data(),
                x.size() * 4);
      be.synchronize();
      for (const int64_t M : {1, 3, 8, 12, 16}) {
        TensorView xv = test::make_view(xd->data(), DType::F32, {M, K}, be.device());
        xv.stride[0] = ldx * 4;
        const TensorView ov = test::make_view(od->data(), DType::F32, {M, N}, be.device());
        auto run = [&](int xf32, int cluster) {
          cuda::g_wq_stage_f32.force(xf32);
          cuda::g_wq_cluster.force(cluster);
          return wq_direct(xv, w, ov);
        };
        const auto staged = run(0, 0);
        const int modes[][2] = {{1, 0}, {0, 1}, {1, 1}, {1, 1}};  // F32 x, clusters
        for (const auto& md : modes) {
          const auto one = run(md[0], md[1]);
          EXPECT_EQ(0, std::memcmp(one.data(), staged.data(), one.size() * 4))
              << dtype_name(c.t) << " N " << N << " K " << K << " M " << M << " ld " << ldx
              << " (F32 x " << md[0] << ", clusters " << md[1] << ")";
        }
      }
    }
  }
}

TEST(CudaWq, MatmulRejectsW4a16KThatIsNotWholeGroups) {
  EXPECT_THROW(w4a16_view(nullptr, 4, 200), UnsupportedError);
}

// ---- MoE ---------------------------------------------------------------------------------

struct QExperts {
  std::vector<test::QWeight> mats;  // gate, up, down per expert
  std::vector<ExpertWeights> dev;
};

QExperts make_experts(DType t, int E, int64_t H, int64_t F) {
  QExperts q;
  for (int e = 0; e < E; ++e)
    for (int i = 0; i < 3; ++i)
      q.mats.push_back(
          i < 2 ? test::make_qweight(cuda_backend(), t, F, H, uint32_t(100 + 3 * e + i))
                : test::make_qweight(cuda_backend(), t, H, F, uint32_t(100 + 3 * e + i)));
  for (int e = 0; e < E; ++e) {
    const test::QWeight* m = &q.mats[size_t(3 * e)];
    q.dev.push_back({m[0].dev, m[1].dev, m[2].dev});
  }
  return q;
}

// y = down . act(silu(gate . x) * (up . x)) for one expert, with x already rounded (and the
// weights to BF16 when `rounded`: the BF16 expansion's products); act rounds as
// test::act_round(act_type, ...); mag gets sum_n-wise |down| . |h| (the scale of each output's
// rounding).
void expert_ref(const QExperts& q, int e, const std::vector<double>& x, int64_t H, int64_t F,
                std::vector<double>& y, std::vector<double>& mag, bool rounded, DType act_type) {
  const auto wv = [&](const test::QWeight& m, int64_t i) {
    const float v = m.deq[size_t(i)];
    return double(rounded ? test::bf16_round(v) : v);
  };
  const test::QWeight& g = q.mats[size_t(3 * e)];
  const test::QWeight& u = q.mats[size_t(3 * e + 1)];
  const test::QWeight& d = q.mats[size_t(3 * e + 2)];
  std::vector<double> h(static_cast<size_t>(F));
  for (int64_t f = 0; f < F; ++f) {
    double gv = 0, uv = 0;
    for (int64_t k = 0; k < H; ++k) {
      gv += wv(g, f * H + k) * x[size_t(k)];
      uv += wv(u, f * H + k) * x[size_t(k)];
    }
    h[size_t(f)] = test::act_round(act_type, float(gv / (1.0 + std::exp(-gv)) * uv));
  }
  y.assign(size_t(H), 0.0);
  mag.assign(size_t(H), 0.0);
  for (int64_t n = 0; n < H; ++n)
    for (int64_t f = 0; f < F; ++f) {
      y[size_t(n)] += wv(d, n * F + f) * h[size_t(f)];
      mag[size_t(n)] += std::fabs(wv(d, n * F + f) * h[size_t(f)]);
    }
}

// Routing for T tokens over E - shared routed experts: slot 0 is expert 0 for every token (more
// than two 64-token tiles at T = 150); the rest spread over the others except expert 3, which
// never gets a token.
void spread_routing(int64_t T, int k, int routed, std::vector<int32_t>& ids,
                    std::vector<float>& wts) {
  ids.assign(size_t(T * k), 0);
  wts.assign(size_t(T * k), 0.0f);
  for (int64_t i = 0; i < T; ++i) {
    std::vector<int> pick = {0};
    for (int j = 1; int(pick.size()) < k; ++j) {
      const int e = int((i * 7 + j) % routed);
      if (e != 3 && std::find(pick.begin(), pick.end(), e) == pick.end()) pick.push_back(e);
    }
    for (int j = 0; j < k; ++j) {
      ids[size_t(i * k + j)] = pick[size_t(j)];
      wts[size_t(i * k + j)] = 0.3f + 0.1f * float(j) - 0.001f * float(i % 7);
    }
  }
}

void check_moe_against_reference(bool expand);

// Both paths: the in-register kernels, and the prefill path on BF16 expansions (forced from one
// assignment per expert; every expert expanded in one launch, gate, up and down side by side).
TEST(CudaWq, MoeFfnMatchesTheDequantizedExperts) {
  DS_REQUIRE_GPU();
  for (const bool expand : {false, true}) {
    SCOPED_TRACE(expand ? "expanded to BF16" : "in-register kernels");
    const test::Forced path(cuda::g_wq_dequant, expand ? 1 : 0);
    const test::Forced from_one(cuda::g_moe_wq_dequant_min, 1);
    check_moe_against_reference(expand);
  }
}

void check_moe_against_reference(bool expand) {
  Backend& be = cuda_backend();
  const int E = 12, k = 6;
  for_formats([&](DType t) {
    // W4A16: 9 and 5 groups; FP8W: DeepSeek-V2-Lite's F = 1408 (11 groups) and H = 1288 (10
    // whole groups and 8 columns).
    const int64_t H = t == DType::W4A16 ? 1152 : 1288, F = t == DType::W4A16 ? 640 : 1408;
    const QExperts q = make_experts(t, E, H, F);
    for (int shared : {0, 2}) {
      for (int64_t T : {1, 3, 8, 12, 17, 64, 150}) {
        std::vector<int32_t> ids;
        std::vector<float> wts;
        spread_routing(T, k, E - shared, ids, wts);
        const auto x = test::random_floats(size_t(T * H), uint32_t(T + 11 * shared));
        const auto got = moe_test::run_moe_ffn(be, x, ids, wts, q.dev, shared, T, H, k);
        int bad = 0;
        for (int64_t i = 0; i < T && bad < 5; ++i) {
          if (T > 17 && i % 5 != 0 && i != T - 1) continue;  // a sample keeps the host quick
          std::vector<double> xr(static_cast<size_t>(H)), want(size_t(H), 0.0), mag(size_t(H), 0.0),
              y, ym;
          // The in-register kernels round as the format does; the expansions' products to BF16.
          const DType act_type = expand ? DType::BF16 : t;
          for (int64_t c = 0; c < H; ++c)
            xr[size_t(c)] = test::act_round(act_type, x[size_t(i * H + c)]);
          for (int j = 0; j < k + shared; ++j) {
            const int e = j < k ? ids[size_t(i * k + j)] : E - shared + (j - k);
            const double wj = j < k ? wts[size_t(i * k + j)] : 1.0;
            expert_ref(q, e, xr, H, F, y, ym, expand, act_type);
            for (int64_t c = 0; c < H; ++c) {
              want[size_t(c)] += wj * y[size_t(c)];
              mag[size_t(c)] += std::fabs(wj) * ym[size_t(c)];
            }
          }
          for (int64_t c = 0; c < H && bad < 5; ++c) {
            const double g = got[size_t(i * H + c)];
            // h may round to the other BF16 neighbour: 2^-8 of the magnitude covers it.
            if (!(std::fabs(g - want[size_t(c)]) <= mag[size_t(c)] / 256 + 1e-6)) {
              ADD_FAILURE() << fmt_name(t) << " T " << T << " shared " << shared << " token " << i
                            << " col " << c << ": " << g << " vs " << want[size_t(c)]
                            << " (magnitude " << mag[size_t(c)] << ")";
              ++bad;
            }
          }
        }
      }
    }
  });
}

// A layer past the cap expands its experts into a ring of whole chunks: here two chunks of two
// slots for 11 touched experts in 6 chunks, so each pair of slots is filled three times, each
// time after the GEMMs of the chunk before have read it. The same bits as every expert
// expanded at once (the same BF16 weights, GEMMs and streams).
TEST(CudaWq, MoeExpansionRingChangesNothing) {
  DS_REQUIRE_GPU();
  Backend& be = cuda_backend();
  const test::Forced expand(cuda::g_wq_dequant, 1);
  const test::Forced from_one(cuda::g_moe_wq_dequant_min, 1);
  const int E = 12, k = 6;
  for_formats([&](DType t) {
    const int64_t H = t == DType::W4A16 ? 1152 : 1288, F = t == DType::W4A16 ? 640 : 1408;
    const long long ring_mb = t == DType::W4A16 ? 17 : 42;  // a chunk: 8.4 / 20.8 MiB
    const QExperts q = make_experts(t, E, H, F);
    for (int shared : {0, 2}) {
      for (int64_t T : {17, 150}) {
        std::vector<int32_t> ids;
        std::vector<float> wts;
        spread_routing(T, k, E - shared, ids, wts);
        const auto x = test::random_floats(size_t(T * H), uint32_t(5 * T + shared));
        ASSERT_EQ(cuda::moe_wq_expand_slots(E, H, F, 8), E);
        const auto all = moe_test::run_moe_ffn(be, x, ids, wts, q.dev, shared, T, H, k);
        const test::Forced cap(cuda::g_moe_wq_expand_max_mb, ring_mb);
        ASSERT_EQ(cuda::moe_wq_expand_slots(E, H, F, 8), 4);
        const auto ring = moe_test::run_moe_ffn(be, x, ids, wts, q.dev, shared, T, H, k);
        ASSERT_EQ(all.size(), ring.size());
        size_t diff = 0;
        while (diff < all.size() && std::memcmp(&all[diff], &ring[diff], 4) == 0) ++diff;
        EXPECT_EQ(diff, all.size())
            << fmt_name(t) << " shared " << shared << " T " << T << ": first difference at " << diff
            << " (token " << int64_t(diff) / H << ")";
      }
    }
  });
}

// Gate/up and down in one launch (DEEPSERVE_MOE_WQ_FUSED: items taken from a counter, each down
// item waiting for its tile's gate/up items) give the same bits as the two launches: every
// decode-sized T (1 to 16; one tile an expert), with and without shared experts, experts left
// without tokens, F not a whole number of 64-column items and H not of 128-row ones, more items
// than CTAs (11 or 12 tiles x 33 items against two or three CTAs an SM), x's F32 rows read in
// the kernel and gathered first; the items in tile order and with the shared experts' first
// (DEEPSERVE_MOE_WQ_SHARED_FIRST).
TEST(CudaWq, OneLaunchFfnChangesNothing) {
  DS_REQUIRE_GPU();
  Backend& be = cuda_backend();
  const int E = 12, k = 6;
  const test::Forced kernels_only(cuda::g_wq_dequant, 0);
  for_formats([&](DType t) {
    const int64_t H = t == DType::W4A16 ? 1152 : 1288, F = t == DType::W4A16 ? 640 : 1408;
    const QExperts q = make_experts(t, E, H, F);
    for (int xf32 = 0; xf32 < 2; ++xf32) {
      const test::Forced stage(cuda::g_moe_wq_stage_f32, xf32);
      for (int shared : {0, 2})
        for (const int64_t T : {1, 3, 8, 12, 16}) {
          std::vector<int32_t> ids;
          std::vector<float> wts;
          spread_routing(T, k, E - shared, ids, wts);
          // Two inputs, one after the other: a launch whose counters were not zeroed by the
          // lists kernel would do nothing and leave the first input's rows.
          const auto x = test::random_floats(size_t(T * H), uint32_t(T + 7 * shared + 3 * xf32));
          const auto x2 =
              test::random_floats(size_t(T * H), uint32_t(T + 7 * shared + 3 * xf32 + 50));
          const std::string what = std::string(fmt_name(t)) + " T " + std::to_string(T) +
                                   " shared " + std::to_string(shared) + " F32 x " +
                                   std::to_string(xf32);
          std::vector<float> two, two2;
          {
            const test::Forced off(cuda::g_moe_wq_fused, 0);
            two = moe_test::run_moe_ffn(be, x, ids, wts, q.dev, shared, T, H, k);
            two2 = moe_test::run_moe_ffn(be, x2, ids, wts, q.dev, shared, T, H, k);
          }
          ASSERT_NE(0, std::memcmp(two.data(), two2.data(), two.size() * 4)) << what;
          const test::Forced on(cuda::g_moe_wq_fused, 1);
          for (int first : {0, 1}) {  // DEEPSERVE_MOE_WQ_SHARED_FIRST: the items' order
            const test::Forced order(cuda::g_moe_wq_shared_first, first);
            const std::string how = what + (first ? ", shared experts first" : "");
            const int64_t before = cuda::moe_wq_fused_launches();
            const auto one = moe_test::run_moe_ffn(be, x, ids, wts, q.dev, shared, T, H, k);
            const auto one2 = moe_test::run_moe_ffn(be, x2, ids, wts, q.dev, shared, T, H, k);
            EXPECT_EQ(cuda::moe_wq_fused_launches(), before + 2) << how;
            ASSERT_EQ(one.size(), two.size()) << how;
            ASSERT_EQ(one2.size(), two2.size()) << how;
            EXPECT_EQ(0, std::memcmp(one.data(), two.data(), one.size() * 4)) << how;
            EXPECT_EQ(0, std::memcmp(one2.data(), two2.data(), one2.size() * 4))
                << how << ", second";
          }
        }
    }
  });
}

// W4A16's stages in halves (DEEPSERVE_MOE_WQ_HALVES: 256 bytes of half the rows a stage) give the
// one-launch FFN's bits at 8 tokens or fewer: V2.5's expert shapes (40 and 12 groups), 9 and 5
// groups (gate/up's last stage pair a group, down's three of four groups zero), V2-Lite's
// (16 and 11), each with and without shared experts, and experts left without tokens. Against the
// two launches, which share nothing with the halves; the launch counter shows the halves ran.
TEST(CudaWq, OneLaunchFfnHalvesChangeNothing) {
  DS_REQUIRE_GPU();
  Backend& be = cuda_backend();
  const int k = 6;
  const test::Forced kernels_only(cuda::g_wq_dequant, 0);
  for (const auto& [E, H, F] :
       {std::tuple{12, int64_t(1152), int64_t(640)}, std::tuple{10, int64_t(2048), int64_t(1408)},
        std::tuple{8, int64_t(5120), int64_t(1536)}}) {
    const QExperts q = make_experts(DType::W4A16, E, H, F);
    for (int shared : {0, 2})
      for (const int64_t T : {1, 5, 8}) {
        std::vector<int32_t> ids;
        std::vector<float> wts;
        spread_routing(T, k, E - shared, ids, wts);
        const auto x = test::random_floats(size_t(T * H), uint32_t(T + 7 * shared + H));
        const std::string what = "H " + std::to_string(H) + " F " + std::to_string(F) + " T " +
                                 std::to_string(T) + " shared " + std::to_string(shared);
        std::vector<float> two;
        {
          const test::Forced off(cuda::g_moe_wq_fused, 0);
          two = moe_test::run_moe_ffn(be, x, ids, wts, q.dev, shared, T, H, k);
        }
        const test::Forced on(cuda::g_moe_wq_fused, 1);
        const test::Forced halves(cuda::g_moe_wq_halves, 1);
        const int64_t before = cuda::moe_wq_halves_launches();
        const auto one = moe_test::run_moe_ffn(be, x, ids, wts, q.dev, shared, T, H, k);
        EXPECT_EQ(cuda::moe_wq_halves_launches(), before + 1) << what;
        ASSERT_EQ(one.size(), two.size()) << what;
        EXPECT_EQ(0, std::memcmp(one.data(), two.data(), one.size() * 4)) << what;
      }
  }
}

// The one-launch FFN's item log (DEEPSERVE_MOE_ITEMS, tools/moe_item_table.py): one launch logs
// each of its items once (its tiles: the routed experts with tokens and the shared ones), with
// the launch's item counts, times that run forward within an item and from one item of a CTA to
// its next, and claims that rise within a CTA; the output is the bits of the launch without it.
TEST(CudaWq, OneLaunchFfnLogsEveryItemOnce) {
  DS_REQUIRE_GPU();
  Backend& be = cuda_backend();
  const int E = 12, k = 6, shared = 2;
  const int64_t H = 1152, F = 640, T = 8;
  const test::Forced kernels_only(cuda::g_wq_dequant, 0);
  const test::Forced one_launch(cuda::g_moe_wq_fused, 1);
  const QExperts q = make_experts(DType::W4A16, E, H, F);
  std::vector<int32_t> ids;
  std::vector<float> wts;
  spread_routing(T, k, E - shared, ids, wts);
  const auto x = test::random_floats(size_t(T * H), 91);
  const auto plain = moe_test::run_moe_ffn(be, x, ids, wts, q.dev, shared, T, H, k);
  cuda::DeviceLog& log = cuda::moe_item_log();
  log.open(100000, 0);
  struct Closer {
    cuda::DeviceLog& log;
    ~Closer() { log.close(); }
  } closer{log};
  const int64_t before = cuda::moe_wq_fused_launches();
  const auto logged = moe_test::run_moe_ffn(be, x, ids, wts, q.dev, shared, T, H, k);
  ASSERT_EQ(cuda::moe_wq_fused_launches(), before + 1);
  ASSERT_EQ(plain.size(), logged.size());
  EXPECT_EQ(0, std::memcmp(plain.data(), logged.data(), plain.size() * 4));
  const std::vector<unsigned long long> rec = log.records();
  const int tiles = int(std::set<int32_t>(ids.begin(), ids.end()).size()) + shared;
  const int gu_cols = int((F + 63) / 64), dn_cols = int((H + 127) / 128);
  const int n_gu = tiles * gu_cols, n_all = n_gu + tiles * dn_cols;
  constexpr size_t kWords = 8;
  ASSERT_EQ(rec.size(), size_t(n_all) * kWords) << tiles << " tiles";
  std::vector<int> seen(size_t(n_all), 0);
  std::map<int, std::vector<const unsigned long long*>> by_cta;
  for (size_t r = 0; r < rec.size(); r += kWords) {
    const unsigned long long* w = rec.data() + r;
    const int item = int(w[0] >> 32);
    ASSERT_GE(item, 0);
    ASSERT_LT(item, n_all);
    ++seen[size_t(item)];
    EXPECT_EQ(int(w[1] & 0xffffffffu), n_gu) << "item " << item;
    EXPECT_EQ(int(w[1] >> 32), n_all) << "item " << item;
    EXPECT_GT(w[2], 0u) << "item " << item;
    EXPECT_LE(w[2], w[3]) << "item " << item;
    EXPECT_LE(w[4], w[5]) << "item " << item;
    EXPECT_LE(w[5], w[6]) << "item " << item;
    if (item < n_gu) EXPECT_EQ(w[4], w[5]) << "gate/up item " << item << " has no wait";
    by_cta[int(w[0] & 0xfffff)].push_back(w);
  }
  for (int i = 0; i < n_all; ++i) EXPECT_EQ(seen[size_t(i)], 1) << "item " << i;
  for (auto& [cta, items] : by_cta) {
    std::sort(items.begin(), items.end(), [](auto* a, auto* b) { return a[2] < b[2]; });
    for (size_t i = 1; i < items.size(); ++i) {
      EXPECT_LT(items[i - 1][0] >> 32, items[i][0] >> 32) << "CTA " << cta << ": claims rise";
      EXPECT_LE(items[i - 1][3], items[i][2]) << "CTA " << cta << ": one item after another";
      EXPECT_LE(items[i - 1][6], items[i][4]) << "CTA " << cta << ": its SM's clock";
    }
  }
}

// A token's output does not depend on its batch: alone and among 12 (the 8- and 16-token
// kernels; FP8W's read x's F32 rows through the sorted tokens) it is the same bits as among
// 150 (the 64-token tiles over the BF16 rows gathered first).
TEST(CudaWq, MoeFfnIsBatchInvariant) {
  DS_REQUIRE_GPU();
  Backend& be = cuda_backend();
  const int E = 12, k = 6, shared = 2;
  const int64_t H = 1024, F = 768, T = 150;
  const test::Forced kernels_only(cuda::g_wq_dequant, 0);  // 150 tokens would take it when forced
  for_formats([&](DType t) {
    SCOPED_TRACE(fmt_name(t));
    const QExperts q = make_experts(t, E, H, F);
    std::vector<int32_t> ids;
    std::vector<float> wts;
    spread_routing(T, k, E - shared, ids, wts);
    const auto x = test::random_floats(size_t(T * H), 77);
    const auto batch = moe_test::run_moe_ffn(be, x, ids, wts, q.dev, shared, T, H, k);
    const auto first12 = moe_test::run_moe_ffn(
        be, std::span(x).first(size_t(12 * H)), std::span(ids).first(size_t(12 * k)),
        std::span(wts).first(size_t(12 * k)), q.dev, shared, 12, H, k);
    EXPECT_EQ(0, std::memcmp(first12.data(), batch.data(), first12.size() * 4))
        << "the first 12 tokens differ from the same tokens among 150";
    int mismatched = 0;
    for (int64_t i = 0; i < T && mismatched < 3; i += 7) {
      const auto alone = moe_test::run_moe_ffn(be, std::span(x).subspan(size_t(i * H), size_t(H)),
                                               std::span(ids).subspan(size_t(i * k), size_t(k)),
                                               std::span(wts).subspan(size_t(i * k), size_t(k)),
                                               q.dev, shared, 1, H, k);
      if (std::memcmp(alone.data(), batch.data() + i * H, size_t(H) * 4) != 0) {
        ADD_FAILURE() << "token " << i << " alone differs from the batch";
        ++mismatched;
      }
    }
  });
}

// Weight prefetch (pdl.cuh): the dense kernel asks L2 for its rows before the wait, the MoE
// down kernel for its rows after reading the lists early. The same bits with it off and on,
// dense (M = 1, 8) and MoE (T = 1, 8, 40), both formats.
TEST(CudaWq, WeightPrefetchChangesNothing) {
  DS_REQUIRE_GPU();
  Backend& be = cuda_backend();
  const test::Forced kernels_only(cuda::g_wq_dequant, 0);
  const int E = 12, k = 6, shared = 2;
  const int64_t H = 1024, F = 768, N = 1000, K = 2048;
  for (DType t : {DType::W4A16, DType::FP8W}) {
    SCOPED_TRACE(fmt_name(t));
    const test::QWeight q = test::make_qweight(be, t, N, K, 91, false);
    const auto x = test::random_floats(size_t(8 * K), 92);
    auto xd = be.alloc(size_t(8 * K) * 4), od = be.alloc(size_t(8 * N) * 4);
    be.upload(test::make_view(xd->data(), DType::F32, {8 * K}, be.device()), x.data(),
              x.size() * 4);
    be.synchronize();
    for (const int64_t M : {1, 8}) {
      const TensorView xv = test::make_view(xd->data(), DType::F32, {M, K}, be.device());
      const TensorView ov = test::make_view(od->data(), DType::F32, {M, N}, be.device());
      std::vector<float> got[2];
      for (int on = 0; on < 2; ++on) {
        const test::Forced forced(cuda::g_prefetch, on);
        got[on] = wq_direct(xv, q.dev, ov);
      }
      EXPECT_EQ(got[1], got[0]) << "dense, M " << M;
    }
    const QExperts qe = make_experts(t, E, H, F);
    for (const int64_t T : {1, 8, 40}) {
      std::vector<int32_t> ids;
      std::vector<float> wts;
      spread_routing(T, k, E - shared, ids, wts);
      const auto xm = test::random_floats(size_t(T * H), uint32_t(93 + T));
      std::vector<float> got[2];
      for (int on = 0; on < 2; ++on) {
        const test::Forced forced(cuda::g_prefetch, on);
        got[on] = moe_test::run_moe_ffn(be, xm, ids, wts, qe.dev, shared, T, H, k);
      }
      EXPECT_EQ(got[1], got[0]) << "MoE, T " << T;
    }
  }
}

// The decode variants' first weights asked for before the dependent-launch wait
// (DEEPSERVE_WQ_EARLY) change no bit: dense products of every format (M = 1, 8, 16; one split
// and several, N and K not whole tiles; M = 40, the prefill-sized tiles) and the MoE (T = 1, 8,
// 12; x's F32 rows read in the kernel, and gathered first, where gate/up takes them early too),
// each against early off. Nor does the pipeline's other order (DEEPSERVE_WQ_ISSUE_FIRST: a
// stage's next copies before its wait), with early weights and without, nor the defaults (FP8W
// issue-first, DEEPSERVE_WQ_ISSUE_FIRST_FP8W).
TEST(CudaWq, EarlyWeightsChangeNothing) {
  DS_REQUIRE_GPU();
  Backend& be = cuda_backend();
  const test::Forced kernels_only(cuda::g_wq_dequant, 0);
  // gathers: the call runs the gather launch (W4A16's MoE; FP8W's without F32 x staging).
  auto run_modes = [&](auto&& run, const std::string& what, bool gathers = false) {
    std::vector<float> base;
    {
      // FP8W's default order is issue-first (DEEPSERVE_WQ_ISSUE_FIRST_FP8W): the defaults as
      // they are against the classic order of a stage.
      const auto as_is = run();
      const test::Forced classic(cuda::g_wq_issue_first_fp8w, 0);
      const test::Forced early(cuda::g_wq_early, 0);
      base = run();
      ASSERT_EQ(as_is.size(), base.size());
      EXPECT_EQ(0, std::memcmp(as_is.data(), base.data(), base.size() * 4)) << what << ", defaults";
    }
    const test::Forced classic(cuda::g_wq_issue_first_fp8w, 0);
    const test::Forced early(cuda::g_wq_early, 1);
    const auto got = run();
    ASSERT_EQ(got.size(), base.size());
    EXPECT_EQ(0, std::memcmp(got.data(), base.data(), got.size() * 4)) << what;
    // And the gather a batch of loads at a time (DEEPSERVE_ROW_REGS): the same bits.
    const test::Forced row_regs(cuda::g_row_regs, 1);
    const int64_t before = cuda::row_regs_launches();
    const auto regs = run();
    EXPECT_EQ(cuda::row_regs_launches() > before, gathers) << what;
    ASSERT_EQ(regs.size(), base.size());
    EXPECT_EQ(0, std::memcmp(regs.data(), base.data(), regs.size() * 4)) << what << ", row regs";
    const test::Forced issue_first(cuda::g_wq_issue_first, 1);
    for (int early : {1, 0}) {
      const test::Forced e(cuda::g_wq_early, early);
      const auto first = run();
      ASSERT_EQ(first.size(), base.size());
      EXPECT_EQ(0, std::memcmp(first.data(), base.data(), first.size() * 4))
          << what << ", copies issued first, early " << early;
    }
  };
  struct Dense {
    DType t;
    int64_t n, k;
  };
  for (const Dense& c : {Dense{DType::W4A16, 1000, 2048}, Dense{DType::W4A16, 200, 384},
                         Dense{DType::FP8W, 576, 2048}, Dense{DType::FP8W, 1000, 1400},
                         Dense{DType::BF16, 2048, 1024}}) {
    std::unique_ptr<Buffer> wbuf;
    TensorView w;
    test::QWeight q;
    if (c.t == DType::BF16) {
      const float amp = 0.6f / std::sqrt(float(c.k)) * 1.7f;
      const auto wr = test::random_floats(size_t(c.n * c.k), uint32_t(c.n + c.k), -amp, amp);
      test::BackendTensor wb = test::upload_floats(be, DType::BF16, {c.n, c.k}, wr);
      wbuf = std::move(wb.buffer);
      w = wb.view;
    } else {
      q = test::make_qweight(be, c.t, c.n, c.k, uint32_t(c.n * 5 + c.k), false);
      w = q.dev;
    }
    const auto x = test::random_floats(size_t(40 * c.k), uint32_t(c.k + 3));
    auto xd = be.alloc(size_t(40 * c.k) * 4), od = be.alloc(size_t(40 * c.n) * 4);
    be.upload(test::make_view(xd->data(), DType::F32, {40 * c.k}, be.device()), x.data(),
              x.size() * 4);
    be.synchronize();
    for (const int64_t M : {1, 8, 16, 40}) {
      if (M > 16 && c.t == DType::BF16) continue;  // BF16 weights take at most 16 rows here
      const TensorView xv = test::make_view(xd->data(), DType::F32, {M, c.k}, be.device());
      const TensorView ov = test::make_view(od->data(), DType::F32, {M, c.n}, be.device());
      run_modes([&] { return wq_direct(xv, w, ov); },
                std::string("dense ") + std::string(dtype_name(c.t)) + " N " + std::to_string(c.n) +
                    " K " + std::to_string(c.k) + " M " + std::to_string(M));
    }
  }
  const int E = 12, k = 6, shared = 2;
  const int64_t H = 1024, F = 768;
  // The two launches: the one-launch FFN asks for no weights before its wait.
  const test::Forced two_launches(cuda::g_moe_wq_fused, 0);
  for (DType t : {DType::W4A16, DType::FP8W}) {
    const QExperts qe = make_experts(t, E, H, F);
    for (int xf32 = 0; xf32 < 2; ++xf32) {
      const test::Forced stage(cuda::g_moe_wq_stage_f32, xf32);
      for (const int64_t T : {1, 8, 12}) {
        std::vector<int32_t> ids;
        std::vector<float> wts;
        spread_routing(T, k, E - shared, ids, wts);
        const auto xm = test::random_floats(size_t(T * H), uint32_t(95 + T));
        run_modes([&] { return moe_test::run_moe_ffn(be, xm, ids, wts, qe.dev, shared, T, H, k); },
                  std::string("MoE ") + fmt_name(t) + " T " + std::to_string(T) + " F32 x " +
                      std::to_string(xf32),
                  t == DType::W4A16 || xf32 == 0);
      }
    }
  }
}

}  // namespace
}  // namespace ds
