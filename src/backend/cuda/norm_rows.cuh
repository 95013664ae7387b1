// rms_norm's rows inside another kernel: one CTA of kThreads threads computes a few rows of
// x (+ y, the residual add) normalized with launch_rms_norm's operations in its order, so a
// fused kernel (the skinny GEMM's norm before or after its product, the MoE down kernel's add
// and norm after its combine) gives the norm kernel's bits.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/backend.h"
#include "backend/cuda/common.cuh"
#include "backend/cuda/norm.cuh"

namespace ds::cuda {

// m rows of K elements: x's (+ y's, written to x_out) into xn, V of rms_norm's threads a row
// (rms_norm_threads(K)). The summed rows are kept in xs ([m][K] floats of shared memory), or,
// with xs null (and y), in x_out. Stores of x_out and xn by the CTAs in turn: this one stores
// the kThreads-element blocks b with b % parts == part (parts 1: all).
struct NormRowsArgs {
  const uint8_t* x = nullptr;
  int64_t x_row = 0;
  const float* y = nullptr;
  int64_t y_row = 0;
  float* x_out = nullptr;
  int64_t x_out_row = 0;
  float* xn = nullptr;
  int64_t xn_row = 0;
  float* xs = nullptr;
  float eps = 0.0f;
  int m = 0, K = 0, V = 0, parts = 1, part = 0;
  // Rows loaded into registers first (norm_rows_detail::row_regs; DEEPSERVE_ROW_REGS=1), where K <=
  // kNormJ * V and the kernel instantiates it (norm_rows' kMayRegs).
  bool regs = false;
};

// The residual add and norm after a kernel's output y (Backend's AddNormParams, raw): r_out =
// r + y, rn = rms_norm(r_out) * g, done by the kernel's last CTA to arrive on counter.
struct AddNormArgs {
  const float* r = nullptr;  // [m, n] F32, the residual stream
  int64_t r_row = 0;         // bytes
  const float* g = nullptr;  // [n] F32 norm weight
  float eps = 1e-6f;
  float* r_out = nullptr;  // [m, n] F32: r + y
  int64_t r_out_row = 0;
  float* rn = nullptr;  // [m, n] F32
  int64_t rn_row = 0;
  int threads = 0;  // rms_norm_threads(n)
  // A device int, 0 between launches (the last CTA puts it back): the CTAs that have stored
  // their share of y. Launches using one counter must be stream-ordered (pdl.cuh: a kernel
  // reaches its wait only after the one ahead of it has finished).
  int* counter = nullptr;
};

// Rows an add and norm after a kernel takes (the inverse rms of each in shared memory).
constexpr int kAddNormMaxRows = 8;

// Whether an in-kernel add and norm takes y and an: F32 rows of y's shape with uniform strides
// and dense rows, a contiguous norm weight of a row's length, at most kAddNormMaxRows rows.
inline bool add_norm_fits(const TensorView& y, const AddNormParams& an) {
  const auto same = [&](const TensorView& v) {
    return v.dtype == DType::F32 && v.rows() == y.rows() && v.cols() == y.cols() &&
           rows_uniform(v) && v.stride[v.ndim - 1] == 1;
  };
  return same(y) && same(an.r) && same(an.r_out) && same(an.rn) && an.norm.dtype == DType::F32 &&
         an.norm.is_contiguous() && an.norm.numel() == y.cols() && y.rows() <= kAddNormMaxRows;
}

// The raw arguments of an (add_norm_fits), arriving on counter.
inline AddNormArgs add_norm_args(const AddNormParams& an, int* counter) {
  AddNormArgs a;
  a.r = an.r.ptr<float>();
  a.r_row = an.r.row_stride();
  a.g = an.norm.ptr<float>();
  a.eps = an.eps;
  a.r_out = an.r_out.ptr<float>();
  a.r_out_row = an.r_out.row_stride();
  a.rn = an.rn.ptr<float>();
  a.rn_row = an.rn.row_stride();
  a.threads = rms_norm_threads(an.r.cols());
  a.counter = counter;
  return a;
}

// Elements of a row each virtual thread holds in registers with NormRowsArgs::regs: rms_norm's
// threads give a row of up to 4,096 at most 4 each.
constexpr int kNormJ = 4;

#ifdef __CUDACC__
namespace norm_rows_detail {

// One row's x (+ y) as norm_rows' first loop sees it, in registers: every load of the thread
// issues at once (in the loop, a load cannot pass the store to x_out before it, which may alias
// it), then the same additions, stores and sums in the same order.
template <int kThreads, int kPer>
__device__ __forceinline__ void row_regs(const float* xr, const float* yr, float* xo, float* row,
                                         int K, int V, float (&ss)[kPer], const int t,
                                         auto&& mine) {
  float e[kPer][kNormJ], yv[kPer][kNormJ];
#pragma unroll
  for (int q = 0; q < kPer; ++q)
#pragma unroll
    for (int j = 0; j < kNormJ; ++j) {
      const int v = t + q * kThreads, i = v + j * V;
      const bool in = v < V && i < K;
      e[q][j] = in ? xr[i] : 0.0f;
      yv[q][j] = in && yr ? __ldcg(yr + i) : 0.0f;
    }
#pragma unroll
  for (int q = 0; q < kPer; ++q) {
    ss[q] = 0.0f;
    const int v = t + q * kThreads;
    if (v >= V) continue;
#pragma unroll
    for (int j = 0; j < kNormJ; ++j) {
      const int i = v + j * V;
      if (i >= K) break;
      float x = e[q][j];
      if (yr) {
        x = rms_residual_add(x, yv[q][j]);
        if (mine(i)) xo[i] = x;
      }
      if (row != xo) row[i] = x;
      ss[q] = rms_add_square(ss[q], x);
    }
  }
}

}  // namespace norm_rows_detail

// The rows of a (see NormRowsArgs), in launch_rms_norm's order: virtual thread v (this thread's
// t + q * kThreads) sums elements v, v + V, ..., then block_sum's two butterflies (virtual warp
// v / 32 lies in lane t % 32 of this warp). gs: the norm weight (shared or global memory); red:
// 32 floats and inv: m floats of shared memory. Every thread of the CTA calls it (it has
// __syncthreads). y is read through L2: a kernel may add other CTAs' stores.
template <int kThreads, bool kMayRegs>
__device__ void norm_rows(const NormRowsArgs& a, const float* gs, float* red, float* inv) {
  constexpr int kPer = 1024 / kThreads, kWarps = kThreads / 32;  // virtual threads a thread
  const int K = a.K, V = a.V, t = int(threadIdx.x), warp = t >> 5, lane = t & 31;
  auto mine = [&](int i) { return (i / kThreads) % a.parts == a.part; };
  auto row_of = [&](int m) {
    return a.xs ? a.xs + int64_t(m) * K
                : reinterpret_cast<float*>(reinterpret_cast<uint8_t*>(a.x_out) + m * a.x_out_row);
  };
  for (int m = 0; m < a.m; ++m) {
    const float* xr = reinterpret_cast<const float*>(a.x + m * a.x_row);
    const float* yr =
        a.y ? reinterpret_cast<const float*>(reinterpret_cast<const uint8_t*>(a.y) + m * a.y_row)
            : nullptr;
    float* xo =
        a.y ? reinterpret_cast<float*>(reinterpret_cast<uint8_t*>(a.x_out) + m * a.x_out_row)
            : nullptr;
    float* row = row_of(m);
    float ss[kPer];
    bool regs = false;
    if constexpr (kMayRegs) regs = a.regs;
    if (regs) {
      if constexpr (kMayRegs)
        norm_rows_detail::row_regs<kThreads>(xr, yr, xo, row, K, V, ss, t, mine);
    } else {
#pragma unroll
      for (int q = 0; q < kPer; ++q) {
        ss[q] = 0.0f;
        const int v = t + q * kThreads;
        if (v >= V) continue;
        for (int i = v; i < K; i += V) {
          float e = xr[i];
          if (yr) {
            e = rms_residual_add(e, __ldcg(yr + i));
            if (mine(i)) xo[i] = e;
          }
          if (row != xo) row[i] = e;
          ss[q] = rms_add_square(ss[q], e);
        }
      }
    }
#pragma unroll
    for (int q = 0; q < kPer; ++q)
      for (int o = 16; o > 0; o >>= 1) ss[q] += __shfl_xor_sync(0xffffffffu, ss[q], o);
    __syncthreads();  // red is free (the last row's final sum has read it)
    if (lane == 0) {
#pragma unroll
      for (int q = 0; q < kPer; ++q)
        if (warp + q * kWarps < V / 32) red[warp + q * kWarps] = ss[q];
    }
    __syncthreads();
    if (warp == 0) {
      float v = lane < V / 32 ? red[lane] : 0.0f;
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == 0) inv[m] = rms_inv(v, K, a.eps);
    }
  }
  __syncthreads();  // every row's sums and its inverse rms visible
  for (int m = 0; m < a.m; ++m) {
    float* row = row_of(m);
    float* xn = reinterpret_cast<float*>(reinterpret_cast<uint8_t*>(a.xn) + m * a.xn_row);
    for (int i = t; i < K; i += kThreads) {
      const float v = rms_apply(row[i], inv[m], gs[i]);
      if (a.xs) row[i] = v;
      if (mine(i)) xn[i] = v;
    }
  }
  __syncthreads();
}

// Every thread of the CTA: makes its stores visible, then the CTA arrives on counter; true in
// the CTA that arrives `expected`-th (last), which sees the others' stores and puts the counter
// back to 0 for the next launch.
__device__ __forceinline__ bool arrive_last(int* counter, int expected) {
  __shared__ int last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(counter, 1) == expected - 1;
    if (last) *counter = 0;
  }
  __syncthreads();
  if (last) __threadfence();
  return last;
}

// The add and norm of p (m rows of K) after y, every row whole, by one CTA (the last to arrive):
// the summed rows kept in r_out between the sum and the scaling.
template <int kThreads>
__device__ void add_norm_rows(const AddNormArgs& p, const float* y, int64_t y_row, int m, int K) {
  __shared__ float red[32], inv[kAddNormMaxRows];
  NormRowsArgs nr;
  nr.x = reinterpret_cast<const uint8_t*>(p.r);
  nr.x_row = p.r_row;
  nr.y = y;
  nr.y_row = y_row;
  nr.x_out = p.r_out;
  nr.x_out_row = p.r_out_row;
  nr.xn = p.rn;
  nr.xn_row = p.rn_row;
  nr.eps = p.eps;
  nr.m = m;
  nr.K = K;
  nr.V = p.threads;
  norm_rows<kThreads, false>(nr, p.g, red, inv);
}
#endif

}  // namespace ds::cuda
