// The W4A16 kernels' lane work on the host, no GPU needed (gemm_w4a16.cuh's lane_dot is the
// kernels' own code): 32 lanes then the warp's xor butterfly over packed rows must give the
// dequantized dot products, absent tokens must stay zero, results must not depend on the
// other tokens of a pass, and the grid must cover every weight row once.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/gemm_w4a16.cuh"

namespace ds {
namespace {

using namespace cuda::w4k;

static_assert(kRows * kTm == 32, "each lane stores exactly one (row, token) sum");

// 16-byte aligned host memory (the host loads check alignment like the GPU would trap).
struct Aligned {
  explicit Aligned(size_t bytes)
      : p(static_cast<uint8_t*>(std::aligned_alloc(16, (bytes + 15) / 16 * 16))) {}
  ~Aligned() { std::free(p); }
  uint8_t* p;
};

// What the warp ends with in lane 0: lane_dot in every lane, then the xor butterfly.
std::vector<float> warp_sums(const uint8_t* const (&rows)[kRows], int64_t K,
                             const float* const (&xs)[kTm]) {
  std::vector<std::vector<float>> lanes(32, std::vector<float>(kRows * kTm));
  for (int l = 0; l < 32; ++l) {
    float v[kRows * kTm];
    lane_dot<kTm>(rows, K, xs, l, v);
    lanes[size_t(l)].assign(v, v + kRows * kTm);
  }
  for (int o = 16; o > 0; o /= 2) {
    auto next = lanes;
    for (int l = 0; l < 32; ++l)
      for (int i = 0; i < kRows * kTm; ++i)
        next[size_t(l)][size_t(i)] = lanes[size_t(l)][size_t(i)] + lanes[size_t(l ^ o)][size_t(i)];
    lanes = next;
  }
  for (int l = 1; l < 32; ++l) EXPECT_EQ(lanes[size_t(l)], lanes[0]) << "lanes disagree";
  return lanes[0];
}

TEST(W4a16Sim, LaneWorkGivesTheDequantizedProducts) {
  for (int64_t K : {128, 256, 384, 1536, 5120}) {
    const int64_t stride = w4a16::row_stride(K);
    Aligned w(size_t(kRows * stride)), x(size_t(kTm * K) * 4);
    std::vector<float> row(static_cast<size_t>(K));
    for (int r = 0; r < kRows; ++r) {
      for (int64_t k = 0; k < K; ++k)
        row[size_t(k)] = std::sin(0.7f * float(k) + float(r)) * (1.0f + float(k % 128) / 64.0f);
      quantize_w4a16_row(row.data(), K, w.p + r * stride);
    }
    float* xf = reinterpret_cast<float*>(x.p);
    for (int64_t i = 0; i < kTm * K; ++i) xf[i] = std::cos(0.3f * float(i));
    const uint8_t* rows[kRows];
    for (int r = 0; r < kRows; ++r) rows[r] = w.p + r * stride;
    const float* xs[kTm] = {xf, nullptr, xf + 2 * K, xf + 3 * K};  // token 1 absent
    const auto got = warp_sums(rows, K, xs);
    for (int r = 0; r < kRows; ++r)
      for (int j = 0; j < kTm; ++j) {
        double want = 0, mag = 0;
        if (xs[j])
          for (int64_t k = 0; k < K; ++k) {
            const double t = double(w4a16::element(rows[r], K, k)) * xs[j][k];
            want += t;
            mag += std::fabs(t);
          }
        EXPECT_NEAR(got[size_t(r * kTm + j)], want, 1e-5 * mag + 1e-7)
            << "K " << K << " row " << r << " token " << j;
      }
    // A token's sums do not depend on the other tokens of its pass.
    const float* alone[kTm] = {nullptr, nullptr, xf + 2 * K, nullptr};
    const auto solo = warp_sums(rows, K, alone);
    for (int r = 0; r < kRows; ++r) EXPECT_EQ(solo[size_t(r * kTm + 2)], got[size_t(r * kTm + 2)]);
  }
}

TEST(W4a16Sim, GridCoversEveryRowOnce) {
  for (int64_t n : {1, 7, 33, 257, 1000, 1536}) {
    std::vector<int> seen(size_t(n), 0);
    const int64_t per_cta = int64_t(kWarps) * kRows, ctas = (n + per_cta - 1) / per_cta;
    for (int64_t b = 0; b < ctas; ++b)
      for (int warp = 0; warp < kWarps; ++warp) {
        const int64_t row0 = (b * kWarps + warp) * kRows;
        if (row0 >= n) continue;
        for (int lane = 0; lane < 32; ++lane) {
          const int r = lane / kTm;
          if (row0 + r < n && lane % kTm == 0) ++seen[size_t(row0 + r)];
        }
      }
    for (int64_t i = 0; i < n; ++i) EXPECT_EQ(seen[size_t(i)], 1) << "n " << n << " row " << i;
  }
}

}  // namespace
}  // namespace ds
