// Quantized-weight tensor-core GEMMs (wq_kernel.cuh): the dense launcher behind
// Backend::matmul (the MoE experts' launchers are moe_wq.cu). Activations are rounded to BF16 (the
// only rounding beyond F32 sums: relative error ~2^-9 per product, so ~2^-9 of the row's sum of |x
// * w|): by a conversion launch into staged rows, or, for the dense decode variants, in the kernel
// from F32 rows (stages_f32); their split-K partials are summed in the kernel too, across a
// thread-block cluster, where the grid's clusters all fit at once (cluster_splits): one launch a
// product where it was three.
#include <cooperative_groups.h>

#include <algorithm>
#include <atomic>
#include <string>

#include "backend/cuda/common.cuh"
#include "backend/cuda/gemm_wq.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/switches.h"
#include "backend/cuda/wq_kernel.cuh"
#include "backend/cuda/wq_launch.cuh"
#include "core/error.h"

namespace ds::cuda {
namespace {

using namespace wqk;

struct DenseArgs {
  const uint8_t* w = nullptr;
  int64_t w_stride = 0, n = 0, k = 0, m = 0;
  const __nv_bfloat16* xb = nullptr;  // [m, kp] BF16, zero past k
  int kp = 0;
  const float* xf = nullptr;  // or F32 x as it is (ld ldxf), for dense_kernel<F, BT, true, *>
  int64_t ldxf = 0;
  float* part = nullptr;  // partial sums [splits, m, n] for reduce_kernel (splits > 1, no CL)
  float* out = nullptr;   // [m, n] ld ldo
  int64_t ldo = 0;
  // Products of a batch (batched_matmul, F32 x): entry b's weights at w + b * w_batch bytes,
  // its x and out rows at xf + b * x_batch, out + b * out_batch elements.
  int batch = 1;
  int64_t w_batch = 0, x_batch = 0, out_batch = 0;
  int groups_per_split = 0;
  int splits = 1;
  int64_t prefetch = 0;      // bytes of the tile's rows a CTA asks L2 for before the wait (pdl.h)
  bool issue_first = false;  // CtaJob::issue_first (DEEPSERVE_WQ_ISSUE_FIRST)
  bool skip_scales = false;  // CtaJob::skip_scales (DEEPSERVE_WQ_PROBE_SKIP_SCALES)
};

// Split-K in one launch (sm_90): the splits of a tile are one thread-block cluster; each CTA
// puts its sums in its shared memory, and CTA z of the cluster adds up slice z of the tile over
// the cluster's CTAs in split order, as reduce_kernel does (the same bits).
constexpr int kMaxClusterSplits = kMaxClusterSize;

template <WqFormat F, int BT>
__device__ void reduce_in_cluster(const DenseArgs& a, float* out,
                                  const float (&acc)[kRM][BT / 8][4], uint8_t* smem, int64_t n0,
                                  int64_t t0, int rows, int toks) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  constexpr int kTileLd = kBN + 4;  // floats per token row of the tile (t spreads banks)
  const cg::cluster_group cluster = cg::this_cluster();
  float* tile = reinterpret_cast<float*>(smem);  // [BT][kTileLd]
  __syncthreads();                               // every warp is past the pipeline's stages
  for_each_out<F>(acc, [&](int r, int k, float v) { tile[k * kTileLd + r] = v; });
  cluster.sync();
  const int S = a.splits, z = int(cluster.block_rank());
  constexpr int kE = BT * kBN;
  const int per = (kE + S - 1) / S;
  const int e1 = min(kE, (z + 1) * per);
  for (int e = z * per + int(threadIdx.x); e < e1; e += kThreads) {
    const int r = e % kBN, k = e / kBN, at = k * kTileLd + r;
    float v[kMaxClusterSplits];
#pragma unroll
    for (int c = 0; c < kMaxClusterSplits; ++c)
      if (c < S) v[c] = *cluster.map_shared_rank(tile + at, c);
    float sum = v[0];
#pragma unroll
    for (int c = 1; c < kMaxClusterSplits; ++c)
      if (c < S) sum += v[c];
    if (r < rows && k < toks) out[(t0 + k) * a.ldo + n0 + r] = sum;
  }
  cluster.sync();  // the other CTAs read this one's tile up to here
#else
  __trap();  // launched on sm_90+ only (cluster_splits)
#endif
}

// Grid (row blocks, token blocks x batch, splits). XF: x is F32 (a.xf), rounded in the kernel.
// CL: the splits are clusters (reduce_in_cluster); else each split writes a.part for
// reduce_kernel. E: the first stages' weights are asked for before the wait (run_cta's kEarly).
template <WqFormat F, int BT, bool XF, bool CL, bool E>
__global__ void __launch_bounds__(kThreads, (min_ctas_of<F, BT>())) dense_kernel(DenseArgs a) {
  const int tblocks = int((a.m + BT - 1) / BT), b = int(blockIdx.y) / tblocks;
  const int64_t n0 = int64_t(blockIdx.x) * kBN, t0 = int64_t(int(blockIdx.y) - b * tblocks) * BT;
  const uint8_t* w = a.w + b * a.w_batch;
  if (a.prefetch > 0 && t0 == 0 && threadIdx.x == 0) {
    // The tile's (packed) rows, shared out among its splits: split z asks for its part of the
    // rows whole, whatever groups it reads itself.
    const int64_t rows = min(int64_t(kBN), a.n - n0), z = blockIdx.z, S = gridDim.z;
    const int64_t r0 = z * rows / S, r1 = (z + 1) * rows / S;
    pdl::prefetch_l2(w + (n0 + r0) * a.w_stride, min(a.prefetch, (r1 - r0) * a.w_stride));
  }
  if constexpr (!E) pdl::enter();
  extern __shared__ __align__(128) uint8_t smem[];
  const int G = int((a.k + kGroup - 1) / kGroup);
  CtaJob jb;
  jb.w0 = w + n0 * a.w_stride;
  jb.w1 = nullptr;
  jb.w_stride = a.w_stride;
  jb.rows = int(min(int64_t(kBN), a.n - n0));
  if constexpr (XF) {
    jb.xf = a.xf + b * a.x_batch + t0 * a.ldxf;
    jb.ldx = a.ldxf;
  } else {
    jb.x = a.xb + t0 * a.kp;
    jb.ldx = a.kp;
  }
  jb.kp = a.kp;
  jb.tokens = int(min(int64_t(BT), a.m - t0));
  jb.K = a.k;
  jb.g_begin = int(blockIdx.z) * a.groups_per_split;
  jb.g_end = min(G, jb.g_begin + a.groups_per_split);
  jb.issue_first = a.issue_first;
  jb.skip_scales = a.skip_scales;
  float acc[kRM][BT / 8][4];
  run_cta<F, BT, XF, false, E>(jb, smem, acc);
  float* out_b = a.out + b * a.out_batch;
  if constexpr (CL) {
    reduce_in_cluster<F, BT>(a, out_b, acc, smem, n0, t0, jb.rows, jb.tokens);
  } else {
    float* out = a.splits > 1 ? a.part + int64_t(blockIdx.z) * a.m * a.n : out_b;
    const int64_t ld = a.splits > 1 ? a.n : a.ldo;
    for_each_out<F>(acc, [&](int r, int k, float v) {
      const int64_t row = n0 + r, tok = t0 + k;
      if (row < a.n && tok < a.m) out[tok * ld + row] = v;
    });
  }
}

// out[m, n] = sum over s (ascending) of part[s, m, n].
__global__ void reduce_kernel(const float* part, int splits, int64_t m, int64_t n, float* out,
                              int64_t ldo) {
  pdl::enter();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= m * n) return;
  float s = part[i];
  for (int p = 1; p < splits; ++p) s += part[int64_t(p) * m * n + i];
  out[(i / n) * ldo + i % n] = s;
}

// xb[r, staged_col(k)] = x[r, k] as F stages it (act_bits: BF16, FP8W's FP16) for k < K, 0 up
// to kp (kp a multiple of 8).
template <WqFormat F>
__global__ void to_act_kernel(const float* x, int64_t ldx, int64_t K, int kp, uint16_t* xb) {
  pdl::enter();
  const int64_t r = blockIdx.y;
  for (int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; k < kp;
       k += int64_t(gridDim.x) * blockDim.x)
    xb[r * kp + staged_col<F>(k)] = act_bits<F>(k < K ? x[r * ldx + k] : 0.0f);
}

// dense_kernel<F, BT, XF, CL, E>'s shared-memory limit (and, CL, non-portable cluster sizes),
// once per process (the same need on every device).
template <WqFormat F, int BT, bool XF, bool CL, bool E = false>
void prepare_dense() {
  static const bool ready = [] {
    set_smem_limit<F, BT, XF>(dense_kernel<F, BT, XF, CL, E>);
    if constexpr (CL)
      check_cuda(cudaFuncSetAttribute(dense_kernel<F, BT, XF, CL, E>,
                                      cudaFuncAttributeNonPortableClusterSizeAllowed, 1),
                 "wq kernel cluster size");
    return true;
  }();
  (void)ready;
}

// How many clusters of `size` CTAs of the decode variant for m tokens the device holds at once
// (cudaOccupancyMaxActiveClusters; asked once per variant and size, 0 if it cannot tell).
template <WqFormat F, bool XF>
int max_active_clusters(int64_t m, int size) {
  int n = 0;
  with_bt(m, [&]<int BT>() {
    if constexpr (BT == kBT) {
      return;
    } else {
      static std::atomic<int> known[kMaxClusterSplits + 1] = {};  // count + 1; 0: not asked
      const int k = known[size].load(std::memory_order_relaxed);
      if (k > 0) {
        n = k - 1;
        return;
      }
      prepare_dense<F, BT, XF, true>();
      n = cuda::max_active_clusters(dense_kernel<F, BT, XF, true, false>,
                                    dim3(1, 1, unsigned(size)), kThreads, kSmem<F, BT, XF>);
      known[size].store(n + 1, std::memory_order_relaxed);
    }
  });
  return n;
}

// The decode variants ask for their first weights before the wait (DEEPSERVE_WQ_EARLY=0: after
// it); the prefill-sized variant always waits first.
template <WqFormat F, bool XF, bool CL>
void launch_dense(const DenseArgs& a, cudaStream_t stream) {
  with_bt(a.m, [&]<int BT>() {
    if constexpr ((XF || CL) && BT == kBT) {
      throw Error("wq gemm: F32 x and cluster split-K are for decode-sized M only");
    } else {
      const dim3 grid(ceil_div(a.n, kBN), ceil_div(a.m, BT) * unsigned(a.batch),
                      unsigned(a.splits));
      DS_CHECK(grid.y <= 65535, "wq gemm: too many rows of x (times the batch)");
      const dim3 cluster(1, 1, CL ? unsigned(a.splits) : 1u);
      const auto go = [&]<bool E>() {
        prepare_dense<F, BT, XF, CL, E>();
        pdl::launch_clusters(dense_kernel<F, BT, XF, CL, E>, grid, kThreads, kSmem<F, BT, XF>,
                             stream, cluster, a);
      };
      if constexpr (BT != kBT) {
        if (g_wq_early.on())
          go.template operator()<true>();
        else
          go.template operator()<false>();
      } else {
        go.template operator()<false>();
      }
      check_cuda(cudaGetLastError(), "wq gemm launch");
    }
  });
}

template <WqFormat F>
void launch_dense(const DenseArgs& a, bool cluster, cudaStream_t stream) {
  if (a.xf && cluster)
    launch_dense<F, true, true>(a, stream);
  else if (a.xf)
    launch_dense<F, true, false>(a, stream);
  else if (cluster)
    launch_dense<F, false, true>(a, stream);
  else
    launch_dense<F, false, false>(a, stream);
}

// Whether dense_kernel reads x as F32 (no conversion launch): decode-sized M whose F32 rows
// cp.async can take whole (16-byte units), where the larger token rows cost the kernel no
// resident CTA it needs (BF16 weights' 16-token variant would drop to one CTA per SM).
bool stages_f32(WqFormat f, int64_t m, int64_t k, int64_t ldx, const void* x) {
  return g_wq_stage_f32.on() && m <= 16 && (m <= 8 || f != WqFormat::BF16) && k % 4 == 0 &&
         ldx % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
}

// Whether the splits sum in the kernel (reduce_in_cluster): decode-sized M on sm_90+, and every
// cluster of the grid (`clusters` of them) resident at once. A cluster's CTAs start together
// within one GPC, so fewer clusters fit than CTAs: V2.5's o_proj at M = 8 (40 clusters of 13
// W4A16 CTAs, 30 resident) took 31.7 us against 26.5 with the reduce launch, FP8W's (40 of 7)
// 50.7 against 31.0 (H200, 2f260e3); the small products keep the one launch.
template <WqFormat F>
bool cluster_splits(int64_t m, int splits, bool xf, int64_t clusters) {
  if (splits <= 1 || splits > kMaxClusterSplits || m > 16 || !g_wq_cluster.on() || !pdl::hopper())
    return false;
  const int fit =
      xf ? max_active_clusters<F, true>(m, splits) : max_active_clusters<F, false>(m, splits);
  return clusters <= fit;
}

// The CTAs a split-K decode GEMM aims for, per SM: DEEPSERVE_WQ_SPLIT_CTAS, else 2 for FP8W
// and 4 for the others (8 was no faster for W5 at 76b5847: docs/PERFORMANCE.md).
int split_ctas_per_sm(WqFormat f) {
  const long long env = g_wq_split_ctas.get();
  return env > 0 ? int(std::min(env, 64LL)) : f == WqFormat::FP8W ? 2 : 4;
}

// Runs the product a describes (w, w_stride, n, k, m; batch and its strides) on F32 x (ld ldx
// elements) into out (ld ldo): split-K from N, K, the batch and the SM count, x staged as F32 in
// the kernel where it can be (else converted to BF16 rows first: one product, not a batch),
// splits summed in a cluster or by reduce_kernel (one product).
template <WqFormat F>
void run_dense(const Context& ctx, const float* x, int64_t ldx, float* out, int64_t ldo,
               DenseArgs& a) {
  const int64_t M = a.m, N = a.n, K = a.k;
  a.kp = int((K + 7) / 8 * 8);
  const int64_t groups = (K + kGroup - 1) / kGroup;
  // A batch's products are row blocks side by side for the split.
  const int64_t rows = int64_t(a.batch) * ceil_div(N, kBN) * kBN;
  a.groups_per_split =
      M <= kWqSplitMaxM
          ? wq_split_groups(rows, K, ctx.sm_count * split_ctas_per_sm(F), kSplitUnitOf<F>)
          : int(groups);
  a.splits = int((groups + a.groups_per_split - 1) / a.groups_per_split);  // none empty
  const bool xf = stages_f32(F, M, K, ldx, x);
  DS_CHECK(a.batch == 1 || xf, "wq gemm: a batch takes F32 x staged in the kernel");
  const int64_t tiles = rows / kBN * ceil_div(M, tokens_per_cta(M));  // clusters, if split
  const bool cluster = cluster_splits<F>(M, a.splits, xf, tiles);
  if (a.batch > 1 && !cluster) {  // no partials buffer per batch entry
    a.groups_per_split = int(groups);
    a.splits = 1;
  }
  const size_t xb_bytes = xf ? 0 : (size_t(M) * size_t(a.kp) * 2 + 255) / 256 * 256;
  const size_t part_bytes = a.splits > 1 && !cluster ? size_t(a.splits) * size_t(M * N) * 4 : 0;
  uint8_t* base = xb_bytes + part_bytes == 0
                      ? nullptr
                      : static_cast<uint8_t*>(ctx.scratch(kScratchMatmul, xb_bytes + part_bytes));
  if (xf) {
    a.xf = x;
    a.ldxf = ldx;
  } else {
    auto* xb = reinterpret_cast<uint16_t*>(base);
    const dim3 cgrid(ceil_div(a.kp, 256 * 4), unsigned(M));
    pdl::launch(to_act_kernel<F>, cgrid, 256, 0, ctx.stream, x, ldx, K, a.kp, xb);
    check_cuda(cudaGetLastError(), "wq gemm convert");
    a.xb = reinterpret_cast<const __nv_bfloat16*>(xb);
  }
  a.part = part_bytes > 0 ? reinterpret_cast<float*>(base + xb_bytes) : nullptr;
  a.prefetch = pdl::prefetch_bytes(pdl::PrefetchKind::DenseWq);
  a.issue_first = issue_first_of(F);
  a.skip_scales = g_wq_skip_scales.on();
  a.out = out;
  a.ldo = ldo;
  launch_dense<F>(a, cluster, ctx.stream);
  if (a.part) {
    pdl::launch(reduce_kernel, ceil_div(M * N, 256), 256, 0, ctx.stream, a.part, a.splits, M, N,
                out, a.ldo);
    check_cuda(cudaGetLastError(), "wq gemm reduce");
  }
}

}  // namespace

int wq_split_groups(int64_t n, int64_t k, int target_ctas, int unit) {
  const int64_t blocks = (n + kBN - 1) / kBN, groups = (k + kGroup - 1) / kGroup;
  const int64_t want = (int64_t(std::max(target_ctas, 1)) + blocks - 1) / blocks;
  const int64_t s =
      std::clamp<int64_t>(want, 1, std::min<int64_t>(16, std::max<int64_t>(1, groups / 2)));
  const int64_t per = (groups + s - 1) / s;
  return int((per + unit - 1) / unit * unit);
}

bool wq_bf16_fits(const TensorView& w) {
  return w.dtype == DType::BF16 && w.ndim == 2 && w.cols() % 8 == 0 && w.row_stride() % 16 == 0 &&
         w.stride[1] == 2 && reinterpret_cast<uintptr_t>(w.data) % 16 == 0;
}

void wq_matmul(const Context& ctx, const TensorView& x, const TensorView& w,
               const TensorView& out) {
  const bool bf16 = w.dtype == DType::BF16;
  DS_CHECK((wq_dtype(w.dtype) || bf16) && w.ndim == 2,
           "wq matmul: a 2-D W4A16 / FP8W / BF16 weight");
  const bool w4 = w.dtype == DType::W4A16;
  const int64_t M = x.rows(), N = w.rows(), K = w.cols();
  DS_CHECK(x.cols() == K && out.cols() == N && out.rows() == M,
           "matmul shapes " + x.shape_str() + " x " + w.shape_str() + " -> " + out.shape_str());
  if (w4 && K % w4a16::kGroup != 0)
    throw UnsupportedError("cuda W4A16 matmul: K = " + std::to_string(K) +
                           " is not a multiple of 128");
  if (bf16) {
    DS_CHECK(wq_bf16_fits(w), "wq matmul: BF16 rows must be 16-byte aligned, K a multiple of 8");
  } else {
    DS_CHECK(w.row_stride() == (w4 ? w4a16::row_stride(K) : fp8w::row_stride(K)) &&
                 reinterpret_cast<uintptr_t>(w.data) % 16 == 0,
             "wq matmul: weight rows must be packed and 16-byte aligned");
  }
  DS_CHECK(x.dtype == DType::F32 && out.dtype == DType::F32, "wq matmul: F32 x and out");
  DS_CHECK(rows_uniform(x) && rows_uniform(out), "wq matmul: rows must be evenly spaced");
  DS_CHECK(x.stride[x.ndim - 1] == 4 && out.stride[out.ndim - 1] == 4, "wq matmul: dense rows");
  if (M == 0 || N == 0) return;
  DS_CHECK(K > 0 && K < (int64_t(1) << 30), "wq matmul: K out of range");
  DS_CHECK(!bf16 || M <= kWqBf16MaxTokens, "wq matmul: BF16 weights take at most 16 rows of x");
  DenseArgs a;
  a.w = static_cast<const uint8_t*>(w.data);
  a.w_stride = w.row_stride();
  a.n = N;
  a.k = K;
  a.m = M;
  const int64_t ldx = M > 1 ? x.row_stride() / 4 : K, ldo = M > 1 ? out.row_stride() / 4 : N;
  if (w4)
    run_dense<WqFormat::W4A16>(ctx, x.ptr<float>(), ldx, out.ptr<float>(), ldo, a);
  else if (bf16)
    run_dense<WqFormat::BF16>(ctx, x.ptr<float>(), ldx, out.ptr<float>(), ldo, a);
  else
    run_dense<WqFormat::FP8W>(ctx, x.ptr<float>(), ldx, out.ptr<float>(), ldo, a);
}

bool wq_batched_fits(const TensorView& x, const TensorView& w, const TensorView& out) {
  if (x.ndim != 3 || w.ndim != 3 || out.ndim != 3 || x.dtype != DType::F32 ||
      out.dtype != DType::F32 || w.dtype != DType::BF16)
    return false;
  const int64_t b = x.shape[0], m = x.shape[1], k = x.shape[2];
  const auto mul16 = [](int64_t bytes) { return bytes % 16 == 0; };
  // Weight rows as wq_bf16_fits, in 16-byte-aligned entries; x rows the kernel stages as F32
  // (stages_f32: no conversion launch for a batch), in 16-byte-aligned entries; F32 out. One
  // token block per entry (M <= 8), so the batch is the grid's y.
  return b >= 1 && b <= 65535 && m >= 1 && w.shape[1] >= 1 && k % 8 == 0 && w.stride[2] == 2 &&
         mul16(w.stride[1]) && mul16(w.stride[0]) &&
         reinterpret_cast<uintptr_t>(w.data) % 16 == 0 && x.stride[2] == 4 &&
         x.stride[1] % 4 == 0 && mul16(x.stride[0]) &&
         stages_f32(WqFormat::BF16, m, k, x.stride[1] / 4, x.data) && out.stride[2] == 4 &&
         out.stride[1] % 4 == 0 && out.stride[0] % 4 == 0;
}

void wq_batched_matmul(const Context& ctx, const TensorView& x, const TensorView& w,
                       const TensorView& out) {
  DS_CHECK(wq_batched_fits(x, w, out), "wq batched matmul: views it does not take");
  const int64_t B = x.shape[0], M = x.shape[1], K = x.shape[2], N = w.shape[1];
  DS_CHECK(w.shape[0] == B && w.shape[2] == K && out.shape[0] == B && out.shape[1] == M &&
               out.shape[2] == N,
           "wq batched matmul shapes " + x.shape_str() + " x " + w.shape_str() + " -> " +
               out.shape_str());
  DenseArgs a;
  a.w = static_cast<const uint8_t*>(w.data);
  a.w_stride = w.stride[1];
  a.n = N;
  a.k = K;
  a.m = M;
  a.batch = int(B);
  a.w_batch = w.stride[0];
  a.x_batch = x.stride[0] / 4;
  a.out_batch = out.stride[0] / 4;
  run_dense<WqFormat::BF16>(ctx, x.ptr<float>(), x.stride[1] / 4, out.ptr<float>(),
                            out.stride[1] / 4, a);
}

}  // namespace ds::cuda
