#include <algorithm>
#include <string>

#include "backend/cuda/kv_store.cuh"
#include "backend/cuda/mla_prepare.cuh"
#include "backend/cuda/norm.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/rope.cuh"
#include "backend/cuda/switches.h"

namespace ds::cuda {
namespace {

struct Rows {
  void* data;
  int64_t stride_t, stride_h;  // bytes
};

// The key's rope pair (a, b) = (x0, x1) rotated by (c, s), written to its row k and, with dst, to
// the cache row (whose rope part starts at R).
template <typename T>
__device__ __forceinline__ void put_key_pair(float* k, T* dst, int R, int a, int b, float x0,
                                             float x1, float c, float s) {
  rope_rotate(x0, x1, c, s);
  k[a] = x0;
  k[b] = x1;
  if (dst) {
    dst[R + a] = from_f32<T>(x0);
    dst[R + b] = from_f32<T>(x1);
  }
}
// The key's rope dims from `from` (past rotary_dim) to the cache row unrotated.
template <typename T>
__device__ __forceinline__ void put_key_tail(const float* k, T* dst, int R, int from, int P,
                                             int tid, int nt) {
  if (dst)
    for (int i = from + tid; i < P; i += nt) dst[R + i] = from_f32<T>(k[i]);
}

// One block per token (looping when tokens exceed the grid). The latent's sum of squares runs
// over the first norm_threads threads exactly as rms_norm_kernel's block of that size (the
// other warps add 0 in block_sum), and the shared helpers fix every rounding, so each value
// gets the four ops' bits.
template <typename T>
__global__ void mla_prepare_kernel(Rows kva, const float* __restrict__ norm, float eps, int R,
                                   int P, int norm_threads, Rows q, int heads,
                                   const int32_t* __restrict__ positions,
                                   const float* __restrict__ inv_freq, int half, bool adjacent,
                                   float attn_factor, T* cache, const int32_t* __restrict__ slots,
                                   int64_t rows, int num_tokens, int64_t capacity,
                                   DeviceErrors* errors) {
  pdl::enter();
  extern __shared__ float cs_sn[];  // [2 * half]: cos then sin
  const int tid = int(threadIdx.x), nt = int(blockDim.x);
  for (int64_t t = blockIdx.x; t < rows; t += gridDim.x) {
    __syncthreads();  // the previous token's readers of cs_sn are done
    const int32_t pos = positions[t];
    for (int i = tid; i < half; i += nt)
      rope_cos_sin(pos, inv_freq[i], attn_factor, cs_sn[i], cs_sn[half + i]);

    float* x = at_bytes<float>(kva.data, t * kva.stride_t);
    float ss = 0.0f;
    if (tid < norm_threads)
      for (int i = tid; i < R; i += norm_threads) ss = rms_add_square(ss, x[i]);
    ss = block_sum(ss);  // its barriers also publish cs_sn
    const float inv = rms_inv(ss, R, eps);

    T* dst = nullptr;
    if (t < num_tokens) {
      const int64_t slot = slots[t];
      if (storable(slot, capacity, errors)) dst = cache + slot * (R + P);
    }
    for (int i = tid; i < R; i += nt) {
      const float y = rms_apply(x[i], inv, norm[i]);
      x[i] = y;
      if (dst) dst[i] = from_f32<T>(y);
    }
    float* k = x + R;
    for (int i = tid; i < half; i += nt) {
      const int a = adjacent ? 2 * i : i, b = adjacent ? 2 * i + 1 : i + half;
      put_key_pair(k, dst, R, a, b, k[a], k[b], cs_sn[i], cs_sn[half + i]);
    }
    put_key_tail(k, dst, R, 2 * half, P, tid, nt);

    rope_heads(static_cast<char*>(q.data) + t * q.stride_t, q.stride_h, heads, half, adjacent,
               cs_sn, tid, nt);
  }
}

// q's rope pairs a thread of mla_prepare_regs_kernel loads at once (a round; V2-Lite's 16 heads
// x 32 pairs take one round at 256 threads, V2.5's 128 heads two).
constexpr int kPairRegs = 8;
// Threads of mla_prepare_regs_kernel at most (its registers: 256 threads is V2's R = 512).
constexpr int kPrepareRegsThreads = 256;

// mla_prepare_kernel with every load of a token issued at once (DEEPSERVE_ROW_REGS=1; the
// launcher checks R <= kRowRegs * norm_threads, half <= blockDim.x <= kPrepareRegsThreads): the
// latent's elements in the registers of its norm's threads, which also normalize them (the other
// threads add 0 to block_sum, as there), the key's rope pair, and q's rope pairs a round at a time.
// In mla_prepare_kernel each element is a round trip of its own (a load cannot pass the store of
// the element before it, which may alias it). Before the dependent-launch wait it reads what no
// kernel writes (pdl.cuh): the norm weight, and the first token's position, rotation angles
// and cache slot (the step's metadata, uploaded before it). Each value sees the same
// operations, the sum of squares the same order: the same bits.
// Grid (token blocks, q parts): with q parts > 1 (DEEPSERVE_MLA_PREPARE_PAIRS, many heads at
// decode sizes) CTA y rotates part y of the token's q pairs, and only part 0 also normalizes and
// stores the latent and the key; one CTA a token serialized V2.5's 4,096 pairs in two rounds of
// dependent loads on 8 SMs (8.4 us a layer at 8 tokens, H100).
template <typename T>
__global__ void __launch_bounds__(kPrepareRegsThreads)
    mla_prepare_regs_kernel(Rows kva, const float* __restrict__ norm, float eps, int R, int P,
                            int norm_threads, Rows q, int heads,
                            const int32_t* __restrict__ positions,
                            const float* __restrict__ inv_freq, int half, bool adjacent,
                            float attn_factor, T* cache, const int32_t* __restrict__ slots,
                            int64_t rows, int num_tokens, int64_t capacity, DeviceErrors* errors) {
  extern __shared__ float cs_sn[];  // [2 * half]: cos then sin
  const int tid = int(threadIdx.x), nt = int(blockDim.x);
  const bool lead = blockIdx.y == 0;  // the latent, the key and the cache row too
  const bool normer = lead && tid < norm_threads;
  float nw[kRowRegs];
#pragma unroll
  for (int j = 0; j < kRowRegs; ++j) {
    const int i = tid + j * norm_threads;
    nw[j] = normer && i < R ? norm[i] : 0.0f;
  }
  int64_t t = blockIdx.x;
  int64_t slot = lead && t < num_tokens ? slots[t] : -1;
  if (tid < half)
    rope_cos_sin(positions[t], inv_freq[tid], attn_factor, cs_sn[tid], cs_sn[half + tid]);
  pdl::enter();
  const int all_pairs = heads * half, part = (all_pairs + int(gridDim.y) - 1) / int(gridDim.y);
  const int p0 = int(blockIdx.y) * part, pairs = min(all_pairs, p0 + part);  // [p0, pairs)
  for (; t < rows; t += gridDim.x) {
    if (t != int64_t(blockIdx.x)) {  // a later token of this block
      __syncthreads();               // the previous token's readers of cs_sn are done
      slot = lead && t < num_tokens ? slots[t] : -1;
      if (tid < half)
        rope_cos_sin(positions[t], inv_freq[tid], attn_factor, cs_sn[tid], cs_sn[half + tid]);
    }
    float* x = at_bytes<float>(kva.data, t * kva.stride_t);
    float* k = x + R;
    char* qrow = static_cast<char*>(q.data) + t * q.stride_t;
    // The token's loads, all at once: latent, the key's rope pair, q's first round of pairs.
    float xv[kRowRegs];
#pragma unroll
    for (int j = 0; j < kRowRegs; ++j) {
      const int i = tid + j * norm_threads;
      xv[j] = normer && i < R ? x[i] : 0.0f;
    }
    const int ka = adjacent ? 2 * tid : tid, kb = adjacent ? 2 * tid + 1 : tid + half;
    float k0 = 0.0f, k1 = 0.0f;
    if (lead && tid < half) k0 = k[ka], k1 = k[kb];
    float qa[kPairRegs], qb[kPairRegs];
    auto q_at = [&](int j) {  // pair j's two values: head j / half, pair j % half
      const int i = j % half;
      float* v = reinterpret_cast<float*>(qrow + int64_t(j / half) * q.stride_h);
      return adjacent ? v + 2 * i : v + i;  // and + 1, or + half
    };
    const int second = adjacent ? 1 : half;
    auto load_round = [&](int base) {
#pragma unroll
      for (int m = 0; m < kPairRegs; ++m) {
        const int j = base + tid + m * nt;
        if (j < pairs) qa[m] = q_at(j)[0], qb[m] = q_at(j)[second];
      }
    };
    load_round(p0);
    if (lead) {
      float ss = 0.0f;
#pragma unroll
      for (int j = 0; j < kRowRegs; ++j)
        if (normer && tid + j * norm_threads < R) ss = rms_add_square(ss, xv[j]);
      ss = block_sum(ss);  // its barriers also publish cs_sn
      const float inv = rms_inv(ss, R, eps);
      T* dst = nullptr;
      if (t < num_tokens && storable(slot, capacity, errors)) dst = cache + slot * (R + P);
#pragma unroll
      for (int j = 0; j < kRowRegs; ++j) {
        const int i = tid + j * norm_threads;
        if (!normer || i >= R) break;
        const float y = rms_apply(xv[j], inv, nw[j]);
        x[i] = y;
        if (dst) dst[i] = from_f32<T>(y);
      }
      if (tid < half) put_key_pair(k, dst, R, ka, kb, k0, k1, cs_sn[tid], cs_sn[half + tid]);
      put_key_tail(k, dst, R, 2 * half, P, tid, nt);
    } else {
      __syncthreads();  // publishes cs_sn
    }
    for (int base = p0; base < pairs; base += kPairRegs * nt) {
      if (base > p0) load_round(base);
#pragma unroll
      for (int m = 0; m < kPairRegs; ++m) {
        const int j = base + tid + m * nt;
        if (j >= pairs) break;
        const int i = j % half;
        rope_rotate(qa[m], qb[m], cs_sn[i], cs_sn[half + i]);
        float* v = q_at(j);
        v[0] = qa[m];
        v[second] = qb[m];
      }
    }
  }
}

}  // namespace

bool mla_prepare_supported(DType cache_dtype) {
  return cache_dtype == DType::F32 || cache_dtype == DType::F16 || cache_dtype == DType::BF16;
}

void launch_mla_prepare(const MlaPrepareArgs& a, cudaStream_t stream) {
  const TensorView &kva = a.kva, &q = a.q_rope;
  const PagedKv& kv = a.cache;
  const int R = a.kv_lora_rank, P = kv.head_dim - R;
  DS_CHECK(mla_prepare_supported(kv.dtype),
           "mla_prepare: cache dtype " + std::string(dtype_name(kv.dtype)));
  DS_CHECK(kva.dtype == DType::F32 && kva.ndim == 2 && R > 0 && P >= 0 && kva.cols() == R + P,
           "mla_prepare: kva " + kva.shape_str() + " for kv_lora_rank " + std::to_string(R) +
               " and a cache head_dim " + std::to_string(kv.head_dim));
  DS_CHECK(kv.v == nullptr && kv.kv_heads == 1, "mla_prepare: needs a latent cache");
  DS_CHECK(q.dtype == DType::F32 && q.ndim == 3 && q.shape[0] == kva.shape[0],
           "mla_prepare: q_rope " + q.shape_str() + " for kva " + kva.shape_str());
  DS_CHECK(
      a.rotary_dim > 0 && a.rotary_dim % 2 == 0 && a.rotary_dim <= q.shape[2] && a.rotary_dim <= P,
      "mla_prepare: rotary_dim " + std::to_string(a.rotary_dim) + " for rope dims " +
          std::to_string(q.shape[2]) + " and " + std::to_string(P));
  DS_CHECK(a.norm != nullptr, "mla_prepare: no norm weight");
  check_inner_dense(kva, "mla_prepare");
  check_inner_dense(q, "mla_prepare");
  const int64_t rows = kva.shape[0];
  DS_CHECK(a.num_tokens <= rows, "mla_prepare: " + std::to_string(a.num_tokens) +
                                     " tokens to store from " + std::to_string(rows) + " rows");
  DS_CHECK(int64_t(kv.num_blocks) * kv.block_size < (int64_t(1) << 31),
           "mla_prepare: cache too large for 32-bit slots");
  DS_CHECK(q.shape[1] * (a.rotary_dim / 2) < (int64_t(1) << 31), "mla_prepare: too many heads");
  if (rows == 0) return;
  const int norm_threads = rms_norm_threads(R);
  const int threads = std::max(256, norm_threads);
  const unsigned blocks = unsigned(std::min<int64_t>(rows, int64_t(1) << 30));
  const int half = a.rotary_dim / 2;
  const Rows kr{kva.data, kva.stride[0], 0};
  const Rows qr{q.data, q.stride[0], q.stride[1]};
  const int64_t capacity = int64_t(kv.num_blocks) * kv.block_size;
  const bool regs = g_row_regs.on() && R <= kRowRegs * norm_threads && half <= threads &&
                    threads <= kPrepareRegsThreads;
  if (regs) note_row_regs_launch();
  // q's rope pairs in parts of at most DEEPSERVE_MLA_PREPARE_PAIRS (default 512) a CTA, for
  // decode-sized steps (at most kPrepareSplitRows tokens) on the register kernel.
  constexpr int64_t kPrepareSplitRows = 64;
  const int64_t pairs = q.shape[1] * half, per = g_mla_prepare_pairs.get();
  const unsigned parts = regs && per > 0 && rows <= kPrepareSplitRows
                             ? unsigned(std::min<int64_t>((pairs + per - 1) / per, 1024))
                             : 1u;
  dispatch_float(kv.dtype, "mla_prepare cache", [&](auto tag) {
    using T = decltype(tag);
    pdl::launch(regs ? mla_prepare_regs_kernel<T> : mla_prepare_kernel<T>, dim3(blocks, parts),
                threads, size_t(2 * half) * sizeof(float), stream, kr, a.norm, a.eps, R, P,
                norm_threads, qr, int(q.shape[1]), a.positions, a.inv_freq, half,
                a.style == RopeStyle::Adjacent, a.attn_factor, static_cast<T*>(kv.k),
                a.slot_mapping, rows, a.num_tokens, capacity, a.errors);
  });
  check_cuda(cudaGetLastError(), "mla_prepare");
}

}  // namespace ds::cuda
