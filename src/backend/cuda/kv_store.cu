#include <algorithm>

#include "backend/cuda/kv_store.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/kv_fp8.h"

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
  pdl::enter();
  for (int t = int(blockIdx.x); t < num_tokens; t += int(gridDim.x)) {
    const int64_t slot = slots[t];
    if (!storable(slot, capacity, errors)) continue;
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

// FP8 cache: one warp per (token, kv head) row of k or v. The part maxima are exact whatever
// the reduction order, and the scale and codes come from kvfp8's functions, so the bits match
// the CPU store.
struct Fp8Dst {
  uint8_t* codes;
  float* scales;
  int split;  // scale parts of a row: [0, split) and [split, dim) when > 0
  int parts;  // scales per slot
};

__global__ void store_kv_fp8_kernel(Src k, Src v, Fp8Dst kd, Fp8Dst vd,
                                    const int32_t* __restrict__ slots, int num_tokens, int heads,
                                    int dim, int64_t capacity, DeviceErrors* errors) {
  pdl::enter();
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int warps = int(blockDim.x) / 32;
  const int rows_per_token = heads * (vd.codes ? 2 : 1);
  for (int t = int(blockIdx.x); t < num_tokens; t += int(gridDim.x)) {
    const int64_t slot = slots[t];
    if (!storable(slot, capacity, errors)) continue;
    for (int r = warp; r < rows_per_token; r += warps) {
      const bool is_v = r >= heads;
      const int h = is_v ? r - heads : r;
      const Src& s = is_v ? v : k;
      const Fp8Dst& d = is_v ? vd : kd;
      const float* x = at_bytes<float>(s.data, t * s.stride_t + h * s.stride_h);
      uint8_t* codes = d.codes + slot * int64_t(heads) * dim + int64_t(h) * dim;
      const int nparts = d.split > 0 ? 2 : 1;
      float* scales = d.scales + slot * d.parts + int64_t(h) * nparts;
      for (int part = 0; part < nparts; ++part) {
        const int i0 = part == 0 ? 0 : d.split, i1 = nparts == 2 && part == 0 ? d.split : dim;
        float amax = 0.0f;
        for (int i = i0 + lane; i < i1; i += 32) amax = fmaxf(amax, fabsf(x[i]));
        for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        const float sc = kvfp8::scale_of(amax);
        for (int i = i0 + lane; i < i1; i += 32) codes[i] = fp8w::encode(x[i] / sc);
        if (lane == 0) scales[part] = sc;
      }
    }
  }
}

void launch_fp8(const StoreKvArgs& a, cudaStream_t stream) {
  const PagedKv& kv = a.kv;
  DS_CHECK(kv.k_scale != nullptr && (kv.v == nullptr || kv.v_scale != nullptr),
           "store_kv: an FP8 cache needs its scales");
  const Src k{a.k.data, a.k.stride[0], a.k.stride[1]};
  const Src v = kv.v ? Src{a.v.data, a.v.stride[0], a.v.stride[1]} : Src{nullptr, 0, 0};
  const Fp8Dst kd{static_cast<uint8_t*>(kv.k), kv.k_scale, kv.rope_split, kv.k_scale_parts()};
  const Fp8Dst vd{static_cast<uint8_t*>(kv.v), kv.v_scale, 0, kv.kv_heads};
  const int rows = kv.kv_heads * (kv.v ? 2 : 1);
  const int threads = 32 * std::clamp(rows, 1, 8);
  const unsigned blocks = unsigned(std::min(a.num_tokens, 1 << 20));
  pdl::launch(store_kv_fp8_kernel, blocks, threads, 0, stream, k, v, kd, vd, a.slot_mapping,
              a.num_tokens, kv.kv_heads, kv.head_dim, int64_t(kv.num_blocks) * kv.block_size,
              a.errors);
}

template <typename T>
void launch_typed(const StoreKvArgs& a, cudaStream_t stream) {
  const Src k{a.k.data, a.k.stride[0], a.k.stride[1]};
  const Src v = a.kv.v ? Src{a.v.data, a.v.stride[0], a.v.stride[1]} : Src{nullptr, 0, 0};
  const int per_token = a.kv.kv_heads * a.kv.head_dim;
  const int threads = std::clamp((per_token + 31) / 32 * 32, 32, 256);
  const unsigned blocks = unsigned(std::min(a.num_tokens, 1 << 20));
  pdl::launch(store_kv_kernel<T>, blocks, threads, 0, stream, k, v, static_cast<T*>(a.kv.k),
              static_cast<T*>(a.kv.v), a.slot_mapping, a.num_tokens, a.kv.kv_heads, a.kv.head_dim,
              int64_t(a.kv.num_blocks) * a.kv.block_size, a.errors);
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
  if (a.kv.fp8())
    launch_fp8(a, stream);
  else
    dispatch_float(a.kv.dtype, "store_kv cache",
                   [&](auto t) { launch_typed<decltype(t)>(a, stream); });
  check_cuda(cudaGetLastError(), "store_kv");
}

}  // namespace ds::cuda
