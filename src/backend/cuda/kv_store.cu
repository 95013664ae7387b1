#include <algorithm>

#include "backend/cuda/kv_store.cuh"

namespace ds::cuda {
namespace {

struct Src {
  const void* data;
  int64_t stride_t, stride_h;  // bytes
};

// One block per token; threads over (head, dim) of k and then v.
template <typename T>
__global__ void store_kv_kernel(Src k, Src v, T* kc, T* vc, const int32_t* __restrict__ slots,
                                int num_tokens, int heads, int dim, int64_t capacity,
                                DeviceErrors* errors) {
  for (int t = int(blockIdx.x); t < num_tokens; t += int(gridDim.x)) {
    const int64_t slot = slots[t];
    if (slot == -1) continue;  // a padding token (graph buckets): nothing to store
    if (slot < 0 || slot >= capacity) {
      if (threadIdx.x == 0) {
        volatile DeviceErrors* e = errors;
        e->slot = int(slot);
        e->capacity = int(capacity);
        e->bad_slot = 1;
      }
      continue;
    }
    const int per_token = heads * dim;
    const int64_t base = slot * per_token;
    for (int j = int(threadIdx.x); j < per_token; j += int(blockDim.x)) {
      const int h = j / dim, i = j % dim;
      kc[base + j] = from_f32<T>(at_bytes<float>(k.data, t * k.stride_t + h * k.stride_h)[i]);
      if (vc)
        vc[base + j] = from_f32<T>(at_bytes<float>(v.data, t * v.stride_t + h * v.stride_h)[i]);
    }
  }
}

template <typename T>
void launch_typed(const StoreKvArgs& a, cudaStream_t stream) {
  const Src k{a.k.data, a.k.stride[0], a.k.stride[1]};
  const Src v = a.kv.v ? Src{a.v.data, a.v.stride[0], a.v.stride[1]} : Src{nullptr, 0, 0};
  const int per_token = a.kv.kv_heads * a.kv.head_dim;
  const int threads = std::clamp((per_token + 31) / 32 * 32, 32, 256);
  const unsigned blocks = unsigned(std::min(a.num_tokens, 1 << 20));
  store_kv_kernel<T><<<blocks, threads, 0, stream>>>(
      k, v, static_cast<T*>(a.kv.k), static_cast<T*>(a.kv.v), a.slot_mapping, a.num_tokens,
      a.kv.kv_heads, a.kv.head_dim, int64_t(a.kv.num_blocks) * a.kv.block_size, a.errors);
}

void check_src(const TensorView& s, const PagedKv& kv, int num_tokens, const char* what) {
  DS_CHECK(s.dtype == DType::F32 && s.ndim == 3,
           std::string("store_kv: ") + what + " must be [T, kv_heads, head_dim] F32");
  DS_CHECK(s.shape[0] >= num_tokens && s.shape[1] == kv.kv_heads && s.shape[2] == kv.head_dim,
           std::string("store_kv: ") + what + " " + s.shape_str() + " for a cache of " +
               std::to_string(kv.kv_heads) + " x " + std::to_string(kv.head_dim));
  check_inner_dense(s, "store_kv");
}

}  // namespace

void launch_store_kv(const StoreKvArgs& a, cudaStream_t stream) {
  if (a.num_tokens <= 0) return;
  check_src(a.k, a.kv, a.num_tokens, "k");
  if (a.kv.v) check_src(a.v, a.kv, a.num_tokens, "v");
  DS_CHECK(int64_t(a.kv.num_blocks) * a.kv.block_size < (int64_t(1) << 31),
           "store_kv: cache too large for 32-bit slots");
  dispatch_float(a.kv.dtype, "store_kv cache",
                 [&](auto t) { launch_typed<decltype(t)>(a, stream); });
  check_cuda(cudaGetLastError(), "store_kv");
}

}  // namespace ds::cuda
