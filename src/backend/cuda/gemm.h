// GEMMs through cuBLAS: out = x . w^T for row-major operands, 16-bit or F32, F32 out.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.h"

namespace ds::cuda {

// For each b < batch: out_b[m, n] = sum_k x_b[m, k] * w_b[n, k]. Row-major matrices; leading
// dimensions and batch strides in elements of their own type.
struct GemmArgs {
  DType dtype = DType::BF16;  // of x and w: F32 (exact FP32 SGEMM, no TF32), F16 or BF16
  int64_t batch = 1, m = 0, n = 0, k = 0;
  const void* x = nullptr;  // [batch][m, k]
  int64_t ldx = 0, stride_x = 0;
  const void* w = nullptr;  // [batch][n, k]
  int64_t ldw = 0, stride_w = 0;
  float* out = nullptr;  // [batch][m, n]
  int64_t ldo = 0, stride_out = 0;
};

class CublasGemm {
 public:
  // workspace: device memory cuBLAS may use (set explicitly so launches can be graph-captured).
  CublasGemm(cudaStream_t stream, void* workspace, size_t workspace_bytes);
  ~CublasGemm();
  CublasGemm(const CublasGemm&) = delete;
  CublasGemm& operator=(const CublasGemm&) = delete;

  void run(const GemmArgs& a);

 private:
  cublasHandle_t handle_ = nullptr;
};

}  // namespace ds::cuda
