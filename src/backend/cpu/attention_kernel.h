// ISA-neutral body of the paged attention kernel. Each attention*.cpp includes it once and
// compiles it with its own target flags; everything here has internal linkage.
//
// Written with GCC vector extensions (16 float lanes; the compiler lowers them to zmm, ymm
// pairs or xmm quads) and without fused multiply-add, so every ISA computes the same bits:
//   score[j] = tree(lane partials of q . k_j) * scale, lane l summing i = l (mod 16) in order
//   p[j]     = exp(score[j] - max) (polynomial exp below), sum = tree(16 lane partials)
//   a_m[i]   = sum over j = m (mod 4), in order, of p[j] * v_j[i]
//   out[i]   = ((a_0[i] + a_1[i]) + (a_2[i] + a_3[i])) * (1 / sum)
// None of it depends on the batch, the thread count or which heads share a call.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>

#include "backend/cpu/attention.h"
#include "backend/cpu/kv_fp8_rows.h"
#include "core/dtype.h"
#if defined(__F16C__)
#include "backend/cpu/simd_common.h"
#endif

// g++ contracts a * b + c into FMA by default in C++ (even -std=c++20) when the target has
// it; keeping products and sums separate makes every ISA round identically.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
// GCC 12 claims the 16-bit widening tails below may run 2^62 times once inlined into the
// head-size specializations (where they run zero times); a false positive.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Waggressive-loop-optimizations"

namespace ds::cpu {
namespace {

// Vectors are never passed or returned by value (helpers use references), so no vector
// crosses a call boundary whose ABI would depend on the ISA (GCC's -Wpsabi note).
typedef float V16 __attribute__((vector_size(64)));
typedef int32_t I16 __attribute__((vector_size(64)));
typedef uint32_t U16 __attribute__((vector_size(64)));
// Unaligned view of 16 16-bit values (F16 / BF16 bits) in memory.
typedef uint16_t H16u __attribute__((vector_size(32), aligned(2), may_alias));
// Unaligned view of 16 floats in memory, as the intrinsics headers' __m512_u.
typedef float V16u __attribute__((vector_size(64), aligned(4), may_alias));

constexpr int kLanes = 16;
constexpr int kKeyBlock = 64;  // keys per pass: their converted rows stay in L1
constexpr int kSplit = 4;      // interleaved P . V key streams (kKeyBlock is a multiple)
static_assert(kKeyBlock % kSplit == 0 && kSplit == 4, "the final sum below adds 4 streams");

inline const V16u& at(const float* p) {
  return *reinterpret_cast<const V16u*>(p);
}
inline V16u& at(float* p) {
  return *reinterpret_cast<V16u*>(p);
}
inline int round_up(int n, int m) {
  return (n + m - 1) / m * m;
}

// acc lane l = sum of q[i] * k[i] over i = l (mod 16) in increasing i; a short tail is
// zero-padded.
template <int kHd>
inline void dot_partials(const float* q, const float* k, int hd, V16& acc) {
  if constexpr (kHd != 0) hd = kHd;
  acc = V16{};
  int i = 0;
  for (; i + kLanes <= hd; i += kLanes) acc += at(q + i) * at(k + i);
  if (i < hd) {
    float qt[kLanes] = {}, kt[kLanes] = {};
    std::memcpy(qt, q + i, size_t(hd - i) * sizeof(float));
    std::memcpy(kt, k + i, size_t(hd - i) * sizeof(float));
    acc += at(qt) * at(kt);
  }
}

// Reduces 16 lane-partial vectors to one vector of 16 sums (lane k = sum of a[k]) with the
// same tree for every key: s1[l] = a[l] + a[l+8], s2[l] = s1[l] + s1[l+4], ... to one lane.
inline void reduce16(const V16* a, V16& out) {
  V16 c[8], e[4], g[2];
  for (int m = 0; m < 8; ++m)
    c[m] = __builtin_shufflevector(a[2 * m], a[2 * m + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19,
                                   20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * m], a[2 * m + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26,
                                   27, 28, 29, 30, 31);
  for (int m = 0; m < 4; ++m)
    e[m] = __builtin_shufflevector(c[2 * m], c[2 * m + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19,
                                   24, 25, 26, 27) +
           __builtin_shufflevector(c[2 * m], c[2 * m + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22,
                                   23, 28, 29, 30, 31);
  for (int m = 0; m < 2; ++m)
    g[m] = __builtin_shufflevector(e[2 * m], e[2 * m + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21,
                                   24, 25, 28, 29) +
           __builtin_shufflevector(e[2 * m], e[2 * m + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22,
                                   23, 26, 27, 30, 31);
  out = __builtin_shufflevector(g[0], g[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28,
                                30) +
        __builtin_shufflevector(g[0], g[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29,
                                31);
}

// The same tree as reduce16, for one vector.
inline float hsum(const V16& a) {
  float s1[8], s2[4];
  for (int l = 0; l < 8; ++l) s1[l] = a[l] + a[l + 8];
  for (int l = 0; l < 4; ++l) s2[l] = s1[l] + s1[l + 4];
  return (s2[0] + s2[2]) + (s2[1] + s2[3]);
}

// x = exp(x) for x <= 0 (or -inf), lanewise: 2^n * poly(r), x = n ln2 + r, |r| <= ln2 / 2;
// a few ulp, and exactly 0 below -87 (where float exp is subnormal or 0 anyway).
inline void exp_nonpos(V16& x) {
  const V16 zero{}, lo = zero - 87.0f, magic = zero + 12582912.0f;  // 1.5 * 2^23: rounds
  const V16 xc = x < lo ? lo : x;
  const V16 t = xc * 1.44269504f + magic;
  const V16 n = t - magic;
  V16 r = xc - n * 0.693359375f;  // ln2 split in two: n * hi is exact
  r = r - n * -2.12194440e-4f;
  V16 y = zero + 1.0f / 5040;
  y = y * r + 1.0f / 720;
  y = y * r + 1.0f / 120;
  y = y * r + 1.0f / 24;
  y = y * r + 1.0f / 6;
  y = y * r + 0.5f;
  y = y * r + 1.0f;
  y = y * r + 1.0f;
  const I16 bits = (((I16)t - (I16)magic) + 127) << 23;  // 2^n, n in [-126, 0]
  y = y * (V16)bits;
  x = x < lo ? zero : y;
}

inline uint16_t bits16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return h;
}

// n F16 or BF16 values at src as F32 at dst. Exact (every 16-bit value is a float), so
// the F16C / AVX-512 conversions give the scalar path's bits.
inline void widen_16bit(const uint8_t* src, DType dtype, size_t n, float* dst) {
  size_t i = 0;
  if (dtype == DType::BF16) {
    for (; i + kLanes <= n; i += kLanes) {
      const U16 w = __builtin_convertvector(*reinterpret_cast<const H16u*>(src + 2 * i), U16);
      at(dst + i) = (V16)(w << 16);
    }
    for (const uint8_t* h = src + 2 * i; i < n; ++i, h += 2) dst[i] = bf16_to_f32(bits16(h));
    return;
  }
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(
        dst + i,
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 2 * i))));
#elif defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(
        dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i))));
#endif
  for (const uint8_t* h = src + 2 * i; i < n; ++i, h += 2) dst[i] = fp16_to_f32(bits16(h));
}

// Cached rows of one kv head of one sequence, as F32 (converting F16/BF16/FP8 into a buffer).
struct KvRows {
  const uint8_t* base;
  const int32_t* table;
  int block_size;
  int64_t slot_bytes, head_offset;  // bytes
  DType dtype;
  int hd;
  Fp8Scales fp8 = {};  // FP8 caches: the slot's scales

  const uint8_t* raw(int j) const {
    const int64_t slot = int64_t(table[j / block_size]) * block_size + j % block_size;
    return base + slot * slot_bytes + head_offset;
  }
  // Row j as F32: the cache itself for F32, else converted into buf.
  const float* row(int j, float* buf) const {
    const uint8_t* r = raw(j);
    if (dtype == DType::F32) return reinterpret_cast<const float*>(r);
    if (dtype == DType::F8_E4M3) {
      const int64_t slot = int64_t(table[j / block_size]) * block_size + j % block_size;
      dequant_fp8_row(r, fp8, slot, hd, buf);
      return buf;
    }
    widen_16bit(r, dtype, size_t(hd), buf);
    return buf;
  }
};

template <int kHd>
void attention_body(const AttentionParams& p, const AttentionMeta& meta, const AttentionItem& it,
                    AttentionScratch& scratch) {
  const int hd = kHd != 0 ? kHd : int(p.q.shape[2]);
  const int ng = it.head_end - it.head_begin;
  const int s = it.seq;
  const int n_new = meta.query_start[s + 1] - meta.query_start[s];
  const int ctx = meta.context_lens[s];
  const int pos = ctx - n_new + (it.token - meta.query_start[s]);
  const int n_keys = p.causal ? pos + 1 : ctx;
  const int n_pad = round_up(n_keys, kLanes), hd_pad = round_up(hd, kLanes);

  const int64_t es = int64_t(dtype_info(p.kv.dtype).type_size);
  const int32_t* table = meta.block_tables + int64_t(s) * meta.max_blocks_per_seq;
  KvRows krows{static_cast<const uint8_t*>(p.kv.k),
               table,
               p.kv.block_size,
               p.kv.slot_stride() * es,
               it.kvh * hd * es,
               p.kv.dtype,
               hd};
  KvRows vrows = krows;
  vrows.base = static_cast<const uint8_t*>(p.kv.v);
  if (p.kv.fp8()) {
    krows.fp8 = {p.kv.k_scale, p.kv.k_scale_parts(), p.kv.k_scale_index(0, it.kvh, 0),
                 p.kv.rope_split};
    vrows.fp8 = {p.kv.v_scale, p.kv.kv_heads, it.kvh, 0};
  }

  float* scores =  // [ng, n_pad]
      scratch.reserve(int64_t(ng) * (n_pad + kSplit * hd_pad + 1) + int64_t(kKeyBlock) * hd_pad);
  float* acc = scores + int64_t(ng) * n_pad;             // [ng, kSplit, hd_pad]
  float* inv_sum = acc + int64_t(ng) * kSplit * hd_pad;  // [ng]
  float* conv = inv_sum + ng;  // [kKeyBlock, hd_pad] K/V rows converted to F32
  auto qrow = [&](int g) {
    return reinterpret_cast<const float*>(static_cast<const uint8_t*>(p.q.data) +
                                          it.token * p.q.stride[0] +
                                          (it.head_begin + g) * p.q.stride[1]);
  };

  // Scores, 16 keys at a time so their lane partials reduce together.
  const float* rows[kLanes];
  for (int j0 = 0; j0 < n_keys; j0 += kLanes) {
    const int nk = std::min(kLanes, n_keys - j0);
    for (int k = 0; k < nk; ++k) rows[k] = krows.row(j0 + k, conv + int64_t(k) * hd_pad);
    for (int g = 0; g < ng; ++g) {
      const float* q = qrow(g);
      V16 part[kLanes], dots;
      for (int k = 0; k < nk; ++k) dot_partials<kHd>(q, rows[k], hd, part[k]);
      for (int k = nk; k < kLanes; ++k) part[k] = V16{};
      reduce16(part, dots);
      float* sc = scores + int64_t(g) * n_pad + j0;
      at(sc) = dots * p.scale;
      for (int k = nk; k < kLanes; ++k) sc[k] = -INFINITY;
    }
  }

  // Softmax weights (unnormalized) and their sums.
  for (int g = 0; g < ng; ++g) {
    float* sc = scores + int64_t(g) * n_pad;
    V16 mv = V16{} - INFINITY;
    for (int j = 0; j < n_pad; j += kLanes) {
      const V16 v = at(sc + j);
      mv = v > mv ? v : mv;
    }
    float mx = mv[0];
    for (int l = 1; l < kLanes; ++l) mx = std::max(mx, float(mv[l]));
    V16 sum{};
    for (int j = 0; j < n_pad; j += kLanes) {
      V16 e = at(sc + j) - mx;
      exp_nonpos(e);
      at(sc + j) = e;
      sum += e;
    }
    inv_sum[g] = 1.0f / hsum(sum);
    std::fill_n(acc + int64_t(g) * kSplit * hd_pad, kSplit * hd_pad, 0.0f);
  }

  // out = P . V over kSplit interleaved key streams (key j feeds stream j % kSplit, in order),
  // so the adds of consecutive keys do not wait on each other; key blocks keep rows in L1.
  const int hd_full = hd / kLanes * kLanes;
  for (int j0 = 0; j0 < n_keys; j0 += kKeyBlock) {
    const int nk = std::min(kKeyBlock, n_keys - j0);
    const float* vr[kKeyBlock];
    for (int k = 0; k < nk; ++k) vr[k] = vrows.row(j0 + k, conv + int64_t(k) * hd_pad);
    for (int g = 0; g < ng; ++g) {
      const float* w = scores + int64_t(g) * n_pad + j0;
      float* a = acc + int64_t(g) * kSplit * hd_pad;  // [kSplit, hd_pad]
      if constexpr (kHd != 0 && kHd % kLanes == 0) {
        constexpr int kC = kHd / kLanes;
        V16 r[kSplit][kC];
        for (int m = 0; m < kSplit; ++m)
          for (int c = 0; c < kC; ++c) r[m][c] = at(a + m * hd_pad + c * kLanes);
        int k = 0;
        for (; k + kSplit <= nk; k += kSplit)
          for (int m = 0; m < kSplit; ++m)
            for (int c = 0; c < kC; ++c) r[m][c] += w[k + m] * at(vr[k + m] + c * kLanes);
        for (int m = 0; k + m < nk; ++m)  // the block's last keys (blocks start at stream 0)
          for (int c = 0; c < kC; ++c) r[m][c] += w[k + m] * at(vr[k + m] + c * kLanes);
        for (int m = 0; m < kSplit; ++m)
          for (int c = 0; c < kC; ++c) at(a + m * hd_pad + c * kLanes) = r[m][c];
      } else {
        for (int k = 0; k < nk; ++k) {
          float* am = a + (k % kSplit) * hd_pad;
          for (int i = 0; i < hd_full; i += kLanes) at(am + i) += w[k] * at(vr[k] + i);
          for (int i = hd_full; i < hd; ++i) am[i] += w[k] * vr[k][i];
        }
      }
    }
  }

  for (int g = 0; g < ng; ++g) {
    float* o =
        reinterpret_cast<float*>(static_cast<uint8_t*>(p.out.data) + it.token * p.out.stride[0] +
                                 (it.head_begin + g) * p.out.stride[1]);
    const float* a = acc + int64_t(g) * kSplit * hd_pad;
    for (int i = 0; i < hd; ++i)
      o[i] = ((a[i] + a[hd_pad + i]) + (a[2 * hd_pad + i] + a[3 * hd_pad + i])) * inv_sum[g];
  }
}

// dst[i] = src[i] in the cache's dtype: F16 rounds to nearest even (F16C where compiled in:
// the same bits as f32_to_fp16 except NaN payloads), BF16 as f32_to_bf16 (integer rounding,
// so denormals survive as they do there).
inline void narrow_row(const float* src, int64_t n, DType dtype, uint8_t* dst) {
  int64_t i = 0;
  if (dtype == DType::F32) {
    std::memcpy(dst, src, size_t(n) * 4);
    return;
  }
  if (dtype == DType::BF16) {
    for (; i + kLanes <= n; i += kLanes) {
      const U16 x = (U16)at(src + i);
      const U16 rounded = (x + (0x7fff + ((x >> 16) & 1))) >> 16;
      const auto nan = (x & 0x7fffffff) > 0x7f800000;
      *reinterpret_cast<H16u*>(dst + 2 * i) =
          __builtin_convertvector(nan ? (x >> 16) | 0x40 : rounded, H16u);
    }
    for (; i < n; ++i) {
      const uint16_t h = f32_to_bf16(src[i]);
      std::memcpy(dst + 2 * i, &h, 2);
    }
    return;
  }
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 2 * i),
                        _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#elif defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
  for (; i < n; ++i) {
    const uint16_t h = f32_to_fp16(src[i]);
    std::memcpy(dst + 2 * i, &h, 2);
  }
}

// Specializes the common head sizes so their loops unroll into registers.
inline void attention_dispatch(const AttentionParams& p, const AttentionMeta& meta,
                               const AttentionItem& it, AttentionScratch& scratch) {
  switch (p.q.shape[2]) {
    case 64:
      return attention_body<64>(p, meta, it, scratch);
    case 128:
      return attention_body<128>(p, meta, it, scratch);
    default:
      return attention_body<0>(p, meta, it, scratch);
  }
}

}  // namespace
}  // namespace ds::cpu

#pragma GCC diagnostic pop
#pragma GCC pop_options
