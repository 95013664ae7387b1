// Quantized weights (W4A16, FP8W) for the GPU tests and benchmarks: quantized on the host from
// sharp random floats, kept dequantized for the references, uploaded as the packed layout.
#pragma once

#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "backend/cuda/switches.h"
#include "backend/fp8w.h"
#include "backend/w4a16.h"
#include "gpu_test_util.h"

namespace ds::test {

inline int64_t wq_row_stride(DType t, int64_t K) {
  return t == DType::W4A16 ? w4a16::row_stride(K) : fp8w::row_stride(K);
}

// The packed bytes of one [N, K] tensor quantized from `w` (row-major floats).
inline std::vector<uint8_t> wq_quantize(DType t, const float* w, int64_t N, int64_t K) {
  const int64_t rs = wq_row_stride(t, K);
  std::vector<uint8_t> out(size_t(N * rs), 0);
  for (int64_t n = 0; n < N; ++n) {
    uint8_t* row = out.data() + n * rs;
    if (t == DType::FP8W) {
      fp8w::quantize_row(w + n * K, K, row);
      continue;
    }
    for (int64_t g = 0; g < K / w4a16::kGroup; ++g) {
      uint16_t s = 0;
      w4a16::quantize_group(w + n * K + g * w4a16::kGroup, row + g * 64, &s);
      std::memcpy(row + K / 2 + 2 * g, &s, 2);
    }
  }
  return out;
}

inline float wq_element(DType t, const uint8_t* row, int64_t K, int64_t k) {
  return t == DType::W4A16 ? w4a16::element(row, K, k) : fp8w::element(row, K, k);
}

// A quantized [N, K] weight on the GPU and its dequantized values [N * K] on the host.
struct QWeight {
  DType dtype = DType::W4A16;
  int64_t n = 0, k = 0;
  std::vector<uint8_t> bytes;
  std::vector<float> deq;
  std::unique_ptr<Buffer> buf;
  TensorView dev;
};

inline QWeight make_qweight(Backend& be, DType t, int64_t N, int64_t K, uint32_t seed,
                            bool keep_host = true) {
  QWeight q;
  q.dtype = t;
  q.n = N;
  q.k = K;
  const float amp = 0.6f / std::sqrt(float(K)) * 1.7f;  // uniform: std ~ 0.6 / sqrt(K)
  const auto w = random_floats(size_t(N * K), seed, -amp, amp);
  q.bytes = wq_quantize(t, w.data(), N, K);
  const int64_t rs = wq_row_stride(t, K);
  if (keep_host) {
    q.deq.resize(size_t(N * K));
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k)
        q.deq[size_t(n * K + k)] = wq_element(t, q.bytes.data() + n * rs, K, k);
  }
  q.buf = be.alloc(q.bytes.size());
  q.dev = TensorView::contiguous(q.buf->data(), t, {N, K}, be.device());
  q.dev.stride[0] = rs;
  be.upload(q.dev, q.bytes.data(), q.bytes.size());
  if (!keep_host) q.bytes = {};
  return q;
}

// The BF16 value (round to nearest even) of an activation, as the kernels stage it.
inline float bf16_round(float x) {
  return w4a16::from_bf16(w4a16::to_bf16(x));
}

// The FP16 value (clamped to +-65504, then round to nearest even) of an activation, as the FP8W
// kernels stage it (wq_kernel.cuh, act_bits).
inline float f16_round(float x) {
  return __half2float(__float2half_rn(std::fmin(std::fmax(x, -65504.0f), 65504.0f)));
}

// An activation as the in-register kernels of weight type t round it: FP16 for FP8W, else BF16.
inline float act_round(DType t, float x) {
  return t == DType::FP8W ? f16_round(x) : bf16_round(x);
}

}  // namespace ds::test
