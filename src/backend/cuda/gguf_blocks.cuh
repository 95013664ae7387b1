// GGML block-quantized rows (layouts of backend/cpu/quants.h, bytes exactly as in the GGUF
// file) read eight elements at a time: octet o of a row is elements 8o .. 8o + 7, which always
// share one scale (and min), so a lane dequantizes an octet into registers with one scale
// lookup. Blocks are only 2-byte aligned (18, 22, 34, 210 bytes), so bytes are read as 16-bit
// words. Host-compilable: the simulation test checks every type's addressing against the CPU
// dequantizer (quants.cpp).
#pragma once

#include <cstdint>
#include <type_traits>

#include "backend/cuda/attention_port.cuh"
#include "core/dtype.h"

namespace ds::cuda::gguf {

// The block types the CUDA kernels read.
constexpr bool is_block_type(DType t) {
  return t == DType::Q4_0 || t == DType::Q4_1 || t == DType::Q5_0 || t == DType::Q5_1 ||
         t == DType::Q8_0 || t == DType::Q4_K || t == DType::Q5_K || t == DType::Q6_K;
}

template <DType T>
struct Layout;
// clang-format off
template <> struct Layout<DType::Q4_0> { static constexpr int kElems = 32, kBytes = 18; };
template <> struct Layout<DType::Q4_1> { static constexpr int kElems = 32, kBytes = 20; };
template <> struct Layout<DType::Q5_0> { static constexpr int kElems = 32, kBytes = 22; };
template <> struct Layout<DType::Q5_1> { static constexpr int kElems = 32, kBytes = 24; };
template <> struct Layout<DType::Q8_0> { static constexpr int kElems = 32, kBytes = 34; };
template <> struct Layout<DType::Q4_K> { static constexpr int kElems = 256, kBytes = 144; };
template <> struct Layout<DType::Q5_K> { static constexpr int kElems = 256, kBytes = 176; };
template <> struct Layout<DType::Q6_K> { static constexpr int kElems = 256, kBytes = 210; };
// clang-format on

DS_KHD uint32_t load_u16(const uint8_t* p) {  // p 2-byte aligned
#if defined(__CUDACC__)
  return *reinterpret_cast<const uint16_t*>(p);
#else
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
#endif
}

// Eight bytes at a 2-byte aligned address, little-endian: bytes 0..3 in lo, 4..7 in hi.
DS_KHD void load8(const uint8_t* p, uint32_t& lo, uint32_t& hi) {
  lo = load_u16(p) | (load_u16(p + 2) << 16);
  hi = load_u16(p + 4) | (load_u16(p + 6) << 16);
}
DS_KHD uint32_t load_u32(const uint8_t* p) {  // p 2-byte aligned
  return load_u16(p) | (load_u16(p + 2) << 16);
}

DS_KHD float half_at(const uint8_t* p) {
#if defined(__CUDACC__)
  return __half2float(__ushort_as_half(uint16_t(load_u16(p))));
#else
  return fp16_to_f32(uint16_t(load_u16(p)));
#endif
}

DS_KHD uint32_t byte_of(uint32_t lo, uint32_t hi, int i) {
  return ((i < 4 ? lo : hi) >> (8 * (i & 3))) & 0xffu;
}

// The 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K block's 12 scale bytes.
DS_KHD void k_scale_min(const uint8_t* s, int j, float& sc, float& m) {
  if (j < 4) {
    sc = float(s[j] & 63);
    m = float(s[j + 4] & 63);
  } else {
    sc = float((s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4));
    m = float((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
  }
}

// Octet o of a row (whose blocks start at `row`), dequantized: w[i] = element 8o + i.
template <DType T>
DS_KHD void octet(const uint8_t* row, int64_t o, float (&w)[8]) {
  constexpr int kE = Layout<T>::kElems, kB = Layout<T>::kBytes;
  const uint8_t* b = row + (o * 8 / kE) * kB;
  const int e = int(o * 8 % kE);  // first element's index inside the block
  uint32_t lo, hi;
  if constexpr (T == DType::Q8_0) {
    const float d = half_at(b);
    load8(b + 2 + e, lo, hi);
    DS_UNROLL
    for (int i = 0; i < 8; ++i) w[i] = d * float(int8_t(byte_of(lo, hi, i)));
  } else if constexpr (T == DType::Q4_0 || T == DType::Q4_1 || T == DType::Q5_0 ||
                       T == DType::Q5_1) {
    // Element j < 16: low nibble of qs[j]; element j + 16: high nibble of qs[j].
    constexpr bool kMin = T == DType::Q4_1 || T == DType::Q5_1;
    constexpr bool k5 = T == DType::Q5_0 || T == DType::Q5_1;
    constexpr int kQs = (kMin ? 4 : 2) + (k5 ? 4 : 0);
    const float d = half_at(b), m = kMin ? half_at(b + 2) : 0.0f;
    load8(b + kQs + (e & 15), lo, hi);
    const int shift = e >= 16 ? 4 : 0;
    const uint32_t qh = k5 ? load_u32(b + (kMin ? 4 : 2)) : 0u;  // bit j: fifth bit of element j
    DS_UNROLL
    for (int i = 0; i < 8; ++i) {
      int q = int((byte_of(lo, hi, i) >> shift) & 0xf);
      if constexpr (k5) q |= int((qh >> (e + i)) & 1u) << 4;
      if constexpr (kMin)
        w[i] = d * float(q) + m;
      else
        w[i] = d * float(q - (k5 ? 16 : 8));
    }
  } else if constexpr (T == DType::Q4_K || T == DType::Q5_K) {
    // 64-element chunk j: low nibbles of qs[32j ..] then high nibbles, sub-blocks 2j, 2j + 1.
    const int j = e / 64, high = (e / 32) & 1, l0 = e & 31;
    float sc, mn;
    k_scale_min(b + 4, 2 * j + high, sc, mn);
    const float d = half_at(b) * sc, dm = half_at(b + 2) * mn;
    constexpr int kQs = T == DType::Q4_K ? 16 : 48;
    load8(b + kQs + 32 * j + l0, lo, hi);
    uint32_t hlo = 0, hhi = 0;
    if constexpr (T == DType::Q5_K) load8(b + 16 + l0, hlo, hhi);  // qh bit 2j + high
    DS_UNROLL
    for (int i = 0; i < 8; ++i) {
      int q = int((byte_of(lo, hi, i) >> (4 * high)) & 0xf);
      if constexpr (T == DType::Q5_K) q |= int((byte_of(hlo, hhi, i) >> (2 * j + high)) & 1u) << 4;
      w[i] = d * float(q) - dm;
    }
  } else {
    static_assert(T == DType::Q6_K);
    // Half n (128 elements): quarter qt from ql[64n + 32 (qt & 1) + l] (low nibble for
    // qt < 2) and bits 2qt of qh[32n + l]; one int8 scale per 16 elements.
    const int n = e / 128, qt = (e / 32) & 3, l0 = e & 31;
    const float d = half_at(b + 208) * float(int8_t(b[192 + e / 16]));
    load8(b + 64 * n + 32 * (qt & 1) + l0, lo, hi);
    uint32_t hlo, hhi;
    load8(b + 128 + 32 * n + l0, hlo, hhi);
    DS_UNROLL
    for (int i = 0; i < 8; ++i) {
      const int q = int((byte_of(lo, hi, i) >> (qt >= 2 ? 4 : 0)) & 0xf) |
                    int(((byte_of(hlo, hhi, i) >> (2 * qt)) & 3u) << 4);
      w[i] = d * float(q - 32);
    }
  }
}

// Bytes of a row of k elements.
inline int64_t row_bytes(DType t, int64_t k) {
  const DTypeInfo& i = dtype_info(t);
  return k / i.block_size * i.type_size;
}

// Calls f(std::integral_constant<DType, T>{}) for the run-time block type t.
template <typename F>
void dispatch(DType t, F&& f) {
  switch (t) {
    case DType::Q4_0:
      return f(std::integral_constant<DType, DType::Q4_0>{});
    case DType::Q4_1:
      return f(std::integral_constant<DType, DType::Q4_1>{});
    case DType::Q5_0:
      return f(std::integral_constant<DType, DType::Q5_0>{});
    case DType::Q5_1:
      return f(std::integral_constant<DType, DType::Q5_1>{});
    case DType::Q8_0:
      return f(std::integral_constant<DType, DType::Q8_0>{});
    case DType::Q4_K:
      return f(std::integral_constant<DType, DType::Q4_K>{});
    case DType::Q5_K:
      return f(std::integral_constant<DType, DType::Q5_K>{});
    case DType::Q6_K:
      return f(std::integral_constant<DType, DType::Q6_K>{});
    default:
      break;
  }
}

// ---- the warp core of the dense and MoE kernels -------------------------------------------
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kRows = 4;  // weight rows per warp
constexpr int kTm = 8;    // tokens per pass: kRows * kTm == 32 sums, one per lane to store

// Lane `lane`'s share of kRows rows (K elements) dotted with TM activation rows, before the
// warp sum: v[r * TM + j] = sum over octets o = lane, lane + 32, ... (ascending) of
// sum_i w_r[8o + i] * xs[j][8o + i]. xs[j] == nullptr: token j absent (its sums stay 0).
template <DType T, int TM>
DS_KHD void lane_dot(const uint8_t* const (&rows)[kRows], int64_t K, const float* const (&xs)[TM],
                     int lane, float (&v)[kRows * TM]) {
  DS_UNROLL
  for (int i = 0; i < kRows * TM; ++i) v[i] = 0.0f;
  const int64_t octets = K / 8;
  for (int64_t o = lane; o < octets; o += 32) {
    float xv[TM][8];
    DS_UNROLL
    for (int j = 0; j < TM; ++j) {
      DS_UNROLL
      for (int i = 0; i < 8; ++i) xv[j][i] = xs[j] ? xs[j][o * 8 + i] : 0.0f;
    }
    DS_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float w[8];
      octet<T>(rows[r], o, w);
      DS_UNROLL
      for (int j = 0; j < TM; ++j) {
        float s = 0.0f;
        DS_UNROLL
        for (int i = 0; i < 8; ++i) s = fmaf(w[i], xv[j][i], s);
        v[r * TM + j] += s;
      }
    }
  }
}

}  // namespace ds::cuda::gguf
