// ISA-neutral body of the MLA kernel. Each mla_attention*.cpp includes it once and compiles
// it with its own target flags; everything here has internal linkage.
//
// Per (token, head), in double (float products are exact in double):
//   s_j  = (q_latent . c_j + q_rope . r_j) * scale, the dot summed in 8 lanes (lane l takes
//          dims i = l (mod 8) in order, the rope dims continuing the same lanes) and then a
//          fixed tree
//   p_j  = exp(s_j - max_j s_j), sum = sequential sum over j
//   out  = float((sum_j p_j * c_j, in increasing j) / sum)
// Vector extensions without fused multiply-add, so every ISA rounds identically.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>

#include "backend/cpu/kv_fp8_rows.h"
#include "backend/cpu/mla_attention.h"
#include "core/dtype.h"

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

namespace ds::cpu {
namespace {

// Vectors only live in locals and references (never by value across calls), so no ABI
// question arises; g++ lowers them to whatever registers the target has.
typedef double D8 __attribute__((vector_size(64)));
typedef double D8u __attribute__((vector_size(64), aligned(8), may_alias));

constexpr int kLanes = 8;
constexpr int kKeyBlock = 16;  // cache rows widened per pass; they stay in L1/L2

inline D8u& at(double* p) {
  return *reinterpret_cast<D8u*>(p);
}
inline const D8u& at(const double* p) {
  return *reinterpret_cast<const D8u*>(p);
}
inline int pad8(int n) {
  return (n + kLanes - 1) / kLanes * kLanes;
}

inline float f32_bits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// Exact F16 -> F32 without branches (so the loop vectorizes): the magnitude bits shifted
// into a float and scaled by 2^112 give normals and subnormals; exponent 31 is inf / NaN.
inline float half_to_float(uint16_t h) {
  const uint32_t mag = uint32_t(h & 0x7fff) << 13;
  uint32_t b;
  const float f = f32_bits(mag) * 0x1p112f;
  std::memcpy(&b, &f, 4);
  b = (h & 0x7c00) == 0x7c00 ? (mag | 0x7f800000u) : b;
  return f32_bits(b | uint32_t(h & 0x8000) << 16);
}

// Cached row j of one sequence (R + P values) widened to double into dst.
struct LatentRows {
  const uint8_t* base;
  const int32_t* table;
  int block_size;
  int64_t slot_bytes;
  DType dtype;
  int width;
  Fp8Scales fp8 = {};  // FP8 caches: the latent and rope scales of each slot

  void widen(int j, double* dst) const {
    const int64_t slot = int64_t(table[j / block_size]) * block_size + j % block_size;
    const uint8_t* r = base + slot * slot_bytes;
    if (dtype == DType::F8_E4M3) {
      dequant_fp8_row(r, fp8, slot, width, dst);
    } else if (dtype == DType::F32) {
      const auto* f = reinterpret_cast<const float*>(r);
      for (int i = 0; i < width; ++i) dst[i] = f[i];
    } else if (dtype == DType::F16) {
      const auto* h = reinterpret_cast<const uint16_t*>(r);
      for (int i = 0; i < width; ++i) dst[i] = half_to_float(h[i]);
    } else {
      const auto* h = reinterpret_cast<const uint16_t*>(r);
      for (int i = 0; i < width; ++i) dst[i] = f32_bits(uint32_t(h[i]) << 16);
    }
  }
};

// For each of kN rows c[k]: acc[k] lane l += q[i] * c[k][i] over i = l (mod 8), in
// increasing i. Several rows share each load of q; each row's sums are as if alone.
template <int kN>
inline void dot_acc(const double* q, const double* const* c, int n, D8* acc) {
  int i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const D8 qv = at(q + i);
    for (int k = 0; k < kN; ++k) acc[k] += qv * at(c[k] + i);
  }
  for (int k = 0; k < kN; ++k)
    for (int l = 0; i + l < n; ++l) acc[k][l] += q[i + l] * c[k][i + l];
}

inline double hsum(const D8& a) {
  return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

inline float* mla_head_row(const TensorView& v, int t, int h) {
  return reinterpret_cast<float*>(static_cast<uint8_t*>(v.data) + t * v.stride[0] +
                                  h * v.stride[1]);
}

void mla_body(const MlaAttentionParams& p, const AttentionMeta& meta, const detail::MlaItem& it,
              MlaScratch& sc) {
  const int R = p.kv_lora_rank, P = int(p.q_rope.shape[2]), width = R + P;
  const int s = it.seq, ng = it.head_end - it.head_begin;
  const int n_new = meta.query_start[s + 1] - meta.query_start[s];
  const int ctx = meta.context_lens[s];
  const int pos = ctx - n_new + (it.token - meta.query_start[s]);
  const int n_keys = p.causal ? pos + 1 : ctx;
  if (n_keys <= 0) {  // nothing visible (an empty non-causal context)
    for (int g = 0; g < ng; ++g)
      std::fill_n(mla_head_row(p.out, it.token, it.head_begin + g), R, 0.0f);
    return;
  }

  // Row lengths padded to whole vectors so every row starts 64-byte apart.
  const size_t wp = size_t(pad8(width)), rp = size_t(pad8(R)), kp = size_t(pad8(n_keys));
  double* scores = sc.reserve(size_t(ng) * (kp + rp + wp + 1) + kKeyBlock * wp);  // [ng, kp]
  double* acc = scores + size_t(ng) * kp;                                         // [ng, rp]
  double* qd = acc + size_t(ng) * rp;   // [ng, wp]: q_latent then q_rope
  double* sums = qd + size_t(ng) * wp;  // [ng]
  double* conv = sums + ng;             // [kKeyBlock, wp]
  LatentRows rows{static_cast<const uint8_t*>(p.cache.k),
                  meta.block_tables + int64_t(s) * meta.max_blocks_per_seq,
                  p.cache.block_size,
                  p.cache.slot_stride() * int64_t(dtype_info(p.cache.dtype).type_size),
                  p.cache.dtype,
                  width};
  if (p.cache.fp8()) rows.fp8 = {p.cache.k_scale, p.cache.k_scale_parts(), 0, p.cache.rope_split};
  for (int g = 0; g < ng; ++g) {
    const float* ql = mla_head_row(p.q_latent, it.token, it.head_begin + g);
    const float* qr = mla_head_row(p.q_rope, it.token, it.head_begin + g);
    double* q = qd + size_t(g) * wp;
    for (int i = 0; i < R; ++i) q[i] = ql[i];
    for (int i = 0; i < P; ++i) q[R + i] = qr[i];
  }

  // Scores, a block of cache rows at a time (widened once for all heads of the item).
  for (int j0 = 0; j0 < n_keys; j0 += kKeyBlock) {
    const int nk = std::min(kKeyBlock, n_keys - j0);
    for (int k = 0; k < nk; ++k) rows.widen(j0 + k, conv + size_t(k) * wp);
    for (int g = 0; g < ng; ++g) {
      const double* q = qd + size_t(g) * wp;
      double* sg = scores + size_t(g) * kp + j0;
      int k = 0;
      for (; k + 4 <= nk; k += 4) {
        const double* c[4] = {conv + size_t(k) * wp, conv + size_t(k + 1) * wp,
                              conv + size_t(k + 2) * wp, conv + size_t(k + 3) * wp};
        const double* cr[4] = {c[0] + R, c[1] + R, c[2] + R, c[3] + R};
        D8 a[4] = {};
        dot_acc<4>(q, c, R, a);
        dot_acc<4>(q + R, cr, P, a);
        for (int m = 0; m < 4; ++m) sg[k + m] = hsum(a[m]) * double(p.scale);
      }
      for (; k < nk; ++k) {
        const double* c = conv + size_t(k) * wp;
        const double* cr = c + R;
        D8 a[1] = {};
        dot_acc<1>(q, &c, R, a);
        dot_acc<1>(q + R, &cr, P, a);
        sg[k] = hsum(a[0]) * double(p.scale);
      }
    }
  }

  // Softmax weights, unnormalized, and their sums.
  for (int g = 0; g < ng; ++g) {
    double* sg = scores + size_t(g) * kp;
    const double mx = *std::max_element(sg, sg + n_keys);
    double sum = 0;
    for (int j = 0; j < n_keys; ++j) {
      sg[j] = std::exp(sg[j] - mx);
      sum += sg[j];
    }
    sums[g] = sum;
  }

  // Weighted sum of the latent rows, keys in increasing order.
  std::fill_n(acc, size_t(ng) * rp, 0.0);
  const int r_full = R / kLanes * kLanes;
  for (int j0 = 0; j0 < n_keys; j0 += kKeyBlock) {
    const int nk = std::min(kKeyBlock, n_keys - j0);
    for (int k = 0; k < nk; ++k) rows.widen(j0 + k, conv + size_t(k) * wp);
    for (int g = 0; g < ng; ++g) {
      const double* w = scores + size_t(g) * kp + j0;
      double* a = acc + size_t(g) * rp;
      // Per element, keys are added in increasing order; the chunk loop is outside so the
      // running sums stay in registers across the block's keys.
      for (int i = 0; i < r_full; i += kLanes) {
        D8 r = at(a + i);
        for (int k = 0; k < nk; ++k) r += w[k] * at(conv + size_t(k) * wp + i);
        at(a + i) = r;
      }
      for (int i = r_full; i < R; ++i)
        for (int k = 0; k < nk; ++k) a[i] += w[k] * conv[size_t(k) * wp + i];
    }
  }

  for (int g = 0; g < ng; ++g) {
    float* o = mla_head_row(p.out, it.token, it.head_begin + g);
    const double* a = acc + size_t(g) * rp;
    for (int i = 0; i < R; ++i) o[i] = float(a[i] / sums[g]);
  }
}

}  // namespace
}  // namespace ds::cpu

#pragma GCC pop_options
