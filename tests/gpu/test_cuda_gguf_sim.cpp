// The GGUF kernels' block addressing on the host, no GPU needed (gguf_blocks.cuh's octet and
// lane_dot are the kernels' own code): every octet of every type must dequantize to the CPU
// reference's elements (quants.cpp), and 32 lanes of lane_dot then the warp sum must give the
// dequantized dot products over rows whose blocks are only 2-byte aligned, absent tokens zero.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "backend/cuda/gguf_blocks.cuh"
#include "gguf_test_util.h"

namespace ds {
namespace {

namespace g = cuda::gguf;

TEST(CudaGgufSim, EveryOctetMatchesTheCpuDequantizer) {
  for (DType t : test::kGgufTypes) {
    const int64_t rows = 3, k = 768;
    const auto b = test::random_gguf_rows(t, rows, k, 7);
    const auto want = test::dequantize_rows(t, b, rows, k);
    const int64_t rb = g::row_bytes(t, k);
    int bad = 0;
    g::dispatch(t, [&](auto tc) {
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t o = 0; o < k / 8; ++o) {
          float w[8];
          g::octet<decltype(tc)::value>(b.data() + r * rb, o, w);
          for (int i = 0; i < 8; ++i) {
            const float x = want[size_t(r * k + o * 8 + i)];
            if (std::fabs(w[i] - x) > 1e-6f * std::fabs(x) + 1e-12f && bad++ < 5)
              ADD_FAILURE() << dtype_name(t) << " row " << r << " element " << o * 8 + i << ": "
                            << w[i] << " vs " << x;
          }
        }
    });
    EXPECT_EQ(bad, 0) << dtype_name(t);
  }
}

TEST(CudaGgufSim, WarpDotMatchesTheDequantizedProduct) {
  constexpr int TM = g::kTm;
  for (DType t : test::kGgufTypes) {
    const int bs = dtype_info(t).block_size;
    for (int64_t k : {256, 1408, 2048}) {
      if (k % bs) continue;
      const int64_t rb = g::row_bytes(t, k);
      // Rows one byte pair apart inside a buffer: 2-byte aligned only, as a GGUF slice can be.
      auto packed = test::random_gguf_rows(t, g::kRows, k, uint32_t(k + int(t)));
      std::vector<uint8_t> buf(packed.size() + 2);
      std::memcpy(buf.data() + 2, packed.data(), packed.size());
      const auto w = test::dequantize_rows(t, packed, g::kRows, k);
      std::vector<std::vector<float>> xv(TM, std::vector<float>(size_t(k)));
      std::mt19937 rng{uint32_t(k)};
      std::uniform_real_distribution<float> u(-1, 1);
      for (auto& x : xv)
        for (auto& v : x) v = u(rng);
      const uint8_t* rows[g::kRows];
      for (int r = 0; r < g::kRows; ++r) rows[r] = buf.data() + 2 + r * rb;
      const float* xs[TM];
      for (int j = 0; j < TM; ++j) xs[j] = j == 5 ? nullptr : xv[size_t(j)].data();
      float sum[g::kRows * TM] = {};
      g::dispatch(t, [&](auto tc) {
        for (int lane = 0; lane < 32; ++lane) {
          float v[g::kRows * TM];
          g::lane_dot<decltype(tc)::value, TM>(rows, k, xs, lane, v);
          for (int i = 0; i < g::kRows * TM; ++i) sum[i] += v[i];
        }
      });
      for (int r = 0; r < g::kRows; ++r)
        for (int j = 0; j < TM; ++j) {
          double want = 0, mag = 0;
          if (j != 5)
            for (int64_t e = 0; e < k; ++e) {
              want += double(w[size_t(r * k + e)]) * xv[size_t(j)][size_t(e)];
              mag += std::fabs(double(w[size_t(r * k + e)]) * xv[size_t(j)][size_t(e)]);
            }
          EXPECT_NEAR(sum[r * TM + j], want, 1e-5 * mag + 1e-7)
              << dtype_name(t) << " K " << k << " row " << r << " token " << j;
        }
      // The one-token variant (M = 1 decode) gives the same sums for token 0.
      float one[g::kRows] = {};
      const float* x0[1] = {xs[0]};
      g::dispatch(t, [&](auto tc) {
        for (int lane = 0; lane < 32; ++lane) {
          float v[g::kRows];
          g::lane_dot<decltype(tc)::value, 1>(rows, k, x0, lane, v);
          for (int i = 0; i < g::kRows; ++i) one[i] += v[i];
        }
      });
      for (int r = 0; r < g::kRows; ++r)
        EXPECT_FLOAT_EQ(one[r], sum[r * TM]) << dtype_name(t) << " K " << k << " row " << r;
    }
  }
}

}  // namespace
}  // namespace ds
