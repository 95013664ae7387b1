// Device helpers of the decode-sized MoE kernels (moe_decode.cu: the Decode path's gate/up and
// down kernels; moe_split.cu: the Split path): the activations staged in shared memory as F32, a
// warp's dot products against rows of weights streamed with 16-byte loads, and the token lists
// a step of a few assignments builds in one warp. CUDA sources only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "backend/cuda/moe.cuh"
#include "backend/cuda/weight_stream.cuh"

namespace ds::cuda::moe::decode {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRows = 4;    // weight rows a warp streams together (x is reused across them)
constexpr int kUnroll = 2;  // 16-byte chunks per row a lane has in flight (dot_rows' default U)

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

// Elements of a row a thread of stage_rows loads at once with `batched`: rows of up to
// kStageBatch * NT (V2-Lite's hidden 2,048 and F 1,408 at 128 threads) in one round trip.
constexpr int kStageBatch = 16;

// Copies nt rows of length K (F32, global) into shared memory in the staged layout (a CTA of
// NT threads). L2: the rows read through L2 only (before a wait, rows two launches back).
// batched (DEEPSERVE_ROW_REGS=1): a thread's loads of a row issue kStageBatch at a time, then
// its stores; the loop form peels and unrolls by 4 (SASS: 1, 2, then 4 loads per round trip,
// about 5 round trips for a row of 16 elements a thread). The same values in the same places.
template <int V, int NT = kThreads, bool L2 = false>
__device__ __forceinline__ void stage_rows(float* xs, const float* src, int64_t src_stride,
                                           const int* row_ids, int row_base, int nt, int K,
                                           bool batched = false) {
  const int chunks = K / V;
  for (int j = 0; j < nt; ++j) {
    const int64_t r = row_ids ? row_ids[row_base + j] : row_base + j;
    const float* s = src + r * src_stride;
    if (batched) {
      for (int k0 = int(threadIdx.x); k0 < K; k0 += kStageBatch * NT) {
        float v[kStageBatch];
#pragma unroll
        for (int b = 0; b < kStageBatch; ++b) {
          const int k = k0 + b * NT;
          v[b] = k < K ? (L2 ? __ldcg(s + k) : s[k]) : 0.0f;
        }
#pragma unroll
        for (int b = 0; b < kStageBatch; ++b) {
          const int k = k0 + b * NT;
          if (k < K) xs[j * K + stage_index<V>(k, chunks)] = v[b];
        }
      }
      continue;
    }
    for (int k = threadIdx.x; k < K; k += NT)
      xs[j * K + stage_index<V>(k, chunks)] = L2 ? __ldcg(s + k) : s[k];
  }
}

// A lane's step of a warp's rows: chunks c0 + 32 u (u < U) of every row, zeros past the row.
template <int U>
__device__ __forceinline__ void load_step(const uint8_t* const (&rows)[kRows], int chunks, int c0,
                                          uint4 (&w)[U][kRows]) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int c = c0 + 32 * u;
#pragma unroll
    for (int r = 0; r < kRows; ++r)
      w[u][r] =
          c < chunks ? __ldg(reinterpret_cast<const uint4*>(rows[r]) + c) : make_uint4(0, 0, 0, 0);
  }
}

// acc[r][j] = dot(row r, staged token j) for j < nt, summed over the whole warp (every
// lane ends with the same value). Rows are byte pointers to 16-byte aligned rows of K
// elements. kFirst and use_first: the lane's first step (load_step at c0 = lane) is `first`,
// loaded earlier (the down kernel's, before its wait); it is taken out of the loop, so `first`
// is dead after it. The sums are the same.
template <WeightKind K, int TC, int U = kUnroll, bool kFirst = false>
__device__ __forceinline__ void dot_rows(const uint8_t* const (&rows)[kRows], int chunks,
                                         const float* xs, int Klen, int nt, float (&acc)[kRows][TC],
                                         const uint4 (&first)[U][kRows] = {},
                                         bool use_first = false) {
  constexpr int V = wstream::kChunkElems<K>;
  constexpr int P = V / 4;
  const int lane = threadIdx.x & 31;
  const float4* xs4 = reinterpret_cast<const float4*>(xs);
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int j = 0; j < TC; ++j) acc[r][j] = 0.0f;

  // The products of step c0's chunks w.
  auto step = [&](int c0, const uint4(&w)[U][kRows]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
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
  };
  int c0 = lane;
  if constexpr (kFirst) {
    if (use_first && c0 < chunks) {
      step(c0, first);
      c0 += 32 * U;
    }
  }
  for (; c0 < chunks; c0 += 32 * U) {
    uint4 w[U][kRows];
    load_step<U>(rows, chunks, c0, w);
    step(c0, w);
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

// The expert of the lane's assignment (lane = t * top_k + j) of a step of at most kWarpListMax
// assignments read from a.ids (expert_of; -1 past the step or for an id out of range).
template <bool L2 = false>
__device__ __forceinline__ int lane_expert(const DecodeFfnArgs& a) {
  const int lane = threadIdx.x & 31;
  const int slots = a.top_k;
  const int n = int(a.num_tokens) * slots;
  return lane < n
             ? expert_of<L2>(a.ids, lane, a.routed, slots - a.routed, a.num_experts, a.expert_base)
             : -1;
}

// The token lists of a step of at most kWarpListMax assignments, by one warp from ids alone, in
// the token-list kernel's order (experts ascending, an expert's assignments by index): returns
// slot `slot`'s active expert and its sorted range, and puts its tokens in tok[0, count). store:
// also writes the lists the down kernel and the combine read (pos, sorted_token, active,
// n_active and the active experts' offsets).
// L2: ids read through L2 only (the down kernel's lookup before its wait; store must be false).
template <bool L2 = false>
__device__ __forceinline__ ActiveExpert warp_lists(const DecodeFfnArgs& a, int slot, int* tok,
                                                   bool store) {
  const int lane = threadIdx.x & 31;
  const int slots = a.top_k;
  const int n = int(a.num_tokens) * slots;
  const int e = lane_expert<L2>(a);
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

// The sorted position of expert e's first assignment in the lists warp_lists builds: the valid
// assignments to lower experts (one warp; every lane returns it).
__device__ __forceinline__ int warp_begin_of(const DecodeFfnArgs& a, int e) {
  const int ei = lane_expert(a);
  return __popc(__ballot_sync(kFull, ei >= 0 && ei < e));
}

// Where warp 0 builds a slot's lists for its CTA: the slot's tokens and active expert.
struct SlotLists {
  int tok[kWarpListMax];
  ActiveExpert act;
};

// Slot `slot`'s active expert, its tokens in s.tok: built by warp 0 (warp_lists) and handed to
// the CTA through s (a barrier: every thread calls it).
template <bool L2 = false>
__device__ __forceinline__ ActiveExpert cta_warp_lists(const DecodeFfnArgs& a, int slot,
                                                       SlotLists& s, bool store) {
  if (threadIdx.x < 32) {
    const ActiveExpert found = warp_lists<L2>(a, slot, s.tok, store);
    if (threadIdx.x == 0) s.act = found;
  }
  __syncthreads();
  return s.act;
}

// A gate/up or split CTA's slot (blockIdx.y): returns its active expert (e < 0: none) and sets
// where the rows of x its tokens are (the token of the expert's sorted position tok_base + j is
// tok[tok_base + j]): from the token lists, or, with a.ids, built here by warp 0 into s
// (CTA (0, 0) also stores the lists). Every thread of the CTA calls it (a barrier with a.ids).
__device__ __forceinline__ ActiveExpert cta_slot(const DecodeFfnArgs& a, SlotLists& s,
                                                 const int*& tok, int& tok_base) {
  ActiveExpert act;
  tok = a.lists.sorted_token;
  tok_base = 0;
  if (a.ids) {
    act = cta_warp_lists(a, blockIdx.y, s, blockIdx.x == 0 && blockIdx.y == 0);
    tok = s.tok;
  } else {
    act = active_expert(a, blockIdx.y);
    tok_base = act.begin;
  }
  return act;
}

__device__ __forceinline__ float silu(float g) {
  return g / (1.0f + expf(-g));
}

// Tokens per pass: n_e <= T when a token's experts are distinct, so small steps get small
// passes (less shared memory, more CTAs per SM); capped by the staging budget.
inline int pick_tc(int64_t num_tokens, int K) {
  int tc = 1;
  while (tc < 8 && tc < num_tokens) tc <<= 1;
  while (tc > 1 && int64_t(tc) * K * 4 > kDecodeStageBytes) tc >>= 1;
  return tc;
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

}  // namespace ds::cuda::moe::decode
