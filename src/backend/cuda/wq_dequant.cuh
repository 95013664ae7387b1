// Quantized weights (W4A16, FP8W) expanded into BF16 rows in device memory, so prefill-sized
// products run as BF16 tensor-core GEMMs (cuBLAS). The in-register kernels of gemm_wq.cu read
// 4-8x fewer weight bytes, which wins while a product is bound by memory (decode); past a few
// hundred tokens per matrix it is bound by math, where their mma.sync tiles reach about half
// of cuBLAS's rate (H200: ~200 vs ~400-700 TFLOP/s), and one extra pass over the weights costs
// less than the difference. Only one matrix (dense) or one MoE layer's experts are expanded at
// a time, into scratch: the model itself is never held in BF16.
//
// The expanded value of element k is bf16((code - 8) * scale) (W4A16) or
// bf16(e4m3(code) * scale) (FP8W), w4a16::element / fp8w::element rounded to nearest even. The
// in-register kernels keep each 128-group's scale out of the products (scale * sum of
// code * x), so the two paths differ by that rounding (relative 2^-9 per weight): a token's
// bits depend on whether its step is prefill-sized, as with BF16 weights (cuBLAS above the
// decode kernels' range).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>

#include "core/tensor.h"

namespace ds::cuda {

// One matrix to expand: rows of K elements at w (row stride w_stride bytes, the packed layout)
// into BF16 rows of K elements at out (ld = K).
struct WqDequantJob {
  const void* w = nullptr;
  int64_t w_stride = 0;
  int64_t rows = 0;
  int64_t k = 0;
  void* out = nullptr;
};
constexpr int kWqDequantMaxJobs = 3;  // an expert's gate, up and down

// Whether these K can be expanded (whole 8-element chunks; W4A16 also whole groups).
bool wq_dequant_fits(DType t, int64_t k);
// Expands up to kWqDequantMaxJobs matrices of format t (W4A16 or FP8W) in one launch.
void launch_wq_dequant(DType t, const WqDequantJob* jobs, int num_jobs, cudaStream_t stream);

namespace moe {
struct ExpertPtrs;
}
// Expands experts ids[0..n) (n <= kWqDequantMaxExperts) of a device table (W4A16 / FP8W rows,
// strides in bytes) in one launch: the i-th one's gate, up and down rows at
// out + i * 3 * F * hidden, + F * hidden, + 2 * F * hidden (slots in list order).
constexpr int kWqDequantMaxExperts = 64;
void launch_wq_dequant_experts(DType t, const moe::ExpertPtrs* experts, const int* ids, int n,
                               int64_t hidden, int64_t inter, void* out, cudaStream_t stream);
// The most BF16 bytes a layer's expansion may take by default (DeepSeek-V2-Lite's 66 experts:
// 1.1 GiB, all at once; V2.5's 162, shared ones included: 7.1 GiB, so a ring of 4 chunks of
// 21 experts, 3.7 GiB); DEEPSERVE_MOE_WQ_EXPAND_MAX_MB moves it.
constexpr int64_t kMoeWqExpandMaxBytes = int64_t(4) << 30;
int64_t moe_wq_expand_max_bytes();
// The expert slots a layer's expansion takes, for E experts (H x F) expanded in `chunks`
// launches of ceil(E / chunks): all E where they fit moe_wq_expand_max_bytes(); else as many
// whole chunks as fit, at least two (the prefill path reuses them as a ring: slots are
// expanded again once the GEMMs of the chunk that held them are done); 0 where two do not.
int64_t moe_wq_expand_slots(int num_experts, int64_t hidden, int64_t inter, int chunks);
// The experts one of `chunks` expansion launches takes: ceil(n / chunks), at least 1.
inline int64_t moe_wq_chunk_experts(int64_t n, int chunks) {
  const int c = chunks > 1 ? chunks : 1;
  const int64_t per = (n + c - 1) / c;
  return per > 1 ? per : 1;
}
// The slots a step may take given `room`, the most scratch bytes the pool can give it now:
// `slots` where bytes_for(slots) (the step's whole scratch) fits; else the most whole chunks of
// per_chunk experts, at least two, that fit (a ring); else 0 (the in-register kernels).
int64_t moe_wq_slots_within(int64_t slots, int64_t per_chunk, size_t room,
                            const std::function<size_t(int64_t)>& bytes_for);

// Whether the stream is being captured into a graph (the expansion buffers grow on demand, so
// captured steps keep the in-register kernels).
bool stream_capturing(cudaStream_t stream);

// Backend::matmul expands a quantized weight for x of at least this many rows
// (DEEPSERVE_WQ_DEQUANT_MIN_ROWS); the MoE expands its experts (in `chunks` launches) when the
// step's assignments average at least this many per expert (DEEPSERVE_MOE_WQ_DEQUANT_MIN) and
// moe_wq_expand_slots() has room. Either off with DEEPSERVE_WQ_DEQUANT=0.
bool wq_dequant_dense(int64_t rows, const TensorView& w, cudaStream_t stream);
bool wq_dequant_moe(int64_t assignments, int num_experts, DType t, int64_t hidden, int64_t inter,
                    int chunks, cudaStream_t stream);

}  // namespace ds::cuda
