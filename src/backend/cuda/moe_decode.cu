// Decode-path experts: bandwidth-bound "grouped GEMV" kernels. A CTA owns (touched expert,
// tile of weight rows), streams that tile once per pass of up to TC tokens with 16-byte
// loads, and multiplies it against the expert's tokens, staged in shared memory as F32.
// Each output element is one lane-strided F32 dot product plus a fixed butterfly reduction,
// so it depends only on its own token: results are deterministic and batch-invariant.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>

#include "backend/cuda/moe.cuh"
#include "backend/cuda/moe_decode.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/switches.h"
#include "backend/cuda/weight_stream.cuh"
#include "core/error.h"

namespace ds::cuda::moe {
namespace {

using namespace decode;

// A gate/up CTA's F-rows [blockIdx.x * units_per_cta * 2, + 2 units) of expert e for `count`
// tokens, the token of position t being tok[tok_base + t] (tok null: t): put(t, j, f0, acc)
// stores h of F-rows f0 and f0 + 1 (f0 + 1 < F) of that token from column j of a unit's sums.
// L2: x read through L2 only (before the wait).
template <WeightKind K, int TC, int U, bool L2 = false, typename Put>
__device__ __forceinline__ void gate_up_rows(const DecodeFfnArgs& a, int e, const int* tok,
                                             int tok_base, int count, int units_per_cta,
                                             const Put& put) {
  constexpr int V = wstream::kChunkElems<K>;
  extern __shared__ float4 smem4[];
  float* xs = reinterpret_cast<float*>(smem4);
  const ExpertPtrs ex = a.experts[e];
  const int esize = wstream::elem_bytes(K);
  const int64_t gate_ld = ex.gate_ld * esize;
  const int64_t up_ld = ex.up_ld * esize;
  const uint8_t* gate = static_cast<const uint8_t*>(ex.gate);
  const uint8_t* up = static_cast<const uint8_t*>(ex.up);
  const int F = a.inter;
  const int chunks = a.hidden / V;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int f_tile = blockIdx.x * units_per_cta * 2;
  // Weight rows of unit u: gate and up of F-rows f0 and f1 (the last row twice for odd F).
  auto unit_rows = [&](int f0, const uint8_t*(&rows)[kRows]) {
    const int f1 = min(f0 + 1, F - 1);
    rows[0] = gate + f0 * gate_ld;
    rows[1] = up + f0 * up_ld;
    rows[2] = gate + f1 * gate_ld;
    rows[3] = up + f1 * up_ld;
  };
  if (f_tile + 2 * warp < F) {
    const uint8_t* rows[kRows];
    unit_rows(f_tile + 2 * warp, rows);
    prefetch_l2(rows, a.hidden * esize);
  }

  for (int t0 = 0; t0 < count; t0 += TC) {
    const int nt = min(TC, count - t0);
    if (t0 > 0) __syncthreads();  // the previous pass is done reading xs
    stage_rows<V, kThreads, L2>(xs, a.x, a.x_stride, tok, tok_base + t0, nt, a.hidden,
                                a.stage_regs);
    __syncthreads();
    for (int u = warp; u < units_per_cta; u += kWarps) {
      const int f0 = f_tile + 2 * u;
      if (f0 >= F) break;
      const uint8_t* rows[kRows];
      unit_rows(f0, rows);
      float acc[kRows][TC];
      dot_rows<K, TC, U>(rows, chunks, xs, a.hidden, nt, acc);
#pragma unroll
      for (int j = 0; j < TC; ++j) {
        if (j < nt && lane == j) put(t0 + j, j, f0, acc);
      }
    }
  }
}

// gate_up_rows' put for the h rows of sorted positions begin + t.
template <int TC>
__device__ __forceinline__ auto h_rows_from(const DecodeFfnArgs& a, int begin) {
  return [h = a.h, F = a.inter, begin](int t, int j, int f0, const float(&acc)[kRows][TC]) {
    float* hrow = h + int64_t(begin + t) * F;
    hrow[f0] = silu(acc[0][j]) * acc[1][j];
    if (f0 + 1 < F) hrow[f0 + 1] = silu(acc[2][j]) * acc[3][j];
  };
}

// Shared experts first (kEarly of gate_up_kernel; steps of one token whose lists the kernel
// builds from a.ids): grid rows y < shared are the shared experts, whose token (0) and weights
// no kernel ahead writes, so their products are computed before the wait into shared memory
// (x, written three launches back, through L2); after it their sorted position comes from the
// ids and the h rows are stored there. Rows y >= shared take routed slot y - shared after the
// wait, as gate_up_kernel does, and exit on a shared one. Shared experts' sums then overlap the
// route kernel instead of following it; the same bits.
constexpr int kSharedEarlyMaxUnits = 256;  // units per CTA the early rows' buffer holds
template <WeightKind K, int U>
__device__ __forceinline__ void gate_up_shared_first(const DecodeFfnArgs& a, int units_per_cta) {
  __shared__ SlotLists lists;
  __shared__ float hs[2 * kSharedEarlyMaxUnits];  // this CTA's F-rows of h
  __shared__ int pos;
  const int shared = a.top_k - a.routed;
  const int y = int(blockIdx.y);
  const int F = a.inter;
  const int f_tile = blockIdx.x * units_per_cta * 2;
  if (y < shared) {
    const int e = a.num_experts - shared + y;
    gate_up_rows<K, 1, U, true>(a, e, nullptr, 0, 1, units_per_cta,
                                [&](int, int j, int f0, const float(&acc)[kRows][1]) {
                                  hs[f0 - f_tile] = silu(acc[0][j]) * acc[1][j];
                                  if (f0 + 1 < F) hs[f0 + 1 - f_tile] = silu(acc[2][j]) * acc[3][j];
                                });
    pdl::enter();
    if (threadIdx.x < 32) {
      // CTA (0, 0) stores the lists the down kernel and the combine read.
      if (blockIdx.x == 0 && y == 0) warp_lists(a, 0, lists.tok, true);
      const int begin = warp_begin_of(a, e);
      if (threadIdx.x == 0) pos = begin;
    }
    __syncthreads();  // pos and every warp's h rows visible
    float* hrow = a.h + int64_t(pos) * F;
    for (int i = int(threadIdx.x); i < 2 * units_per_cta && f_tile + i < F; i += kThreads)
      hrow[f_tile + i] = hs[i];
    return;
  }
  pdl::enter();
  const ActiveExpert act = cta_warp_lists(a, y - shared, lists, false);
  if (act.e < 0 || act.e >= a.num_experts - shared) return;
  gate_up_rows<K, 1, U>(a, act.e, lists.tok, 0, act.count, units_per_cta,
                        h_rows_from<1>(a, act.begin));
}

// Grid (ceil(F / rows_per_cta), min(E, N)); a warp's unit is 2 F-rows of gate and up. U: the
// chunks per row a lane has in flight (dot_rows). kEarly (one token per pass, lists from ids,
// shared experts): gate_up_shared_first.
template <WeightKind K, int TC, int U, bool kEarly = false>
__global__ void __launch_bounds__(kThreads) gate_up_kernel(DecodeFfnArgs a, int units_per_cta) {
  if constexpr (kEarly) {
    static_assert(TC == 1, "the shared-first rows are for one token");
    gate_up_shared_first<K, U>(a, units_per_cta);
    return;
  }
  pdl::enter();
  __shared__ SlotLists lists;
  const int* tok;  // token of sorted position tok_base + j: tok[tok_base + j]
  int tok_base;
  const ActiveExpert act = cta_slot(a, lists, tok, tok_base);
  if (act.e < 0) return;
  gate_up_rows<K, TC, U>(a, act.e, tok, tok_base, act.count, units_per_cta,
                         h_rows_from<TC>(a, act.begin));
}

// The fused combine, run by every CTA of the down grid after its rows of y are stored (active
// expert or not): the last CTA of row tile blockIdx.x to arrive (one counter per tile, reset by
// that CTA for the next launch) writes out[t, r_tile .. + rows) for every token through
// combine_cols, as the combine kernel does (moe_lists.cu), so the bits are the same.
// With a.post, the last of those CTAs to finish its tile's combine then adds out's rows into the
// residual stream and normalizes them (add_norm_rows: the norm kernel's bits).
__device__ __forceinline__ void combine_row_tile(const DecodeFfnArgs& a, int r_tile, int rows) {
  if (!arrive_last(a.tile_done + blockIdx.x, int(gridDim.y))) return;
  const int slots = a.top_k;
  const int64_t n = a.num_tokens * rows;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) {
    const int64_t t = i / rows;
    const int r = r_tile + int(i - t * rows);
    float acc[1];
    combine_cols<1, true>(a.y, a.hidden, a.lists.pos + t * slots, a.weights + t * a.routed,
                          a.routed, slots, r, acc);
    a.out[t * a.out_stride + r] = acc[0];
  }
  if (a.post.counter != nullptr && arrive_last(a.post.counter, int(gridDim.x)))
    add_norm_rows<kThreads>(a.post, a.out, a.out_stride * 4, int(a.num_tokens), a.hidden);
}

// A down CTA's rows [r_tile, r_tile + units_per_cta * kRows) of expert act.e for its tokens.
// kFirst: `first` holds the first step of the warp's first unit (unit `warp`), loaded before
// the wait (down_kernel's kEarly).
template <WeightKind K, int TC, int U, bool kFirst = false>
__device__ __forceinline__ void down_rows(const DecodeFfnArgs& a, const ActiveExpert& act,
                                          int r_tile, int units_per_cta,
                                          const uint4 (&first)[U][kRows] = {}) {
  constexpr int V = wstream::kChunkElems<K>;
  const int esize = wstream::elem_bytes(K);
  const int F = a.inter;
  const int H = a.hidden;
  extern __shared__ float4 smem4[];
  float* xs = reinterpret_cast<float*>(smem4);
  const int begin = act.begin, count = act.count;
  const ExpertPtrs ex = a.experts[act.e];
  const int64_t down_ld = ex.down_ld * esize;
  const uint8_t* down = static_cast<const uint8_t*>(ex.down);
  const int chunks = F / V;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  // Weight rows of unit u: down rows r0.. (the last row repeated past H).
  auto unit_rows = [&](int r0, const uint8_t*(&rows)[kRows]) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) rows[r] = down + min(r0 + r, H - 1) * down_ld;
  };
  if (!kFirst && r_tile + kRows * warp < H) {
    const uint8_t* rows[kRows];
    unit_rows(r_tile + kRows * warp, rows);
    prefetch_l2(rows, F * esize);
  }

  // Unit u (rows r0 ..) against the staged tokens t0 .. t0 + nt; use_first: the unit's first
  // step is `first` (std::bool_constant).
  auto unit = [&](int u, int r0, int t0, int nt, auto use_first) {
    const uint8_t* rows[kRows];
    unit_rows(r0, rows);
    float acc[kRows][TC];
    if constexpr (decltype(use_first)::value)
      dot_rows<K, TC, U, true>(rows, chunks, xs, F, nt, acc, first, true);
    else
      dot_rows<K, TC, U>(rows, chunks, xs, F, nt, acc);
#pragma unroll
    for (int j = 0; j < TC; ++j) {
      if (j < nt && lane == j) {
        float* yrow = a.y + int64_t(begin + t0 + j) * H;
#pragma unroll
        for (int r = 0; r < kRows; ++r)
          if (r0 + r < H) yrow[r0 + r] = acc[r][j];
      }
    }
  };
  // kFirst: the first pass and the warp's first unit in it come out of the loops, so `first` is
  // dead once that unit has used it (live through the loops, it cost 64 registers).
  int t_start = 0;
  if constexpr (kFirst) {
    if (count > 0) {
      const int nt = min(TC, count);
      stage_rows<V>(xs, a.h, F, nullptr, begin, nt, F, a.stage_regs);
      __syncthreads();
      int u = warp;
      if (u < units_per_cta && r_tile + kRows * u < H) {
        unit(u, r_tile + kRows * u, 0, nt, std::true_type{});
        for (u += kWarps; u < units_per_cta; u += kWarps) {
          const int r0 = r_tile + kRows * u;
          if (r0 >= H) break;
          unit(u, r0, 0, nt, std::false_type{});
        }
      }
      t_start = TC;
    }
  }
  for (int t0 = t_start; t0 < count; t0 += TC) {
    const int nt = min(TC, count - t0);
    if (t0 > 0) __syncthreads();
    stage_rows<V>(xs, a.h, F, nullptr, begin + t0, nt, F, a.stage_regs);
    __syncthreads();
    for (int u = warp; u < units_per_cta; u += kWarps) {
      const int r0 = r_tile + kRows * u;
      if (r0 >= H) break;
      unit(u, r0, t0, nt, std::false_type{});
    }
  }
}

// The early start of a down CTA (kEarly): its expert, found before the wait from what kernels
// two or more launches back wrote (the route kernel's ids, rebuilt into the slot's lists by warp
// 0 as the gate/up CTAs do, or the token-list kernel's lists; both read through L2), and the
// first step of each warp's first unit of weight rows loaded into `first`; then the wait.
template <WeightKind K, int U>
__device__ __forceinline__ ActiveExpert down_early_start(const DecodeFfnArgs& a, int r_tile,
                                                         int units_per_cta,
                                                         uint4 (&first)[U][kRows]) {
  __shared__ SlotLists lists;
  const ActiveExpert act = a.ids ? cta_warp_lists<true>(a, blockIdx.y, lists, false)
                                 : active_expert<true>(a, blockIdx.y);
  const int warp = threadIdx.x >> 5;
  const int r0 = r_tile + kRows * warp;
  if (act.e >= 0 && warp < units_per_cta && r0 < a.hidden) {
    const ExpertPtrs ex = a.experts[act.e];  // the expert table is constant
    const int64_t ld = ex.down_ld * wstream::elem_bytes(K);
    const uint8_t* rows[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r)
      rows[r] = static_cast<const uint8_t*>(ex.down) + min(r0 + r, a.hidden - 1) * ld;
    load_step<U>(rows, a.inter / wstream::kChunkElems<K>, threadIdx.x & 31, first);
  }
  pdl::enter();
  return act;
}

// Grid (ceil(hidden / rows_per_cta), min(E, N)); a warp's unit is kRows hidden rows of down.
// With a.out, the last CTA of each row tile then does the combine for those rows. kEarly: the
// lookup and each warp's first weights before the wait (down_early_start;
// DEEPSERVE_MOE_DOWN_EARLY).
template <WeightKind K, int TC, int U, bool kEarly = false>
__global__ void __launch_bounds__(kThreads, kEarly ? 4 : 0)
    down_kernel(DecodeFfnArgs a, int units_per_cta) {
  const int esize = wstream::elem_bytes(K);
  const int F = a.inter;
  const int H = a.hidden;
  const int r_tile = blockIdx.x * units_per_cta * kRows;
  const int tile_rows = min(units_per_cta * kRows, H - r_tile);
  if constexpr (kEarly) {
    uint4 first[U][kRows];
    const ActiveExpert act = down_early_start<K, U>(a, r_tile, units_per_cta, first);
    if (act.e >= 0) down_rows<K, TC, U, true>(a, act, r_tile, units_per_cta, first);
    if (a.out) combine_row_tile(a, r_tile, tile_rows);
    return;
  }
  const ActiveExpert act = down_start(
      a.prefetch, [&](auto l2) { return active_expert<l2.value>(a, blockIdx.y); },
      [&](const ActiveExpert& found) {             // the CTA's rows of down
        const ExpertPtrs ex = a.experts[found.e];  // the expert table is constant
        pdl::prefetch_l2(static_cast<const uint8_t*>(ex.down) + r_tile * ex.down_ld * esize,
                         min(a.prefetch, ((tile_rows - 1) * ex.down_ld + F) * esize));
      });
  if (act.e >= 0) down_rows<K, TC, U>(a, act, r_tile, units_per_cta);
  if (a.out) combine_row_tile(a, r_tile, tile_rows);
}

// Row units per CTA at the base size: they grow with TC so the staged activations stay small
// against the weights streamed by the CTA.
int units_for(int tc) {
  return kWarps * (tc >= 2 ? tc / 2 : 1);
}

// Resident CTAs per SM of `kernel` with `smem` bytes of dynamic shared memory (cached).
template <typename Kernel>
int resident_per_sm(Kernel kernel, size_t smem) {
  static std::mutex mu;
  static std::map<std::pair<const void*, size_t>, int> known;
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_pair(reinterpret_cast<const void*>(kernel), smem);
  auto it = known.find(key);
  if (it != known.end()) return it->second;
  int n = 0;
  check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, smem), "occupancy");
  known.emplace(key, n);
  return n;
}

// Row units per CTA for `total` units over `slots` grid rows: the base size times m, where m is
// DEEPSERVE_MOE_DECODE_UPW or else the smallest m <= 4 whose grid fits one wave of resident CTAs
// (1 when none does, or without an SM count). A CTA's second wave would start only as the
// first drains, each CTA paying its lookups and staging again (ncu, T = 1: 1,408 gate/up CTAs
// on 924 slots, 1.52 waves).
int units_per_cta(int tc, int64_t total, unsigned slots, int resident, int sm_count) {
  const int base = units_for(tc);
  const long long forced = g_moe_decode_upw.get();
  if (forced > 0) return base * int(std::min<long long>(forced, 64));
  const int64_t wave = int64_t(resident) * sm_count;
  for (int m = 1; m <= 4; ++m)
    if ((total + base * m - 1) / (base * m) * int64_t(slots) <= wave) return base * m;
  return base;
}

// Chunks per row a lane has in flight: 4 for passes of up to 2 tokens (their sums need few
// registers) unless DEEPSERVE_MOE_DECODE_UNROLL=2, else 2. The same bits either way.
template <int TC>
constexpr bool kMayUnroll4 = TC <= 2;
// f(std::integral_constant<int, U>{}) with U those chunks for passes of TC tokens.
template <int TC, typename Fn>
auto with_unroll(Fn&& f) {
  if constexpr (kMayUnroll4<TC>)
    if (g_moe_decode_unroll.get() == 4) return f(std::integral_constant<int, 4>{});
  return f(std::integral_constant<int, kUnroll>{});
}

// Returns whether the kernel does the combine (a.out, with a counter for every row tile). The
// early start (DEEPSERVE_MOE_DOWN_EARLY=1) only where the gate/up kernel is launched just before
// (every stage), so the ids or lists it reads are two launches back.
template <WeightKind K, int TC, int U, bool kEarly>
bool launch_down_as(const DecodeFfnArgs& a, unsigned slots, cudaStream_t stream) {
  const size_t smem = size_t(TC) * a.inter * 4;
  const int units = units_per_cta(TC, (a.hidden + kRows - 1) / kRows, slots,
                                  resident_per_sm(down_kernel<K, TC, U, kEarly>, smem), a.sm_count);
  const int rows = units * kRows;
  const dim3 grid(unsigned((a.hidden + rows - 1) / rows), slots);
  DecodeFfnArgs d = a;
  if (a.tile_done == nullptr || grid.x > unsigned(kTileCounters)) d.out = nullptr;
  if (d.out == nullptr) d.post.counter = nullptr;  // the add and norm go with the combine
  pdl::launch(down_kernel<K, TC, U, kEarly>, grid, kThreads, smem, stream, d, units);
  if (kEarly) ++early_launch_counts().down_early;
  return d.out != nullptr;
}

template <WeightKind K, int TC, int U>
bool launch_down(const DecodeFfnArgs& a, unsigned slots, cudaStream_t stream) {
  if (a.stages == kMoeAllStages && g_moe_down_early.on())
    return launch_down_as<K, TC, U, true>(a, slots, stream);
  return launch_down_as<K, TC, U, false>(a, slots, stream);
}

template <WeightKind K, int TC, int U, bool kEarly>
bool launch_gate_up_as(const DecodeFfnArgs& a, unsigned slots, cudaStream_t stream) {
  const size_t smem = size_t(TC) * a.hidden * 4;
  const int units =
      units_per_cta(TC, (a.inter + 1) / 2, slots,
                    resident_per_sm(gate_up_kernel<K, TC, U, kEarly>, smem), a.sm_count);
  if (kEarly && units > kSharedEarlyMaxUnits) return false;
  const int rows = units * 2;
  const dim3 grid(unsigned((a.inter + rows - 1) / rows), slots);
  pdl::launch(gate_up_kernel<K, TC, U, kEarly>, grid, kThreads, smem, stream, a, units);
  if (kEarly) ++early_launch_counts().shared_first;
  return true;
}

// Shared experts first (DEEPSERVE_MOE_SHARED_EARLY=1, gate_up_shared_first) for one-token steps
// whose lists the kernel builds from ids, with shared experts; x must not be written by the
// kernel just ahead (the model's: the route kernel).
template <WeightKind K, int TC, int U>
void launch_gate_up(const DecodeFfnArgs& a, unsigned slots, cudaStream_t stream) {
  if constexpr (TC == 1) {
    if (g_moe_shared_early.on() && a.ids != nullptr && a.num_tokens == 1 && a.top_k > a.routed &&
        launch_gate_up_as<K, TC, U, true>(a, slots, stream))
      return;
  }
  launch_gate_up_as<K, TC, U, false>(a, slots, stream);
}

// Launches both kernels (those of a.stages); returns whether the down kernel does the combine
// (true also when down is left out: no combine either).
template <WeightKind K>
bool launch_kind(const DecodeFfnArgs& a, int tc_gu, int tc_dn, unsigned slots,
                 cudaStream_t stream) {
  if (a.stages & 1)
    with_tc(tc_gu, [&](auto tc) {
      constexpr int T = decltype(tc)::value;
      with_unroll<T>([&](auto u) { launch_gate_up<K, T, decltype(u)::value>(a, slots, stream); });
    });
  if ((a.stages & 2) == 0) return true;
  bool fused = false;
  with_tc(tc_dn, [&](auto tc) {
    constexpr int T = decltype(tc)::value;
    fused = with_unroll<T>(
        [&](auto u) { return launch_down<K, T, decltype(u)::value>(a, slots, stream); });
  });
  return fused;
}

template <WeightKind K>
void prepare_kind() {
  const auto attr = cudaFuncAttributeMaxDynamicSharedMemorySize;
  for (int tc : {1, 2, 4, 8}) {
    with_tc(tc, [&](auto c) {
      constexpr int T = c.value;
      check(cudaFuncSetAttribute(gate_up_kernel<K, T, kUnroll>, attr, kDecodeStageBytes),
            "smem limit");
      if constexpr (T == 1)
        check(cudaFuncSetAttribute(gate_up_kernel<K, T, kUnroll, true>, attr, kDecodeStageBytes),
              "smem limit");
      check(cudaFuncSetAttribute(down_kernel<K, T, kUnroll>, attr, kDecodeStageBytes),
            "smem limit");
      check(cudaFuncSetAttribute(down_kernel<K, T, kUnroll, true>, attr, kDecodeStageBytes),
            "smem limit");
      if constexpr (kMayUnroll4<T>) {
        check(cudaFuncSetAttribute(gate_up_kernel<K, T, 4>, attr, kDecodeStageBytes), "smem limit");
        if constexpr (T == 1)
          check(cudaFuncSetAttribute(gate_up_kernel<K, T, 4, true>, attr, kDecodeStageBytes),
                "smem limit");
        check(cudaFuncSetAttribute(down_kernel<K, T, 4>, attr, kDecodeStageBytes), "smem limit");
        check(cudaFuncSetAttribute(down_kernel<K, T, 4, true>, attr, kDecodeStageBytes),
              "smem limit");
      }
    });
  }
}

}  // namespace

EarlyLaunchCounts& early_launch_counts() {
  static EarlyLaunchCounts counts;
  return counts;
}

void prepare_decode_kernels() {
  prepare_kind<WeightKind::BF16>();
  prepare_kind<WeightKind::F16>();
  prepare_kind<WeightKind::F32>();
}

bool launch_decode_ffn(const DecodeFfnArgs& args, cudaStream_t stream) {
  DecodeFfnArgs a = args;
  a.stage_regs = g_row_regs.on();
  if (a.stage_regs) note_row_regs_launch();
  const int V = 16 / wstream::elem_bytes(a.kind);
  if (a.hidden % V != 0 || a.inter % V != 0)
    throw UnsupportedError("cuda moe_ffn: hidden and F must be multiples of " + std::to_string(V));
  if (int64_t(a.hidden) * 4 > kDecodeStageBytes || int64_t(a.inter) * 4 > kDecodeStageBytes)
    throw UnsupportedError("cuda moe_ffn: hidden / F too large for the decode kernels");
  const int64_t n = a.num_tokens * a.top_k;
  const unsigned slots = unsigned(std::min<int64_t>(a.num_experts, n));
  const int tc_gu = pick_tc(a.num_tokens, a.hidden);
  const int tc_dn = pick_tc(a.num_tokens, a.inter);
  bool fused = false;
  switch (a.kind) {
    case WeightKind::BF16:
      fused = launch_kind<WeightKind::BF16>(a, tc_gu, tc_dn, slots, stream);
      break;
    case WeightKind::F16:
      fused = launch_kind<WeightKind::F16>(a, tc_gu, tc_dn, slots, stream);
      break;
    case WeightKind::F32:
      fused = launch_kind<WeightKind::F32>(a, tc_gu, tc_dn, slots, stream);
      break;
  }
  check(cudaGetLastError(), "decode kernels");
  return fused;
}

}  // namespace ds::cuda::moe
