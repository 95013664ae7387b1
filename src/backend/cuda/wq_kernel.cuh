// The tensor-core kernel behind gemm_wq.cuh (dense) and moe_wq.cu (experts); device code only.
//
// A CTA (4 warps) owns kBN = 128 weight rows (gate + up: 64 rows of each) and up to BT tokens
// (64; 8 or 16 for decode steps: less shared memory and fewer registers, so 4-5 CTAs share an
// SM and hide the loads' latency), and walks K one 128-group per pipeline stage (kStages
// deep, cp.async). Warp w holds row blocks of 16; lane (g = lane / 4, t = lane % 4) of a
// group reads 16-byte chunk t of its rows (real k 32t .. 32t + 31) and, for k32 step p, feeds
// real k 32t + 8p .. + 7 into two mmas. The token side uses the same permutation of k, so the
// products are the true ones. W4A16 also pairs the codes of each 8-k chunk as (k, k + 4)
// (two per 32-bit lop3, see dequant8_w4): its activations are staged in that order
// (w4_stage_pos), by the producers of the BF16 rows. FP8W's products take FP16 activations
// (kF16Act): its staged rows hold FP16 bits, and its fragments go to FP16 mmas.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "backend/cuda/gemm_wq.cuh"
#include "backend/cuda/mma_ptx.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/fp8w.h"
#include "backend/w4a16.h"

namespace ds::cuda::wqk {

constexpr int kThreads = 128;
constexpr int kWarps = 4;
constexpr int kBN = 128;  // weight rows per CTA
constexpr int kRM = 2;    // 16-row blocks per warp
constexpr int kBT = 64;   // tokens per CTA (prefill); decode variants take 8 or 16
// 128-k groups per pipeline stage. The decode variants' loop costs about the same per stage
// (wait, barrier, a chain of mmas per group) whatever the stage's bytes: on the H200 (a64764e)
// a dense W4A16 GEMM at M = 8 took about as long as the FP8W one with twice its bytes (V2.5
// o_proj 37.3 against 46.4 us). So W4A16's decode variants take two groups a stage (16 KB of
// codes; one scale word per row holds both groups' scales) and FP8W's 8-token variant two
// (32 KB, as BF16's one), each group with its own chain of mmas: W4A16's MoE at T = 8 went
// 228.8 -> 180.2 us (76b5847). A group's products are summed and scaled as with one group a
// stage (group after group into acc), so the bits do not change. A stage starts at a group
// that is a multiple of the count.
template <WqFormat F, int BT>
constexpr int kGpsOf = (F == WqFormat::W4A16 && BT <= 16) || (F == WqFormat::FP8W && BT <= 8) ? 2
                                                                                              : 1;
// Pipeline depth, so that 2-3 CTAs fit an SM: 3 stages of BF16 (32 KB of weights) or two-group
// W4A16 (16 KB), 2 of two-group FP8W (32 KB), else 4. (Four-group W4A16 stages, 32 KB in 2
// stages, were slower: its MoE at T = 8 182 -> 196 us, W5 326 -> 306 tok/s; H200, 2f260e3.)
template <WqFormat F, int BT>
constexpr int kStagesOf = (F == WqFormat::FP8W && kGpsOf<F, BT> == 2)   ? 2
                          : (F == WqFormat::BF16 || kGpsOf<F, BT> == 2) ? 3
                                                                        : 4;
// Splits of K start at a multiple of this: the most groups any decode variant of F stages at
// once, so every variant (and so every M up to kWqSplitMaxM) splits alike.
template <WqFormat F>
constexpr int kSplitUnitOf = kGpsOf<F, 8> > kGpsOf<F, 16> ? kGpsOf<F, 8> : kGpsOf<F, 16>;
// Scale words per row and stage (W4A16 packs two groups' scales in a word).
template <WqFormat F, int BT>
constexpr int kSwOf = F == WqFormat::BF16    ? 0
                      : F == WqFormat::W4A16 ? (kGpsOf<F, BT> + 1) / 2
                                             : kGpsOf<F, BT>;
constexpr int kGroup = 128;
constexpr int kTokRow = kGroup * 2;  // staged bytes per token row (BF16)

template <WqFormat F>
struct Fmt;
template <>
struct Fmt<WqFormat::W4A16> {
  static constexpr int kRowBytes = 64;  // codes of one group
  static __device__ __forceinline__ int64_t code_off(int64_t g) { return g * 64; }
  static __device__ __forceinline__ int64_t code_limit(int64_t K) { return K / 2; }
  // The 4-byte word holding group g's BF16 scale (group pairs share one; in-bounds by padding).
  static __device__ __forceinline__ int64_t scale_off(int64_t K, int64_t g) {
    return K / 2 + 4 * (g / 2);
  }
  static __device__ __forceinline__ float scale(uint32_t word, int64_t g) {
    return __uint_as_float(((g & 1) ? (word >> 16) : (word & 0xffffu)) << 16);
  }
};
template <>
struct Fmt<WqFormat::FP8W> {
  static constexpr int kRowBytes = 128;
  static __device__ __forceinline__ int64_t code_off(int64_t g) { return g * 128; }
  static __device__ __forceinline__ int64_t code_limit(int64_t K) { return fp8w::code_bytes(K); }
  static __device__ __forceinline__ int64_t scale_off(int64_t K, int64_t g) {
    return fp8w::code_bytes(K) + 4 * g;
  }
  static __device__ __forceinline__ float scale(uint32_t word, int64_t) {
    return __uint_as_float(word);
  }
};

template <>
struct Fmt<WqFormat::BF16> {
  static constexpr int kRowBytes = 256;  // one group of 128 BF16 values, no scale
  static __device__ __forceinline__ int64_t code_off(int64_t g) { return g * 256; }
  static __device__ __forceinline__ int64_t code_limit(int64_t K) { return K * 2; }
};

template <WqFormat F, int BT>
constexpr uint32_t kStageA = uint32_t(kBN) * uint32_t(Fmt<F>::kRowBytes) * uint32_t(kGpsOf<F, BT>);
template <WqFormat F, int BT>
constexpr uint32_t kStageS = uint32_t(kBN) * 4 * kSwOf<F, BT>;
// Token rows staged as F32 (XF: the dense decode variants read x as it is and round each value
// to BF16 where they build the mma fragment, so no conversion pass runs before them).
constexpr int kTokRowF32 = kGroup * 4;
template <WqFormat F, int BT, bool XF = false>
constexpr uint32_t kStageBytes = kStageA<F, BT> + kStageS<F, BT> +
                                 uint32_t(kGpsOf<F, BT>) * uint32_t(BT) *
                                     uint32_t(XF ? kTokRowF32 : kTokRow);
template <WqFormat F, int BT, bool XF = false>
constexpr size_t kSmem = size_t(kStagesOf<F, BT>) * kStageBytes<F, BT, XF>;

// CTAs per SM the register budget is cut for: decode variants are latency-bound, so they keep
// as many CTAs resident as their shared memory allows (with F32 token rows, the larger), up to
// 4 (at 5, 96 registers, W4A16's one-group kernel serialized its dequantization: its MoE at
// T = 8 went 95 -> 106 us on the H200). BF16: 2 (1 for prefill tiles).
template <WqFormat F, int BT>
constexpr int min_ctas_of() {
  if constexpr (BT > 16) return 1;
  if constexpr (F == WqFormat::BF16) return 2;
  constexpr size_t per_sm = 228 * 1024, reserved = 1024;  // sm_90 shared memory per SM, per CTA
  constexpr int fit = int(per_sm / (kSmem<F, BT, true> + reserved));
  return fit < 1 ? 1 : fit > 4 ? 4 : fit;
}

// Where element e (0..7) of each aligned 8-k chunk of a W4A16 activation row is staged: the
// codes pair as (k, k + 4), so the row is x0 x4 x1 x5 x2 x6 x3 x7 per chunk.
__host__ __device__ __forceinline__ int w4_stage_pos(int e) {
  return 2 * (e & 3) + (e >> 2);
}
// Column of element k of a K-wide activation row as staged for format F.
template <WqFormat F>
__host__ __device__ __forceinline__ int64_t staged_col(int64_t k) {
  return F == WqFormat::W4A16 ? (k & ~int64_t(7)) + w4_stage_pos(int(k & 7)) : k;
}

// Token rows are 16 chunks; lanes (g, t) of step p read chunk 4t + p of row g: the eight
// lanes of a phase (rows 2i, 2i + 1; t = 0..3) land in eight different 16-byte bank groups.
__device__ __forceinline__ int b_chunk(int r, int c) {
  return c ^ (((c >> 3) & 1) << 1) ^ (r & 1);
}
// Physical 16-byte chunk of weight-row chunk c of a stage of G groups (FP8W rows, 8 chunks a
// group: flip by row parity so the two rows one phase reads sit in different banks; two-group
// W4A16 rows too, whose phases read chunks 4u .. 4u + 3 of two rows; BF16 rows are read like
// token rows).
template <WqFormat F, int G = 1>
__device__ __forceinline__ int a_chunk(int r, int c) {
  if constexpr (F == WqFormat::W4A16) return G == 2 ? c ^ ((r & 1) << 2) : c;
  return F == WqFormat::FP8W ? (c ^ (r & 1)) : b_chunk(r, c);
}

// Physical 16-byte unit of unit u (4 floats) of F32 token row r: lanes (g, t) of step p read
// units 8t + 2p + h of rows 2i, 2i + 1 in one phase, so t and the row's parity pick eight
// different bank groups.
__device__ __forceinline__ int f32_unit(int r, int u) {
  return u ^ ((u >> 2) & 6) ^ (r & 1);
}

__device__ __forceinline__ uint32_t bf16x2_bits(float lo, float hi) {
  const __nv_bfloat162 b = __floats2bfloat162_rn(lo, hi);  // lo in the low half, as staged
  return *reinterpret_cast<const uint32_t*>(&b);
}

// FP8W's activations are FP16, not BF16: an e4m3 pair becomes an FP16 pair in one cvt (exact;
// e4m3 fits FP16), where a BF16 pair took four instructions through F32 (W1f +1.5% on the H200,
// c910aba against cef1370: the FP8W MoE is not bound by its issued instructions). FP16 keeps 11
// significant bits to BF16's 8; its range ends at 65504, so values are clamped there first
// (finite, never inf).
template <WqFormat F>
constexpr bool kF16Act = F == WqFormat::FP8W;
constexpr float kF16Max = 65504.0f;
__device__ __forceinline__ float f16_clamp(float v) {
  return fminf(fmaxf(v, -kF16Max), kF16Max);  // NaN comes out as a bound: never in practice
}
__device__ __forceinline__ uint32_t f16x2_bits(float lo, float hi) {
  const __half2 h = __floats2half2_rn(f16_clamp(lo), f16_clamp(hi));  // lo in the low half
  return *reinterpret_cast<const uint32_t*>(&h);
}
// Two activations as the mma operand of format F (low half first).
template <WqFormat F>
__device__ __forceinline__ uint32_t act2_bits(float lo, float hi) {
  if constexpr (kF16Act<F>)
    return f16x2_bits(lo, hi);
  else
    return bf16x2_bits(lo, hi);
}
// One activation as format F stages it (the 16 bits of a staged row).
template <WqFormat F>
__device__ __forceinline__ uint16_t act_bits(float v) {
  if constexpr (kF16Act<F>)
    return __half_as_ushort(__float2half_rn(f16_clamp(v)));
  else
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
}

__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 4 : 0));
}

__device__ __forceinline__ uint32_t lop3_and_or(uint32_t a, uint32_t mask, uint32_t bits) {
  uint32_t r;  // (a & mask) | bits in one instruction
  asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(r) : "r"(a), "r"(mask), "r"(bits));
  return r;
}

// Eight int4 codes (k order, low nibble first) -> four BF16x2 of (code - 8), exact: pair q
// holds codes (q, q + 4), nibbles q and q + 4 of w, which sit 16 bits apart, so one shift and
// one lop3 place both in the mantissas of bf16 128 (128 + code is exact), and one subtraction
// removes 136.
__device__ __forceinline__ void dequant8_w4(uint32_t w, uint32_t (&o)[4]) {
  const __nv_bfloat162 bias = __floats2bfloat162_rn(136.0f, 136.0f);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const uint32_t x = lop3_and_or(w >> (4 * q), 0x000f000fu, 0x43004300u);
    __nv_bfloat162 h = *reinterpret_cast<const __nv_bfloat162*>(&x);
    h = __hsub2(h, bias);
    o[q] = *reinterpret_cast<const uint32_t*>(&h);
  }
}
// The e4m3 codes in the low 16 bits of w (low byte first) as two floats, exactly (e4m3 fits
// f16; the BF16 expansion, wq_dequant.cu).
__device__ __forceinline__ float2 e4m3x2_to_float2(uint32_t w) {
  const auto pair = static_cast<__nv_fp8x2_storage_t>(w & 0xffffu);
  return __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3)));
}
// The e4m3 codes in the low 16 bits of w (low byte first) as an FP16 pair, exactly (one
// cvt.rn.f16x2.e4m3x2 on sm_89 and later).
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t w) {
  const auto pair = static_cast<__nv_fp8x2_storage_t>(w & 0xffffu);
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3);
  return uint32_t(h.x) | (uint32_t(h.y) << 16);
}
// Eight e4m3 codes (two words, k order) -> four FP16x2, exact. (Into BF16 it took four
// instructions a pair, through F32; an integer form, sign and 7 bits shifted into a BF16 then
// one exact multiply by 2^120, five.)
__device__ __forceinline__ void dequant8_f8(uint32_t lo, uint32_t hi, uint32_t (&o)[4]) {
#pragma unroll
  for (int q = 0; q < 4; ++q) o[q] = e4m3x2_to_f16x2((q < 2 ? lo : hi) >> (16 * (q & 1)));
}

// What a CTA works on: weight rows (A) and token rows (B, BF16, ld elements, k >= kp zero).
struct CtaJob {
  const uint8_t* w0;       // rows [0, rows0) of the first matrix
  const uint8_t* w1;       // gate/up: up's rows (CTA rows kBN/2..), else nullptr
  int64_t w_stride;        // bytes
  int rows;                // valid rows in each matrix from the CTA's first
  const __nv_bfloat16* x;  // BF16 (FP8W: FP16) rows as staged (k >= kp zero); or, for XF,
  const float* xf;         // F32 rows as they are (K a multiple of 4, rows 16-byte aligned);
  const int* xrow;         // run_cta<..., true, true>: token r is row xrow[r] of xf
  int64_t ldx;             // elements
  int kp;                  // valid (padded) activation columns
  int tokens;              // valid tokens (<= kBT)
  int64_t K;               // weight columns
  int g_begin, g_end;
};

// Accumulates acc[i][j][*] (row block i of the warp, token block j) for one CtaJob. Rows of the
// CTA: gate/up (w1 != nullptr) puts 64 rows of w0 then 64 of w1, and warp w's block i is rows
// (i * 64 + w * 16) so both live in the same thread; otherwise warp w owns rows w * 32 + 16 i.
template <WqFormat F>
__device__ __forceinline__ int warp_row(bool gate_up, int warp, int i) {
  return gate_up ? i * (kBN / 2) + warp * 16 : warp * 32 + i * 16;
}

// Calls f(row, tok, v) for each value v of run_cta's acc without gate/up, at row and token
// (from the CTA's first) that the thread's fragment holds.
template <WqFormat F, int TN, typename Fn>
__device__ __forceinline__ void for_each_out(const float (&acc)[kRM][TN][4], Fn&& f) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < kRM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q)
        f(warp_row<F>(false, warp, i) + g + 8 * (q >> 1), j * 8 + 2 * t + (q & 1), acc[i][j][q]);
}

// Calls f(i, j, q) for the accumulator fragments of the token blocks with work (j < tn), unrolled.
template <int TN, typename Fn>
__device__ __forceinline__ void for_live_frags(int tn, Fn&& f) {
#pragma unroll
  for (int i = 0; i < kRM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j)
      if (j < tn) {
#pragma unroll
        for (int q = 0; q < 4; ++q) f(i, j, q);
      }
}

// kEarly: the weights (codes and scales) of the first kStages - 1 stages are asked for before
// pdl::enter(), which run_cta calls, and the token rows after it: the caller's job must not
// depend on what the kernel ahead writes (pdl.cuh), and the caller must not call enter() itself.
template <WqFormat F, int BT, bool XF = false, bool XI = false, bool kEarly = false>
__device__ void run_cta(const CtaJob& jb, uint8_t* smem, float (&acc)[kRM][BT / 8][4]) {
  static_assert(XF || !XI, "indexed token rows are F32");
  static_assert(!(kEarly && XI), "the token indices come from the lists, after the wait");
  using Fm = Fmt<F>;
  constexpr bool kBf16 = F == WqFormat::BF16;  // no scales: products go straight into acc
  constexpr int kStages = kStagesOf<F, BT>;
  constexpr int kGps = kGpsOf<F, BT>;  // groups per stage
  constexpr int kSw = kSwOf<F, BT>;    // scale words per row and stage
  constexpr int kTN = BT / 8;
  constexpr uint32_t kStage = kStageBytes<F, BT, XF>;
  constexpr uint32_t kSA = kStageA<F, BT>;
  constexpr int kTokBytes = XF ? kTokRowF32 : kTokRow;      // staged bytes per token row and group
  constexpr uint32_t kTokGroup = uint32_t(BT) * kTokBytes;  // a group's token rows in a stage
  constexpr int kXBytes = XF ? 4 : 2;                       // bytes per element of x
  constexpr int kRowB = Fm::kRowBytes * kGps;               // weight bytes per row and stage
  constexpr int kCa = kRowB / 16;                           // weight chunks per row and stage
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const bool gate_up = jb.w1 != nullptr;
  const uint32_t s0 = ptx::smem_u32(smem);
  const int64_t climit = Fm::code_limit(jb.K);
  // Each thread's share of a stage, fixed over the groups (so a group's copies are an offset
  // add each): weight chunk c_a of rows r0 + m * kRowStep (m < kCa; gate/up: the first half
  // from w0, the second from w1), the scale word of row tid, and token chunks of rows
  // tr0 + m * kTokStep. The steps are even, so each row keeps r0's chunk swizzle.
  constexpr int kRowStep = kThreads / kCa;
  constexpr int kTokChunks = kTokBytes / 16;  // 16-byte units per row
  constexpr int kTokStep = kThreads / kTokChunks;
  const int c_a = tid % kCa, r0 = tid / kCa;
  const int64_t w_step = int64_t(kRowStep) * jb.w_stride;
  const uint8_t* wa0 = jb.w0 + int64_t(r0) * jb.w_stride + 16 * c_a;
  const uint8_t* wa1 = gate_up ? jb.w1 + int64_t(r0) * jb.w_stride + 16 * c_a : wa0;
  uint32_t rows_ok = 0;  // bit m: row r0 + m * kRowStep (of its matrix) exists
#pragma unroll
  for (int m = 0; m < kCa; ++m) {
    const int rr = r0 + (gate_up ? m % (kCa / 2) : m) * kRowStep;
    rows_ok |= uint32_t(rr < jb.rows) << m;
  }
  const uint32_t a_dst = uint32_t(r0 * kRowB + a_chunk<F, kGps>(r0, c_a) * 16);
  const uint8_t* s_src = nullptr;  // row tid's scale words (group 0's)
  bool s_ok = false;
  if constexpr (!kBf16) {
    const int rr = gate_up ? tid % (kBN / 2) : tid;
    const uint8_t* base = gate_up && tid >= kBN / 2 ? jb.w1 : jb.w0;
    s_ok = rr < jb.rows;
    s_src = s_ok ? base + int64_t(rr) * jb.w_stride + Fm::scale_off(jb.K, 0) : base;
  }
  const int tc = tid % kTokChunks, tr0 = tid / kTokChunks;
  const int64_t x_k0 = int64_t(16 / kXBytes) * tc;  // the chunk's first k in a group
  constexpr int kTokRows = BT / kTokStep;           // token rows a thread copies
  uint32_t b_dst;
  const uint8_t* x_src;
  const uint8_t* x_row[XI ? kTokRows : 1];  // XI: each of them through jb.xrow
  if constexpr (XF) {
    b_dst = uint32_t(tr0 * kTokBytes + f32_unit(tr0, tc) * 16);
    x_src = reinterpret_cast<const uint8_t*>(jb.xf + tr0 * jb.ldx + x_k0);
    if constexpr (XI) {
#pragma unroll
      for (int m = 0; m < kTokRows; ++m) {
        const int r = tr0 + m * kTokStep;
        x_row[m] =
            r < jb.tokens
                ? reinterpret_cast<const uint8_t*>(jb.xf + int64_t(jb.xrow[r]) * jb.ldx + x_k0)
                : x_src;
      }
    }
  } else {
    b_dst = uint32_t(tr0 * kTokBytes + b_chunk(tr0, tc) * 16);
    x_src = reinterpret_cast<const uint8_t*>(jb.x + tr0 * jb.ldx + x_k0);
  }
  const int64_t x_step = int64_t(kTokStep) * jb.ldx * kXBytes;  // bytes between its rows
  // Where the thread's token row m starts (XI: the pointer looked up above).
  auto x_row_src = [&](int m) {
    if constexpr (XI)
      return x_row[m];
    else
      return x_src + m * x_step;
  };
  const int64_t x_limit = XF ? jb.K : jb.kp;  // zeros from here (K for F32 rows, kp staged)
  // Stage kt holds groups g_begin + kGps * kt, + 1 ...: codes of every group (kGps * 128 k of
  // each row, in one span), one scale word per row (W4A16's holds the group pair's scales),
  // and the token rows of each group in turn. load_w copies a stage's weights (codes and scale
  // words) into buffer `stage`, load_x its token rows.
  auto load_w = [&](int stage, int kt) {
    const int64_t gi = jb.g_begin + int64_t(kGps) * kt;
    const uint32_t sa = s0 + stage * kStage, ss = sa + kSA;
    const int64_t goff = Fm::code_off(gi);
    const bool g_ok = goff + 16 * c_a < climit;
#pragma unroll
    for (int m = 0; m < kCa; ++m) {
      const bool ok = g_ok && (rows_ok >> m & 1u);
      const uint8_t* row =
          gate_up && m >= kCa / 2 ? wa1 + (m - kCa / 2) * w_step : wa0 + m * w_step;
      ptx::cp_async16(sa + a_dst + uint32_t(m * kRowStep * kRowB), ok ? row + goff : jb.w0, ok);
    }
    if constexpr (!kBf16) {
      // Word w of the stage's scales (rows [w][tid]); one past the last group is zero-filled.
      const uint8_t* src = s_src + (Fm::scale_off(jb.K, gi) - Fm::scale_off(jb.K, 0));
#pragma unroll
      for (int w = 0; w < kSw; ++w) {
        const bool ok = s_ok && gi + (F == WqFormat::W4A16 ? 2 * w : w) < jb.g_end;
        cp_async4(ss + (w * kBN + tid) * 4, ok ? src + 4 * w : s_src, ok);
      }
    }
  };
  auto load_x = [&](int stage, int kt) {
    const int64_t gi = jb.g_begin + int64_t(kGps) * kt;
    const uint32_t sb = s0 + stage * kStage + kSA + kStageS<F, BT>;
#pragma unroll
    for (int u = 0; u < kGps; ++u) {
      const int64_t k = (gi + u) * kGroup + x_k0;
      const bool k_ok = k < x_limit;
      const int64_t x_off = (gi + u) * kGroup * kXBytes;
#pragma unroll
      for (int m = 0; m < kTokRows; ++m) {
        if (tr0 + m * kTokStep >= jb.tokens) break;
        ptx::cp_async16(sb + u * kTokGroup + b_dst + uint32_t(m * kTokStep * kTokBytes),
                        k_ok ? x_row_src(m) + x_off : x_src, k_ok);
      }
    }
  };
#pragma unroll
  for (int i = 0; i < kRM; ++i)
#pragma unroll
    for (int j = 0; j < kTN; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.0f;
  const int KT = (jb.g_end - jb.g_begin + kGps - 1) / kGps;  // stages
  const int tn = (jb.tokens + 7) / 8;                        // token blocks with work
  // The prologue: stages 0 .. kStages - 2, one commit group each (kEarly: every early weight
  // copy lands in group 0, which the first wait then covers).
  if constexpr (kEarly) {
#pragma unroll 1
    for (int s = 0; s < kStages - 1; ++s)
      if (s < KT) load_w(s, s);
    pdl::enter();
  }
#pragma unroll 1
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < KT) {
      if constexpr (!kEarly) load_w(s, s);
      load_x(s, s);
    }
    ptx::cp_async_commit();
  }
#pragma unroll 1
  for (int kt = 0; kt < KT; ++kt) {
    ptx::cp_async_wait<kStages - 2>();
    __syncthreads();
    if (kt + kStages - 1 < KT) {
      load_w((kt + kStages - 1) % kStages, kt + kStages - 1);
      load_x((kt + kStages - 1) % kStages, kt + kStages - 1);
    }
    ptx::cp_async_commit();
    const int stage = kt % kStages;
    const uint8_t* sa = smem + stage * kStage;
    const auto* ss = reinterpret_cast<const uint32_t*>(sa + kSA);
    const uint8_t* sb0 = sa + kSA + kStageS<F, BT>;
    const int64_t g0 = jb.g_begin + int64_t(kGps) * kt;
    const int groups = min(kGps, jb.g_end - int(g0));  // of this stage (a missing one reads zeros)
    constexpr int kGc = Fm::kRowBytes / 16;            // a group's chunks of a weight row
    // Raw codes of rows (block i, half h: row g + 8h) for group u: W4 one chunk, FP8 two (BF16
    // reads its chunk of each step in the step).
    uint4 raw[kGps][kRM][2][F == WqFormat::FP8W ? 2 : 1];
    float sc[kGps][kRM][2];
    if constexpr (!kBf16) {
#pragma unroll
      for (int u = 0; u < kGps; ++u)
#pragma unroll
        for (int i = 0; i < kRM; ++i)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = warp_row<F>(gate_up, warp, i) + g + 8 * h;
            const uint8_t* row = sa + r * kRowB;
            if constexpr (F == WqFormat::FP8W) {
#pragma unroll
              for (int c = 0; c < 2; ++c)
                raw[u][i][h][c] = *reinterpret_cast<const uint4*>(
                    row + a_chunk<F, kGps>(r, kGc * u + 2 * t + c) * 16);
            } else {
              raw[u][i][h][0] =
                  *reinterpret_cast<const uint4*>(row + a_chunk<F, kGps>(r, kGc * u + t) * 16);
            }
            sc[u][i][h] = Fm::scale(ss[(F == WqFormat::W4A16 ? u / 2 : u) * kBN + r], g0 + u);
          }
    }
    float part[kGps][kRM][kTN][4];  // each group's sums; token blocks >= tn stay untouched
    if constexpr (!kBf16)
#pragma unroll
      for (int u = 0; u < kGps; ++u)
        for_live_frags<kTN>(tn, [&](int i, int j, int q) { part[u][i][j][q] = 0.0f; });
#pragma unroll
    for (int p = 0; p < 4; ++p) {
#pragma unroll
      for (int u = 0; u < kGps; ++u) {
        float(*sum)[kTN][4] = kBf16 ? acc : part[u];  // where group u's products go
        const uint8_t* sb = sb0 + u * kTokGroup;
        uint32_t a[kRM][2][4];  // [block][mma of the pair][fragment]
#pragma unroll
        for (int i = 0; i < kRM; ++i) {
          uint32_t d[2][4];  // rows g and g + 8: real k 32t + 8p + 2q, + 1 in d[h][q]
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            if constexpr (kBf16) {
              const int r = warp_row<F>(gate_up, warp, i) + g + 8 * h;
              const uint4 v =
                  *reinterpret_cast<const uint4*>(sa + r * kRowB + a_chunk<F>(r, 4 * t + p) * 16);
              d[h][0] = v.x, d[h][1] = v.y, d[h][2] = v.z, d[h][3] = v.w;
            } else if constexpr (F == WqFormat::FP8W) {
              const uint4 v = raw[u][i][h][p / 2];
              dequant8_f8((p & 1) ? v.z : v.x, (p & 1) ? v.w : v.y, d[h]);
            } else {
              const uint4 v = raw[u][i][h][0];
              dequant8_w4(p == 0 ? v.x : p == 1 ? v.y : p == 2 ? v.z : v.w, d[h]);
            }
          }
#pragma unroll
          for (int m = 0; m < 2; ++m) {
            a[i][m][0] = d[0][2 * m];
            a[i][m][1] = d[1][2 * m];
            a[i][m][2] = d[0][2 * m + 1];
            a[i][m][3] = d[1][2 * m + 1];
          }
        }
#pragma unroll
        for (int j = 0; j < kTN; ++j) {
          if (j >= tn) break;
          const int r = j * 8 + g;
          uint4 b;
          if constexpr (XF) {  // chunk 4t + p is units 8t + 2p, + 1; rounded as to_bf16 would
            const uint8_t* row = sb + r * kTokBytes;
            const float4 lo =
                *reinterpret_cast<const float4*>(row + f32_unit(r, 8 * t + 2 * p) * 16);
            const float4 hi =
                *reinterpret_cast<const float4*>(row + f32_unit(r, 8 * t + 2 * p + 1) * 16);
            if constexpr (F == WqFormat::W4A16) {  // x0 x4 x1 x5 x2 x6 x3 x7 (w4_stage_pos)
              b = make_uint4(bf16x2_bits(lo.x, hi.x), bf16x2_bits(lo.y, hi.y),
                             bf16x2_bits(lo.z, hi.z), bf16x2_bits(lo.w, hi.w));
            } else {
              b = make_uint4(act2_bits<F>(lo.x, lo.y), act2_bits<F>(lo.z, lo.w),
                             act2_bits<F>(hi.x, hi.y), act2_bits<F>(hi.z, hi.w));
            }
          } else {
            b = *reinterpret_cast<const uint4*>(sb + r * kTokBytes + b_chunk(r, 4 * t + p) * 16);
          }
#pragma unroll
          for (int i = 0; i < kRM; ++i) {
            if constexpr (kF16Act<F>) {
              ptx::mma_f16(sum[i][j], a[i][0], b.x, b.y);
              ptx::mma_f16(sum[i][j], a[i][1], b.z, b.w);
            } else {
              ptx::mma_bf16(sum[i][j], a[i][0], b.x, b.y);
              ptx::mma_bf16(sum[i][j], a[i][1], b.z, b.w);
            }
          }
        }
      }
    }
    if constexpr (!kBf16)
#pragma unroll
      for (int u = 0; u < kGps; ++u)  // group after group, as with one group a stage
        if (u < groups)
          for_live_frags<kTN>(tn, [&](int i, int j, int q) {
            acc[i][j][q] = fmaf(part[u][i][j][q], sc[u][i][q >> 1], acc[i][j][q]);
          });
  }
  ptx::cp_async_wait<0>();
}

}  // namespace ds::cuda::wqk
