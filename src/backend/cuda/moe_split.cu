// The Split path's kernels (MoeFfnPath::Split, moe.cuh): a CTA per (touched expert, strip of
// F-rows) streams the strip's gate, up and down weights, then a reduce sums the strips and
// combines the slots.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <string>

#include "backend/cuda/moe.cuh"
#include "backend/cuda/moe_decode.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/switches.h"
#include "backend/cuda/weight_stream.cuh"
#include "core/error.h"

namespace ds::cuda::moe {
namespace {

using namespace decode;

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
  __shared__ SlotLists lists;
  const int* tok;  // token of sorted position tok_base + j: tok[tok_base + j]
  int tok_base;
  const ActiveExpert act = cta_slot(a, lists, tok, tok_base);
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
    stage_rows<V, kSplitThreads>(xs, a.x, a.x_stride, tok, tok_base + t0, nt, H, a.stage_regs);
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
static_assert(kReduceLanes == kMoeSplitMaxSlots, "one lane group per slot at least");

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

template <WeightKind K>
void launch_split_kind(const DecodeFfnArgs& a, int tc, dim3 grid, cudaStream_t stream) {
  with_tc(tc, [&](auto c) {
    pdl::launch(split_kernel<K, c.value>, grid, kSplitThreads, size_t(c.value) * a.hidden * 4,
                stream, a, int(grid.x));
  });
}

}  // namespace

void prepare_split_kernels() {
  const auto attr = cudaFuncAttributeMaxDynamicSharedMemorySize;
  for (int tc : {1, 2, 4, 8}) {
    decode::with_tc(tc, [&](auto c) {
      check(cudaFuncSetAttribute(split_kernel<WeightKind::BF16, c.value>, attr, kDecodeStageBytes),
            "smem limit");
      check(cudaFuncSetAttribute(split_kernel<WeightKind::F16, c.value>, attr, kDecodeStageBytes),
            "smem limit");
    });
  }
}

void launch_split_ffn(const DecodeFfnArgs& args, cudaStream_t stream) {
  DecodeFfnArgs a = args;
  a.stage_regs = g_row_regs.on();  // stage_rows' batched loads
  if (a.kind == WeightKind::F32)
    throw UnsupportedError("cuda moe_ffn: the split path takes BF16 or F16 experts");
  if (a.hidden % 8 != 0 || a.inter % 8 != 0)
    throw UnsupportedError("cuda moe_ffn: hidden and F must be multiples of 8");
  if (int64_t(a.hidden) * 4 > kDecodeStageBytes)
    throw UnsupportedError("cuda moe_ffn: hidden too large for the split kernel");
  if (a.top_k > kMoeSplitMaxSlots)
    throw UnsupportedError("cuda moe_ffn: the split path takes at most " +
                           std::to_string(kMoeSplitMaxSlots) + " slots per token");
  DS_CHECK(a.part != nullptr && a.out != nullptr && a.weights != nullptr,
           "split moe: no partial or output buffer");
  const int strips = split_strips(a.inter);
  const unsigned slots = unsigned(std::min<int64_t>(a.num_experts, a.num_tokens * a.top_k));
  const int tc = pick_tc(a.num_tokens, a.hidden);
  const dim3 grid(unsigned(strips), slots);
  if ((a.stages & 1) && a.kind == WeightKind::BF16)
    launch_split_kind<WeightKind::BF16>(a, tc, grid, stream);
  else if (a.stages & 1)
    launch_split_kind<WeightKind::F16>(a, tc, grid, stream);
  // Strip groups per slot: as many as the CTA's lanes hold (depends on slots and F only).
  const int groups = std::max(1, std::min(strips, kReduceLanes / a.top_k));
  const dim3 rgrid(unsigned((a.hidden + kReduceCols - 1) / kReduceCols), unsigned(a.num_tokens));
  if (a.stages & 2)
    pdl::launch(split_reduce_kernel, rgrid, kSplitThreads, 0, stream, a, strips, groups);
  check(cudaGetLastError(), "split kernels");
}

}  // namespace ds::cuda::moe
