// The MoE router's choice on the GPU (DeepSeek-V2 MoEGate semantics, backend.h): F32 softmax
// over the experts, then greedy or group-limited top-k, one warp per token. Used by the route
// kernel (moe_route.cu) and, for small decode steps, by the one-launch MoE kernel
// (moe_decode.cu), so both make the same picks.
#pragma once

#include <climits>
#include <cmath>
#include <cstdint>

#include "backend/backend.h"
#include "backend/cuda/moe.cuh"

namespace ds::cuda::route {

// RouteArgs: moe.cuh (the decode experts' arguments carry one).

// Checks moe_route's arguments (throws on bad shapes, dtypes or options) and builds the
// kernel's view of them.
RouteArgs route_args(const TensorView& logits, const MoeRouteParams& p, TensorView ids,
                     TensorView weights);
// The route kernel over every token of a (num_tokens > 0).
void launch_route(const RouteArgs& a, cudaStream_t stream);

#if defined(__CUDACC__)
constexpr unsigned kFull = 0xffffffffu;
constexpr int kPerLane = moe::kMaxExperts / 32;  // scores each lane holds

__device__ __forceinline__ float warp_max(float v) {
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, off));
  return v;
}

__device__ __forceinline__ double warp_sum(double v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(kFull, v, off);
  return v;
}

// Highest score, ties to the lower index; (score, index) is a total order, so every lane
// ends with the same winner.
__device__ __forceinline__ void warp_argmax(float& s, int& i) {
  for (int off = 16; off > 0; off >>= 1) {
    const float os = __shfl_xor_sync(kFull, s, off);
    const int oi = __shfl_xor_sync(kFull, i, off);
    if (os > s || (os == s && oi < i)) {
      s = os;
      i = oi;
    }
  }
}

// Lane j < top_k's pick for one token: its j-th expert and weight.
struct Pick {
  int id;
  float weight;
};

// The picks for logits row `row` (a.num_experts F32 scores), by one whole warp.
__device__ __forceinline__ Pick route_token(const RouteArgs& a, const float* row, int lane) {
  const int E = a.num_experts;

  // Lane l holds experts l, l + 32, ...; absent experts score -inf so they are never chosen.
  // The softmax runs in double and is rounded to F32 scores, as the CPU reference does, so
  // both pick the same experts even when two scores are close.
  float s[kPerLane];
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int idx = lane + 32 * i;
    s[i] = idx < E ? row[idx] : -INFINITY;
    m = fmaxf(m, s[i]);
  }
  m = warp_max(m);
  double ex[kPerLane];
  double sum = 0.0;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int idx = lane + 32 * i;
    ex[i] = idx < E ? exp(double(s[i]) - double(m)) : 0.0;
    sum += ex[i];
  }
  sum = warp_sum(sum);
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int idx = lane + 32 * i;
    s[i] = idx < E ? float(ex[i] / sum) : -INFINITY;
  }

  if (a.group_limited) {
    // Lane g keeps the max score of group g; then the topk_group best groups survive. As in
    // MoEGate, experts of dropped groups score 0 and still take part in the top-k.
    const int gsize = E / a.n_group;
    float my_group = -INFINITY;
    for (int g = 0; g < a.n_group; ++g) {
      float gm = -INFINITY;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const int idx = lane + 32 * i;
        if (idx < E && idx / gsize == g) gm = fmaxf(gm, s[i]);
      }
      gm = warp_max(gm);
      if (lane == g) my_group = gm;
    }
    float gs = lane < a.n_group ? my_group : -INFINITY;
    int gi = lane < a.n_group ? lane : INT_MAX;
    unsigned keep = 0;
    for (int r = 0; r < a.topk_group; ++r) {
      float bs = gs;
      int bi = gi;
      warp_argmax(bs, bi);
      keep |= 1u << bi;
      if (lane == bi) {
        gs = -INFINITY;
        gi = INT_MAX;
      }
    }
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int idx = lane + 32 * i;
      if (idx < E && !((keep >> (idx / gsize)) & 1u)) s[i] = 0.0f;
    }
  }

  // Greedy top-k: k rounds of warp argmax; lane j keeps the j-th pick.
  int my_id = -1;
  float my_score = 0.0f;
  double total = 0.0;
  for (int j = 0; j < a.top_k; ++j) {
    float bs = -INFINITY;
    int bi = INT_MAX;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      if (s[i] > bs) {  // ascending index, strict: the lower index wins a tie
        bs = s[i];
        bi = lane + 32 * i;
      }
    }
    warp_argmax(bs, bi);
    if (lane == j) {
      my_id = bi;
      my_score = bs;
    }
    total += bs;
    // Selects with constant indices keep s in registers (s[bi >> 5] would go to local memory).
    const bool mine = (bi & 31) == lane;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) s[i] = mine && i == (bi >> 5) ? -INFINITY : s[i];
  }

  Pick pk{my_id, 0.0f};
  if (lane < a.top_k)
    pk.weight =
        a.norm && a.top_k > 1 ? float(double(my_score) / (total + 1e-20)) : my_score * a.scale;
  return pk;
}

// Stores token t's picks (lanes < top_k) into a's ids, weights and counts.
__device__ __forceinline__ void store_picks(const RouteArgs& a, int64_t t, int lane, Pick pk) {
  if (lane < a.top_k) {
    a.ids[t * a.ids_stride + lane] = pk.id;
    a.weights[t * a.weights_stride + lane] = pk.weight;
    if (a.counts) atomicAdd(a.counts + pk.id, 1ULL);
  }
}
#endif

}  // namespace ds::cuda::route
