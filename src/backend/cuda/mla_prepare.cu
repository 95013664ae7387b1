#include <algorithm>
#include <string>

#include "backend/cuda/kv_store.cuh"
#include "backend/cuda/mla_prepare.cuh"
#include "backend/cuda/norm.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/rope.cuh"

namespace ds::cuda {
namespace {

struct Rows {
  void* data;
  int64_t stride_t, stride_h;  // bytes
};

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
      float x0 = k[a], x1 = k[b];
      rope_rotate(x0, x1, cs_sn[i], cs_sn[half + i]);
      k[a] = x0;
      k[b] = x1;
      if (dst) {
        dst[R + a] = from_f32<T>(x0);
        dst[R + b] = from_f32<T>(x1);
      }
    }
    if (dst)  // rope key dims past rotary_dim are stored unrotated
      for (int i = 2 * half + tid; i < P; i += nt) dst[R + i] = from_f32<T>(k[i]);

    rope_heads(static_cast<char*>(q.data) + t * q.stride_t, q.stride_h, heads, half, adjacent,
               cs_sn, tid, nt);
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
  dispatch_float(kv.dtype, "mla_prepare cache", [&](auto tag) {
    using T = decltype(tag);
    pdl::launch(mla_prepare_kernel<T>, blocks, threads, size_t(2 * half) * sizeof(float), stream,
                kr, a.norm, a.eps, R, P, norm_threads, qr, int(q.shape[1]), a.positions, a.inv_freq,
                half, a.style == RopeStyle::Adjacent, a.attn_factor, static_cast<T*>(kv.k),
                a.slot_mapping, rows, a.num_tokens, capacity, a.errors);
  });
  check_cuda(cudaGetLastError(), "mla_prepare");
}

}  // namespace ds::cuda
