// Shared by the CUDA op files: error checks, row addressing of strided views, 16-bit
// load/store, and the host-mapped words kernels use to report bad inputs.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <string>

#include "core/error.h"
#include "core/tensor.h"

namespace ds::cuda {

inline void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(std::string("CUDA ") + what + ": " + cudaGetErrorString(e));
}

// Raises a kernel's dynamic shared-memory limit once per device rather than on every launch,
// so a step captured into a CUDA graph after a warm-up run holds nothing but launches.
template <auto kKernel>
void allow_smem(int bytes) {
  static std::array<std::atomic<int>, 64> allowed{};
  int dev = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  std::atomic<int>* a = dev < int(allowed.size()) ? &allowed[size_t(dev)] : nullptr;
  if (a && a->load() >= bytes) return;
  check_cuda(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
             "cudaFuncSetAttribute");
  if (!a) return;
  int cur = a->load();
  while (cur < bytes && !a->compare_exchange_weak(cur, bytes)) {
  }
}

// Thread-block clusters larger than 8 CTAs are non-portable; H100 / H200 take 16.
constexpr int kMaxClusterSize = 16;

// How many clusters of `cluster` CTAs of `kernel` (block `threads`, `smem` bytes of dynamic
// shared memory) the device holds at once (cudaOccupancyMaxActiveClusters); 0 if it cannot tell.
// The kernel's shared-memory limit and cluster-size attribute must be set already.
template <typename Kernel>
int max_active_clusters(Kernel kernel, dim3 cluster, int threads, size_t smem) {
  cudaLaunchAttribute attr = {};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = cluster.x;
  attr.val.clusterDim.y = cluster.y;
  attr.val.clusterDim.z = cluster.z;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = cluster;
  cfg.blockDim = dim3(unsigned(threads));
  cfg.dynamicSmemBytes = smem;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, kernel, &cfg) != cudaSuccess) {
    (void)cudaGetLastError();
    n = 0;
  }
  return n;
}

// Input errors a kernel cannot throw: it sets the flag word (plain stores of the same value, so
// no atomics on host memory are needed) and the backend reports it at the next synchronize().
struct DeviceErrors {
  int bad_token = 0;  // embed: an id outside [0, vocab)
  int token = 0;
  int vocab = 0;
  int bad_slot = 0;  // store_kv: a slot outside [0, capacity)
  int slot = 0;
  int capacity = 0;
};

// Byte offset of flat row r of a view whose leading dims (all but the last) may be strided
// arbitrarily: up to 3 leading dims, unused ones have size 1.
struct RowIndex {
  int64_t size1 = 1, size2 = 1;                   // sizes of the two innermost leading dims
  int64_t stride0 = 0, stride1 = 0, stride2 = 0;  // bytes
  __host__ __device__ int64_t offset(int64_t r) const {
    const int64_t i2 = r % size2;
    r /= size2;
    const int64_t i1 = r % size1;
    return (r / size1) * stride0 + i1 * stride1 + i2 * stride2;
  }
};

// The RowIndex of v's rows (v.rows() of them, each v.cols() elements long).
inline RowIndex row_index(const TensorView& v) {
  DS_CHECK(v.ndim >= 1 && v.ndim <= 4, "view rank " + std::to_string(v.ndim));
  int64_t size[3] = {1, 1, 1}, stride[3] = {0, 0, 0};
  const int lead = v.ndim - 1;
  for (int d = 0; d < lead; ++d) {
    size[3 - lead + d] = v.shape[size_t(d)];
    stride[3 - lead + d] = v.stride[size_t(d)];
  }
  RowIndex r;
  r.size1 = size[1];
  r.size2 = size[2];
  r.stride0 = stride[0];
  r.stride1 = stride[1];
  r.stride2 = stride[2];
  return r;
}

// Whether v's rows are evenly spaced (so row r is at r * v.row_stride()).
inline bool rows_uniform(const TensorView& v) {
  for (int d = 0; d + 2 < v.ndim; ++d)
    if (v.shape[size_t(d + 1)] != 1 &&
        v.stride[size_t(d)] != v.stride[size_t(d + 1)] * v.shape[size_t(d + 1)])
      return false;
  return true;
}

// The innermost dimension must be dense for every CUDA op.
inline void check_inner_dense(const TensorView& v, const char* what) {
  const int64_t es = dtype_info(v.dtype).type_size;
  DS_CHECK(v.ndim >= 1 && (v.shape[size_t(v.ndim - 1)] <= 1 || v.stride[size_t(v.ndim - 1)] == es),
           std::string(what) + ": innermost dimension must be contiguous");
}

// Calls fn(T{}) with T the CUDA element type of a float dtype (F32, F16, BF16); other
// dtypes are an UnsupportedError naming `what`. One place for the per-dtype launch switch.
template <typename Fn>
void dispatch_float(DType t, const std::string& what, Fn&& fn) {
  switch (t) {
    case DType::F32:
      fn(float{});
      break;
    case DType::F16:
      fn(__half{});
      break;
    case DType::BF16:
      fn(__nv_bfloat16{});
      break;
    default:
      throw UnsupportedError("cuda " + what + ": dtype " + std::string(dtype_name(t)));
  }
}

inline unsigned ceil_div(int64_t a, int64_t b) {
  return unsigned((a + b - 1) / b);
}

#ifdef __CUDACC__
template <typename T>
__device__ __forceinline__ float to_f32(T v);
template <>
__device__ __forceinline__ float to_f32<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ float to_f32<__half>(__half v) {
  return __half2float(v);
}
template <>
__device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}

// Round to nearest even, as the host's f32_to_fp16 / f32_to_bf16.
template <typename T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half from_f32<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

template <typename T>
__device__ __forceinline__ T* at_bytes(void* base, int64_t offset) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + offset);
}
template <typename T>
__device__ __forceinline__ const T* at_bytes(const void* base, int64_t offset) {
  return reinterpret_cast<const T*>(static_cast<const char*>(base) + offset);
}

// The warp's highest score s and its index i, ties to the lower index; (score, index) is a total
// order, so every lane ends with the same winner (a NaN score never wins a comparison).
__device__ __forceinline__ void warp_argmax(float& s, int& i) {
  for (int o = 16; o > 0; o >>= 1) {
    const float os = __shfl_xor_sync(0xffffffffu, s, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (os > s || (os == s && oi < i)) {
      s = os;
      i = oi;
    }
  }
}

// Sum of v over the block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int warps = int(blockDim.x) / 32;
  __syncthreads();  // partial may still be read by a previous call
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = lane < warps ? partial[lane] : 0.0f;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
#endif

}  // namespace ds::cuda
