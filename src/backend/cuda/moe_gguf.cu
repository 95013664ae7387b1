// MoE experts with GGUF block-quantized weights over the device token lists (moe.cuh): per
// (expert, block of weight rows) CTAs stream the expert's rows once per pass of kTm of its
// tokens with gguf_blocks.cuh's warp core, gate and up together so h = silu(gate x) * up x is
// written directly, then down. Graph-capturable; every output a fixed-order sum of its own
// token's row. Experts with no tokens exit at once.
#include <string>

#include "backend/cuda/common.cuh"
#include "backend/cuda/gguf_blocks.cuh"
#include "backend/cuda/moe.cuh"
#include "backend/cuda/pdl.cuh"

namespace ds::cuda::moe {
namespace {

using namespace gguf;

template <DType T>
__device__ __forceinline__ void warp_dot(const uint8_t* const (&rows)[kRows], int64_t K,
                                         const float* const (&xs)[kTm], int lane,
                                         float (&v)[kRows * kTm]) {
  lane_dot<T, kTm>(rows, K, xs, lane, v);
  DS_UNROLL
  for (int i = 0; i < kRows * kTm; ++i) {
    DS_UNROLL
    for (int o = 16; o > 0; o /= 2) v[i] += __shfl_xor_sync(0xffffffffu, v[i], o);
  }
}

__device__ __forceinline__ float pick(const float (&v)[kRows * kTm], int lane) {
  float r = 0.0f;
  DS_UNROLL
  for (int k = 0; k < kRows * kTm; ++k)
    if (k == lane) r = v[k];
  return r;
}

// Expert blockIdx.y's sorted positions [begin, end) and the warp's first weight row.
struct ExpertWarp {
  int e, begin, end, lane;
  int64_t row0;
  bool run;
  __device__ ExpertWarp(const TokenLists& lists, int64_t rows) {
    e = int(blockIdx.y);
    begin = lists.offsets[e];
    end = lists.offsets[e + 1];
    lane = int(threadIdx.x) % 32;
    row0 = (int64_t(blockIdx.x) * kWarps + int(threadIdx.x) / 32) * kRows;
    run = begin < end && row0 < rows;
  }
};

// h[p, f] = silu(gate_f . x[token(p)]) * (up_f . x[token(p)]) for expert blockIdx.y's positions.
template <DType T>
__global__ void __launch_bounds__(kThreads)
    gguf_gate_up_kernel(const ExpertPtrs* experts, TokenLists lists, const float* x,
                        int64_t x_stride, int hidden, int inter, float* h) {
  pdl::enter();
  const ExpertWarp w(lists, inter);
  if (!w.run) return;
  const auto* gate = static_cast<const uint8_t*>(experts[w.e].gate);
  const auto* up = static_cast<const uint8_t*>(experts[w.e].up);
  const int64_t g_ld = experts[w.e].gate_ld, u_ld = experts[w.e].up_ld;
  const uint8_t *g_rows[kRows], *u_rows[kRows];
  DS_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const int64_t row = w.row0 + r < inter ? w.row0 + r : inter - 1;
    g_rows[r] = gate + row * g_ld;
    u_rows[r] = up + row * u_ld;
  }
  const int r = w.lane / kTm, j = w.lane % kTm;
  for (int p0 = w.begin; p0 < w.end; p0 += kTm) {
    const float* xs[kTm];
    DS_UNROLL
    for (int t = 0; t < kTm; ++t)
      xs[t] = p0 + t < w.end ? x + int64_t(lists.sorted_token[p0 + t]) * x_stride : nullptr;
    float vg[kRows * kTm], vu[kRows * kTm];
    warp_dot<T>(g_rows, hidden, xs, w.lane, vg);
    warp_dot<T>(u_rows, hidden, xs, w.lane, vu);
    const float g = pick(vg, w.lane), u = pick(vu, w.lane);
    if (w.row0 + r < inter && p0 + j < w.end)
      h[int64_t(p0 + j) * inter + w.row0 + r] = g / (1.0f + expf(-g)) * u;
  }
}

// y[p, n] = down_n . h[p] for expert blockIdx.y's positions.
template <DType T>
__global__ void __launch_bounds__(kThreads)
    gguf_down_kernel(const ExpertPtrs* experts, TokenLists lists, const float* h, int hidden,
                     int inter, float* y) {
  pdl::enter();
  const ExpertWarp w(lists, hidden);
  if (!w.run) return;
  const auto* down = static_cast<const uint8_t*>(experts[w.e].down);
  const int64_t ld = experts[w.e].down_ld;
  const uint8_t* rows[kRows];
  DS_UNROLL
  for (int r = 0; r < kRows; ++r)
    rows[r] = down + (w.row0 + r < hidden ? w.row0 + r : hidden - 1) * ld;
  const int r = w.lane / kTm, j = w.lane % kTm;
  for (int p0 = w.begin; p0 < w.end; p0 += kTm) {
    const float* xs[kTm];
    DS_UNROLL
    for (int t = 0; t < kTm; ++t) xs[t] = p0 + t < w.end ? h + int64_t(p0 + t) * inter : nullptr;
    float v[kRows * kTm];
    warp_dot<T>(rows, inter, xs, w.lane, v);
    const float out = pick(v, w.lane);
    if (w.row0 + r < hidden && p0 + j < w.end) y[int64_t(p0 + j) * hidden + w.row0 + r] = out;
  }
}

}  // namespace

void launch_gguf_ffn(const DecodeFfnArgs& a, DType dtype, cudaStream_t stream) {
  const int bs = dtype_info(dtype).block_size;
  if (a.hidden % bs != 0 || a.inter % bs != 0)
    throw UnsupportedError("cuda moe_ffn: " + std::string(dtype_name(dtype)) +
                           " experts need hidden and F multiples of " + std::to_string(bs));
  const int per_cta = kWarps * kRows;
  const dim3 gu((unsigned(a.inter) + per_cta - 1) / per_cta, unsigned(a.num_experts));
  const dim3 dn((unsigned(a.hidden) + per_cta - 1) / per_cta, unsigned(a.num_experts));
  bool launched = false;
  gguf::dispatch(dtype, [&](auto t) {
    constexpr DType T = decltype(t)::value;
    pdl::launch(gguf_gate_up_kernel<T>, gu, kThreads, 0, stream, a.experts, a.lists, a.x,
                a.x_stride, a.hidden, a.inter, a.h);
    check_cuda(cudaGetLastError(), "moe gguf gate/up launch");
    pdl::launch(gguf_down_kernel<T>, dn, kThreads, 0, stream, a.experts, a.lists, a.h, a.hidden,
                a.inter, a.y);
    check_cuda(cudaGetLastError(), "moe gguf down launch");
    launched = true;
  });
  if (!launched)
    throw UnsupportedError("cuda moe_ffn: experts of dtype " + std::string(dtype_name(dtype)));
}

}  // namespace ds::cuda::moe
