#include <cuda_fp16.h>

#include "backend/cuda/common.cuh"
#include "backend/cuda/fill_random.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/fp8w.h"
#include "backend/w4a16.h"

namespace ds::cuda {
namespace {

struct FillArgs {
  uint64_t seed = 0;
  float mean = 0.0f, mul = 0.0f;
  int round_as = 0;        // 0 F32, 1 F16, 2 BF16
  int out = 0;             // 0 F32, 1 F16, 2 BF16, 3 W4A16, 4 FP8W
  int64_t d1 = 1, d2 = 1;  // dims[1], dims[2] (dims[0] follows from the count)
  int64_t m0 = 0, m1 = 0, m2 = 0;
  int64_t row_stride = 0;  // W4A16 / FP8W bytes per row
  void* dst = nullptr;
};

__device__ float value(const FillArgs& a, int64_t flat) {
  const int64_t c = flat % a.d2, b = (flat / a.d2) % a.d1, z = flat / (a.d2 * a.d1);
  const float v =
      w4a16::random_value(a.seed, uint64_t(z * a.m0 + b * a.m1 + c * a.m2), a.mean, a.mul);
  if (a.round_as == 2) return w4a16::from_bf16(w4a16::to_bf16(v));
  if (a.round_as == 1) return __half2float(__float2half_rn(v));
  return v;
}

__global__ void fill_plain_kernel(FillArgs a, int64_t n) {
  pdl::enter();
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float v = value(a, i);
    if (a.out == 0)
      static_cast<float*>(a.dst)[i] = v;
    else if (a.out == 1)
      static_cast<__half*>(a.dst)[i] = __float2half_rn(v);
    else
      static_cast<uint16_t*>(a.dst)[i] = w4a16::to_bf16(v);
  }
}

// One thread per 128-group of a [rows, K = d2] W4A16 tensor.
__global__ void fill_w4a16_kernel(FillArgs a, int64_t groups) {
  pdl::enter();
  const int64_t per_row = a.d2 / w4a16::kGroup;
  for (int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; g < groups;
       g += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = g / per_row, gi = g % per_row;
    float x[w4a16::kGroup];
    for (int i = 0; i < w4a16::kGroup; ++i) x[i] = value(a, row * a.d2 + gi * w4a16::kGroup + i);
    uint4 codes[w4a16::kGroup / 32];  // 64 bytes, 16-byte aligned for the stores below
    uint16_t scale = 0;
    w4a16::quantize_group(x, reinterpret_cast<uint8_t*>(codes), &scale);
    uint8_t* r = static_cast<uint8_t*>(a.dst) + row * a.row_stride;
    uint4* dst = reinterpret_cast<uint4*>(r + gi * (w4a16::kGroup / 2));
    for (int i = 0; i < 4; ++i) dst[i] = codes[i];
    reinterpret_cast<uint16_t*>(r + a.d2 / 2)[gi] = scale;
    if (gi == per_row - 1)
      for (int64_t i = a.d2 / 2 + a.d2 / 64; i < a.row_stride; ++i) r[i] = 0;
  }
}

// One thread per 128-group of a [rows, K = d2] FP8W tensor (any K): the values, then the same
// scale and codes as fp8w::quantize_row on the host; the group ending the row zeroes its padding.
__global__ void fill_fp8w_kernel(FillArgs a, int64_t groups) {
  pdl::enter();
  const int64_t per_row = fp8w::groups(a.d2);
  for (int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; g < groups;
       g += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = g / per_row, gi = g % per_row;
    const int64_t k0 = gi * fp8w::kGroup, rest = a.d2 - k0;
    const int64_t n = rest < fp8w::kGroup ? rest : int64_t(fp8w::kGroup);
    float x[fp8w::kGroup];
    float amax = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
      x[i] = value(a, row * a.d2 + k0 + i);
      amax = fmaxf(amax, fabsf(x[i]));
    }
    const float s = amax > 0.0f ? amax / fp8w::kMax : 1.0f;
    uint8_t* r = static_cast<uint8_t*>(a.dst) + row * a.row_stride;
    for (int64_t i = 0; i < n; ++i) r[k0 + i] = fp8w::encode(x[i] / s);
    fp8w::set_scale(r, a.d2, gi, s);
    if (gi == per_row - 1) {
      for (int64_t i = a.d2; i < fp8w::code_bytes(a.d2); ++i) r[i] = 0;
      for (int64_t i = fp8w::code_bytes(a.d2) + per_row * 4; i < a.row_stride; ++i) r[i] = 0;
    }
  }
}

int code_of(DType t) {
  switch (t) {
    case DType::F32:
      return 0;
    case DType::F16:
      return 1;
    case DType::BF16:
      return 2;
    case DType::FP8W:
      return 4;
    default:
      return 3;
  }
}

}  // namespace

void launch_fill_random(const TensorView& dst, const RandomFill& p, cudaStream_t stream) {
  const RandomFillShape s = random_fill_shape(dst, p);
  FillArgs a;
  a.seed = p.seed;
  a.mean = p.mean;
  a.mul = s.mul;
  a.round_as = code_of(p.round_as);
  a.out = code_of(dst.dtype);
  a.d1 = s.dims[1];
  a.d2 = s.dims[2];
  a.m0 = s.map[0];
  a.m1 = s.map[1];
  a.m2 = s.map[2];
  a.row_stride = dst.row_stride();
  a.dst = dst.data;
  const int64_t n = s.dims[0] * s.dims[1] * s.dims[2];
  if (n == 0) return;
  constexpr int kThreads = 256;
  if (dst.dtype == DType::W4A16) {
    const int64_t groups = n / w4a16::kGroup;
    const int64_t blocks = std::min<int64_t>((groups + kThreads - 1) / kThreads, 1 << 20);
    pdl::launch(fill_w4a16_kernel, unsigned(blocks), kThreads, 0, stream, a, groups);
  } else if (dst.dtype == DType::FP8W) {
    const int64_t groups = s.dims[0] * s.dims[1] * fp8w::groups(a.d2);
    const int64_t blocks = std::min<int64_t>((groups + kThreads - 1) / kThreads, 1 << 20);
    pdl::launch(fill_fp8w_kernel, unsigned(blocks), kThreads, 0, stream, a, groups);
  } else {
    const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, 1 << 20);
    pdl::launch(fill_plain_kernel, unsigned(blocks), kThreads, 0, stream, a, n);
  }
  check_cuda(cudaGetLastError(), "fill_random launch");
}

}  // namespace ds::cuda
