// MoE gate on the GPU: the route kernel (one warp per token) and moe_route's checks; the
// choice itself is route_token (moe_route.cuh).
#include <climits>
#include <cmath>
#include <string>

#include "backend/cuda/moe_route.cuh"
#include "backend/cuda/pdl.cuh"
#include "core/error.h"

namespace ds::cuda {
namespace route {
namespace {

constexpr int kRouteWarps = 4;

__global__ void __launch_bounds__(kRouteWarps * 32) route_kernel(RouteArgs a) {
  pdl::enter();
  const int lane = threadIdx.x & 31;
  const int64_t t = int64_t(blockIdx.x) * kRouteWarps + (threadIdx.x >> 5);
  if (t >= a.num_tokens) return;  // the whole warp leaves together
  store_picks(a, t, lane, route_token(a, a.logits + t * a.logit_stride, lane));
}

}  // namespace

RouteArgs route_args(const TensorView& logits, const MoeRouteParams& p, TensorView ids,
                     TensorView weights) {
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
  return a;
}

void launch_route(const RouteArgs& a, cudaStream_t stream) {
  const int64_t blocks = (a.num_tokens + kRouteWarps - 1) / kRouteWarps;
  pdl::launch(route_kernel, unsigned(blocks), kRouteWarps * 32, 0, stream, a);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw Error(std::string("CUDA moe_route: ") + cudaGetErrorString(err));
}

}  // namespace route

void moe_route(const Context& ctx, const TensorView& logits, const MoeRouteParams& p,
               TensorView ids, TensorView weights) {
  const route::RouteArgs a = route::route_args(logits, p, ids, weights);
  if (a.num_tokens > 0) route::launch_route(a, ctx.stream);
}

}  // namespace ds::cuda
