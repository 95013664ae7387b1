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
#include <type_traits>
#include <utility>

#include "backend/cuda/gemm_wq.cuh"
#include "backend/cuda/mma_ptx.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/wq_copy_plan.h"
#include "backend/fp8w.h"
#include "backend/w4a16.h"

namespace ds::cuda::wqk {

constexpr int kWarps = 4;  // kThreads / 32; kThreads, kBN: wq_copy_plan.h
constexpr int kRM = 2;     // 16-row blocks per warp
constexpr int kBT = 64;    // tokens per CTA (prefill); decode variants take 8 or 16
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
constexpr int kGpsOf = (wq_w4(F) && BT <= 16) || (F == WqFormat::FP8W && BT <= 8) ? 2 : 1;
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
constexpr int kSwOf = F == WqFormat::BF16 ? 0
                      : wq_w4(F)          ? (kGpsOf<F, BT> + 1) / 2
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
  return wq_w4(F) ? (k & ~int64_t(7)) + w4_stage_pos(int(k & 7)) : k;
}

// b_chunk, a_chunk (the weight and token rows' chunk swizzles): wq_copy_plan.h.

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
// significant bits to BF16's 8; its range ends at 65504, so finite values past it become
// +-65504 (cvt's .satfinite: the same bits as clamping first, in the one instruction, where
// the clamps took 4 of FP8W's ~700 a stage; a NaN stays NaN).
template <WqFormat F>
constexpr bool kF16Act = F == WqFormat::FP8W;
__device__ __forceinline__ uint32_t f16x2_bits(float lo, float hi) {
  uint32_t r;  // lo in the low half
  asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ uint16_t f16_bits(float v) {
  uint16_t r;
  asm("cvt.rn.satfinite.f16.f32 %0, %1;\n" : "=h"(r) : "f"(v));
  return r;
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
    return f16_bits(v);
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

// Keeps v in a register as an opaque value: the compiler can neither fold it nor re-derive it
// from what it was computed of (no instruction is emitted).
__device__ __forceinline__ void pin_reg(uint32_t& v) {
  asm volatile("" : "+r"(v));
}

// f(std::integral_constant<int, I>{}) for I = 0 .. N - 1: compile-time indices, so copies can
// take their offsets as immediates.
template <int N, typename Fn>
__device__ __forceinline__ void each_index(Fn&& f) {
  [&]<int... I>(std::integer_sequence<int, I...>) {
    (f(std::integral_constant<int, I>{}), ...);
  }
  (std::make_integer_sequence<int, N>{});
}

// Zeroes a CTA's accumulators (or a stage's sums).
template <int R, int TN>
__device__ __forceinline__ void zero_frags(float (&acc)[R][TN][4]) {
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.0f;
}

// The A fragments of an mma pair (k16 halves m = 0, 1) from the dequantized values of rows g
// (d[0]) and g + 8 (d[1]): d[h][q] holds real k 32t + 8p + 2q, + 1.
__device__ __forceinline__ void pair_frags(const uint32_t (&d)[2][4], uint32_t (&a)[2][4]) {
#pragma unroll
  for (int m = 0; m < 2; ++m) {
    a[m][0] = d[0][2 * m];
    a[m][1] = d[1][2 * m];
    a[m][2] = d[0][2 * m + 1];
    a[m][3] = d[1][2 * m + 1];
  }
}

// A stage's token-row copies: for each of the thread's rows m (kStep rows apart, staged kRowB
// bytes each; only where on[m]) and each of G groups u (kGroupB bytes of the stage apart), the
// 16-byte chunk at src[m] + k + u * 128 elements of kXB bytes into sb; zeros past x_end.
template <int G, int kRows, int kStep, int kRowB, int kXB, uint32_t kGroupB>
__device__ __forceinline__ void copy_token_rows(uint32_t sb, const uint8_t* const (&src)[kRows],
                                                const bool (&on)[kRows], int k, int x_end) {
  uint32_t bytes[G];
#pragma unroll
  for (int u = 0; u < G; ++u) bytes[u] = k + u * kGroup < x_end ? 16u : 0u;
  each_index<kRows>([&](auto mc) {
    constexpr int m = decltype(mc)::value;
    const uint8_t* from = src[m] + int64_t(k) * kXB;
    each_index<G>([&](auto uc) {
      constexpr int u = decltype(uc)::value;
      ptx::cp_async16_at_if<int(u * kGroupB) + m * kStep * kRowB, u * kGroup * kXB>(
          sb, from, bytes[u], on[m]);
    });
  });
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
  bool issue_first = false;  // run_cta's order of a stage: the next stage's copies first
  bool skip_scales = false;  // a probe: the scale copies read nothing (zeros; wrong sums)
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
// GU: the job is gate/up's (jb.w1 set), known where the kernel is written, so a fragment's rows
// are compile-time offsets from the thread's first.
template <WqFormat F, int BT, bool XF = false, bool XI = false, bool kEarly = false,
          bool GU = false>
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
  constexpr bool gate_up = GU;
  const uint32_t s0 = ptx::smem_u32(smem);
  const int64_t climit = Fm::code_limit(jb.K);
  // Each thread's share of a stage, fixed over the stages, so a stage's copies cost an add a
  // row: weight chunks w_copy_chunk(tid, j) of rows w_copy_row(tid, p) (wq_copy_plan.h;
  // gate/up: rows kBN / 2 .. from w1), the scale words of row tid, and token chunk tc of rows
  // tr0 + m * kTokStep. Rows past the matrix copy its last instead (what they add to is never
  // stored); token rows past the tile's tokens are not copied, as before.
  static_assert(kCa % kWThreadsPerRow == 0, "whole chunks a thread");
  constexpr int kWj = kCa / kWThreadsPerRow;  // chunks a thread copies of each of its rows
  constexpr int kTokChunks = kTokBytes / 16;  // 16-byte units per row
  constexpr int kTokStep = kThreads / kTokChunks;
  constexpr int kTokRows = BT / kTokStep;  // token rows a thread copies
  const int64_t g_code0 = Fm::code_off(jb.g_begin);
  const int last_row = max(jb.rows - 1, 0);
  const uint8_t* w_src[kWPasses];  // chunk w_copy_chunk(tid, 0) of each row, group g_begin's
#pragma unroll
  for (int p = 0; p < kWPasses; ++p) {
    const int r = w_copy_row(tid, p);
    const bool up = gate_up && r >= kBN / 2;
    const int rr = min(up ? r - kBN / 2 : r, last_row);
    w_src[p] = (up ? jb.w1 : jb.w0) + int64_t(rr) * jb.w_stride + g_code0 + 16 * (tid & 3);
  }
  uint32_t w_dst[kWj];
#pragma unroll
  for (int j = 0; j < kWj; ++j) w_dst[j] = w_copy_dst<F, kGps>(tid, j, kRowB);
  // Copy j of stage kt (bytes kt * kRowB + 64 j past w_src) holds codes while below this.
  const int w_end = int(climit - g_code0) - 16 * (tid & 3);
  const uint8_t* s_src = nullptr;  // row tid's scale words, group g_begin's
  if constexpr (!kBf16) {
    const int rr = min(gate_up ? tid % (kBN / 2) : tid, last_row);
    const uint8_t* base = gate_up && tid >= kBN / 2 ? jb.w1 : jb.w0;
    s_src = base + int64_t(rr) * jb.w_stride + Fm::scale_off(jb.K, jb.g_begin);
  }
  const int tc = tid % kTokChunks, tr0 = tid / kTokChunks;
  const int x_k0 = (16 / kXBytes) * tc;  // the chunk's first k in a group
  const uint32_t b_dst =
      uint32_t(tr0 * kTokBytes + (XF ? f32_unit(tr0, tc) : b_chunk(tr0, tc)) * 16);
  const uint8_t* x_src[kTokRows];  // token row m's chunk tc, group g_begin's
  bool x_on[kTokRows];             // row m is one of the tile's tokens (else no copy)
#pragma unroll
  for (int m = 0; m < kTokRows; ++m) {
    const int r = tr0 + m * kTokStep, rv = r < jb.tokens ? r : 0;
    x_on[m] = r < jb.tokens;
    const int64_t at = int64_t(jb.g_begin) * kGroup + x_k0;
    if constexpr (XI)
      x_src[m] = reinterpret_cast<const uint8_t*>(jb.xf + int64_t(jb.xrow[rv]) * jb.ldx + at);
    else if constexpr (XF)
      x_src[m] = reinterpret_cast<const uint8_t*>(jb.xf + rv * jb.ldx + at);
    else
      x_src[m] = reinterpret_cast<const uint8_t*>(jb.x + rv * jb.ldx + at);
  }
  // Group u of stage kt (k from (kGps kt + u) kGroup past x_src) holds values while below this;
  // zeros from there (x_limit: K for F32 rows, kp staged).
  const int x_end = int((XF ? jb.K : jb.kp) - int64_t(jb.g_begin) * kGroup) - x_k0;
  // Stage kt holds groups g_begin + kGps * kt, + 1 ...: codes of every group (kGps * 128 k of
  // each row, in one span), one scale word per row (W4A16's holds the group pair's scales),
  // and the token rows of each group in turn. load_w copies a stage's weights (codes and scale
  // words) into buffer `stage`, load_x its token rows.
  auto load_w = [&](int stage, int kt) {
    const uint32_t sa = s0 + stage * kStage, ss = sa + kSA;
    const int off = kt * kRowB;
    uint32_t bytes[kWj];  // 16, or 0 (zeros) for chunks past the codes
#pragma unroll
    for (int j = 0; j < kWj; ++j) bytes[j] = off + 64 * j < w_end ? 16u : 0u;
    each_index<kWPasses>([&](auto pc) {
      constexpr int p = decltype(pc)::value;
      const uint8_t* src = w_src[p] + off;
      each_index<kWj>([&](auto jc) {
        constexpr int j = decltype(jc)::value;
        ptx::cp_async16_at<p * kWRowsPerPass * kRowB, 64 * j>(sa + w_dst[j], src, bytes[j]);
      });
    });
    if constexpr (!kBf16) {
      // Word w of the stage's scales (rows [w][tid]); one past the last group is zero-filled.
      const int64_t gi = jb.g_begin + int64_t(kGps) * kt;
      const uint8_t* src = s_src + (Fm::scale_off(jb.K, gi) - Fm::scale_off(jb.K, jb.g_begin));
#pragma unroll
      for (int w = 0; w < kSw; ++w) {
        const bool ok = !jb.skip_scales && gi + (wq_w4(F) ? 2 * w : w) < jb.g_end;
        cp_async4(ss + (w * kBN + tid) * 4, src + 4 * w, ok);
      }
    }
  };
  auto load_x = [&](int stage, int kt) {
    copy_token_rows<kGps, kTokRows, kTokStep, kTokBytes, kXBytes, kTokGroup>(
        s0 + stage * kStage + kSA + kStageS<F, BT> + b_dst, x_src, x_on, kt * kGps * kGroup, x_end);
  };
  zero_frags(acc);
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
  // The fragment loads' offsets in a stage's buffers, formed once and pinned in registers
  // (left to itself the compiler re-derived the swizzles every stage, ~80 instructions of ~530):
  // the thread's first fragment row r_f; the others (block i, half h; token block j) are a
  // compile-time, even number of rows past it, so they keep its swizzle.
  constexpr int kGc = Fm::kRowBytes / 16;           // a group's chunks of a weight row
  constexpr int kAc = F == WqFormat::FP8W ? 2 : 1;  // chunks a group's fragment row reads
  constexpr int kAo = kBf16 ? 4 : kGps * kAc;       // BF16: one a k32 step p
  const int r_f = warp_row<F>(gate_up, warp, 0) + g;
  uint32_t a_off[kAo];  // of row r_f: [p] (BF16) or [u * kAc + c]
#pragma unroll
  for (int o = 0; o < kAo; ++o) {
    const int c = kBf16 ? 4 * t + o : kGc * (o / kAc) + (kAc == 2 ? 2 * t + o % kAc : t);
    a_off[o] = uint32_t(r_f * kRowB + a_chunk<F, kGps>(r_f, c) * 16);
    pin_reg(a_off[o]);
  }
  uint32_t b_off[4][XF ? 2 : 1];  // of token row g: step p's chunk (XF: its two F32 units)
#pragma unroll
  for (int q = 0; q < 4; ++q)
#pragma unroll
    for (int c = 0; c < (XF ? 2 : 1); ++c) {
      b_off[q][c] = uint32_t(g * kTokBytes +
                             (XF ? f32_unit(g, 8 * t + 2 * q + c) : b_chunk(g, 4 * t + q)) * 16);
      pin_reg(b_off[q][c]);
    }
  int stage = 0, next = kStages - 1;  // the buffers of stages kt and kt + kStages - 1
  // A stage: wait for its copies, then (once every warp is past the stage before, whose buffer
  // is `next`) issue the copies of stage kt + kStages - 1. With jb.issue_first the copies go
  // first: every warp past the stage before (a barrier), issue, then wait for stage kt with
  // one more group in flight, and a second barrier. The wait no longer holds up the next
  // copies: with two stages (FP8W's decode variants) the weights in flight during the wait go
  // from one stage to two. The same copies into the same buffers, the same products.
  const bool issue_first = jb.issue_first;
#pragma unroll 1
  for (int kt = 0; kt < KT; ++kt, stage = stage + 1 == kStages ? 0 : stage + 1,
           next = next + 1 == kStages ? 0 : next + 1) {
    if (!issue_first) ptx::cp_async_wait<kStages - 2>();
    __syncthreads();
    if (kt + kStages - 1 < KT) {
      load_w(next, kt + kStages - 1);
      load_x(next, kt + kStages - 1);
    }
    ptx::cp_async_commit();
    if (issue_first) {
      ptx::cp_async_wait<kStages - 1>();
      __syncthreads();
    }
    const uint8_t* sa = smem + stage * kStage;
    const auto* ss = reinterpret_cast<const uint32_t*>(sa + kSA);
    const uint8_t* sb0 = sa + kSA + kStageS<F, BT>;
    const int64_t g0 = jb.g_begin + int64_t(kGps) * kt;
    const int groups = min(kGps, jb.g_end - int(g0));  // of this stage (a missing one reads zeros)
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
            const int dr = warp_row<F>(gate_up, 0, i) + 8 * h;  // rows past r_f
#pragma unroll
            for (int c = 0; c < kAc; ++c)
              raw[u][i][h][c] =
                  *reinterpret_cast<const uint4*>(sa + a_off[u * kAc + c] + dr * kRowB);
            sc[u][i][h] = Fm::scale(ss[(wq_w4(F) ? u / 2 : u) * kBN + r_f + dr], g0 + u);
          }
    }
    // Each group's sums (token blocks >= tn are zeroed too, in a few wide moves rather than a
    // select each, and never read).
    float part[kGps][kRM][kTN][4];
    if constexpr (!kBf16)
#pragma unroll
      for (int u = 0; u < kGps; ++u) zero_frags(part[u]);
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
              const int dr = warp_row<F>(gate_up, 0, i) + 8 * h;
              const uint4 v = *reinterpret_cast<const uint4*>(sa + a_off[p] + dr * kRowB);
              d[h][0] = v.x, d[h][1] = v.y, d[h][2] = v.z, d[h][3] = v.w;
            } else if constexpr (F == WqFormat::FP8W) {
              const uint4 v = raw[u][i][h][p / 2];
              dequant8_f8((p & 1) ? v.z : v.x, (p & 1) ? v.w : v.y, d[h]);
            } else {
              const uint4 v = raw[u][i][h][0];
              const uint32_t word = p == 0 ? v.x : p == 1 ? v.y : p == 2 ? v.z : v.w;
              dequant8_w4(word, d[h]);
            }
          }
          pair_frags(d, a[i]);
        }
        // Decode tiles (kTN <= 2) test every token block against tn; wider tiles only at
        // blocks kTN / 4 and kTN / 2, so they compute 2, 4 or 8 blocks (of 8). A test at every
        // block put a branch between each block's four mmas, so the two mmas of an accumulator
        // ran back to back with nothing to hide their latency (the 64-token tile's top stall,
        // `wait`, in ncu); the blocks between two tests now interleave. A block past tn
        // multiplies stale token rows into sums that are never stored (a product's column
        // depends on its own token alone), and every accumulator takes its products in the
        // same order as before, so the bits do not change.
#pragma unroll
        for (int j = 0; j < kTN; ++j) {
          if ((kTN <= 2 || j == kTN / 4 || j == kTN / 2) && j >= tn) break;
          const uint8_t* row = sb + j * 8 * kTokBytes;  // token row j * 8 + g's, at b_off
          uint4 b;
          if constexpr (XF) {  // chunk 4t + p is units 8t + 2p, + 1; rounded as to_bf16 would
            const float4 lo = *reinterpret_cast<const float4*>(row + b_off[p][0]);
            const float4 hi = *reinterpret_cast<const float4*>(row + b_off[p][1]);
            if constexpr (wq_w4(F)) {  // x0 x4 x1 x5 x2 x6 x3 x7 (w4_stage_pos)
              b = make_uint4(act2_bits<F>(lo.x, hi.x), act2_bits<F>(lo.y, hi.y),
                             act2_bits<F>(lo.z, hi.z), act2_bits<F>(lo.w, hi.w));
            } else {
              b = make_uint4(act2_bits<F>(lo.x, lo.y), act2_bits<F>(lo.z, lo.w),
                             act2_bits<F>(hi.x, hi.y), act2_bits<F>(hi.z, hi.w));
            }
          } else {
            b = *reinterpret_cast<const uint4*>(row + b_off[p][0]);
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
