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

// Copies nt rows of length K (F32, global) into shared memory in the staged layout (a CTA of
// NT threads).
template <int V, int NT = kThreads>
__device__ __forceinline__ void stage_rows(float* xs, const float* src, int64_t src_stride,
                                           const int* row_ids, int row_base, int nt, int K) {
  const int chunks = K / V;
  for (int j = 0; j < nt; ++j) {
    const int64_t r = row_ids ? row_ids[row_base + j] : row_base + j;
    const float* s = src + r * src_stride;
    for (int k = threadIdx.x; k < K; k += NT) xs[j * K + stage_index<V>(k, chunks)] = s[k];
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

// The token lists of a step of at most kWarpListMax assignments, by one warp from ids alone, in
// the token-list kernel's order (experts ascending, an expert's assignments by index): returns
// slot `slot`'s active expert and its sorted range, and puts its tokens in tok[0, count). store:
// also writes the lists the down kernel and the combine read (pos, sorted_token, active,
// n_active and the active experts' offsets).
__device__ __forceinline__ ActiveExpert warp_lists(const DecodeFfnArgs& a, int slot, int* tok,
                                                   bool store) {
  const int lane = threadIdx.x & 31;
  const int slots = a.top_k;
  const int n = int(a.num_tokens) * slots;
  const int e =
      lane < n ? expert_of(a.ids, lane, a.routed, slots - a.routed, a.num_experts, a.expert_base)
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

// Grid (ceil(F / rows_per_cta), min(E, N)); a warp's unit is 2 F-rows of gate and up.
template <WeightKind K, int TC>
__global__ void __launch_bounds__(kThreads) gate_up_kernel(DecodeFfnArgs a, int units_per_cta) {
  pdl::enter();
  constexpr int V = wstream::kChunkElems<K>;
  extern __shared__ float4 smem4[];
  float* xs = reinterpret_cast<float*>(smem4);
  // The slot's expert and the rows of x its tokens are: from the token lists, or built here.
  __shared__ int warp_tok[kWarpListMax];
  __shared__ ActiveExpert warp_act;
  ActiveExpert act;
  const int* tok = a.lists.sorted_token;  // token of sorted position tok_base + j
  int tok_base = 0;
  if (a.ids) {
    if (threadIdx.x < 32) {
      const ActiveExpert found =
          warp_lists(a, blockIdx.y, warp_tok, blockIdx.x == 0 && blockIdx.y == 0);
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

// The fused combine, run by every CTA of the down grid after its rows of y are stored (active
// expert or not): the last CTA of row tile blockIdx.x to arrive (one counter per tile, reset by
// that CTA for the next launch) writes out[t, r_tile .. + rows) for every token through
// combine_cols, as the combine kernel does (moe_lists.cu), so the bits are the same.
__device__ __forceinline__ void combine_row_tile(const DecodeFfnArgs& a, int r_tile, int rows) {
  __shared__ int last;
  __threadfence();  // this thread's y stores are visible before the CTA is counted
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(a.tile_done + blockIdx.x, 1) == int(gridDim.y) - 1;
    if (last) a.tile_done[blockIdx.x] = 0;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
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
}

// A down CTA's rows [r_tile, r_tile + units_per_cta * kRows) of expert act.e for its tokens.
template <WeightKind K, int TC>
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
    stage_rows<V>(xs, a.h, F, nullptr, begin + t0, nt, F);
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
  if (a.out) combine_row_tile(a, r_tile, tile_rows);
}

// ---- Split path -------------------------------------------------------------------------
// A CTA per (touched expert, strip of kSplitRows F-rows): its gate and up rows give the strip's
// h = silu(gate x) * up x in shared memory, then the same F-columns of down (kSplitRows
// elements of each of the hidden rows) multiply it, and the CTA stores one partial output row
// per (token, strip). Every weight byte is read by one CTA of one launch, and no CTA waits for
// another; the reduce kernel then sums the strips and combines the slots.
constexpr int kSplitWarps = 8;
constexpr int kSplitThreads = kSplitWarps * 32;
constexpr int kSplitChunks = kSplitRows / 8;  // 16-byte chunks of a strip's down row
constexpr int kSplitRowGroups = kSplitThreads / kSplitChunks;  // down rows in flight per pass
constexpr int kSplitBatch = 8;  // partial rows a reduce thread loads at once

// Passes of up to 2 tokens fit three CTAs per SM (79 and 76 registers, no spills, sm_90a);
// unbounded, the 2-token pass took 100 registers, two CTAs per SM, so a 2-token step with 2
// shared experts (~13 experts x 44 strips = 585 CTAs) needed 2.2 waves.
template <WeightKind K, int TC>
__global__ void __launch_bounds__(kSplitThreads, TC <= 2 ? 3 : 2)
    split_kernel(DecodeFfnArgs a, int strips) {
  constexpr int kBatch = 8;  // down rows a thread loads at once
  static_assert(wstream::kChunkElems<K> == 8, "2-byte weights");
  constexpr int V = 8;
  pdl::enter();
  extern __shared__ float4 smem4[];
  float* xs = reinterpret_cast<float*>(smem4);
  __shared__ float hs[TC][kSplitRows];
  __shared__ int warp_tok[kWarpListMax];
  __shared__ ActiveExpert warp_act;
  ActiveExpert act;
  const int* tok = a.lists.sorted_token;
  int tok_base = 0;
  if (a.ids) {
    if (threadIdx.x < 32) {
      const ActiveExpert found =
          warp_lists(a, blockIdx.y, warp_tok, blockIdx.x == 0 && blockIdx.y == 0);
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
  const int begin = act.begin, count = act.count;
  const ExpertPtrs ex = a.experts[act.e];
  constexpr int esize = 2;
  const int64_t gate_ld = ex.gate_ld * esize, up_ld = ex.up_ld * esize;
  const int64_t down_ld = ex.down_ld * esize;
  const uint8_t* gate = static_cast<const uint8_t*>(ex.gate);
  const uint8_t* up = static_cast<const uint8_t*>(ex.up);
  const int H = a.hidden;
  const int f_strip = blockIdx.x * kSplitRows;
  const int nf = min(kSplitRows, a.inter - f_strip);  // a multiple of 8: F is
  // This thread's 16-byte chunk of the strip in each down row, and its first row.
  const int chunk = threadIdx.x % kSplitChunks;
  const int row0 = threadIdx.x / kSplitChunks;
  const bool has_chunk = chunk * 8 < nf;
  const uint8_t* down = static_cast<const uint8_t*>(ex.down) + (f_strip + chunk * 8) * esize;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  // Unit u: gate and up of F-rows f_strip + 2u and + 2u + 1 (nf is even).
  auto unit_rows = [&](int u, const uint8_t*(&rows)[kRows]) {
    const int f0 = f_strip + 2 * u;
    rows[0] = gate + f0 * gate_ld;
    rows[1] = up + f0 * up_ld;
    rows[2] = gate + (f0 + 1) * gate_ld;
    rows[3] = up + (f0 + 1) * up_ld;
  };
  if (a.prefetch_down && has_chunk) {  // the strip of down, toward L2 while gate/up stream
    for (int r = row0; r < H; r += kSplitRowGroups)
      asm volatile("prefetch.global.L2 [%0];" ::"l"(down + r * down_ld));
  }
  if (2 * warp < nf) {
    const uint8_t* rows[kRows];
    unit_rows(warp, rows);
    prefetch_l2(rows, H * esize);
  }

  for (int t0 = 0; t0 < count; t0 += TC) {
    const int nt = min(TC, count - t0);
    if (t0 > 0) __syncthreads();  // the previous pass is done reading xs and hs
    stage_rows<V, kSplitThreads>(xs, a.x, a.x_stride, tok, tok_base + t0, nt, H);
    __syncthreads();
    for (int u = warp; 2 * u < nf; u += kSplitWarps) {
      const uint8_t* rows[kRows];
      unit_rows(u, rows);
      float acc[kRows][TC];
      dot_rows<K, TC>(rows, H / V, xs, H, nt, acc);
#pragma unroll
      for (int j = 0; j < TC; ++j) {
        if (j < nt && lane == j) {
          hs[j][2 * u] = silu(acc[0][j]) * acc[1][j];
          hs[j][2 * u + 1] = silu(acc[2][j]) * acc[3][j];
        }
      }
    }
    __syncthreads();
    // Down rows r = row0 + kSplitRowGroups * i: each thread dots its chunk (8 F-columns) with h,
    // then the kSplitChunks threads of a row add theirs in a fixed butterfly (all get the sum).
    for (int rb = row0; rb - row0 < H; rb += kSplitRowGroups * kBatch) {
      uint4 w[kBatch];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int r = rb + kSplitRowGroups * i;
        w[i] = has_chunk && r < H ? __ldg(reinterpret_cast<const uint4*>(down + r * down_ld))
                                  : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int r = rb + kSplitRowGroups * i;
        float wf[V];
        wstream::chunk_to_float<K>(w[i], wf);
#pragma unroll
        for (int j = 0; j < TC; ++j) {
          if (j < nt) {
            float acc = 0.0f;
            if (has_chunk) {
#pragma unroll
              for (int e = 0; e < V; ++e) acc = fmaf(wf[e], hs[j][chunk * 8 + e], acc);
            }
#pragma unroll
            for (int off = 1; off < kSplitChunks; off <<= 1)
              acc += __shfl_xor_sync(kFull, acc, off);
            if (chunk == 0 && r < H)
              a.part[(int64_t(begin + t0 + j) * strips + blockIdx.x) * H + r] = acc;
          }
        }
      }
    }
  }
}

// out[t, c .. c + 4) for the columns of CTA (blockIdx.x, token blockIdx.y): each (slot j,
// strip group g) thread pair sums strips g, g + G, ... of the slot's partial rows (ascending);
// then one thread per (slot, column quad) adds the slot's groups in order, and one per column
// quad combines the slots as combine_cols does (routed: fma with the weight, ascending; shared:
// added). The order depends on slots and strips alone, never on the other tokens.
constexpr int kReduceCols = 32;
constexpr int kReduceQuads = kReduceCols / 4;
constexpr int kReduceLanes = kSplitThreads / kReduceQuads;  // (slot, group) pairs per CTA

__device__ __forceinline__ void add4(float4& a, const float4& b) {
  a.x += b.x;
  a.y += b.y;
  a.z += b.z;
  a.w += b.w;
}

__global__ void __launch_bounds__(kSplitThreads)
    split_reduce_kernel(DecodeFfnArgs a, int strips, int groups) {
  pdl::enter();
  __shared__ float4 red[kReduceLanes][kReduceQuads];
  __shared__ float4 slot_sum[kReduceLanes][kReduceQuads];
  const int t = blockIdx.y;
  const int quad = threadIdx.x % kReduceQuads;
  const int q = threadIdx.x / kReduceQuads;
  const int col = blockIdx.x * kReduceCols + quad * 4;
  const int slots = a.top_k;
  const int H = a.hidden;
  const int* tp = a.lists.pos + int64_t(t) * slots;
  const bool live = col < H;
  if (q < slots * groups && live) {
    const int j = q / groups, g = q % groups;
    const int p = tp[j];
    float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (p >= 0) {
      const float* base = a.part + int64_t(p) * strips * H + col;
      for (int s0 = g; s0 < strips; s0 += groups * kSplitBatch) {
        float4 v[kSplitBatch];
#pragma unroll
        for (int i = 0; i < kSplitBatch; ++i) {
          const int s = s0 + groups * i;
          v[i] = s < strips ? __ldcg(reinterpret_cast<const float4*>(base + int64_t(s) * H))
                            : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
#pragma unroll
        for (int i = 0; i < kSplitBatch; ++i)
          if (s0 + groups * i < strips) add4(sum, v[i]);
      }
    }
    red[q][quad] = sum;
  }
  __syncthreads();
  if (q < slots && live) {  // slot q's row: its groups in order
    float4 y = red[q * groups][quad];
    for (int g = 1; g < groups; ++g) add4(y, red[q * groups + g][quad]);
    slot_sum[q][quad] = y;
  }
  __syncthreads();
  if (q != 0 || !live) return;
  float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  for (int j = 0; j < slots; ++j) {
    if (tp[j] < 0) continue;
    const float4 y = slot_sum[j][quad];
    if (j < a.routed) {
      const float w = a.weights[int64_t(t) * a.routed + j];
      acc.x = fmaf(w, y.x, acc.x);
      acc.y = fmaf(w, y.y, acc.y);
      acc.z = fmaf(w, y.z, acc.z);
      acc.w = fmaf(w, y.w, acc.w);
    } else {
      add4(acc, y);
    }
  }
  float* o = a.out + int64_t(t) * a.out_stride + col;  // rows need not be 16-byte aligned
  o[0] = acc.x;
  o[1] = acc.y;
  o[2] = acc.z;
  o[3] = acc.w;
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
      if constexpr (K != WeightKind::F32)
        check(cudaFuncSetAttribute(split_kernel<K, c.value>, attr, kDecodeStageBytes),
              "smem limit");
    });
  }
}

template <WeightKind K>
void launch_split_kind(const DecodeFfnArgs& a, int tc, dim3 grid, cudaStream_t stream) {
  with_tc(tc, [&](auto c) {
    pdl::launch(split_kernel<K, c.value>, grid, kSplitThreads, size_t(c.value) * a.hidden * 4,
                stream, a, int(grid.x));
  });
}

}  // namespace

void prepare_decode_kernels() {
  prepare_kind<WeightKind::BF16>();
  prepare_kind<WeightKind::F16>();
  prepare_kind<WeightKind::F32>();
}

void launch_split_ffn(const DecodeFfnArgs& a, cudaStream_t stream) {
  if (a.kind == WeightKind::F32)
    throw UnsupportedError("cuda moe_ffn: the split path takes BF16 or F16 experts");
  if (a.hidden % 8 != 0 || a.inter % 8 != 0)
    throw UnsupportedError("cuda moe_ffn: hidden and F must be multiples of 8");
  if (int64_t(a.hidden) * 4 > kDecodeStageBytes)
    throw UnsupportedError("cuda moe_ffn: hidden too large for the split kernel");
  if (a.top_k > kReduceLanes)
    throw UnsupportedError("cuda moe_ffn: the split path takes at most " +
                           std::to_string(kReduceLanes) + " slots per token");
  DS_CHECK(a.part != nullptr && a.out != nullptr && a.weights != nullptr,
           "split moe: no partial or output buffer");
  const int strips = split_strips(a.inter);
  const unsigned slots = unsigned(std::min<int64_t>(a.num_experts, a.num_tokens * a.top_k));
  const int tc = pick_tc(a.num_tokens, a.hidden);
  const dim3 grid(unsigned(strips), slots);
  if (a.kind == WeightKind::BF16)
    launch_split_kind<WeightKind::BF16>(a, tc, grid, stream);
  else
    launch_split_kind<WeightKind::F16>(a, tc, grid, stream);
  // Strip groups per slot: as many as the CTA's lanes hold (depends on slots and F only).
  const int groups = std::max(1, std::min(strips, kReduceLanes / a.top_k));
  const dim3 rgrid(unsigned((a.hidden + kReduceCols - 1) / kReduceCols), unsigned(a.num_tokens));
  pdl::launch(split_reduce_kernel, rgrid, kSplitThreads, 0, stream, a, strips, groups);
  check(cudaGetLastError(), "split kernels");
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
