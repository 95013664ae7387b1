// The skinny GEMM kernel (gemm_skinny.cuh): one CTA of kWarps warps per (tile of weight rows,
// batch entry); warps split the tile's rows into row groups and, for short N, K into k groups.
#include <algorithm>
#include <climits>
#include <string>

#include "backend/cuda/gemm_skinny.cuh"
#include "backend/cuda/pdl.cuh"
#include "core/error.h"

namespace ds::cuda {
namespace skinny {

Plan make_plan(int64_t batch, int64_t m, int64_t n, int64_t k, int elem_bytes, int sm_count) {
  Plan p;
  p.chunks = int(k * elem_bytes / 16);
  p.units = (n + kRows - 1) / kRows;
  // Enough CTAs to keep every SM streaming with a couple of CTAs resident.
  const int64_t target = 2 * int64_t(std::max(sm_count, 1));
  auto ctas_for = [&](int row_groups, int rounds) {
    const int64_t per_cta = int64_t(row_groups) * rounds;
    return (p.units + per_cta - 1) / per_cta;
  };
  while (p.k_groups < kWarps && 2 * p.k_groups * kMinSliceChunks <= p.chunks &&
         batch * ctas_for(kWarps / p.k_groups, 1) < target)
    p.k_groups *= 2;
  p.row_groups = kWarps / p.k_groups;
  p.slice = (p.chunks + p.k_groups - 1) / p.k_groups;
  while (p.tm < kMaxTm && p.tm < m) p.tm *= 2;
  // With more tokens each CTA takes more units (its rows of x are then read from L2 once per
  // CTA and from L1 afterwards), as long as the grid still covers the SMs.
  while (2 * p.rounds <= p.tm / 2 && batch * ctas_for(p.row_groups, 2 * p.rounds) >= target)
    p.rounds *= 2;
  p.ctas = ctas_for(p.row_groups, p.rounds);
  return p;
}

}  // namespace skinny

namespace {

using skinny::kRows;
using skinny::kThreads;
using skinny::kWarps;

struct KernelArgs {
  skinny::Plan plan;
  int64_t m = 0, n = 0;
  const uint8_t* x = nullptr;
  int64_t x_row = 0, x_batch = 0;
  const uint8_t* w = nullptr;
  int64_t w_row = 0, w_batch = 0;
  uint8_t* out = nullptr;
  int64_t out_row = 0, out_batch = 0;
  int64_t prefetch = 0;  // bytes of its weight rows a CTA asks L2 for before the wait (pdl.h)
};

// Grid (plan.ctas, batch). Every warp runs the same rounds and passes, so all reach each
// __syncthreads; warps without a unit in a round only skip the arithmetic.
template <wstream::Elem E, int TM>
__global__ void __launch_bounds__(kThreads) skinny_gemm_kernel(const KernelArgs a) {
  const skinny::Plan& p = a.plan;
  if (a.prefetch > 0 && threadIdx.x == 0) {
    // The CTA's units are consecutive, so its weight rows are one range.
    const int64_t span = int64_t(p.rounds) * p.row_groups * kRows;
    const int64_t r0 = int64_t(blockIdx.x) * span, r1 = min(a.n, r0 + span);
    if (r0 < r1)
      pdl::prefetch_l2(a.w + int64_t(blockIdx.y) * a.w_batch + r0 * a.w_row,
                       min(a.prefetch, (r1 - r0 - 1) * a.w_row + int64_t(p.chunks) * 16));
  }
  pdl::enter();
  constexpr int kVals = kRows * TM;
  __shared__ float part[kWarps * kVals];  // [warp][row * TM + token] warp sums
  const int warp = int(threadIdx.x) >> 5, lane = int(threadIdx.x) & 31;
  const skinny::WarpJob job = skinny::warp_job(p, warp);
  const int64_t b = blockIdx.y, cta = blockIdx.x;
  const uint8_t* x = a.x + b * a.x_batch;
  const uint8_t* w = a.w + b * a.w_batch;
  uint8_t* out = a.out + b * a.out_batch;
  for (int round = 0; round < p.rounds; ++round) {
    const int64_t u = skinny::unit_of(p, cta, round, job.rg);
    const uint8_t* rows[kRows];
    skinny::unit_rows(w, a.w_row, a.n, u, rows);
    for (int64_t m0 = 0; m0 < a.m; m0 += TM) {
      const int nt = int(a.m - m0 < TM ? a.m - m0 : TM);
      if (u < p.units) {
        float v[kVals];
        skinny::lane_dot<E, TM>(rows, reinterpret_cast<const float*>(x + m0 * a.x_row), a.x_row, nt,
                                job.c_begin, job.c_end, lane, v);
        wstream::warp_scatter_sum<kVals, kVals>(v, lane);
        if (skinny::lane_writes<TM>(lane))
          part[warp * kVals + wstream::scatter_value_of_lane<kVals>(lane)] = v[0];
      }
      __syncthreads();
      skinny::reduce_store<TM>(p, part, int(threadIdx.x), cta, round, nt, a.n, out + m0 * a.out_row,
                               a.out_row);
      __syncthreads();  // part is rewritten by the next pass
    }
  }
}

template <wstream::Elem E>
void launch_elem(const KernelArgs& ka, dim3 grid, cudaStream_t stream) {
  switch (ka.plan.tm) {
    case 1:
      pdl::launch(skinny_gemm_kernel<E, 1>, grid, kThreads, 0, stream, ka);
      break;
    case 2:
      pdl::launch(skinny_gemm_kernel<E, 2>, grid, kThreads, 0, stream, ka);
      break;
    case 4:
      pdl::launch(skinny_gemm_kernel<E, 4>, grid, kThreads, 0, stream, ka);
      break;
    default:
      pdl::launch(skinny_gemm_kernel<E, 8>, grid, kThreads, 0, stream, ka);
      break;
  }
}

bool aligned(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

}  // namespace

bool skinny_gemm_fits(const SkinnyGemmArgs& a) {
  if (a.wtype != DType::F32 && a.wtype != DType::F16 && a.wtype != DType::BF16) return false;
  if (a.batch < 1 || a.m < 1 || a.n < 1 || a.k < 1) return false;
  const int64_t es = dtype_info(a.wtype).type_size;
  if ((a.k * es) % 16 != 0 || a.k * es / 16 > (INT_MAX >> 2)) return false;
  if (a.batch > 65535 || (a.n + kRows - 1) / kRows > INT_MAX) return false;
  if (!aligned(a.x, 16) || !aligned(a.w, 16) || !aligned(a.out, 4)) return false;
  if (a.m > 1 && (a.x_row % 16 != 0 || a.out_row % 4 != 0)) return false;
  if (a.n > 1 && a.w_row % 16 != 0) return false;
  if (a.batch > 1 && (a.x_batch % 16 != 0 || a.w_batch % 16 != 0 || a.out_batch % 4 != 0))
    return false;
  return true;
}

SkinnyGemmArgs skinny_matmul_args(const TensorView& x, const TensorView& w, const TensorView& out) {
  SkinnyGemmArgs a;
  a.wtype = w.dtype;
  a.m = x.rows();
  a.n = w.rows();
  a.k = x.cols();
  a.x = x.data;
  a.x_row = x.row_stride();
  a.w = w.data;
  a.w_row = w.row_stride();
  a.out = out.data;
  a.out_row = out.row_stride();
  return a;
}

SkinnyGemmArgs skinny_batched_args(const TensorView& x, const TensorView& w,
                                   const TensorView& out) {
  DS_CHECK(x.ndim == 3 && w.ndim == 3 && out.ndim == 3, "skinny GEMM: batched views are 3-D");
  SkinnyGemmArgs a;
  a.wtype = w.dtype;
  a.batch = x.shape[0];
  a.m = x.shape[1];
  a.n = w.shape[1];
  a.k = x.shape[2];
  a.x = x.data;
  a.x_row = x.stride[1];
  a.x_batch = x.stride[0];
  a.w = w.data;
  a.w_row = w.stride[1];
  a.w_batch = w.stride[0];
  a.out = out.data;
  a.out_row = out.stride[1];
  a.out_batch = out.stride[0];
  return a;
}

bool use_skinny_gemm(const SkinnyGemmArgs& a) {
  const int64_t weight_bytes = a.batch * a.n * a.k * int64_t(dtype_info(a.wtype).type_size);
  const bool small =
      a.m <= kSkinnyAnyM || (a.m <= kSkinnyMaxM && weight_bytes <= kSkinnySmallWeightBytes);
  return small && skinny_gemm_fits(a);
}

void launch_skinny_gemm(const SkinnyGemmArgs& a, int sm_count, cudaStream_t stream) {
  DS_CHECK(skinny_gemm_fits(a), "skinny GEMM: shape, dtype or alignment not supported");
  const int es = int(dtype_info(a.wtype).type_size);
  KernelArgs ka;
  ka.plan = skinny::make_plan(a.batch, a.m, a.n, a.k, es, sm_count);
  ka.m = a.m;
  ka.n = a.n;
  ka.x = static_cast<const uint8_t*>(a.x);
  ka.x_row = a.m > 1 ? a.x_row : 0;
  ka.x_batch = a.batch > 1 ? a.x_batch : 0;
  ka.w = static_cast<const uint8_t*>(a.w);
  ka.w_row = a.n > 1 ? a.w_row : 0;
  ka.w_batch = a.batch > 1 ? a.w_batch : 0;
  ka.out = static_cast<uint8_t*>(a.out);
  ka.out_row = a.m > 1 ? a.out_row : 0;
  ka.out_batch = a.batch > 1 ? a.out_batch : 0;
  ka.prefetch = pdl::prefetch_bytes(pdl::PrefetchKind::Skinny);
  DS_CHECK(ka.plan.ctas <= INT_MAX, "skinny GEMM: too many rows");
  const dim3 grid(unsigned(ka.plan.ctas), unsigned(a.batch));
  switch (a.wtype) {
    case DType::BF16:
      launch_elem<wstream::Elem::BF16>(ka, grid, stream);
      break;
    case DType::F16:
      launch_elem<wstream::Elem::F16>(ka, grid, stream);
      break;
    default:
      launch_elem<wstream::Elem::F32>(ka, grid, stream);
      break;
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw Error(std::string("CUDA skinny GEMM: ") + cudaGetErrorString(e));
}

}  // namespace ds::cuda
