#include "backend/cpu/quants.h"

#include <cmath>
#include <cstring>
#include <string>

#include "core/error.h"

namespace ds::cpu {
namespace {

float h2f(uint16_t h) {
  return fp16_to_f32(h);
}
float fp16_round(float f) {
  return fp16_to_f32(f32_to_fp16(f));
}

[[noreturn]] void unsupported(const char* what, DType t) {
  throw UnsupportedError(std::string(what) + " does not support " + std::string(dtype_name(t)));
}

// ggml's nearest_int: round half to even through the float magic number.
int nearest_int(float f) {
  float v = f + 12582912.f;
  int32_t i;
  std::memcpy(&i, &v, 4);
  return (i & 0x007fffff) - 0x00400000;
}

void dequant_q4_0(const BlockQ4_0* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += kQk) {
    const float d = h2f(b[i].d);
    for (int j = 0; j < kQk / 2; ++j) {
      y[j] = float((b[i].qs[j] & 0xf) - 8) * d;
      y[j + kQk / 2] = float((b[i].qs[j] >> 4) - 8) * d;
    }
  }
}

void dequant_q4_1(const BlockQ4_1* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += kQk) {
    const float d = h2f(b[i].d), m = h2f(b[i].m);
    for (int j = 0; j < kQk / 2; ++j) {
      y[j] = float(b[i].qs[j] & 0xf) * d + m;
      y[j + kQk / 2] = float(b[i].qs[j] >> 4) * d + m;
    }
  }
}

template <typename B, bool kHasMin>
void dequant_q5(const B* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += kQk) {
    const float d = h2f(b[i].d);
    uint32_t qh;
    std::memcpy(&qh, b[i].qh, 4);
    for (int j = 0; j < kQk / 2; ++j) {
      const int h0 = ((qh >> j) << 4) & 0x10, h1 = (qh >> (j + 12)) & 0x10;
      int q0 = (b[i].qs[j] & 0xf) | h0, q1 = (b[i].qs[j] >> 4) | h1;
      if constexpr (kHasMin) {
        const float m = h2f(b[i].m);
        y[j] = float(q0) * d + m;
        y[j + kQk / 2] = float(q1) * d + m;
      } else {
        y[j] = float(q0 - 16) * d;
        y[j + kQk / 2] = float(q1 - 16) * d;
      }
    }
  }
}

template <typename B>
void dequant_q8(const B* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += kQk) {
    const float d = h2f(b[i].d);
    for (int j = 0; j < kQk; ++j) y[j] = float(b[i].qs[j]) * d;
  }
}

void dequant_q4_k(const BlockQ4_K* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i) {
    const float d = h2f(b[i].d), dmin = h2f(b[i].dmin);
    const uint8_t* q = b[i].qs;
    for (int j = 0; j < 4; ++j, q += 32) {
      uint8_t sc0, m0, sc1, m1;
      q4k_scale_min(b[i].scales, 2 * j, &sc0, &m0);
      q4k_scale_min(b[i].scales, 2 * j + 1, &sc1, &m1);
      const float d0 = d * sc0, dm0 = dmin * m0, d1 = d * sc1, dm1 = dmin * m1;
      for (int l = 0; l < 32; ++l) *y++ = d0 * float(q[l] & 0xf) - dm0;
      for (int l = 0; l < 32; ++l) *y++ = d1 * float(q[l] >> 4) - dm1;
    }
  }
}

void dequant_q5_k(const BlockQ5_K* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i) {
    const float d = h2f(b[i].d), dmin = h2f(b[i].dmin);
    const uint8_t* ql = b[i].qs;
    const uint8_t* qh = b[i].qh;
    uint8_t u1 = 1, u2 = 2;
    for (int j = 0; j < 4; ++j, ql += 32, u1 <<= 2, u2 <<= 2) {
      uint8_t sc0, m0, sc1, m1;
      q4k_scale_min(b[i].scales, 2 * j, &sc0, &m0);
      q4k_scale_min(b[i].scales, 2 * j + 1, &sc1, &m1);
      const float d0 = d * sc0, dm0 = dmin * m0, d1 = d * sc1, dm1 = dmin * m1;
      for (int l = 0; l < 32; ++l) *y++ = d0 * float((ql[l] & 0xf) + (qh[l] & u1 ? 16 : 0)) - dm0;
      for (int l = 0; l < 32; ++l) *y++ = d1 * float((ql[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - dm1;
    }
  }
}

// The 256 signed 6-bit values of a Q6_K block in element order (q - 32).
void q6k_values(const BlockQ6_K& b, int8_t* q) {
  for (int n = 0; n < 2; ++n) {
    const uint8_t* ql = b.ql + 64 * n;
    const uint8_t* qh = b.qh + 32 * n;
    int8_t* o = q + 128 * n;
    for (int l = 0; l < 32; ++l) {
      o[l] = int8_t(((ql[l] & 0xf) | ((qh[l] & 3) << 4)) - 32);
      o[l + 32] = int8_t(((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32);
      o[l + 64] = int8_t(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
      o[l + 96] = int8_t(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
    }
  }
}

void dequant_q6_k(const BlockQ6_K* b, float* y, int64_t nb) {
  int8_t q[kQkK];
  for (int64_t i = 0; i < nb; ++i, y += kQkK) {
    q6k_values(b[i], q);
    const float d = h2f(b[i].d);
    for (int e = 0; e < kQkK; ++e) y[e] = d * float(b[i].scales[e / 16]) * float(q[e]);
  }
}

void quant_q4_0(const float* x, BlockQ4_0* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQk) {
    float amax = 0, max = 0;
    for (int j = 0; j < kQk; ++j)
      if (amax < std::fabs(x[j])) {
        amax = std::fabs(x[j]);
        max = x[j];
      }
    const float d = max / -8, id = d != 0 ? 1.0f / d : 0.0f;
    y[i].d = f32_to_fp16(d);
    for (int j = 0; j < kQk / 2; ++j) {
      const int q0 = std::min(15, int(int8_t(x[j] * id + 8.5f)));
      const int q1 = std::min(15, int(int8_t(x[j + kQk / 2] * id + 8.5f)));
      y[i].qs[j] = uint8_t(q0 | (q1 << 4));
    }
  }
}

void quant_q4_1(const float* x, BlockQ4_1* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQk) {
    float min = x[0], max = x[0];
    for (int j = 1; j < kQk; ++j) {
      min = std::min(min, x[j]);
      max = std::max(max, x[j]);
    }
    const float d = (max - min) / 15, id = d != 0 ? 1.0f / d : 0.0f;
    y[i].d = f32_to_fp16(d);
    y[i].m = f32_to_fp16(min);
    for (int j = 0; j < kQk / 2; ++j) {
      const int q0 = std::min(15, int(int8_t((x[j] - min) * id + 0.5f)));
      const int q1 = std::min(15, int(int8_t((x[j + kQk / 2] - min) * id + 0.5f)));
      y[i].qs[j] = uint8_t(q0 | (q1 << 4));
    }
  }
}

void quant_q8_k(const float* x, BlockQ8_K* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQkK) {
    float amax = 0, max = 0;
    for (int j = 0; j < kQkK; ++j)
      if (std::fabs(x[j]) > amax) {
        amax = std::fabs(x[j]);
        max = x[j];
      }
    if (amax == 0) {
      std::memset(&y[i], 0, sizeof(BlockQ8_K));
      continue;
    }
    // -127 (not -128) as ggml uses: the int8 range stays symmetric.
    const float iscale = -127.f / max;
    for (int j = 0; j < kQkK; ++j) y[i].qs[j] = int8_t(std::min(127, nearest_int(iscale * x[j])));
    for (int g = 0; g < kQkK / 16; ++g) {
      int sum = 0;
      for (int l = 0; l < 16; ++l) sum += y[i].qs[g * 16 + l];
      y[i].bsums[g] = int16_t(sum);
    }
    y[i].d = 1 / iscale;
  }
}

}  // namespace

void q4k_scale_min(const uint8_t* q, int j, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = uint8_t((q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4));
    *m = uint8_t((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

int quantize_block_q8(const float* x, int8_t* q, float* d_out) {
  float amax = 0;
  for (int j = 0; j < kQk; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / 127, id = d != 0 ? 1.0f / d : 0.0f;
  int sum = 0;
  for (int j = 0; j < kQk; ++j) {
    q[j] = int8_t(std::round(x[j] * id));
    sum += q[j];
  }
  *d_out = d;
  return sum;
}

void quantize_block_act(const float* x, ActBlock* out) {
  float amax = 0;
  for (int j = 0; j < kQk; ++j) amax = std::max(amax, std::fabs(x[j]));
  // 127 / amax, not 1 / d, and half-to-even rounding: what the SIMD quantizers compute.
  const float d = amax / 127.f, id = amax != 0 ? 127.f / amax : 0.0f;
  int sum = 0;
  for (int j = 0; j < kQk; ++j) {
    out->qs[j] = int8_t(nearest_int(x[j] * id));
    sum += out->qs[j];
  }
  out->d = fp16_round(d);
  out->s = fp16_round(d * float(sum));
}

void quantize_row_act(const float* x, ActBlock* dst, int64_t n) {
  DS_CHECK(n % kQk == 0, "row length must be a multiple of 32");
  for (int64_t i = 0; i < n / kQk; ++i) quantize_block_act(x + i * kQk, &dst[i]);
}

void dequantize_row_ref(DType t, const void* src, float* y, int64_t n) {
  const auto& info = dtype_info(t);
  if (n % info.block_size != 0)
    throw Error("dequantize_row: " + std::to_string(n) + " is not a multiple of the " +
                std::string(info.name) + " block size");
  const int64_t nb = n / info.block_size;
  switch (t) {
    case DType::F32:
      std::memcpy(y, src, size_t(n) * 4);
      return;
    case DType::F16: {
      const auto* h = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) y[i] = fp16_to_f32(h[i]);
      return;
    }
    case DType::BF16: {
      const auto* h = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) y[i] = bf16_to_f32(h[i]);
      return;
    }
    case DType::Q4_0:
      return dequant_q4_0(static_cast<const BlockQ4_0*>(src), y, nb);
    case DType::Q4_1:
      return dequant_q4_1(static_cast<const BlockQ4_1*>(src), y, nb);
    case DType::Q5_0:
      return dequant_q5<BlockQ5_0, false>(static_cast<const BlockQ5_0*>(src), y, nb);
    case DType::Q5_1:
      return dequant_q5<BlockQ5_1, true>(static_cast<const BlockQ5_1*>(src), y, nb);
    case DType::Q8_0:
      return dequant_q8(static_cast<const BlockQ8_0*>(src), y, nb);
    case DType::Q8_1:
      return dequant_q8(static_cast<const BlockQ8_1*>(src), y, nb);
    case DType::Q4_K:
      return dequant_q4_k(static_cast<const BlockQ4_K*>(src), y, nb);
    case DType::Q5_K:
      return dequant_q5_k(static_cast<const BlockQ5_K*>(src), y, nb);
    case DType::Q6_K:
      return dequant_q6_k(static_cast<const BlockQ6_K*>(src), y, nb);
    case DType::Q8_K: {
      const auto* b = static_cast<const BlockQ8_K*>(src);
      for (int64_t i = 0; i < nb; ++i)
        for (int j = 0; j < kQkK; ++j) y[i * kQkK + j] = b[i].d * float(b[i].qs[j]);
      return;
    }
    default:
      unsupported("dequantize_row", t);
  }
}

void quantize_row_ref(DType t, const float* x, void* dst, int64_t n) {
  const auto& info = dtype_info(t);
  if (n % info.block_size != 0)
    throw Error("quantize_row: " + std::to_string(n) + " is not a multiple of the " +
                std::string(info.name) + " block size");
  const int64_t nb = n / info.block_size;
  switch (t) {
    case DType::F32:
      std::memcpy(dst, x, size_t(n) * 4);
      return;
    case DType::F16: {
      auto* h = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) h[i] = f32_to_fp16(x[i]);
      return;
    }
    case DType::BF16: {
      auto* h = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) h[i] = f32_to_bf16(x[i]);
      return;
    }
    case DType::Q4_0:
      return quant_q4_0(x, static_cast<BlockQ4_0*>(dst), nb);
    case DType::Q4_1:
      return quant_q4_1(x, static_cast<BlockQ4_1*>(dst), nb);
    case DType::Q8_0: {
      auto* b = static_cast<BlockQ8_0*>(dst);
      for (int64_t i = 0; i < nb; ++i) {
        float d;
        quantize_block_q8(x + i * kQk, b[i].qs, &d);
        b[i].d = f32_to_fp16(d);
      }
      return;
    }
    case DType::Q8_1: {
      auto* b = static_cast<BlockQ8_1*>(dst);
      for (int64_t i = 0; i < nb; ++i) {
        float d;
        const int sum = quantize_block_q8(x + i * kQk, b[i].qs, &d);
        b[i].d = f32_to_fp16(d);
        b[i].s = f32_to_fp16(float(sum) * d);
      }
      return;
    }
    case DType::Q8_K:
      return quant_q8_k(x, static_cast<BlockQ8_K*>(dst), nb);
    default:
      unsupported("quantize_row", t);
  }
}

namespace {

// The eight-lane sum order of llama.cpp's hsum_float_8.
float hsum8(const float* a) {
  return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

// Element e of a Q4 block: the low nibble of qs[e] for e < 16, the high one of qs[e - 16].
int nibble(const uint8_t* qs, int e) {
  return e < kQk / 2 ? qs[e] & 0xf : qs[e - kQk / 2] >> 4;
}

// The block loop shared by the three 32-element types; wq(b, e) is weight element e of
// block b as an integer, dw(b) the block scale.
template <typename WQ, typename DW>
void accumulate_q8(const ActBlock* x, int64_t nb, WQ wq, DW dw, float* acc) {
  for (int64_t b = 0; b < nb; ++b) {
    const float dd = dw(b) * x[b].d;
    for (int u = 0; u < 8; ++u) {
      int isum = 0;
      for (int e = 4 * u; e < 4 * u + 4; ++e) isum += wq(b, e) * x[b].qs[e];
      acc[u] = std::fma(dd, float(isum), acc[u]);
    }
  }
}

}  // namespace

float vec_dot_q4_0(const BlockQ4_0* w, const ActBlock* x, int64_t nb) {
  float acc[8] = {};
  accumulate_q8(
      x, nb, [&](int64_t b, int e) { return nibble(w[b].qs, e) - 8; },
      [&](int64_t b) { return h2f(w[b].d); }, acc);
  return hsum8(acc);
}

float vec_dot_q4_1(const BlockQ4_1* w, const ActBlock* x, int64_t nb) {
  float acc[8] = {};
  accumulate_q8(
      x, nb, [&](int64_t b, int e) { return nibble(w[b].qs, e); },
      [&](int64_t b) { return h2f(w[b].d); }, acc);
  float summs = 0;
  for (int64_t b = 0; b < nb; ++b) summs = std::fma(h2f(w[b].m), x[b].s, summs);
  return hsum8(acc) + summs;
}

float vec_dot_q8_0(const BlockQ8_0* w, const ActBlock* x, int64_t nb) {
  float acc[8] = {};
  accumulate_q8(
      x, nb, [&](int64_t b, int e) { return int(w[b].qs[e]); },
      [&](int64_t b) { return h2f(w[b].d); }, acc);
  return hsum8(acc);
}

float vec_dot_q4_k(const BlockQ4_K* w, const BlockQ8_K* x, int64_t nb) {
  float sum = 0;
  for (int64_t i = 0; i < nb; ++i) {
    int isum = 0, msum = 0;
    for (int j = 0; j < 8; ++j) {
      uint8_t sc, m;
      q4k_scale_min(w[i].scales, j, &sc, &m);
      const uint8_t* q = w[i].qs + 32 * (j / 2);
      const int8_t* y = x[i].qs + 32 * j;
      int dot = 0;
      for (int l = 0; l < 32; ++l) dot += ((j & 1) ? q[l] >> 4 : q[l] & 0xf) * y[l];
      isum += sc * dot;
      msum += m * (x[i].bsums[2 * j] + x[i].bsums[2 * j + 1]);
    }
    sum += h2f(w[i].d) * x[i].d * float(isum) - h2f(w[i].dmin) * x[i].d * float(msum);
  }
  return sum;
}

float vec_dot_q6_k(const BlockQ6_K* w, const BlockQ8_K* x, int64_t nb) {
  float sum = 0;
  int8_t q[kQkK];
  for (int64_t i = 0; i < nb; ++i) {
    q6k_values(w[i], q);
    int isum = 0;
    for (int g = 0; g < kQkK / 16; ++g) {
      int dot = 0;
      for (int l = 0; l < 16; ++l) dot += q[g * 16 + l] * x[i].qs[g * 16 + l];
      isum += w[i].scales[g] * dot;
    }
    sum += h2f(w[i].d) * x[i].d * float(isum);
  }
  return sum;
}

float vec_dot_f32(const float* w, const float* x, int64_t n) {
  float sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += w[i] * x[i];
  return sum;
}

float vec_dot_f16(const uint16_t* w, const float* x, int64_t n) {
  float sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += fp16_to_f32(w[i]) * x[i];
  return sum;
}

float vec_dot_bf16(const uint16_t* w, const float* x, int64_t n) {
  float sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += bf16_to_f32(w[i]) * x[i];
  return sum;
}

}  // namespace ds::cpu
