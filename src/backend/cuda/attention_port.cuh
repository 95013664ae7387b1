// The few device primitives the attention kernel bodies use, behind one interface: under nvcc
// they are CUDA intrinsics; under a host compiler they are declared here and defined by the
// host simulator (tests/gpu/test_cuda_attention_sim.cpp), which runs each CTA's threads as
// cooperative fibers so the same bodies can be checked on a machine without a GPU.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define DS_KDEV __device__ __forceinline__
#define DS_KHD __host__ __device__ __forceinline__
#define DS_UNROLL _Pragma("unroll")
#else
#include <cmath>
#include <cstring>

#include "core/dtype.h"
#define DS_KDEV inline
#define DS_KHD inline
#define DS_UNROLL
#endif

namespace ds::cuda::kern {

// Where a thread is: what threadIdx / blockIdx say, flattened for 1-D blocks.
struct Thread {
  int tid = 0, lane = 0, warp = 0, nthreads = 0;
  int bx = 0, by = 0, bz = 0;
};

#if defined(__CUDACC__)

DS_KDEV Thread this_thread() {
  Thread t;
  t.tid = int(threadIdx.x);
  t.lane = t.tid & 31;
  t.warp = t.tid >> 5;
  t.nthreads = int(blockDim.x);
  t.bx = int(blockIdx.x);
  t.by = int(blockIdx.y);
  t.bz = int(blockIdx.z);
  return t;
}
DS_KDEV void sync_block() {
  __syncthreads();
}
DS_KDEV void sync_warp() {
  __syncwarp();
}
DS_KDEV float shfl_xor(float v, int mask) {
  return __shfl_xor_sync(0xffffffffu, v, mask);
}
DS_KDEV int shfl_up_int(int v, int delta) {
  return __shfl_up_sync(0xffffffffu, v, delta);
}
DS_KDEV int shfl_int(int v, int src) {
  return __shfl_sync(0xffffffffu, v, src);
}
DS_KDEV unsigned ballot(bool p) {
  return __ballot_sync(0xffffffffu, p);
}
DS_KDEV int first_set(unsigned x) {
  return __ffs(int(x)) - 1;
}
DS_KDEV float exp2_approx(float x) {
  return exp2f(x);
}
DS_KDEV float bf16_bits_to_float(uint16_t h) {
  return __uint_as_float(uint32_t(h) << 16);
}
DS_KDEV float f16_bits_to_float(uint16_t h) {
  return __half2float(__ushort_as_half(h));
}
DS_KDEV uint16_t float_to_bf16_bits(float f) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
}
// D = A * B + C for one m16n8k16 tile: A row-major 16x16 bf16 (a[4], 2 per register), B
// "col" 16x8 bf16 (b[2]), C/D 16x8 f32 (c[4]); the PTX ISA's fragment layouts.
DS_KDEV void mma_bf16_16816(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

#else  // host simulation: defined by the simulator

void sync_block();
void sync_warp();
float shfl_xor(float v, int mask);
int shfl_up_int(int v, int delta);
int shfl_int(int v, int src);
unsigned ballot(bool p);
void mma_bf16_16816(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]);
inline int first_set(unsigned x) {
  return x ? __builtin_ctz(x) : -1;
}
inline float exp2_approx(float x) {
  return std::exp2(x);
}
inline float bf16_bits_to_float(uint16_t h) {
  return bf16_to_f32(h);
}
inline float f16_bits_to_float(uint16_t h) {
  return fp16_to_f32(h);
}
inline uint16_t float_to_bf16_bits(float f) {
  return f32_to_bf16(f);
}

#endif

// Vector accesses must be aligned on the GPU; the simulator checks what the GPU would trap.
#if defined(__CUDACC__)
DS_KDEV void check_aligned(const void*, int) {}
#else
void check_aligned(const void* p, int bytes);
#endif

DS_KDEV uint32_t pack_bf16(uint16_t lo, uint16_t hi) {
  return uint32_t(lo) | uint32_t(hi) << 16;
}

DS_KDEV float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, shfl_xor(v, o));
  return v;
}
DS_KDEV float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += shfl_xor(v, o);
  return v;
}

}  // namespace ds::cuda::kern
