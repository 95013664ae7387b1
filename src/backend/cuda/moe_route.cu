// MoE gate on the GPU: softmax over the experts, then greedy or group-limited top-k, one warp
// per token (DeepSeek-V2 MoEGate semantics, backend.h).
#include <cmath>
#include <string>

#include "backend/cuda/moe.cuh"
#include "backend/cuda/pdl.cuh"
#include "backend/cuda/switches.h"
#include "core/error.h"

namespace ds::cuda {
namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kPerLane = moe::kMaxExperts / 32;  // scores each lane holds
constexpr int kRouteWarps = 4;

struct RouteArgs {
  const float* logits = nullptr;  // [T, E], row stride logit_stride elements
  int64_t logit_stride = 0;
  int64_t num_tokens = 0;
  int num_experts = 0;
  int top_k = 0;
  bool group_limited = false;
  int n_group = 1;
  int topk_group = 1;
  bool norm = false;
  float scale = 1.0f;
  int32_t* ids = nullptr;  // [T, k]
  int64_t ids_stride = 0;
  float* weights = nullptr;  // [T, k]
  int64_t weights_stride = 0;
  unsigned long long* counts = nullptr;  // [E] or null
};

__device__ __forceinline__ double warp_sum(double v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(kFull, v, off);
  return v;
}

// The softmax of a warp's logits s (lane l holds experts l, l + 32, ...; m their maximum) in
// double, rounded to F32 as the CPU reference does, so both pick the same experts even when
// two scores are close; -inf past E.
template <int PL>
__device__ __forceinline__ void softmax_scores(float (&s)[PL], float m, int E, int lane) {
  double ex[PL];
  double sum = 0.0;
#pragma unroll
  for (int i = 0; i < PL; ++i) {
    const int idx = lane + 32 * i;
    ex[i] = idx < E ? exp(double(s[i]) - double(m)) : 0.0;
    sum += ex[i];
  }
  sum = warp_sum(sum);
#pragma unroll
  for (int i = 0; i < PL; ++i) {
    const int idx = lane + 32 * i;
    s[i] = idx < E ? float(ex[i] / sum) : -INFINITY;
  }
}

// The token warp threadIdx.x / 32 of this CTA routes (the kernels' grid: kRouteWarps a CTA).
__device__ __forceinline__ int64_t route_token() {
  return int64_t(blockIdx.x) * kRouteWarps + (threadIdx.x >> 5);
}

// Lane j < top_k stores token t's j-th pick: its expert and weight (normalized by `total`, the
// picks' scores summed in pick order, or scaled, as MoEGate), and counts the expert.
__device__ __forceinline__ void store_pick(const RouteArgs& a, int64_t t, int lane, int id,
                                           float score, double total) {
  if (lane >= a.top_k) return;
  const float w = a.norm && a.top_k > 1 ? float(double(score) / (total + 1e-20)) : score * a.scale;
  a.ids[t * a.ids_stride + lane] = id;
  a.weights[t * a.weights_stride + lane] = w;
  if (a.counts) atomicAdd(a.counts + id, 1ULL);
}

// A float's bits as an unsigned that orders as the float does (NaN aside), and back: so a
// warp's max is one redux.sync instead of five rounds of shuffles.
__device__ __forceinline__ unsigned ordered_bits(float v) {
  const unsigned b = __float_as_uint(v);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float from_ordered_bits(unsigned k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// One warp a token; lane l holds experts l, l + 32, ... (PL of them: E <= 32 PL). The choices
// are MoEGate's, in its order: softmax, then (group-limited) the topk_group groups of highest
// max score, the others' experts scored 0, then the top_k experts by score, equal scores to the
// lower index, k rounds of picking the best left. A score s >= 0 is held as the key
// bits(s) + 1 (0: an absent expert, or one already picked), so picking is two warp reductions
// (redux.sync: the best key, then the lowest index holding it) where an argmax over shuffles
// took ten dependent ones: the same experts, order and weights as that argmax.
template <int PL>
__global__ void __launch_bounds__(kRouteWarps * 32) route_kernel(RouteArgs a) {
  pdl::enter();
  const int lane = threadIdx.x & 31;
  const int64_t t = route_token();
  if (t >= a.num_tokens) return;  // the whole warp leaves together
  const int E = a.num_experts;
  const float* row = a.logits + t * a.logit_stride;

  float s[PL];
  unsigned mk = 0;  // below every float's key
#pragma unroll
  for (int i = 0; i < PL; ++i) {
    const int idx = lane + 32 * i;
    s[i] = idx < E ? row[idx] : -INFINITY;
    if (idx < E) mk = max(mk, ordered_bits(s[i]));
  }
  softmax_scores(s, from_ordered_bits(__reduce_max_sync(kFull, mk)), E, lane);
  unsigned key[PL];
#pragma unroll
  for (int i = 0; i < PL; ++i) key[i] = lane + 32 * i < E ? __float_as_uint(s[i]) + 1u : 0u;

  if (a.group_limited) {
    // Lane g keeps the max key of group g; then the topk_group best groups survive (equal maxima
    // to the lower group). As in MoEGate, experts of dropped groups score 0 and still take part
    // in the top-k.
    const int gsize = E / a.n_group;
    int gid[PL];
#pragma unroll
    for (int i = 0; i < PL; ++i) {
      const int idx = lane + 32 * i;
      gid[i] = idx < E ? idx / gsize : -1;
    }
    unsigned gk = 0;  // 0 past the groups: every group holds an expert, so its key is >= 1
    for (int g = 0; g < a.n_group; ++g) {
      unsigned gm = 0;
#pragma unroll
      for (int i = 0; i < PL; ++i) gm = gid[i] == g ? max(gm, key[i]) : gm;
      gm = __reduce_max_sync(kFull, gm);
      if (lane == g) gk = gm;
    }
    unsigned keep = 0;
    for (int r = 0; r < a.topk_group; ++r) {
      const unsigned best = __reduce_max_sync(kFull, gk);
      const int bi = int(__reduce_min_sync(kFull, gk == best ? unsigned(lane) : 32u));
      keep |= 1u << bi;
      if (lane == bi) gk = 0;
    }
    const unsigned zero = __float_as_uint(0.0f) + 1u;
#pragma unroll
    for (int i = 0; i < PL; ++i)
      if (gid[i] >= 0 && !((keep >> gid[i]) & 1u)) key[i] = zero;
  }

  // Greedy top-k: lane j keeps the j-th pick.
  int my_id = -1;
  float my_score = 0.0f;
  double total = 0.0;
  for (int j = 0; j < a.top_k; ++j) {
    unsigned lk = 0;
    int li = 0;
#pragma unroll
    for (int i = 0; i < PL; ++i) {
      if (key[i] > lk) {  // ascending index, strict: the lower index wins a tie
        lk = key[i];
        li = lane + 32 * i;
      }
    }
    const unsigned best = __reduce_max_sync(kFull, lk);  // >= 1: top_k <= E experts to pick
    const int bi = int(__reduce_min_sync(kFull, lk == best ? unsigned(li) : 0xffffffffu));
    const float bs = __uint_as_float(best - 1u);
    if (lane == j) {
      my_id = bi;
      my_score = bs;
    }
    total += bs;
    // Selects with constant indices keep key in registers (key[bi >> 5] would go to local memory).
    const bool mine = (bi & 31) == lane;
#pragma unroll
    for (int i = 0; i < PL; ++i) key[i] = mine && i == (bi >> 5) ? 0u : key[i];
  }

  store_pick(a, t, lane, my_id, my_score, total);
}

// route_kernel for E experts: the fewest scores a lane that hold them.
template <int PL = 1>
auto route_kernel_for(int E) {
  if constexpr (PL < kPerLane) {
    if (E > 32 * PL) return route_kernel_for<PL + 1>(E);
  }
  return &route_kernel<PL>;
}

}  // namespace

void moe_route(const Context& ctx, const TensorView& logits, const MoeRouteParams& p,
               TensorView ids, TensorView weights) {
  DS_CHECK(logits.dtype == DType::F32 && ids.dtype == DType::I32 && weights.dtype == DType::F32,
           "moe_route dtypes: logits F32, ids I32, weights F32");
  const int64_t T = logits.rows();
  const int64_t E = logits.cols();
  const int k = p.top_k;
  DS_CHECK(ids.rows() == T && weights.rows() == T && ids.cols() == k && weights.cols() == k,
           "moe_route shapes: logits " + logits.shape_str() + ", ids " + ids.shape_str() +
               ", weights " + weights.shape_str());
  if (E > moe::kMaxExperts || k > 32)
    throw UnsupportedError("cuda moe_route: at most " + std::to_string(moe::kMaxExperts) +
                           " experts and top_k 32 (got " + std::to_string(E) + ", " +
                           std::to_string(k) + ")");
  DS_CHECK(k >= 1 && k <= E, "moe_route: top_k out of range");
  const bool grouped = p.method == MoeTopk::GroupLimitedGreedy;
  if (grouped) {
    DS_CHECK(p.n_group >= 1 && p.n_group <= 32 && E % p.n_group == 0,
             "moe_route: n_group must divide the experts (at most 32 groups)");
    DS_CHECK(p.topk_group >= 1 && p.topk_group <= p.n_group,
             "moe_route: topk_group must lie in [1, n_group]");
  }
  DS_CHECK(
      logits.row_stride() % 4 == 0 && ids.row_stride() % 4 == 0 && weights.row_stride() % 4 == 0,
      "moe_route: misaligned rows");
  if (T == 0) return;

  RouteArgs a;
  a.logits = logits.ptr<float>();
  a.logit_stride = logits.row_stride() / 4;
  a.num_tokens = T;
  a.num_experts = int(E);
  a.top_k = k;
  a.group_limited = grouped;
  a.n_group = grouped ? p.n_group : 1;
  a.topk_group = grouped ? p.topk_group : 1;
  a.norm = p.norm_topk_prob;
  a.scale = p.routed_scaling_factor;
  a.ids = ids.ptr<int32_t>();
  a.ids_stride = ids.row_stride() / 4;
  a.weights = weights.ptr<float>();
  a.weights_stride = weights.row_stride() / 4;
  a.counts = reinterpret_cast<unsigned long long*>(p.expert_counts);
  const int64_t blocks = (T + kRouteWarps - 1) / kRouteWarps;
  pdl::launch(route_kernel_for(int(E)), unsigned(blocks), kRouteWarps * 32, 0, ctx.stream, a);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw Error(std::string("CUDA moe_route: ") + cudaGetErrorString(err));
}

}  // namespace ds::cuda
