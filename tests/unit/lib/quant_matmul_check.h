// Backend::matmul with a quantized weight against the product with the weight's rows
// dequantized, summed in double: one check for every weight format's CPU reference.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "backend/backend.h"

namespace ds {

// w: [N, K], filled by the caller; dequant(n, row) writes the K floats of row n.
inline void expect_matmul_is_dequantized_product(
    Backend& be, const TensorView& w, int64_t M, int64_t N, int64_t K,
    const std::function<void(int64_t, float*)>& dequant, const std::string& what) {
  std::vector<float> x(size_t(M * K)), out(size_t(M * N));
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::cos(0.1f * float(i));
  be.matmul(TensorView::contiguous(x.data(), DType::F32, {M, K}), w,
            TensorView::contiguous(out.data(), DType::F32, {M, N}));
  std::vector<float> wr(static_cast<size_t>(K));
  for (int64_t n = 0; n < N; ++n) {
    dequant(n, wr.data());
    for (int64_t m = 0; m < M; ++m) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += double(wr[size_t(k)]) * x[size_t(m * K + k)];
      EXPECT_NEAR(out[size_t(m * N + n)], s, 1e-3 * (1 + std::fabs(s)))
          << what << ": row " << n << ", token " << m;
    }
  }
}

}  // namespace ds
