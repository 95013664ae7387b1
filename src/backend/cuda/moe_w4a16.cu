// MoE experts with W4A16 weights over the device token lists (moe.cuh): per (expert, block of
// weight rows) CTAs stream the expert's rows once per pass of kTm of its tokens with the warp
// core of gemm_w4a16.cuh, gate and up together so h = silu(gate x) * up x is written
// directly. Graph-capturable; every output a fixed-order sum of its own token's row.
#include "backend/cuda/common.cuh"
#include "backend/cuda/gemm_w4a16.cuh"
#include "backend/cuda/moe.cuh"

namespace ds::cuda::moe {
namespace {

using namespace w4k;

// Where a thread of an expert kernel is: expert blockIdx.y's sorted positions [begin, end) and
// the warp's first weight row; run() is false when it has nothing to do.
struct ExpertWarp {
  int e, begin, end, lane;
  int64_t row0;
  __device__ ExpertWarp(const TokenLists& lists, int64_t rows) {
    e = int(blockIdx.y);
    begin = lists.offsets[e];
    end = lists.offsets[e + 1];
    lane = int(threadIdx.x) % 32;
    row0 = (int64_t(blockIdx.x) * kWarps + int(threadIdx.x) / 32) * kRows;
    run_ = begin < end && row0 < rows;
  }
  __device__ bool run() const { return run_; }

 private:
  bool run_;
};

// h[p, f] = silu(gate_f . x[token(p)]) * (up_f . x[token(p)]) for expert blockIdx.y's positions.
__global__ void __launch_bounds__(kThreads)
    w4a16_gate_up_kernel(const ExpertPtrs* experts, TokenLists lists, const float* x,
                         int64_t x_stride, int hidden, int inter, float* h) {
  const ExpertWarp w(lists, inter);
  if (!w.run()) return;
  const int e = w.e, begin = w.begin, end = w.end, lane = w.lane;
  const int64_t row0 = w.row0;
  const int64_t stride = w4a16::row_stride(hidden);
  const auto* gate = static_cast<const uint8_t*>(experts[e].gate);
  const auto* up = static_cast<const uint8_t*>(experts[e].up);
  const uint8_t *g_rows[kRows], *u_rows[kRows];
  DS_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const int64_t row = row0 + r < inter ? row0 + r : inter - 1;
    g_rows[r] = gate + row * stride;
    u_rows[r] = up + row * stride;
  }
  const int r = lane / kTm, j = lane % kTm;
  for (int p0 = begin; p0 < end; p0 += kTm) {
    const float* xs[kTm];
    DS_UNROLL
    for (int t = 0; t < kTm; ++t)
      xs[t] = p0 + t < end ? x + int64_t(lists.sorted_token[p0 + t]) * x_stride : nullptr;
    float vg[kRows * kTm], vu[kRows * kTm];
    warp_dot<kTm>(g_rows, hidden, xs, lane, vg);
    warp_dot<kTm>(u_rows, hidden, xs, lane, vu);
    const float g = pick(vg, lane), u = pick(vu, lane);
    if (row0 + r < inter && p0 + j < end)
      h[int64_t(p0 + j) * inter + row0 + r] = g / (1.0f + expf(-g)) * u;
  }
}

// y[p, n] = down_n . h[p] for expert blockIdx.y's positions.
__global__ void __launch_bounds__(kThreads)
    w4a16_down_kernel(const ExpertPtrs* experts, TokenLists lists, const float* h, int hidden,
                      int inter, float* y) {
  const ExpertWarp w(lists, hidden);
  if (!w.run()) return;
  const int e = w.e, begin = w.begin, end = w.end, lane = w.lane;
  const int64_t row0 = w.row0;
  const int64_t stride = w4a16::row_stride(inter);
  const auto* down = static_cast<const uint8_t*>(experts[e].down);
  const uint8_t* rows[kRows];
  DS_UNROLL
  for (int r = 0; r < kRows; ++r)
    rows[r] = down + (row0 + r < hidden ? row0 + r : hidden - 1) * stride;
  const int r = lane / kTm, j = lane % kTm;
  for (int p0 = begin; p0 < end; p0 += kTm) {
    const float* xs[kTm];
    DS_UNROLL
    for (int t = 0; t < kTm; ++t) xs[t] = p0 + t < end ? h + int64_t(p0 + t) * inter : nullptr;
    float v[kRows * kTm];
    warp_dot<kTm>(rows, inter, xs, lane, v);
    const float out = pick(v, lane);
    if (row0 + r < hidden && p0 + j < end) y[int64_t(p0 + j) * hidden + row0 + r] = out;
  }
}

}  // namespace

void launch_w4a16_ffn(const DecodeFfnArgs& a, cudaStream_t stream) {
  DS_CHECK(a.hidden % w4a16::kGroup == 0 && a.inter % w4a16::kGroup == 0,
           "cuda moe_ffn: W4A16 experts need hidden and F multiples of 128");
  DS_CHECK(a.x_stride % 4 == 0 && reinterpret_cast<uintptr_t>(a.x) % 16 == 0,
           "cuda moe_ffn: W4A16 needs 16-byte aligned activation rows");
  const int per_cta = kWarps * kRows;
  const dim3 gu((unsigned(a.inter) + per_cta - 1) / per_cta, unsigned(a.num_experts));
  w4a16_gate_up_kernel<<<gu, kThreads, 0, stream>>>(a.experts, a.lists, a.x, a.x_stride, a.hidden,
                                                    a.inter, a.h);
  check_cuda(cudaGetLastError(), "moe w4a16 gate/up launch");
  const dim3 dn((unsigned(a.hidden) + per_cta - 1) / per_cta, unsigned(a.num_experts));
  w4a16_down_kernel<<<dn, kThreads, 0, stream>>>(a.experts, a.lists, a.h, a.hidden, a.inter, a.y);
  check_cuda(cudaGetLastError(), "moe w4a16 down launch");
}

}  // namespace ds::cuda::moe
