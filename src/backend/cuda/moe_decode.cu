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
#include "backend/cuda/moe_route.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/switches.h"
#include "backend/cuda/weight_stream.cuh"
#include "core/error.h"

namespace ds::cuda::moe {
namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRows = 4;    // weight rows a warp streams together (x is reused across them)
constexpr int kUnroll = 2;  // 16-byte chunks per row a lane has in flight

// Shared-memory index of element k of a staged row: chunk c's V floats are split into
// 4-float parts stored part-major ([part][chunk][4]), so a warp reading one part of 32
// consecutive chunks touches consecutive 16-byte words (no bank conflicts).
template <int V>
__device__ __forceinline__ int stage_index(int k, int chunks) {
  if constexpr (V == 4) {
    return k;
  } else {
    return ((k & 7) >> 2) * chunks * 4 + (k >> 3) * 4 + (k & 3);
  }
}

// Copies nt rows of length K (F32, global) into shared memory in the staged layout.
// L2: src was written by another CTA of this launch (read through L2 only, ld.global.cg).
template <int V, bool L2 = false>
__device__ __forceinline__ void stage_rows(float* xs, const float* src, int64_t src_stride,
                                           const int* row_ids, int row_base, int nt, int K) {
  const int chunks = K / V;
  for (int j = 0; j < nt; ++j) {
    const int64_t r = row_ids ? row_ids[row_base + j] : row_base + j;
    const float* s = src + r * src_stride;
    for (int k = threadIdx.x; k < K; k += kThreads)
      xs[j * K + stage_index<V>(k, chunks)] = L2 ? __ldcg(s + k) : s[k];
  }
}

// acc[r][j] = dot(row r, staged token j) for j < nt, summed over the whole warp (every
// lane ends with the same value). Rows are byte pointers to 16-byte aligned rows of K
// elements.
template <WeightKind K, int TC>
__device__ __forceinline__ void dot_rows(const uint8_t* const (&rows)[kRows], int chunks,
                                         const float* xs, int Klen, int nt,
                                         float (&acc)[kRows][TC]) {
  constexpr int V = wstream::kChunkElems<K>;
  constexpr int P = V / 4;
  const int lane = threadIdx.x & 31;
  const float4* xs4 = reinterpret_cast<const float4*>(xs);
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int j = 0; j < TC; ++j) acc[r][j] = 0.0f;

  for (int c0 = lane; c0 < chunks; c0 += 32 * kUnroll) {
    uint4 w[kUnroll][kRows];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = c0 + 32 * u;
#pragma unroll
      for (int r = 0; r < kRows; ++r)
        w[u][r] = c < chunks ? __ldg(reinterpret_cast<const uint4*>(rows[r]) + c)
                             : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = c0 + 32 * u;
      if (c < chunks) {
        float wf[kRows][V];
#pragma unroll
        for (int r = 0; r < kRows; ++r) wstream::chunk_to_float<K>(w[u][r], wf[r]);
#pragma unroll
        for (int j = 0; j < TC; ++j) {
          if (j < nt) {
            float xv[V];
#pragma unroll
            for (int p = 0; p < P; ++p) {
              const float4 q = xs4[(j * Klen) / 4 + p * chunks + c];
              xv[4 * p + 0] = q.x;
              xv[4 * p + 1] = q.y;
              xv[4 * p + 2] = q.z;
              xv[4 * p + 3] = q.w;
            }
#pragma unroll
            for (int r = 0; r < kRows; ++r)
#pragma unroll
              for (int i = 0; i < V; ++i) acc[r][j] = fmaf(wf[r][i], xv[i], acc[r][j]);
          }
        }
      }
    }
  }
  // xor butterfly: partners add the same two values, so all lanes agree bit for bit.
#pragma unroll
  for (int j = 0; j < TC; ++j) {
    if (j < nt) {
#pragma unroll
      for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) acc[r][j] += __shfl_xor_sync(kFull, acc[r][j], off);
    }
  }
}

// Starts pulling a warp's first rows toward L2 while the activations are being staged, so
// the CTA's weight stream does not wait behind the staging's latency.
__device__ __forceinline__ void prefetch_l2(const uint8_t* const (&rows)[kRows], int row_bytes) {
  const int lane = threadIdx.x & 31;
  for (int b = lane * 128; b < row_bytes; b += 32 * 128) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) asm volatile("prefetch.global.L2 [%0];" ::"l"(rows[r] + b));
  }
}

// The touched expert a CTA row (blockIdx.y) works on and its run of sorted tokens; e = -1 for
// rows past the experts this step touched (those CTAs exit).
struct ActiveExpert {
  int e, begin, count;
};
template <bool L2 = false>
__device__ __forceinline__ ActiveExpert active_expert(const DecodeFfnArgs& a, int slot) {
  if (slot >= list_int<L2>(a.lists.n_active)) return {-1, 0, 0};
  const int e = list_int<L2>(a.lists.active + slot);
  const int begin = list_int<L2>(a.lists.offsets + e);
  return {e, begin, list_int<L2>(a.lists.offsets + e + 1) - begin};
}

// The token lists of a step of at most kWarpListMax assignments, by one warp from ids [T, routed]
// alone (global or shared memory), in
// the token-list kernel's order (experts ascending, an expert's assignments by index): returns
// slot `slot`'s active expert and its sorted range, and puts its tokens in tok[0, count). store:
// also writes the lists the down kernel and the combine read (pos, sorted_token, active,
// n_active and the active experts' offsets).
__device__ __forceinline__ ActiveExpert warp_lists(const DecodeFfnArgs& a, const int32_t* ids,
                                                   int slot, int* tok, bool store) {
  const int lane = threadIdx.x & 31;
  const int slots = a.top_k;
  const int n = int(a.num_tokens) * slots;
  const int e = lane < n
                    ? expert_of(ids, lane, a.routed, slots - a.routed, a.num_experts, a.expert_base)
                    : -1;
  const unsigned peers = __match_any_sync(kFull, e);
  const unsigned below = peers & ((1u << lane) - 1u);
  const bool leader = e >= 0 && below == 0;  // the expert's first assignment
  // Over all lanes: valid assignments to lower experts (the sorted start) and distinct lower
  // experts (the active rank).
  int begin = 0, rank = 0;
  const int packed = e * 2 + int(leader);
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    const int pj = __shfl_sync(kFull, packed, j);
    const int ej = pj >> 1;  // arithmetic: -1 stays -1
    if (ej >= 0 && ej < e) {
      ++begin;
      rank += pj & 1;
    }
  }
  const int count = __popc(peers);
  const unsigned leaders = __ballot_sync(kFull, leader);
  const unsigned mine = __ballot_sync(kFull, leader && rank == slot);
  const int src = mine ? __ffs(mine) - 1 : 0;
  const int se = __shfl_sync(kFull, e, src), sb = __shfl_sync(kFull, begin, src),
            sc = __shfl_sync(kFull, count, src);
  const ActiveExpert act = mine ? ActiveExpert{se, sb, sc} : ActiveExpert{-1, 0, 0};
  const int within = __popc(below);
  if (act.e >= 0 && e == act.e) tok[within] = lane / slots;
  if (store) {
    if (lane < n) {
      a.lists.pos[lane] = e >= 0 ? begin + within : -1;
      if (e >= 0) a.lists.sorted_token[begin + within] = lane / slots;
    }
    if (leader) {
      a.lists.active[rank] = e;
      a.lists.offsets[e] = begin;
      a.lists.offsets[e + 1] = begin + count;  // the next active expert's start, if any: the same
    }
    if (lane == 0) *a.lists.n_active = __popc(leaders);
  }
  return act;
}

__device__ __forceinline__ float silu(float g) {
  return g / (1.0f + expf(-g));
}

// Gate/up rows [f_tile, f_tile + 2 * units_per_cta) of expert act.e for its act.count tokens: the
// token at sorted position act.begin + j is row tok[tok_base + j] of x (tok null: row j).
template <WeightKind K, int TC>
__device__ __forceinline__ void gate_up_rows(const DecodeFfnArgs& a, const ActiveExpert& act,
                                             const int* tok, int tok_base, int f_tile,
                                             int units_per_cta) {
  constexpr int V = wstream::kChunkElems<K>;
  extern __shared__ float4 smem4[];
  float* xs = reinterpret_cast<float*>(smem4);
  const int begin = act.begin, count = act.count;
  const ExpertPtrs ex = a.experts[act.e];
  const int esize = wstream::elem_bytes(K);
  const int64_t gate_ld = ex.gate_ld * esize;
  const int64_t up_ld = ex.up_ld * esize;
  const uint8_t* gate = static_cast<const uint8_t*>(ex.gate);
  const uint8_t* up = static_cast<const uint8_t*>(ex.up);
  const int F = a.inter;
  const int chunks = a.hidden / V;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
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
    stage_rows<V>(xs, a.x, a.x_stride, tok, tok_base + t0, nt, a.hidden);
    __syncthreads();
    for (int u = warp; u < units_per_cta; u += kWarps) {
      const int f0 = f_tile + 2 * u;
      if (f0 >= F) break;
      const uint8_t* rows[kRows];
      unit_rows(f0, rows);
      float acc[kRows][TC];
      dot_rows<K, TC>(rows, chunks, xs, a.hidden, nt, acc);
#pragma unroll
      for (int j = 0; j < TC; ++j) {
        if (j < nt && lane == j) {
          float* hrow = a.h + int64_t(begin + t0 + j) * F;
          hrow[f0] = silu(acc[0][j]) * acc[1][j];
          if (f0 + 1 < F) hrow[f0 + 1] = silu(acc[2][j]) * acc[3][j];
        }
      }
    }
  }
}

// Grid (ceil(F / rows_per_cta), min(E, N)); a warp's unit is 2 F-rows of gate and up.
template <WeightKind K, int TC>
__global__ void __launch_bounds__(kThreads) gate_up_kernel(DecodeFfnArgs a, int units_per_cta) {
  pdl::enter();
  // The slot's expert and the rows of x its tokens are: from the token lists, or built here.
  __shared__ int warp_tok[kWarpListMax];
  __shared__ ActiveExpert warp_act;
  ActiveExpert act;
  const int* tok = a.lists.sorted_token;  // token of sorted position tok_base + j
  int tok_base = 0;
  if (a.ids) {
    if (threadIdx.x < 32) {
      const ActiveExpert found =
          warp_lists(a, a.ids, blockIdx.y, warp_tok, blockIdx.x == 0 && blockIdx.y == 0);
      if (threadIdx.x == 0) warp_act = found;
    }
    __syncthreads();
    act = warp_act;
    tok = warp_tok;
  } else {
    act = active_expert(a, blockIdx.y);
    tok_base = act.begin;
  }
  if (act.e < 0) return;
  gate_up_rows<K, TC>(a, act, tok, tok_base, blockIdx.x * units_per_cta * 2, units_per_cta);
}

// The fused combine, run by every CTA of the down grid after its rows of y are stored (active
// expert or not): the last of the `arrivals` CTAs of row tile `tile` to arrive (one counter per
// tile, reset by that CTA for the next launch) writes out[t, r_tile .. + rows) for every token
// through combine_cols, as the combine kernel does (moe_lists.cu), so the bits are the same.
// Fresh: the lists' pos and the weights were written in this launch (at most kWarpListMax
// each): read through L2 into shared memory first.
template <bool Fresh = false>
__device__ __forceinline__ void combine_row_tile(const DecodeFfnArgs& a, int tile, int arrivals,
                                                 int r_tile, int rows) {
  __shared__ int last;
  __threadfence();  // this thread's y stores are visible before the CTA is counted
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(a.tile_done + tile, 1) == arrivals - 1;
    if (last) a.tile_done[tile] = 0;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  const int slots = a.top_k;
  const int* pos = a.lists.pos;
  const float* weights = a.weights;
  if constexpr (Fresh) {
    __shared__ int pos_s[kWarpListMax];
    __shared__ float weights_s[kWarpListMax];
    if (threadIdx.x < a.num_tokens * slots) pos_s[threadIdx.x] = __ldcg(pos + threadIdx.x);
    if (threadIdx.x < a.num_tokens * a.routed)
      weights_s[threadIdx.x] = __ldcg(weights + threadIdx.x);
    __syncthreads();
    pos = pos_s;
    weights = weights_s;
  }
  const int64_t n = a.num_tokens * rows;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) {
    const int64_t t = i / rows;
    const int r = r_tile + int(i - t * rows);
    float acc[1];
    combine_cols<1, true>(a.y, a.hidden, pos + t * slots, weights + t * a.routed, a.routed, slots,
                          r, acc);
    a.out[t * a.out_stride + r] = acc[0];
  }
}

// A down CTA's rows [r_tile, r_tile + units_per_cta * kRows) of expert act.e for its tokens.
template <WeightKind K, int TC, bool L2 = false>
__device__ __forceinline__ void down_rows(const DecodeFfnArgs& a, const ActiveExpert& act,
                                          int r_tile, int units_per_cta) {
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
  if (r_tile + kRows * warp < H) {
    const uint8_t* rows[kRows];
    unit_rows(r_tile + kRows * warp, rows);
    prefetch_l2(rows, F * esize);
  }

  for (int t0 = 0; t0 < count; t0 += TC) {
    const int nt = min(TC, count - t0);
    if (t0 > 0) __syncthreads();
    stage_rows<V, L2>(xs, a.h, F, nullptr, begin + t0, nt, F);
    __syncthreads();
    for (int u = warp; u < units_per_cta; u += kWarps) {
      const int r0 = r_tile + kRows * u;
      if (r0 >= H) break;
      const uint8_t* rows[kRows];
      unit_rows(r0, rows);
      float acc[kRows][TC];
      dot_rows<K, TC>(rows, chunks, xs, F, nt, acc);
#pragma unroll
      for (int j = 0; j < TC; ++j) {
        if (j < nt && lane == j) {
          float* yrow = a.y + int64_t(begin + t0 + j) * H;
#pragma unroll
          for (int r = 0; r < kRows; ++r)
            if (r0 + r < H) yrow[r0 + r] = acc[r][j];
        }
      }
    }
  }
}

// Grid (ceil(hidden / rows_per_cta), min(E, N)); a warp's unit is kRows hidden rows of down.
// With a.out, the last CTA of each row tile then does the combine for those rows.
template <WeightKind K, int TC>
__global__ void __launch_bounds__(kThreads) down_kernel(DecodeFfnArgs a, int units_per_cta) {
  const int esize = wstream::elem_bytes(K);
  const int F = a.inter;
  const int H = a.hidden;
  const int r_tile = blockIdx.x * units_per_cta * kRows;
  const int tile_rows = min(units_per_cta * kRows, H - r_tile);
  const ActiveExpert act = down_start(
      a.prefetch, [&](auto l2) { return active_expert<l2.value>(a, blockIdx.y); },
      [&](const ActiveExpert& found) {             // the CTA's rows of down
        const ExpertPtrs ex = a.experts[found.e];  // the expert table is constant
        pdl::prefetch_l2(static_cast<const uint8_t*>(ex.down) + r_tile * ex.down_ld * esize,
                         min(a.prefetch, ((tile_rows - 1) * ex.down_ld + F) * esize));
      });
  if (act.e >= 0) down_rows<K, TC>(a, act, r_tile, units_per_cta);
  if (a.out) combine_row_tile(a, blockIdx.x, int(gridDim.y), r_tile, tile_rows);
}

// ---- The one-launch decode MoE (moe_routed_ffn, steps of at most kWarpListMax assignments) ----
// One grid does the router's choice, gate/up, down and the combine. A CTA only ever waits for
// work of lower tickets. The ticket is blockIdx.x when the whole grid fits one wave of resident
// CTAs (every CTA it waits for is then running or done); else CTAs take tickets in the order they
// start (an atomic counter), so lower tickets are held by CTAs already running. Tickets:
//   0                 the lead: the router's choice (route_token, a warp per token), stores
//                     ids, weights, counts and the token lists, then raises the route flag;
//   1 ..              gate/up tiles, the S shared experts' first (they hold every token at
//                     known sorted positions, so they start at once, alongside the lead), then
//                     the routed slots' (after the flag); each counts itself on its expert;
//   then              down tiles in the same order: each waits for all gate/up tiles of its
//                     expert, and the last CTA of each row tile does the combine.
// The last CTA to finish resets the counters. Every sum is the two-kernel path's, so the bits
// are the same.
struct OneLaunch {
  int gu_units = 0, dn_units = 0;  // row units per CTA
  int gu_tiles = 0, dn_tiles = 0;  // CTAs per expert slot in each phase
  int routed_slots = 0;            // R: grid rows for routed experts (at most T * routed)
  int total = 0;                   // 1 + (S + R) * (gu_tiles + dn_tiles)
  int poll_ns = 0;                 // sleep between polls (DEEPSERVE_MOE_ONE_POLL_NS)
  bool tickets = false;            // work order from a counter (else blockIdx.x: all resident)
};

__device__ __forceinline__ int load_relaxed(const int* p) {
  int v;
  asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// The CTA goes on once *p >= target: thread 0 polls with relaxed loads (an acquire load at each
// poll would also invalidate the SM's L1 each time) every poll_ns, then one fence orders the
// CTA's reads after the counts it saw. A wait past ~2^25 polls traps: a lost count is a bug to
// report, not a hang.
__device__ __forceinline__ void cta_wait(const int* p, int target, int poll_ns) {
  if (threadIdx.x == 0) {
    unsigned polls = 0;
    while (load_relaxed(p) < target) {
      if (poll_ns > 0) __nanosleep(unsigned(poll_ns));
      if (++polls > (1u << 25)) __trap();
    }
    __threadfence();
  }
  __syncthreads();
}

// Counts the CTA on *p once every thread's stores are visible.
__device__ __forceinline__ void cta_signal(int* p) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) atomicAdd(p, 1);
}

// At TC <= 2 the two-kernel path's gate/up and down kernels fit 72 registers (7 CTAs per SM); so
// must this one, whose router code would otherwise take it to ~120 (4 CTAs per SM). Larger
// passes need more (72 spills there): as many as theirs (96 at TC = 4, 128 at 8).
template <int TC>
constexpr int kOneMinCtas = TC <= 2   ? 7
                            : TC == 4 ? 5
                                      : 4;

template <WeightKind K, int TC>
__global__ void __launch_bounds__(kThreads, kOneMinCtas<TC>)
    moe_one_kernel(DecodeFfnArgs a, OneLaunch o) {
  pdl::enter();
  __shared__ int ticket_s;
  __shared__ int32_t ids_s[kWarpListMax];
  __shared__ int tok_s[kWarpListMax];
  __shared__ ActiveExpert act_s;
  int ticket = int(blockIdx.x);
  if (o.tickets) {
    if (threadIdx.x == 0) ticket_s = atomicAdd(a.sync + kSyncTicket, 1);
    __syncthreads();
    ticket = ticket_s;
  }
  const int T = int(a.num_tokens);
  const int E = a.num_experts, S = a.top_k - a.routed;
  const int n_ids = T * a.routed;
  const int gu_ctas = (S + o.routed_slots) * o.gu_tiles;
  // Shared expert j: the last S experts, every token, after all routed assignments.
  auto shared_expert = [&](int j) { return ActiveExpert{E - S + j, n_ids + j * T, T}; };
  // Routed slot r's expert and tokens (tok_s), once the lead's ids are out; -1 past them.
  auto routed_expert = [&](int r) {
    cta_wait(a.sync + kSyncRouted, 1, o.poll_ns);
    if (threadIdx.x < n_ids) ids_s[threadIdx.x] = __ldcg(a.ids + threadIdx.x);
    __syncthreads();
    if (threadIdx.x < 32) {
      const ActiveExpert found = warp_lists(a, ids_s, r, tok_s, false);
      if (threadIdx.x == 0) act_s = found;
    }
    __syncthreads();
    ActiveExpert act = act_s;
    if (act.e >= E - S) act.e = -1;  // a shared expert's slot: its own tickets run it
    return act;
  };

  if (ticket == 0) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int t = warp; t < T; t += kWarps) {
      const route::Pick pk =
          route::route_token(a.route, a.route.logits + t * a.route.logit_stride, lane);
      if (lane < a.routed) ids_s[t * a.routed + lane] = pk.id;
      route::store_picks(a.route, t, lane, pk);
    }
    __syncthreads();
    if (threadIdx.x < 32) warp_lists(a, ids_s, 0, tok_s, true);
    cta_signal(a.sync + kSyncRouted);
  } else if (ticket <= gu_ctas) {
    const int i = ticket - 1;
    const int slot = i / o.gu_tiles, tile = i - slot * o.gu_tiles;
    const bool shared = slot < S;
    const ActiveExpert act = shared ? shared_expert(slot) : routed_expert(slot - S);
    if (act.e >= 0) {
      gate_up_rows<K, TC>(a, act, shared ? nullptr : tok_s, 0, tile * o.gu_units * 2, o.gu_units);
      cta_signal(a.sync + kSyncHDone + act.e * kSyncStride);
    }
  } else {
    const int i = ticket - 1 - gu_ctas;
    const int slot = i / o.dn_tiles, tile = i - slot * o.dn_tiles;
    const ActiveExpert act = slot < S ? shared_expert(slot) : routed_expert(slot - S);
    const int r_tile = tile * o.dn_units * kRows;
    if (act.e >= 0) {
      cta_wait(a.sync + kSyncHDone + act.e * kSyncStride, o.gu_tiles, o.poll_ns);
      down_rows<K, TC, true>(a, act, r_tile, o.dn_units);
    }
    combine_row_tile<true>(a, tile, S + o.routed_slots, r_tile,
                           min(o.dn_units * kRows, a.hidden - r_tile));
  }

  // The last CTA out resets the counters for the next launch (every CTA has passed its waits).
  __syncthreads();
  if (threadIdx.x == 0 && atomicAdd(a.sync + kSyncFinished, 1) == o.total - 1) {
    a.sync[kSyncTicket] = 0;
    a.sync[kSyncFinished] = 0;
    a.sync[kSyncRouted] = 0;
    for (int e = 0; e < E; ++e) a.sync[kSyncHDone + e * kSyncStride] = 0;
  }
}

// Tokens per pass: n_e <= T when a token's experts are distinct, so small steps get small
// passes (less shared memory, more CTAs per SM); capped by the staging budget.
int pick_tc(int64_t num_tokens, int K) {
  int tc = 1;
  while (tc < 8 && tc < num_tokens) tc <<= 1;
  while (tc > 1 && int64_t(tc) * K * 4 > kDecodeStageBytes) tc >>= 1;
  return tc;
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

// Returns whether the kernel does the combine (a.out, with a counter for every row tile).
template <WeightKind K, int TC>
bool launch_down(const DecodeFfnArgs& a, unsigned slots, cudaStream_t stream) {
  const size_t smem = size_t(TC) * a.inter * 4;
  const int units = units_per_cta(TC, (a.hidden + kRows - 1) / kRows, slots,
                                  resident_per_sm(down_kernel<K, TC>, smem), a.sm_count);
  const int rows = units * kRows;
  const dim3 grid(unsigned((a.hidden + rows - 1) / rows), slots);
  DecodeFfnArgs d = a;
  if (a.tile_done == nullptr || grid.x > unsigned(kTileCounters)) d.out = nullptr;
  pdl::launch(down_kernel<K, TC>, grid, kThreads, smem, stream, d, units);
  return d.out != nullptr;
}

template <WeightKind K, int TC>
void launch_gate_up(const DecodeFfnArgs& a, unsigned slots, cudaStream_t stream) {
  const size_t smem = size_t(TC) * a.hidden * 4;
  const int units = units_per_cta(TC, (a.inter + 1) / 2, slots,
                                  resident_per_sm(gate_up_kernel<K, TC>, smem), a.sm_count);
  const int rows = units * 2;
  const dim3 grid(unsigned((a.inter + rows - 1) / rows), slots);
  pdl::launch(gate_up_kernel<K, TC>, grid, kThreads, smem, stream, a, units);
}

template <WeightKind K, int TC>
void launch_one(const DecodeFfnArgs& a, cudaStream_t stream) {
  const size_t smem = size_t(TC) * std::max(a.hidden, a.inter) * 4;
  const int64_t wave = int64_t(resident_per_sm(moe_one_kernel<K, TC>, smem)) * a.sm_count;
  const int S = a.top_k - a.routed;
  OneLaunch o;
  o.routed_slots = int(std::min<int64_t>(a.num_experts - S, a.num_tokens * a.routed));
  const int slots = S + o.routed_slots;
  auto size = [&](int units) {
    o.gu_units = o.dn_units = units;
    o.gu_tiles = (a.inter + 2 * units - 1) / (2 * units);
    o.dn_tiles = (a.hidden + kRows * units - 1) / (kRows * units);
    o.total = 1 + slots * (o.gu_tiles + o.dn_tiles);
  };
  // m units of the base size per warp: DEEPSERVE_MOE_DECODE_UPW, else the smallest m <= 8 whose
  // whole grid is resident at once (then blockIdx orders the work; else tickets do).
  const int base = units_for(TC);
  const long long forced = g_moe_decode_upw.get();
  if (forced > 0) {
    size(base * int(std::min<long long>(forced, 64)));
  } else {
    for (int m = 1; m <= 8; ++m) {
      size(base * m);
      if (o.total <= wave) break;
    }
  }
  o.tickets = o.total > wave || g_moe_one_tickets.on();
  o.poll_ns = int(std::clamp<long long>(g_moe_one_poll_ns.get(), 0, 100000));
  DS_CHECK(o.dn_tiles <= kTileCounters, "moe one-launch: too many row tiles");
  pdl::launch(moe_one_kernel<K, TC>, dim3(unsigned(o.total)), kThreads, smem, stream, a, o);
}

// f(std::integral_constant<int, TC>) for the pass size tc (1, 2, 4 or 8).
template <typename F>
void with_tc(int tc, F&& f) {
  switch (tc) {
    case 1:
      f(std::integral_constant<int, 1>{});
      break;
    case 2:
      f(std::integral_constant<int, 2>{});
      break;
    case 4:
      f(std::integral_constant<int, 4>{});
      break;
    default:
      f(std::integral_constant<int, 8>{});
      break;
  }
}

// Launches both kernels; returns whether the down kernel does the combine.
template <WeightKind K>
bool launch_kind(const DecodeFfnArgs& a, int tc_gu, int tc_dn, unsigned slots,
                 cudaStream_t stream) {
  with_tc(tc_gu, [&](auto tc) { launch_gate_up<K, tc.value>(a, slots, stream); });
  bool fused = false;
  with_tc(tc_dn, [&](auto tc) { fused = launch_down<K, tc.value>(a, slots, stream); });
  return fused;
}

template <WeightKind K>
void prepare_kind() {
  const auto attr = cudaFuncAttributeMaxDynamicSharedMemorySize;
  for (int tc : {1, 2, 4, 8}) {
    with_tc(tc, [&](auto c) {
      check(cudaFuncSetAttribute(gate_up_kernel<K, c.value>, attr, kDecodeStageBytes),
            "smem limit");
      check(cudaFuncSetAttribute(down_kernel<K, c.value>, attr, kDecodeStageBytes), "smem limit");
      check(cudaFuncSetAttribute(moe_one_kernel<K, c.value>, attr, kDecodeStageBytes),
            "smem limit");
    });
  }
}

}  // namespace

bool one_launch_fits(int64_t num_tokens, int hidden, int inter) {
  return pick_tc(num_tokens, hidden) == pick_tc(num_tokens, inter);
}

void launch_decode_one(const DecodeFfnArgs& a, cudaStream_t stream) {
  DS_CHECK(a.ids && a.routes && a.sync && a.tile_done && a.out && a.expert_base == 0 &&
               a.num_tokens * a.top_k <= kWarpListMax &&
               one_launch_fits(a.num_tokens, a.hidden, a.inter),
           "moe one-launch: not a step it takes");
  with_tc(pick_tc(a.num_tokens, a.hidden), [&](auto tc) {
    switch (a.kind) {
      case WeightKind::BF16:
        launch_one<WeightKind::BF16, tc.value>(a, stream);
        break;
      case WeightKind::F16:
        launch_one<WeightKind::F16, tc.value>(a, stream);
        break;
      case WeightKind::F32:
        launch_one<WeightKind::F32, tc.value>(a, stream);
        break;
    }
  });
  check(cudaGetLastError(), "one-launch kernel");
}

void prepare_decode_kernels() {
  prepare_kind<WeightKind::BF16>();
  prepare_kind<WeightKind::F16>();
  prepare_kind<WeightKind::F32>();
}

bool launch_decode_ffn(const DecodeFfnArgs& a, cudaStream_t stream) {
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
