// The quantized MoE experts on the wq kernels (wq_kernel.cuh): gate + up fused with SiLU * up,
// then down, over the grouped token lists' tiles; at decode sizes both in one launch
// (ffn_fused_kernel). Behind moe_ffn's Grouped / Streamed paths (moe.cu).
#include <algorithm>
#include <cstdint>

#include "backend/cuda/common.cuh"
#include "backend/cuda/device_log.cuh"
#include "backend/cuda/device_log.h"
#include "backend/cuda/gemm_wq.cuh"
#include "backend/cuda/moe.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/switches.h"
#include "backend/cuda/wq_kernel.cuh"
#include "backend/cuda/wq_launch.cuh"
#include "core/error.h"

namespace ds::cuda {
namespace moe {
namespace {

using namespace wqk;

// The CtaJob of a tile's tokens (rows of x, K wide) against `rows` weight rows at w0 (and w1,
// gate/up), over all of K's groups.
__device__ __forceinline__ CtaJob tile_job(const Tile& tl, const uint8_t* w0, const uint8_t* w1,
                                           int64_t w_stride, int rows, const void* x, int K,
                                           bool issue_first, bool skip_scales) {
  CtaJob jb;
  jb.w0 = w0;
  jb.w1 = w1;
  jb.w_stride = w_stride;
  jb.rows = rows;
  jb.x = static_cast<const __nv_bfloat16*>(x) + int64_t(tl.begin) * K;
  jb.ldx = K;
  jb.kp = K;
  jb.tokens = tl.rows;
  jb.K = K;
  jb.g_begin = 0;
  jb.g_end = (K + kGroup - 1) / kGroup;
  jb.issue_first = issue_first;
  jb.skip_scales = skip_scales;
  return jb;
}

// Bytes between expert weight rows: ExpertPtrs counts packed formats in bytes, BF16 in elements.
template <WqFormat F>
__device__ __forceinline__ int64_t ld_bytes(int64_t ld) {
  return F == WqFormat::BF16 ? ld * 2 : ld;
}

// W4A16 stages in halves (the one-launch MoE FFN at BT = 8: DEEPSERVE_MOE_WQ_HALVES). run_cta's
// two-group stage reads 128 bytes of each of the CTA's 128 rows, a run that the DRAM serves
// worse than longer ones: StreamBench's 16 KB stages of 128 rows x 128 bytes against 64 rows x
// 256 bytes (docs/PERFORMANCE.md, forty-second section). Here stage 2j reads groups 4j .. 4j + 3
// (256 contiguous bytes) of half 0 of the rows and stage 2j + 1 the same groups of half 1, so a
// stage moves the same 16 KB of codes; its token rows are those four groups' (8 KB, read twice
// from L2). Half i is what each warp's row block i holds: gate/up's rows of w0 (i = 0) or w1;
// otherwise rows w * 32 + 16 i .. + 15 of each warp w. Each group's products are summed alone
// and folded into acc group after group, as in run_cta, so the bits are run_cta's.
constexpr int kHvGroups = 4;             // groups a stage
constexpr int kHvRows = kBN / 2;         // rows a stage
constexpr int kHvRowB = 64 * kHvGroups;  // bytes of a row a stage
constexpr int kHvStages = 3;
constexpr uint32_t kHvCodeBytes = uint32_t(kHvRows) * kHvRowB;   // a stage's codes
constexpr uint32_t kHvScaleBytes = uint32_t(kHvRows) * 4 * 2;    // two scale words a row
constexpr uint32_t kHvTokBytes = uint32_t(kHvGroups) * kTokRow;  // a token's rows a stage
template <int BT>
constexpr uint32_t kHvStageBytes = kHvCodeBytes + kHvScaleBytes + (kHvTokBytes * BT);
template <int BT>
constexpr size_t kHvSmem = size_t(kHvStages) * kHvStageBytes<BT>;

template <int BT, bool GU>
__device__ void run_cta_halves(const CtaJob& jb, uint8_t* smem, float (&acc)[kRM][BT / 8][4]) {
  constexpr WqFormat F = WqFormat::W4A16;
  using Fm = Fmt<F>;
  constexpr int kS = kHvStages, kG = kHvGroups, kRowB = kHvRowB, kTN = BT / 8;
  constexpr uint32_t kSA = kHvCodeBytes, kSS = kHvScaleBytes;
  constexpr uint32_t kTokGroup = uint32_t(BT) * kTokRow, kStage = kHvStageBytes<BT>;
  constexpr int kTokChunks = kTokRow / 16, kTokStep = kThreads / kTokChunks;
  constexpr int kTokRows = BT / kTokStep;
  static_assert(kTokRows >= 1 && BT % kTokStep == 0, "whole token rows a pass");
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const uint32_t s0 = ptx::smem_u32(smem);
  const int last_row = max(jb.rows - 1, 0);
  // The first byte of CTA row r (rows past the matrix: its last, whose sums are never stored).
  auto row_ptr = [&](int r) {
    const bool up = GU && r >= kBN / 2;
    const int rr = min(up ? r - kBN / 2 : r, last_row);
    return (up ? jb.w1 : jb.w0) + int64_t(rr) * jb.w_stride;
  };
  // The CTA row of row rl (0 .. 63) of half h.
  auto cta_row = [](int h, int rl) {
    return GU ? h * kHvRows + rl : (rl >> 4) * 32 + h * 16 + (rl & 15);
  };
  // Copies: thread tid takes chunks (tid & 3) + 4 j of rows (tid >> 2) + 32 p of the half
  // (p < 2, j < 4): a warp's copy reads 64 contiguous bytes of each of 8 rows.
  const int64_t g_code0 = Fm::code_off(jb.g_begin);
  const int rl0 = tid >> 2;    // the thread's pass-0 row
  const uint8_t* w_src[2][2];  // [half][pass]
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int p = 0; p < 2; ++p)
      w_src[h][p] = row_ptr(cta_row(h, rl0 + 32 * p)) + g_code0 + 16 * (tid & 3);
  uint32_t w_dst[4];
#pragma unroll
  for (int j = 0; j < 4; ++j)
    w_dst[j] = uint32_t(rl0 * kRowB + a_chunk<F, 2>(rl0, (tid & 3) + 4 * j) * 16);
  const int w_end = int(Fm::code_limit(jb.K) - g_code0) - 16 * (tid & 3);
  // Scale words: thread tid copies word tid >> 6 (groups 2w, 2w + 1 of the stage's four) of
  // row tid & 63 of each half.
  const int s_rl = tid & (kHvRows - 1), s_w = tid >> 6;
  const uint8_t* s_src[2];
#pragma unroll
  for (int h = 0; h < 2; ++h)
    s_src[h] = row_ptr(cta_row(h, s_rl)) + Fm::scale_off(jb.K, jb.g_begin);
  const int tc = tid % kTokChunks, tr0 = tid / kTokChunks;
  const uint32_t b_dst = uint32_t(tr0 * kTokRow + b_chunk(tr0, tc) * 16);
  const uint8_t* x_src[kTokRows];
  bool x_on[kTokRows];
#pragma unroll
  for (int m = 0; m < kTokRows; ++m) {
    const int r = tr0 + m * kTokStep, rv = r < jb.tokens ? r : 0;
    x_on[m] = r < jb.tokens;
    x_src[m] = reinterpret_cast<const uint8_t*>(jb.x + rv * jb.ldx + int64_t(jb.g_begin) * kGroup +
                                                8 * tc);
  }
  const int x_end = int(jb.kp - int64_t(jb.g_begin) * kGroup) - 8 * tc;
  // Stage kt: half kt & 1 of groups g_begin + 4 (kt >> 1) ...
  auto load = [&](int buf, int kt) {
    const int h = kt & 1, pair = kt >> 1;
    const uint32_t sa = s0 + buf * kStage, ss = sa + kSA, sb = ss + kSS + b_dst;
    const int off = pair * kRowB;
    uint32_t bytes[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) bytes[j] = off + 64 * j < w_end ? 16u : 0u;
    each_index<2>([&](auto pc) {
      constexpr int p = decltype(pc)::value;
      const uint8_t* src = (h ? w_src[1][p] : w_src[0][p]) + off;
      each_index<4>([&](auto jc) {
        constexpr int j = decltype(jc)::value;
        ptx::cp_async16_at<p * 32 * kRowB, 64 * j>(sa + w_dst[j], src, bytes[j]);
      });
    });
    const int64_t gi = jb.g_begin + int64_t(kG) * pair;
    const uint8_t* src = (h ? s_src[1] : s_src[0]) +
                         (Fm::scale_off(jb.K, gi + 2 * s_w) - Fm::scale_off(jb.K, jb.g_begin));
    cp_async4(ss + (s_w * kHvRows + s_rl) * 4, src, !jb.skip_scales && gi + 2 * s_w < jb.g_end);
    copy_token_rows<kG, kTokRows, kTokStep, kTokRow, 2, kTokGroup>(sb, x_src, x_on,
                                                                   pair * kG * kGroup, x_end);
  };
  zero_frags(acc);
  const int KT = 2 * ((jb.g_end - jb.g_begin + kG - 1) / kG);
  const int tn = (jb.tokens + 7) / 8;
#pragma unroll 1
  for (int s = 0; s < kS - 1; ++s) {
    if (s < KT) load(s, s);
    ptx::cp_async_commit();
  }
  // The thread's fragment rows in a half: warp * 16 + g, + 8.
  const int r_f = warp * 16 + g;
  uint32_t a_off[kG];
#pragma unroll
  for (int u = 0; u < kG; ++u) {
    a_off[u] = uint32_t(r_f * kRowB + a_chunk<F, 2>(r_f, 4 * u + t) * 16);
    pin_reg(a_off[u]);
  }
  uint32_t b_off[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    b_off[q] = uint32_t(g * kTokRow + b_chunk(g, 4 * t + q) * 16);
    pin_reg(b_off[q]);
  }
  // One stage of half I in buffer `buf`.
  auto compute = [&](auto ic, int buf, int kt) {
    constexpr int I = decltype(ic)::value;
    const uint8_t* sa = smem + buf * kStage;
    const auto* ss = reinterpret_cast<const uint32_t*>(sa + kSA);
    const uint8_t* sb0 = sa + kSA + kSS;
    const int64_t g0 = jb.g_begin + int64_t(kG) * (kt >> 1);
    const int groups = min(kG, jb.g_end - int(g0));
    uint4 raw[kG][2];
    float sc[kG][2];
#pragma unroll
    for (int u = 0; u < kG; ++u)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        raw[u][h] = *reinterpret_cast<const uint4*>(sa + a_off[u] + 8 * h * kRowB);
        sc[u][h] = Fm::scale(ss[(u / 2) * kHvRows + r_f + 8 * h], g0 + u);
      }
    float part[kG][kTN][4];
    zero_frags(part);
#pragma unroll
    for (int p = 0; p < 4; ++p) {
#pragma unroll
      for (int u = 0; u < kG; ++u) {
        uint32_t d[2][4];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint4 v = raw[u][h];
          dequant8_w4(p == 0 ? v.x : p == 1 ? v.y : p == 2 ? v.z : v.w, d[h]);
        }
        uint32_t a[2][4];
        pair_frags(d, a);
        const uint8_t* sb = sb0 + u * kTokGroup;
#pragma unroll
        for (int j = 0; j < kTN; ++j) {
          if (j >= tn) break;
          const uint4 b = *reinterpret_cast<const uint4*>(sb + j * 8 * kTokRow + b_off[p]);
          ptx::mma_bf16(part[u][j], a[0], b.x, b.y);
          ptx::mma_bf16(part[u][j], a[1], b.z, b.w);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kG; ++u)  // group after group, as run_cta
      if (u < groups)
#pragma unroll
        for (int j = 0; j < kTN; ++j)
          if (j < tn)
#pragma unroll
            for (int q = 0; q < 4; ++q)
              acc[I][j][q] = fmaf(part[u][j][q], sc[u][q >> 1], acc[I][j][q]);
  };
  int buf = 0, next = kS - 1;
  auto step = [&](auto ic, int kt) {
    ptx::cp_async_wait<kS - 2>();
    __syncthreads();
    if (kt + kS - 1 < KT) load(next, kt + kS - 1);
    ptx::cp_async_commit();
    compute(ic, buf, kt);
    buf = buf + 1 == kS ? 0 : buf + 1;
    next = next + 1 == kS ? 0 : next + 1;
  };
#pragma unroll 1
  for (int kt = 0; kt < KT; kt += 2) {  // KT is even: both halves of every group quad
    step(std::integral_constant<int, 0>{}, kt);
    step(std::integral_constant<int, 1>{}, kt + 1);
  }
  ptx::cp_async_wait<0>();
}

// h[p, f] = act(silu(gate_f . x_p) * (up_f . x_p)) for tile tl's tokens and f in f0 .. f0 + 63,
// h staged for down's format (staged_col, act_bits). BT >= the most tokens a tile can hold. XI:
// x's F32 rows staged through the sorted tokens (rounded in the kernel), else a.xa gathered
// (BF16; FP8W's FP16). E: run_cta asks for the first stages' weights, then waits (pdl.cuh).
// HV: W4A16's stages in halves (run_cta_halves; BF16 rows, BT = 8, not E).
template <WqFormat F, int BT, bool XI, bool E, bool HV = false>
__device__ __forceinline__ void gate_up_cta(const GroupedFfnArgs& a, const Tile& tl, int f0,
                                            uint8_t* smem) {
  const ExpertPtrs ex = a.experts[tl.e];
  const int H = a.hidden, Fi = a.inter;
  const int64_t gate_ld = ld_bytes<F>(ex.gate_ld), up_ld = ld_bytes<F>(ex.up_ld);
  // One row stride serves both matrices (the table's check: gate and up rows alike).
  CtaJob jb = tile_job(tl, static_cast<const uint8_t*>(ex.gate) + int64_t(f0) * gate_ld,
                       static_cast<const uint8_t*>(ex.up) + int64_t(f0) * up_ld, gate_ld,
                       min(kBN / 2, Fi - f0), a.xa, H, a.wq_issue_first, a.wq_skip_scales);
  if constexpr (XI) {
    jb.xf = a.x;
    jb.ldx = a.x_stride;
    jb.xrow = a.lists.sorted_token + tl.begin;
  }
  float acc[kRM][BT / 8][4];
  if constexpr (HV)
    run_cta_halves<BT, true>(jb, smem, acc);
  else
    run_cta<F, BT, XI, XI, E, true>(jb, smem, acc);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  auto* h = static_cast<uint16_t*>(a.h);
#pragma unroll
  for (int j = 0; j < BT / 8; ++j)
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int f = f0 + warp * 16 + g + 8 * (q >> 1), tok = j * 8 + 2 * t + (q & 1);
      if (f >= Fi || tok >= tl.rows) continue;
      const float gv = acc[0][j][q], uv = acc[1][j][q];
      h[int64_t(tl.begin + tok) * Fi + staged_col<F>(f)] =
          act_bits<F>(gv / (1.0f + expf(-gv)) * uv);
    }
}

// y[p, n] = down_n . h_p for tile tl's tokens and n in n0 .. n0 + 127 (E, HV as gate_up_cta's).
template <WqFormat F, int BT, bool E, bool HV = false>
__device__ __forceinline__ void down_cta(const GroupedFfnArgs& a, const Tile& tl, int n0,
                                         uint8_t* smem) {
  const int H = a.hidden, Fi = a.inter;
  const ExpertPtrs ex = a.experts[tl.e];
  const int64_t down_ld = ld_bytes<F>(ex.down_ld);
  const CtaJob jb =
      tile_job(tl, static_cast<const uint8_t*>(ex.down) + int64_t(n0) * down_ld, nullptr, down_ld,
               min(kBN, H - n0), a.h, Fi, a.wq_issue_first, a.wq_skip_scales);
  float acc[kRM][BT / 8][4];
  if constexpr (HV)
    run_cta_halves<BT, false>(jb, smem, acc);
  else
    run_cta<F, BT, false, false, E>(jb, smem, acc);
  for_each_out<F>(acc, [&](int r, int tok, float v) {
    const int row = n0 + r;
    if (row < H && tok < tl.rows) a.y[int64_t(tl.begin + tok) * H + row] = v;
  });
}

// Grid (ceil(F / 64), tiles): gate_up_cta. E (not XI: the gather launch sits between the token
// lists and this kernel, so the lists are settled when it starts, pdl.cuh): the tile is looked
// up through L2 and its first stages' weights asked for before the wait.
template <WqFormat F, int BT, bool XI, bool E>
__global__ void __launch_bounds__(kThreads, (min_ctas_of<F, BT>()))
    gate_up_kernel(GroupedFfnArgs a) {
  static_assert(!(XI && E), "with XI the lists are written by the launch just ahead");
  if constexpr (!E) pdl::enter();
  extern __shared__ __align__(128) uint8_t smem[];
  const Tile tl = tile_of<kTileM, E>(a.lists, blockIdx.y);
  if (tl.e < 0) {
    if constexpr (E) pdl::enter();
    return;
  }
  gate_up_cta<F, BT, XI, E>(a, tl, blockIdx.x * (kBN / 2), smem);
}

// Grid (ceil(hidden / 128), tiles): down_cta. E: the tile is looked up through L2 (the lists
// are two launches back) and its first stages' weights asked for before the wait; else
// a.prefetch may ask L2 for them (down_start).
template <WqFormat F, int BT, bool E>
__global__ void __launch_bounds__(kThreads, (min_ctas_of<F, BT>())) down_kernel(GroupedFfnArgs a) {
  const int n0 = blockIdx.x * kBN;
  Tile tl;
  if constexpr (E) {
    tl = tile_of<kTileM, true>(a.lists, blockIdx.y);
    if (tl.e < 0) pdl::enter();
  } else {
    tl = down_start(
        a.prefetch, [&](auto l2) { return tile_of<kTileM, l2.value>(a.lists, blockIdx.y); },
        [&](const Tile& found) {                     // the tile's rows of down
          const ExpertPtrs ex = a.experts[found.e];  // the expert table is constant
          const int64_t ld = ld_bytes<F>(ex.down_ld);
          pdl::prefetch_l2(static_cast<const uint8_t*>(ex.down) + n0 * ld,
                           min(a.prefetch, (min(kBN, a.hidden - n0) - 1) * ld + 16));
        });
  }
  extern __shared__ __align__(128) uint8_t smem[];
  if (tl.e < 0) return;
  down_cta<F, BT, E>(a, tl, n0, smem);
}

// The item log's records (moe_item_log): 0 CTA | SM << 20 | item << 32, 1 gate/up items |
// all items << 32, 2 / 3 global timer at start / end (ns), 4 / 5 / 6 SM clock at start, after a
// down item's wait (a gate/up item: its start) and at end. An item ends when every thread of its
// CTA is past it (the barrier before the next claim).
constexpr int kItemWords = 8;

__device__ __forceinline__ unsigned long long* item_starts(const GroupedFfnArgs& a, int item,
                                                           int n_gu, int n_all) {
  unsigned long long* rec = device_log::claim(a.item_log, a.item_cap, a.item_skip, kItemWords);
  if (rec) {
    rec[0] = blockIdx.x | uint64_t(device_log::smid()) << 20 | uint64_t(item) << 32;
    rec[1] = uint64_t(n_gu) | uint64_t(n_all) << 32;
    rec[2] = device_log::globaltimer();
    rec[4] = rec[5] = clock64();
  }
  return rec;
}

__device__ __forceinline__ void item_ends(unsigned long long* rec) {
  rec[6] = clock64();
  rec[3] = device_log::globaltimer();
}

// The one-launch FFN's shared memory: the larger half's (its CTAs an SM: min_ctas_of, which
// counts F32 token rows); HV: run_cta_halves' stages.
template <WqFormat F, int BT, bool XI, bool HV = false>
constexpr size_t kFusedSmem = HV                                ? kHvSmem<BT>
                              : kSmem<F, BT, XI> > kSmem<F, BT> ? kSmem<F, BT, XI>
                                                                : kSmem<F, BT>;
// Whether the one-launch FFN of F, BT, XI can take W4A16's stages in halves (HV).
template <WqFormat F, int BT, bool XI>
constexpr bool kHvFits = (F == WqFormat::W4A16) && BT == 8 && !XI;

// Gate/up and down in one launch of as many CTAs as reside at once (DEEPSERVE_MOE_WQ_FUSED=0:
// the two launches). W1f TPOT 4.55 -> 4.49 ms, W5 20.16 -> 19.81 (H200, 8f94be4).
// Each CTA takes items from a counter (lists.sched[0], zeroed by the lists kernel): first every
// (tile, 64 columns) of gate/up, then every (tile, 128 rows) of down, which waits until all of
// its tile's gate/up items have stored h (lists.sched[1 + tile]). The last gate/up items then
// share the SMs with the first down items, where two launches leave SMs idle at the end of the
// gate/up launch (a partly filled last wave: StreamBench) and at the start of down's. An item
// is claimed only by a running CTA, and a claimed gate/up item waits for nothing, so every
// wait ends. The products are gate_up_cta's and down_cta's: the same bits as two launches.
// kSF (DEEPSERVE_MOE_WQ_SHARED_FIRST): the items of the shared experts' tiles (the
// last num_shared of the table: one tile each at these sizes, all T tokens) come first, gate/up
// and down alike, and before the wait CTA b < num_shared x gu_cols asks L2 for the gate and up
// rows of gate/up item b, which no kernel writes and which the lists are not needed to find: the
// CTAs that start first take those items and find their weights on chip, fetched while the lists
// kernel ran. Only the order of the items changes, so the bits do not.
// kLog: the item log is on (moe_item_log; its own instantiation, so the kernels that run
// without it are not touched).
// HV: W4A16's stages in halves (run_cta_halves, DEEPSERVE_MOE_WQ_HALVES; kHvFits).
template <WqFormat F, int BT, bool XI, bool kSF, bool kLog, bool HV>
__global__ void __launch_bounds__(kThreads, (min_ctas_of<F, BT>()))
    ffn_fused_kernel(GroupedFfnArgs a) {
  static_assert(!HV || kHvFits<F, BT, XI>, "halves: W4A16, 8 tokens, gathered BF16 rows");
  const int S = kSF ? a.num_shared : 0;
  if constexpr (kSF) {
    const int gu_cols = (a.inter + kBN / 2 - 1) / (kBN / 2);
    if (threadIdx.x == 0 && int(blockIdx.x) < S * gu_cols) {
      const int j = int(blockIdx.x) / gu_cols, f0 = (int(blockIdx.x) - j * gu_cols) * (kBN / 2);
      const ExpertPtrs ex = a.experts[a.num_experts - S + j];  // the expert table is constant
      const int64_t gl = ld_bytes<F>(ex.gate_ld), ul = ld_bytes<F>(ex.up_ld);
      const int rows = min(kBN / 2, a.inter - f0);
      pdl::prefetch_l2(static_cast<const uint8_t*>(ex.gate) + f0 * gl, (rows - 1) * gl + 16);
      pdl::prefetch_l2(static_cast<const uint8_t*>(ex.up) + f0 * ul, (rows - 1) * ul + 16);
    }
  }
  pdl::enter();
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ int item_s;
  const int n_tiles = *a.lists.n_tiles;
  const int gu_cols = (a.inter + kBN / 2 - 1) / (kBN / 2), dn_cols = (a.hidden + kBN - 1) / kBN;
  const int n_gu = n_tiles * gu_cols, n_all = n_gu + n_tiles * dn_cols;
  // The tile of the s-th tile in item order: the last S (shared) first, then the routed ones.
  // (Without kSF the order is the table's; the one expression for both would keep a compare the
  // compiler cannot drop, s not being known non-negative.)
  auto tile_at = [&](int s) {
    if constexpr (kSF)
      return s < S ? n_tiles - S + s : s - S;
    else
      return s;
  };
  int* const next = a.lists.sched;
  int* const done = a.lists.sched + 1;
  unsigned long long* rec = nullptr;  // thread 0's record of the item it runs, if logged
  // Every item comes from the counter, after the CTA's last one, so an item is only ever held by
  // a running CTA (however many reside). Claiming the next item as one starts measured slower
  // (W1f TPOT 4.49 -> 4.53 ms, W5 19.81 -> 19.89; H200, 8f94be4), and so did claiming it one
  // ahead with its first stages asked of L2 at the current item's tail, with or without the L2
  // asks, and counting a gate/up item with one fence a CTA (W5's 20 layers -3.1%, -1.0%, -0.7%;
  // H100, 3572911; docs/PERFORMANCE.md, thirty-seventh section).
  for (;;) {
    __syncthreads();  // the last item's shared memory and item_s are free again
    if (threadIdx.x == 0) {
      if (kLog && rec) item_ends(rec);
      item_s = atomicAdd(next, 1);
    }
    __syncthreads();
    const int item = item_s;
    if (item >= n_all) break;
    if (kLog && threadIdx.x == 0) rec = item_starts(a, item, n_gu, n_all);
    if (item < n_gu) {
      const int q = item / gu_cols, s = tile_at(q);
      gate_up_cta<F, BT, XI, false, HV>(a, tile_of<kTileM>(a.lists, s),
                                        (item - q * gu_cols) * (kBN / 2), smem);
      __threadfence();  // every thread's h stores, before the tile's count moves
      __syncthreads();
      if (threadIdx.x == 0) atomicAdd(done + s, 1);
    } else {
      const int d = item - n_gu, q = d / dn_cols, s = tile_at(q);
      // Only waiting here: at 8 tokens a down item waits 1.8 us of 12.8 (W5's 20 layers; the
      // item log) and using the wait measured slower: asking L2 for the item's down rows -0.15%,
      // copying its first weight stages before the wait (run_cta's kEarly) -0.4%, both -0.4%
      // (H100, b10ce7d; docs/PERFORMANCE.md, thirty-eighth section).
      if (threadIdx.x == 0) {
        while (*static_cast<volatile int*>(done + s) < gu_cols) __nanosleep(32);
        __threadfence();  // the h stores counted, before this CTA's reads of them
        if (kLog && rec) rec[5] = clock64();
      }
      __syncthreads();
      down_cta<F, BT, false, HV>(a, tile_of<kTileM>(a.lists, s), (d - q * dn_cols) * kBN, smem);
    }
  }
}

// x's rows gathered per sorted position into a.xa, as format F's kernels stage them (the launch
// ahead of gate/up unless it reads x's F32 rows itself, XI).
template <WqFormat F>
void gather_rows(const GroupedFfnArgs& a, cudaStream_t stream) {
  launch_gather_act(a.x, a.x_stride, a.lists.sorted_token, a.lists.offsets + a.num_experts,
                    a.num_tokens * a.top_k, a.hidden, a.xa, stream, F);
}

// E: the kernels whose token rows are BF16 (gate/up unless XI, down) ask for their first
// weights before the wait.
template <WqFormat F, int BT, bool XI, bool E>
void launch_ffn(const GroupedFfnArgs& a, cudaStream_t stream) {
  constexpr bool kGuE = E && !XI;
  static const bool ready = [] {
    set_smem_limit<F, BT, XI>(gate_up_kernel<F, BT, XI, kGuE>);
    set_smem_limit<F, BT, false>(down_kernel<F, BT, E>);
    return true;
  }();
  (void)ready;
  if (!XI) gather_rows<F>(a, stream);
  const unsigned tiles = unsigned(max_tiles(a.num_tokens * a.top_k, a.num_experts));
  pdl::launch(gate_up_kernel<F, BT, XI, kGuE>, dim3(ceil_div(a.inter, kBN / 2), tiles), kThreads,
              kSmem<F, BT, XI>, stream, a);
  check_cuda(cudaGetLastError(), "wq moe gate/up");
  pdl::launch(down_kernel<F, BT, E>, dim3(ceil_div(a.hidden, kBN), tiles), kThreads, kSmem<F, BT>,
              stream, a);
  check_cuda(cudaGetLastError(), "wq moe down");
}

// ffn_fused_kernel's launch (after the gather launch unless XI): one CTA for each that can
// reside at once, at most one for each item the step could have; kSF: the shared experts first.
template <WqFormat F, int BT, bool XI, bool kSF, bool kLog, bool HV>
void launch_ffn_fused(const GroupedFfnArgs& a, cudaStream_t stream) {
  constexpr size_t smem = kFusedSmem<F, BT, XI, HV>;
  static const int resident = [] {
    set_smem_bytes(ffn_fused_kernel<F, BT, XI, kSF, kLog, HV>, smem);
    int per_sm = 0, dev = 0, sms = 0;
    check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                   &per_sm, ffn_fused_kernel<F, BT, XI, kSF, kLog, HV>, kThreads, smem),
               "wq moe fused occupancy");
    check_cuda(cudaGetDevice(&dev), "wq moe fused device");
    check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev),
               "wq moe fused SM count");
    return std::max(1, per_sm * sms);
  }();
  if (!XI) gather_rows<F>(a, stream);
  const int64_t items = max_tiles(a.num_tokens * a.top_k, a.num_experts) *
                        (ceil_div(a.inter, kBN / 2) + ceil_div(a.hidden, kBN));
  pdl::launch(ffn_fused_kernel<F, BT, XI, kSF, kLog, HV>,
              unsigned(std::min<int64_t>(resident, items)), kThreads, smem, stream, a);
  check_cuda(cudaGetLastError(), "wq moe fused");
  note_moe_wq_fused_launch();
  if (HV) note_moe_wq_halves_launch();
}

template <WqFormat F, int BT, bool XI, bool HV>
void launch_ffn_fused(const GroupedFfnArgs& a, cudaStream_t stream) {
  const bool sf = g_moe_wq_shared_first.on() && a.num_shared > 0;
  const DeviceLogView log = moe_item_log().view();
  if (log.buf == nullptr) {
    sf ? launch_ffn_fused<F, BT, XI, true, false, HV>(a, stream)
       : launch_ffn_fused<F, BT, XI, false, false, HV>(a, stream);
    return;
  }
  GroupedFfnArgs b = a;
  b.item_log = log.buf;
  b.item_cap = log.cap;
  b.item_skip = log.skip;
  sf ? launch_ffn_fused<F, BT, XI, true, true, HV>(b, stream)
     : launch_ffn_fused<F, BT, XI, false, true, HV>(b, stream);
}

template <WqFormat F, int BT, bool XI>
void launch_ffn_fused(const GroupedFfnArgs& a, cudaStream_t stream) {
  if constexpr (kHvFits<F, BT, XI>) {
    if (g_moe_wq_halves.on()) return launch_ffn_fused<F, BT, XI, true>(a, stream);
  }
  launch_ffn_fused<F, BT, XI, false>(a, stream);
}

// launch_ffn<F, BT, XI, E> with the decode variants' early weights unless DEEPSERVE_WQ_EARLY=0;
// the decode variants in one launch (ffn_fused_kernel) unless DEEPSERVE_MOE_WQ_FUSED=0 (BF16
// experts: with DEEPSERVE_MOE_BF16_FUSED=1).
template <WqFormat F, int BT, bool XI>
void launch_ffn(const GroupedFfnArgs& a, cudaStream_t stream) {
  if constexpr (BT != kBT) {
    // BF16 experts (the Streamed path: W1's decode) keep the two launches until measured.
    const bool fused = F == WqFormat::BF16 ? g_moe_bf16_fused.on() : g_moe_wq_fused.on();
    if (fused && a.lists.sched) return launch_ffn_fused<F, BT, XI>(a, stream);
    if (g_wq_early.on()) return launch_ffn<F, BT, XI, true>(a, stream);
  }
  launch_ffn<F, BT, XI, false>(a, stream);
}

// Whether FP8W's decode variants (the caller's BT < kBT) read x's F32 rows themselves (no
// gather launch): x's rows must take whole 16-byte cp.async units. On the
// H200 (1beb961, WqBench.Moe) that took FP8W's MoE at T = 8 from 125.5 to 118.1 us (V2-Lite)
// and 348.2 to 329.5 (V2.5), but W4A16's from 84.9 to 103.2 and 229.0 to 287.1: its CTAs
// stream half the weight bytes against the same F32 rows.
bool experts_stage_f32(const GroupedFfnArgs& a) {
  return g_moe_wq_stage_f32.on() && a.hidden % 4 == 0 && a.x_stride % 4 == 0 &&
         reinterpret_cast<uintptr_t>(a.x) % 16 == 0;
}

// An expert holds each token at most once, so a step of T tokens never puts more than
// min(T, kTileM) in a tile: T <= 16 takes the decode variants.
template <WqFormat F>
void launch_ffn(const GroupedFfnArgs& args, cudaStream_t stream) {
  static_assert(kTileM == kBT, "a tile's tokens fit one CTA");
  GroupedFfnArgs a = args;
  a.wq_issue_first = issue_first_of(F);
  a.wq_skip_scales = g_wq_skip_scales.on();
  with_bt(a.num_tokens, [&]<int BT>() {
    if constexpr (F == WqFormat::FP8W && BT != kBT) {
      if (experts_stage_f32(a)) return launch_ffn<F, BT, true>(a, stream);
    }
    launch_ffn<F, BT, false>(a, stream);
  });
}

}  // namespace

void launch_wq_ffn(const GroupedFfnArgs& a, DType dtype, cudaStream_t stream) {
  const int64_t n = a.num_tokens * a.top_k;
  if (a.hidden % 8 != 0 || a.inter % 8 != 0)
    throw UnsupportedError("cuda moe_ffn: quantized experts need hidden and F multiples of 8");
  if (n == 0) return;
  if (dtype == DType::W4A16)
    launch_ffn<WqFormat::W4A16>(a, stream);
  else if (dtype == DType::FP8W)
    launch_ffn<WqFormat::FP8W>(a, stream);
  else if (dtype == DType::BF16)
    launch_ffn<WqFormat::BF16>(a, stream);
  else
    throw UnsupportedError("cuda moe_ffn: the streamed expert kernels take W4A16, FP8W or BF16");
}

}  // namespace moe

DeviceLog& moe_item_log() {
  static DeviceLog log{"DEEPSERVE_MOE_ITEMS", moe::kItemWords, 400000};
  return log;
}

void moe_item_log_write() {
  moe_item_log().write(
      "cta\tsm\titem\tgate_up_items\titems\tstart_ns\tend_ns\tc_start\tc_wait\tc_end",
      [](std::ostream& f, const unsigned long long* w) {
        if (w[3] == 0) return false;  // not ended when copied (none, after a sync)
        f << (w[0] & 0xfffff) << '\t' << ((w[0] >> 20) & 0xfff) << '\t' << (w[0] >> 32) << '\t'
          << (w[1] & 0xffffffff) << '\t' << (w[1] >> 32) << '\t' << w[2] << '\t' << w[3] << '\t'
          << w[4] << '\t' << w[5] << '\t' << w[6];
        return true;
      });
}

}  // namespace ds::cuda
