// GGUF dense GEMM and embedding: one warp per kRows weight rows, one CTA row per pass of TM
// tokens (gguf_blocks.cuh's lane_dot, then an xor butterfly).
#include <algorithm>
#include <string>

#include "backend/cuda/embed.cuh"
#include "backend/cuda/gemm_gguf.cuh"
#include "backend/cuda/gguf_blocks.cuh"
#include "backend/cuda/pdl.cuh"

namespace ds::cuda {
namespace {

using namespace gguf;

// The warp's sums: lane_dot, then an xor butterfly, so every lane holds every sum.
template <DType T, int TM>
__device__ __forceinline__ void warp_dot(const uint8_t* const (&rows)[kRows], int64_t K,
                                         const float* const (&xs)[TM], int lane,
                                         float (&v)[kRows * TM]) {
  lane_dot<T, TM>(rows, K, xs, lane, v);
  DS_UNROLL
  for (int i = 0; i < kRows * TM; ++i) {
    DS_UNROLL
    for (int o = 16; o > 0; o /= 2) v[i] += __shfl_xor_sync(0xffffffffu, v[i], o);
  }
}

// v[i] without indexing the register array at run time (0 past the end).
template <int N>
__device__ __forceinline__ float pick(const float (&v)[N], int i) {
  float r = 0.0f;
  DS_UNROLL
  for (int k = 0; k < N; ++k)
    if (k == i) r = v[k];
  return r;
}

// TM tokens per pass: 8 in general (kRows * 8 == 32 sums, one per lane), 1 for decode of a
// single token (fewer registers, more warps in flight).
template <DType T, int TM>
__global__ void __launch_bounds__(kThreads) gguf_gemm_kernel(GgufGemmArgs a) {
  pdl::enter();
  static_assert(kRows * TM <= 32, "one sum per lane at most");
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int64_t row0 = (int64_t(blockIdx.x) * kWarps + warp) * kRows;
  if (row0 >= a.n) return;
  const uint8_t* rows[kRows];
  DS_UNROLL
  for (int r = 0; r < kRows; ++r) rows[r] = a.w + (row0 + r < a.n ? row0 + r : a.n - 1) * a.w_row;
  const int r = lane / TM, j = lane % TM;
  for (int64_t m0 = int64_t(blockIdx.y) * TM; m0 < a.m; m0 += int64_t(gridDim.y) * TM) {
    const float* xs[TM];
    DS_UNROLL
    for (int t = 0; t < TM; ++t) xs[t] = m0 + t < a.m ? a.x + (m0 + t) * a.x_row : nullptr;
    float v[kRows * TM];
    warp_dot<T, TM>(rows, a.k, xs, lane, v);
    const float out = pick(v, lane);
    if (lane < kRows * TM && row0 + r < a.n && m0 + j < a.m)
      a.out[(m0 + j) * a.out_row + row0 + r] = out;
  }
}

template <DType T>
__global__ void gguf_embed_kernel(const uint8_t* table, int64_t table_row, int64_t vocab,
                                  const int32_t* __restrict__ ids, int n, void* out, RowIndex orow,
                                  int64_t dim, DeviceErrors* errors) {
  pdl::enter();
  embed_rows(ids, n, vocab, out, orow, dim, errors, [&](float* o, int32_t id) {
    const uint8_t* row = table + int64_t(id) * table_row;
    for (int64_t q = threadIdx.x; q < dim / 8; q += blockDim.x) {
      float w[8];
      octet<T>(row, q, w);
      DS_UNROLL
      for (int i = 0; i < 8; ++i) o[q * 8 + i] = w[i];
    }
  });
}

void check_weight(const TensorView& w, const char* what) {
  DS_CHECK(w.ndim == 2, std::string(what) + ": a 2-D weight");
  const DTypeInfo& info = dtype_info(w.dtype);
  DS_CHECK(w.cols() % info.block_size == 0, std::string(what) + ": K not a whole number of blocks");
  DS_CHECK(reinterpret_cast<uintptr_t>(w.data) % 2 == 0 && w.row_stride() % 2 == 0 &&
               w.row_stride() >= gguf::row_bytes(w.dtype, w.cols()),
           std::string(what) + ": weight rows must be 2-byte aligned");
}

}  // namespace

bool is_gguf_block_type(DType t) {
  return gguf::is_block_type(t);
}

GgufGemmArgs gguf_matmul_args(const TensorView& x, const TensorView& w, const TensorView& out) {
  DS_CHECK(is_gguf_block_type(w.dtype), "gguf gemm: a GGUF block-quantized weight");
  check_weight(w, "gguf gemm");
  DS_CHECK(x.dtype == DType::F32 && out.dtype == DType::F32, "gguf gemm: F32 x and out");
  DS_CHECK(x.cols() == w.cols() && out.cols() == w.rows() && out.rows() == x.rows(),
           "matmul shapes " + x.shape_str() + " x " + w.shape_str() + " -> " + out.shape_str());
  DS_CHECK(rows_uniform(x) && rows_uniform(out), "gguf gemm: rows must be evenly spaced");
  check_inner_dense(x, "gguf gemm");
  check_inner_dense(out, "gguf gemm");
  GgufGemmArgs a;
  a.dtype = w.dtype;
  a.m = x.rows();
  a.n = w.rows();
  a.k = w.cols();
  a.x = x.ptr<float>();
  a.x_row = x.rows() > 1 ? x.row_stride() / 4 : a.k;
  a.w = static_cast<const uint8_t*>(w.data);
  a.w_row = w.rows() > 1 ? w.row_stride() : gguf::row_bytes(w.dtype, a.k);
  a.out = out.ptr<float>();
  a.out_row = out.rows() > 1 ? out.row_stride() / 4 : a.n;
  return a;
}

void launch_gguf_gemm(const GgufGemmArgs& a, cudaStream_t stream) {
  if (a.m == 0 || a.n == 0) return;
  DS_CHECK(a.k > 0 && a.k % dtype_info(a.dtype).block_size == 0,
           "gguf gemm: K must be a whole number of blocks");
  const int64_t per_cta = int64_t(kWarps) * kRows;
  const int tm = a.m == 1 ? 1 : kTm;
  const dim3 grid(unsigned((a.n + per_cta - 1) / per_cta),
                  unsigned(std::min<int64_t>((a.m + tm - 1) / tm, 65535)));
  bool launched = false;
  gguf::dispatch(a.dtype, [&](auto t) {
    if (tm == 1)
      pdl::launch(gguf_gemm_kernel<decltype(t)::value, 1>, grid, kThreads, 0, stream, a);
    else
      pdl::launch(gguf_gemm_kernel<decltype(t)::value, kTm>, grid, kThreads, 0, stream, a);
    launched = true;
  });
  if (!launched)
    throw UnsupportedError("cuda gguf gemm: dtype " + std::string(dtype_name(a.dtype)));
  check_cuda(cudaGetLastError(), "gguf gemm launch");
}

void launch_gguf_embed(const TensorView& table, const int32_t* ids, int n, TensorView out,
                       DeviceErrors* errors, cudaStream_t stream) {
  DS_CHECK(out.dtype == DType::F32, "embed writes F32");
  check_weight(table, "gguf embed");
  DS_CHECK(out.rows() >= n && out.cols() == table.cols(),
           "embed shapes " + table.shape_str() + " -> " + out.shape_str());
  check_inner_dense(out, "embed");
  if (n <= 0 || table.cols() == 0) return;
  const int64_t dim = table.cols();
  const int threads = int(std::clamp<int64_t>((dim / 8 + 31) / 32 * 32, 32, 256));
  const unsigned blocks = unsigned(std::min(n, 1 << 20));
  bool launched = false;
  gguf::dispatch(table.dtype, [&](auto t) {
    pdl::launch(gguf_embed_kernel<decltype(t)::value>, blocks, threads, 0, stream,
                static_cast<const uint8_t*>(table.data), table.row_stride(), table.shape[0], ids, n,
                out.data, row_index(out), dim, errors);
    launched = true;
  });
  if (!launched)
    throw UnsupportedError("cuda gguf embed: dtype " + std::string(dtype_name(table.dtype)));
  check_cuda(cudaGetLastError(), "gguf embed launch");
}

}  // namespace ds::cuda
