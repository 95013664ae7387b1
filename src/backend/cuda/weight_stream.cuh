// Building blocks of the bandwidth-bound "stream the weights once" kernels (skinny GEMM; the
// MoE decode kernels use the same ideas): 16-byte weight chunks widened to F32, vector loads,
// and a warp sum of many values at once. Host-compilable (through attention_port.cuh's
// macros) so the host simulation tests run the same index and reduction logic.
#pragma once

#include <vector_types.h>

#include <cstdint>

#include "backend/cuda/attention_port.cuh"
#include "backend/w4a16.h"

#if !defined(__CUDACC__)
#include <cstring>
#include <stdexcept>
#endif

namespace ds::cuda::wstream {

// Weight element types a chunk may hold.
enum class Elem : int { BF16 = 0, F16 = 1, F32 = 2 };

// Elements per 16-byte chunk.
template <Elem E>
inline constexpr int kChunkElems = E == Elem::F32 ? 4 : 8;

DS_KHD int elem_bytes(Elem e) {
  return e == Elem::F32 ? 4 : 2;
}

// Two 16-bit values of one 32-bit word (low half first) as F32; exact.
template <Elem E>
DS_KDEV void word_to_float2(uint32_t w, float& lo, float& hi) {
  if constexpr (E == Elem::BF16) {
    lo = kern::bf16_bits_to_float(uint16_t(w & 0xffffu));
    hi = kern::bf16_bits_to_float(uint16_t(w >> 16));
  } else {
    lo = kern::f16_bits_to_float(uint16_t(w & 0xffffu));
    hi = kern::f16_bits_to_float(uint16_t(w >> 16));
  }
}

DS_KDEV float bits_to_float(uint32_t u) {
  return w4a16::bits_float(u);
}

// A chunk's elements in memory order.
template <Elem E>
DS_KDEV void chunk_to_float(const uint4& v, float (&f)[kChunkElems<E>]) {
  if constexpr (E == Elem::F32) {
    f[0] = bits_to_float(v.x);
    f[1] = bits_to_float(v.y);
    f[2] = bits_to_float(v.z);
    f[3] = bits_to_float(v.w);
  } else {
    word_to_float2<E>(v.x, f[0], f[1]);
    word_to_float2<E>(v.y, f[2], f[3]);
    word_to_float2<E>(v.z, f[4], f[5]);
    word_to_float2<E>(v.w, f[6], f[7]);
  }
}

// Read-only 16-byte loads (the data must not change during the kernel). The host versions
// check the alignment the GPU would trap on.
#if defined(__CUDACC__)
DS_KDEV uint4 load_chunk(const uint8_t* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}
DS_KDEV float4 load_float4(const float* p) {
  return __ldg(reinterpret_cast<const float4*>(p));
}
#else
inline void check_16(const void* p) {
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0) throw std::logic_error("misaligned 16-byte load");
}
inline uint4 load_chunk(const uint8_t* p) {
  check_16(p);
  uint4 v;
  std::memcpy(&v, p, 16);
  return v;
}
inline float4 load_float4(const float* p) {
  check_16(p);
  float4 v;
  std::memcpy(&v, p, 16);
  return v;
}
#endif

// ---- warp sums of N values at once ---------------------------------------------------------
// A plain xor butterfly sums one value in 5 shuffles, pairing lanes that differ in bit 4, then
// 3, 2, 1, 0. The "scatter" form below pairs lanes in the same order but each lane keeps half
// of its values at each level and sends the other half to its partner, so N values cost
// N - 1 + 5 - log2(N) shuffles instead of 5 N; every value gets the same bits a butterfly
// would give it. Afterwards lane l holds the sum of value l >> (5 - log2 N) in v[0].

// Values kept per lane after the level that starts with N.
template <int N>
inline constexpr int kScatterKeep = N > 1 ? N / 2 : 1;

// What a lane sends at a level that starts with N values (upper: its bit of this level is 1).
template <int N, int Total>
DS_KDEV void scatter_pack(const float (&v)[Total], bool upper, float (&send)[Total]) {
  if constexpr (N > 1) {
    DS_UNROLL
    for (int i = 0; i < N / 2; ++i) send[i] = upper ? v[i] : v[i + N / 2];
  } else {
    send[0] = v[0];
  }
}

// Adds what the partner sent to the half this lane keeps (moved to the front).
template <int N, int Total>
DS_KDEV void scatter_add(float (&v)[Total], bool upper, const float (&recv)[Total]) {
  if constexpr (N > 1) {
    DS_UNROLL
    for (int i = 0; i < N / 2; ++i) v[i] = (upper ? v[i + N / 2] : v[i]) + recv[i];
  } else {
    v[0] += recv[0];
  }
}

// Which value (index into the original v) lane ends up holding.
template <int N>
DS_KHD int scatter_value_of_lane(int lane) {
  static_assert(N >= 1 && N <= 32 && (N & (N - 1)) == 0, "N: a power of two up to 32");
  constexpr int bits = N >= 32 ? 5 : N >= 16 ? 4 : N >= 8 ? 3 : N >= 4 ? 2 : N >= 2 ? 1 : 0;
  return lane >> (5 - bits);
}

#if defined(__CUDACC__)
template <int N, int Total, int O = 16>
DS_KDEV void warp_scatter_sum(float (&v)[Total], int lane) {
  if constexpr (O > 0) {
    constexpr int S = kScatterKeep<N>;
    const bool upper = (lane & O) != 0;
    float send[Total];
    scatter_pack<N, Total>(v, upper, send);
    DS_UNROLL
    for (int i = 0; i < S; ++i) send[i] = __shfl_xor_sync(0xffffffffu, send[i], O);
    scatter_add<N, Total>(v, upper, send);
    warp_scatter_sum<S, Total, O / 2>(v, lane);
  }
}
#endif

}  // namespace ds::cuda::wstream
