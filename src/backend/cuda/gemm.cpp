#include "backend/cuda/gemm.h"

#include <limits>
#include <string>

#include "core/error.h"

namespace ds::cuda {
namespace {

void check_cublas(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw Error(std::string("cuBLAS ") + what + ": " + cublasGetStatusString(s));
}

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::F32:
      return CUDA_R_32F;
    case DType::F16:
      return CUDA_R_16F;
    case DType::BF16:
      return CUDA_R_16BF;
    default:
      throw UnsupportedError("cuBLAS GEMM: dtype " + std::string(dtype_name(t)));
  }
}

int as_int(int64_t v, const char* what) {
  DS_CHECK(v >= 0 && v <= std::numeric_limits<int>::max(),
           std::string("GEMM ") + what + " out of range: " + std::to_string(v));
  return int(v);
}

}  // namespace

CublasGemm::CublasGemm(cudaStream_t stream, void* workspace, size_t workspace_bytes) {
  check_cublas(cublasCreate(&handle_), "create");
  check_cublas(cublasSetStream(handle_, stream), "set stream");
  check_cublas(cublasSetWorkspace(handle_, workspace, workspace_bytes), "set workspace");
  // Default math: F32 GEMMs stay FP32 (no TF32), 16-bit ones accumulate in F32.
  check_cublas(cublasSetMathMode(handle_, CUBLAS_DEFAULT_MATH), "set math mode");
  check_cublas(cublasSetPointerMode(handle_, CUBLAS_POINTER_MODE_HOST), "set pointer mode");
}

CublasGemm::~CublasGemm() {
  if (handle_) cublasDestroy(handle_);
}

void CublasGemm::run(const GemmArgs& a) {
  if (a.batch == 0 || a.m == 0 || a.n == 0) return;
  DS_CHECK(a.ldx >= a.k && a.ldw >= a.k && a.ldo >= a.n, "GEMM leading dimensions too small");
  const cudaDataType_t t = cuda_type(a.dtype);
  const float alpha = 1.0f, beta = 0.0f;
  // cuBLAS is column-major: a row-major [rows, cols] matrix is its column-major transpose, so
  // out^T [n, m] = w [n, k] . x^T [k, m]: A = w read transposed, B = x as stored.
  const int m = as_int(a.n, "N"), n = as_int(a.m, "M"), k = as_int(a.k, "K");
  const int lda = as_int(a.ldw, "ldw"), ldb = as_int(a.ldx, "ldx"), ldc = as_int(a.ldo, "ldo");
  if (a.batch == 1) {
    check_cublas(
        cublasGemmEx(handle_, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &alpha, a.w, t, lda, a.x, t, ldb,
                     &beta, a.out, CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        "GemmEx");
    return;
  }
  check_cublas(cublasGemmStridedBatchedEx(handle_, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &alpha, a.w,
                                          t, lda, a.stride_w, a.x, t, ldb, a.stride_x, &beta, a.out,
                                          CUDA_R_32F, ldc, a.stride_out, as_int(a.batch, "batch"),
                                          CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
               "GemmStridedBatchedEx");
}

}  // namespace ds::cuda
