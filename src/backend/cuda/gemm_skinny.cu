// The skinny GEMM kernel (gemm_skinny.cuh): one CTA of kWarps warps per (tile of weight rows,
// batch entry); warps split the tile's rows into row groups and, for short N, K into k groups.
#include <algorithm>
#include <climits>
#include <string>

#include "backend/cuda/common.cuh"
#include "backend/cuda/gemm_skinny.cuh"
#include "backend/cuda/norm.cuh"
#include "backend/cuda/norm_rows.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/switches.h"
#include "core/error.h"

namespace ds::cuda {
namespace skinny {

Plan make_plan(int64_t batch, int64_t m, int64_t n, int64_t k, int elem_bytes, int sm_count,
               bool one_wave) {
  Plan p;
  p.chunks = int(k * elem_bytes / 16);
  p.units = (n + kRows - 1) / kRows;
  const int64_t sms = std::max(sm_count, 1);
  // Enough CTAs to keep every SM streaming with a couple of CTAs resident (one_wave: one).
  const int64_t target = (one_wave ? 1 : 2) * sms;
  auto ctas_for = [&](int row_groups, int rounds) {
    const int64_t per_cta = int64_t(row_groups) * rounds;
    return (p.units + per_cta - 1) / per_cta;
  };
  auto may_split = [&] {
    return p.k_groups < kWarps && 2 * p.k_groups * kMinSliceChunks <= p.chunks;
  };
  if (one_wave) {
    while (may_split() && batch * ctas_for(kWarps / (2 * p.k_groups), 1) <= sms) p.k_groups *= 2;
  } else {
    while (may_split() && batch * ctas_for(kWarps / p.k_groups, 1) < target) p.k_groups *= 2;
  }
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
  // The fused norm (launch_skinny_norm_gemm): K and rms_norm's threads for a row of K.
  SkinnyNormArgs nrm;
  int k = 0, norm_threads = 0;
  bool early = false;  // the first weight step loaded before the wait (always with the norm)
  // DEEPSERVE_ROW_REGS=1 and K <= kNormJ * norm_threads: norm_rows loads a row's elements into
  // registers first (NormRowsArgs::regs).
  bool norm_regs = false;
  // The add and norm after the product (launch_skinny_gemm_add_norm): post.counter non-null.
  AddNormArgs post;
};

// rms_norm's threads per row are at most 1024: each thread here plays up to 4 of them.
constexpr int kNormPer = 1024 / kThreads;
constexpr size_t kMaxNormSmem = size_t(96) << 10;

// Grid (plan.ctas, batch). Every warp runs the same rounds and passes, so all reach each
// __syncthreads; warps without a unit in a round only skip the arithmetic.
// NORM: x's rows go through norm_rows first and the product reads them from shared memory.
template <wstream::Elem E, int TM, bool NORM>
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
  const int warp = int(threadIdx.x) >> 5, lane = int(threadIdx.x) & 31;
  const skinny::WarpJob job = skinny::warp_job(p, warp);
  const int64_t b = blockIdx.y, cta = blockIdx.x;
  const uint8_t* w = a.w + b * a.w_batch;
  // a.early: the first step of weight chunks (round 0) is loaded into registers before the wait;
  // weights are no earlier kernel's output.
  uint4 first[skinny::kUnroll<TM>][kRows];
  const bool early = a.early && skinny::unit_of(p, cta, 0, job.rg) < p.units;
  if (early) {
    const uint8_t* rows[kRows];
    skinny::unit_rows(w, a.w_row, a.n, skinny::unit_of(p, cta, 0, job.rg), rows);
    skinny::load_step<TM>(rows, job.c_begin + lane, job.c_end, first);
  }
  extern __shared__ __align__(16) float xs[];  // NORM: [m][k], the normed rows, then g [k]
  if constexpr (NORM) {
    // The norm weight is no earlier kernel's output either: staged before the wait.
    for (int i = int(threadIdx.x); i < a.k; i += kThreads) xs[a.m * a.k + i] = a.nrm.g[i];
  }
  pdl::enter();
  constexpr int kVals = kRows * TM;
  __shared__ float part[kWarps * kVals];  // [warp][row * TM + token] warp sums
  const uint8_t* x = a.x + b * a.x_batch;
  int64_t x_row = a.x_row;
  if constexpr (NORM) {
    __shared__ float red[32], inv[skinny::kMaxTm];
    NormRowsArgs nr;
    nr.x = a.x;
    nr.x_row = a.x_row;
    nr.y = a.nrm.y;
    nr.y_row = a.nrm.y_row;
    nr.x_out = a.nrm.x_out;
    nr.x_out_row = a.nrm.x_out_row;
    nr.xn = a.nrm.xn;
    nr.xn_row = a.nrm.xn_row;
    nr.eps = a.nrm.eps;
    nr.m = int(a.m);
    nr.K = a.k;
    nr.V = a.norm_threads;
    nr.parts = int(gridDim.x);
    nr.part = int(blockIdx.x);
    nr.regs = a.norm_regs;
    nr.xs = xs;
    norm_rows<kThreads, true>(nr, xs + a.m * a.k, red, inv);
    x = reinterpret_cast<const uint8_t*>(xs);
    x_row = int64_t(a.k) * 4;
  }
  uint8_t* out = a.out + b * a.out_batch;
  for (int round = 0; round < p.rounds; ++round) {
    const int64_t u = skinny::unit_of(p, cta, round, job.rg);
    const uint8_t* rows[kRows];
    skinny::unit_rows(w, a.w_row, a.n, u, rows);
    for (int64_t m0 = 0; m0 < a.m; m0 += TM) {
      const int nt = int(a.m - m0 < TM ? a.m - m0 : TM);
      if (u < p.units) {
        float v[kVals];
        const float* xm = reinterpret_cast<const float*>(x + m0 * x_row);
        if (early && round == 0 && m0 == 0)
          skinny::lane_dot<E, TM, NORM, true>(rows, xm, x_row, nt, job.c_begin, job.c_end, lane, v,
                                              first);
        else
          skinny::lane_dot<E, TM, NORM>(rows, xm, x_row, nt, job.c_begin, job.c_end, lane, v);
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
  // The add and norm after the product, by the last CTA to store its share of out.
  if (a.post.counter != nullptr && arrive_last(a.post.counter, int(gridDim.x)))
    add_norm_rows<kThreads>(a.post, reinterpret_cast<const float*>(a.out), a.out_row, int(a.m),
                            int(a.n));
}

template <wstream::Elem E, int TM, bool NORM>
void launch_tm(const KernelArgs& ka, dim3 grid, size_t smem, cudaStream_t stream) {
  if constexpr (NORM) {
    static const bool ready = [] {  // once per kernel: the normed rows may pass 48 KB
      check_cuda(
          cudaFuncSetAttribute(skinny_gemm_kernel<E, TM, NORM>,
                               cudaFuncAttributeMaxDynamicSharedMemorySize, int(kMaxNormSmem)),
          "skinny norm GEMM shared memory");
      return true;
    }();
    (void)ready;
  }
  pdl::launch(skinny_gemm_kernel<E, TM, NORM>, grid, kThreads, smem, stream, ka);
}

template <wstream::Elem E, bool NORM>
void launch_elem(const KernelArgs& ka, dim3 grid, size_t smem, cudaStream_t stream) {
  switch (ka.plan.tm) {
    case 1:
      return launch_tm<E, 1, NORM>(ka, grid, smem, stream);
    case 2:
      return launch_tm<E, 2, NORM>(ka, grid, smem, stream);
    case 4:
      return launch_tm<E, 4, NORM>(ka, grid, smem, stream);
    default:
      return launch_tm<E, 8, NORM>(ka, grid, smem, stream);
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

namespace {

KernelArgs kernel_args(const SkinnyGemmArgs& a, int sm_count) {
  const int es = int(dtype_info(a.wtype).type_size);
  KernelArgs ka;
  ka.plan = skinny::make_plan(a.batch, a.m, a.n, a.k, es, sm_count, g_skinny_one_wave.on());
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
  ka.early = g_skinny_early.on();
  DS_CHECK(ka.plan.ctas <= INT_MAX, "skinny GEMM: too many rows");
  return ka;
}

template <bool NORM>
void launch(const SkinnyGemmArgs& a, const KernelArgs& ka, size_t smem, cudaStream_t stream) {
  const dim3 grid(unsigned(ka.plan.ctas), unsigned(a.batch));
  switch (a.wtype) {
    case DType::BF16:
      launch_elem<wstream::Elem::BF16, NORM>(ka, grid, smem, stream);
      break;
    case DType::F16:
      launch_elem<wstream::Elem::F16, NORM>(ka, grid, smem, stream);
      break;
    default:
      launch_elem<wstream::Elem::F32, NORM>(ka, grid, smem, stream);
      break;
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw Error(std::string("CUDA skinny GEMM: ") + cudaGetErrorString(e));
}

}  // namespace

void launch_skinny_gemm(const SkinnyGemmArgs& a, int sm_count, cudaStream_t stream) {
  DS_CHECK(skinny_gemm_fits(a), "skinny GEMM: shape, dtype or alignment not supported");
  launch<false>(a, kernel_args(a, sm_count), 0, stream);
}

bool skinny_norm_fits(const SkinnyGemmArgs& a) {
  return skinny_gemm_fits(a) && a.batch == 1 && a.m <= skinny::kMaxTm &&
         size_t(a.m + 1) * size_t(a.k) * 4 <= kMaxNormSmem && a.k <= INT_MAX / 2 &&
         rms_norm_threads(a.k) <= kNormPer * kThreads;
}

void launch_skinny_norm_gemm(const SkinnyGemmArgs& a, const SkinnyNormArgs& nrm, int sm_count,
                             cudaStream_t stream) {
  DS_CHECK(skinny_norm_fits(a), "skinny norm GEMM: shape, dtype or alignment not supported");
  DS_CHECK(nrm.g != nullptr && nrm.xn != nullptr && (nrm.y == nullptr || nrm.x_out != nullptr),
           "skinny norm GEMM: norm weight, xn (and x_out with y) needed");
  KernelArgs ka = kernel_args(a, sm_count);
  ka.x_row = a.x_row;  // norm_rows steps through x's rows itself
  ka.nrm = nrm;
  ka.k = int(a.k);
  ka.norm_threads = rms_norm_threads(a.k);
  ka.early = true;
  ka.norm_regs = g_row_regs.on() && a.k <= int64_t(kNormJ) * ka.norm_threads;
  if (ka.norm_regs) note_row_regs_launch();
  launch<true>(a, ka, size_t(a.m + 1) * size_t(a.k) * 4, stream);
}

bool skinny_add_norm_fits(const SkinnyGemmArgs& a) {
  return skinny_gemm_fits(a) && a.batch == 1 && a.m <= kAddNormMaxRows && a.n <= INT_MAX / 2 &&
         rms_norm_threads(a.n) <= kNormPer * kThreads;
}

void launch_skinny_gemm_add_norm(const SkinnyGemmArgs& a, const AddNormArgs& post, int sm_count,
                                 cudaStream_t stream) {
  DS_CHECK(skinny_add_norm_fits(a), "skinny GEMM with add and norm: shape not supported");
  DS_CHECK(post.r != nullptr && post.g != nullptr && post.r_out != nullptr && post.rn != nullptr &&
               post.counter != nullptr && post.threads == rms_norm_threads(a.n),
           "skinny GEMM with add and norm: r, the norm weight, r_out, rn, a counter and "
           "rms_norm's threads for a row needed (add_norm_args)");
  KernelArgs ka = kernel_args(a, sm_count);
  ka.out_row = a.out_row;  // the last CTA steps through out's rows itself
  ka.post = post;
  launch<false>(a, ka, 0, stream);
}

}  // namespace ds::cuda
