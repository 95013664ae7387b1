#include <algorithm>

#include "backend/cuda/common.cuh"
#include "backend/cuda/norm.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/switches.h"

namespace ds::cuda {
namespace {

// One block per row (looping when rows exceed the grid). kAdd: x + y first, written to xo (x
// itself, or another buffer); each thread reads y and writes out at the same indices, so out
// may alias y.
template <bool kAdd>
__global__ void rms_norm_kernel(const void* x, RowIndex xr, const void* y, RowIndex yr, void* xo,
                                RowIndex xor_, const float* __restrict__ w, float eps, void* out,
                                RowIndex orow, int64_t rows, int n) {
  pdl::enter();
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* xp = at_bytes<float>(x, xr.offset(r));
    float* sp = kAdd ? at_bytes<float>(xo, xor_.offset(r)) : nullptr;
    float ss = 0.0f;
    for (int i = int(threadIdx.x); i < n; i += int(blockDim.x)) {
      float v = xp[i];
      if constexpr (kAdd) {
        v = rms_residual_add(v, at_bytes<float>(y, yr.offset(r))[i]);
        sp[i] = v;
      }
      ss = rms_add_square(ss, v);
    }
    ss = block_sum(ss);
    const float s = rms_inv(ss, n, eps);
    float* op = at_bytes<float>(out, orow.offset(r));
    const float* vp = kAdd ? sp : xp;
    for (int i = int(threadIdx.x); i < n; i += int(blockDim.x)) op[i] = rms_apply(vp[i], s, w[i]);
  }
}

// The same norm with each thread's elements of the row (i = tid + j * blockDim.x, j < kRowRegs)
// in registers (launch_rms_norm: DEEPSERVE_ROW_REGS=1, n <= kRowRegs * threads). In
// rms_norm_kernel every element is a round trip of its own: the loads of element i + blockDim.x
// cannot pass the store of element i, which may alias them, so a row of 4 elements a thread
// waits on memory 8 times in a row (PTX: ld, ld, st, ld, ld, st ...). Here a thread's loads
// all issue at once, the normalized values come from its registers, and the weights, which no
// kernel writes (pdl.cuh), are read before the dependent-launch wait. Each element sees the same
// operations, and the sum of squares the same order: the same bits.
template <bool kAdd>
__global__ void __launch_bounds__(1024)
    rms_norm_regs_kernel(const void* x, RowIndex xr, const void* y, RowIndex yr, void* xo,
                         RowIndex xor_, const float* __restrict__ w, float eps, void* out,
                         RowIndex orow, int64_t rows, int n) {
  const int tid = int(threadIdx.x), nt = int(blockDim.x);
  float wr[kRowRegs];
#pragma unroll
  for (int j = 0; j < kRowRegs; ++j) wr[j] = tid + j * nt < n ? w[tid + j * nt] : 0.0f;
  pdl::enter();
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* xp = at_bytes<float>(x, xr.offset(r));
    float v[kRowRegs], yv[kRowRegs];
#pragma unroll
    for (int j = 0; j < kRowRegs; ++j) {
      const int i = tid + j * nt;
      v[j] = i < n ? xp[i] : 0.0f;
      if constexpr (kAdd) yv[j] = i < n ? at_bytes<float>(y, yr.offset(r))[i] : 0.0f;
    }
    float* sp = kAdd ? at_bytes<float>(xo, xor_.offset(r)) : nullptr;
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < kRowRegs; ++j) {
      const int i = tid + j * nt;
      if (i >= n) break;
      if constexpr (kAdd) {
        v[j] = rms_residual_add(v[j], yv[j]);
        sp[i] = v[j];
      }
      ss = rms_add_square(ss, v[j]);
    }
    ss = block_sum(ss);
    const float s = rms_inv(ss, n, eps);
    float* op = at_bytes<float>(out, orow.offset(r));
#pragma unroll
    for (int j = 0; j < kRowRegs; ++j) {
      const int i = tid + j * nt;
      if (i >= n) break;
      op[i] = rms_apply(v[j], s, wr[j]);
    }
  }
}

}  // namespace

void launch_rms_norm(const RmsNormArgs& a, cudaStream_t stream) {
  const bool add = a.residual.data != nullptr;
  DS_CHECK(a.x.dtype == DType::F32 && a.w.dtype == DType::F32 && a.out.dtype == DType::F32 &&
               (!add || a.residual.dtype == DType::F32),
           "rms_norm takes F32");
  const int64_t rows = a.x.rows(), n = a.x.cols();
  DS_CHECK(
      a.out.rows() == rows && a.out.cols() == n && a.w.numel() == n,
      "rms_norm shapes " + a.x.shape_str() + " * " + a.w.shape_str() + " -> " + a.out.shape_str());
  DS_CHECK(!add || (a.residual.rows() == rows && a.residual.cols() == n),
           "add_rms_norm shapes " + a.x.shape_str() + " += " + a.residual.shape_str());
  check_inner_dense(a.x, "rms_norm");
  check_inner_dense(a.out, "rms_norm");
  if (add) check_inner_dense(a.residual, "add_rms_norm");
  DS_CHECK(a.w.ndim == 1 || a.w.is_contiguous(), "rms_norm weight must be contiguous");
  if (rows == 0 || n == 0) return;
  // About 4 elements per thread, whole warps, at most 1024 threads.
  const int threads = rms_norm_threads(n);
  const unsigned blocks = unsigned(std::min<int64_t>(rows, int64_t(1) << 30));
  const bool regs = g_row_regs.on() && n <= int64_t(kRowRegs) * threads;
  if (regs) note_row_regs_launch();
  if (add) {
    const TensorView& xo = a.x_out.data != nullptr ? a.x_out : a.x;
    DS_CHECK(xo.rows() == rows && xo.cols() == n && xo.dtype == DType::F32,
             "add_rms_norm: x_out " + xo.shape_str() + " for x " + a.x.shape_str());
    check_inner_dense(xo, "add_rms_norm");
    pdl::launch(regs ? rms_norm_regs_kernel<true> : rms_norm_kernel<true>, blocks, threads, 0,
                stream, a.x.data, row_index(a.x), a.residual.data, row_index(a.residual), xo.data,
                row_index(xo), a.w.ptr<float>(), a.eps, a.out.data, row_index(a.out), rows, int(n));
  } else {
    pdl::launch(regs ? rms_norm_regs_kernel<false> : rms_norm_kernel<false>, blocks, threads, 0,
                stream, a.x.data, row_index(a.x), nullptr, RowIndex{}, nullptr, RowIndex{},
                a.w.ptr<float>(), a.eps, a.out.data, row_index(a.out), rows, int(n));
  }
  check_cuda(cudaGetLastError(), "rms_norm");
}

}  // namespace ds::cuda
