// W4A16 dense GEMM: one warp per kRows weight rows, one CTA row per pass of kTm tokens.
#include "backend/cuda/common.cuh"
#include "backend/cuda/gemm_w4a16.cuh"

namespace ds::cuda {
namespace {

using namespace w4k;

__global__ void __launch_bounds__(kThreads) w4a16_gemm_kernel(W4a16GemmArgs a) {
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int64_t row0 = (int64_t(blockIdx.x) * kWarps + warp) * kRows;
  if (row0 >= a.n) return;
  const int64_t m0 = int64_t(blockIdx.y) * kTm;
  const int64_t stride = w4a16::row_stride(a.k);
  const uint8_t* rows[kRows];
  DS_UNROLL
  for (int r = 0; r < kRows; ++r) rows[r] = a.w + (row0 + r < a.n ? row0 + r : a.n - 1) * stride;
  const float* xs[kTm];
  DS_UNROLL
  for (int j = 0; j < kTm; ++j) xs[j] = m0 + j < a.m ? a.x + (m0 + j) * a.x_row : nullptr;
  float v[kRows * kTm];
  warp_dot<kTm>(rows, a.k, xs, lane, v);
  const int r = lane / kTm, j = lane % kTm;
  if (row0 + r < a.n && m0 + j < a.m) a.out[(m0 + j) * a.out_row + row0 + r] = pick(v, lane);
}

}  // namespace

W4a16GemmArgs w4a16_matmul_args(const TensorView& x, const TensorView& w, const TensorView& out) {
  DS_CHECK(w.dtype == DType::W4A16 && w.ndim == 2, "w4a16 gemm: a 2-D W4A16 weight");
  if (w.cols() % w4a16::kGroup != 0)
    throw UnsupportedError("cuda W4A16 matmul: K = " + std::to_string(w.cols()) +
                           " is not a multiple of 128");
  DS_CHECK(w.row_stride() == w4a16::row_stride(w.cols()), "w4a16 gemm: rows not packed");
  DS_CHECK(x.dtype == DType::F32 && out.dtype == DType::F32, "w4a16 gemm: F32 x and out");
  DS_CHECK(rows_uniform(x) && rows_uniform(out), "w4a16 gemm: rows must be evenly spaced");
  DS_CHECK(reinterpret_cast<uintptr_t>(x.data) % 16 == 0 && x.row_stride() % 16 == 0 &&
               reinterpret_cast<uintptr_t>(w.data) % 16 == 0 && out.row_stride() % 4 == 0,
           "w4a16 gemm: x rows must be 16-byte aligned");
  W4a16GemmArgs a;
  a.m = x.rows();
  a.n = w.rows();
  a.k = w.cols();
  a.x = x.ptr<float>();
  a.x_row = x.rows() > 1 ? x.row_stride() / 4 : a.k;
  a.w = static_cast<const uint8_t*>(w.data);
  a.out = out.ptr<float>();
  a.out_row = out.rows() > 1 ? out.row_stride() / 4 : a.n;
  return a;
}

void launch_w4a16_gemm(const W4a16GemmArgs& a, cudaStream_t stream) {
  if (a.m == 0 || a.n == 0) return;
  DS_CHECK(a.k % w4a16::kGroup == 0, "w4a16 gemm: K must be a multiple of 128");
  const int64_t per_cta = int64_t(kWarps) * kRows;
  const dim3 grid(unsigned((a.n + per_cta - 1) / per_cta), unsigned((a.m + kTm - 1) / kTm));
  DS_CHECK(grid.y <= 65535, "w4a16 gemm: too many rows of x");
  w4a16_gemm_kernel<<<grid, kThreads, 0, stream>>>(a);
  check_cuda(cudaGetLastError(), "w4a16 gemm launch");
}

}  // namespace ds::cuda
