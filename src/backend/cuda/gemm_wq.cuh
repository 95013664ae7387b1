// Tensor-core GEMMs for quantized weights (W4A16: backend/w4a16.h, FP8W: backend/fp8w.h),
// dense (Backend::matmul) and over the MoE token lists (moe.cuh). Weights are the mma's A
// operand (16 weight rows per m16 block), tokens the B operand (8 per n8 block), so a decode
// step with a few tokens wastes no weight bytes. Packed weight tiles move global -> shared
// with cp.async, are dequantized in registers (int4 / e4m3 -> exact BF16 codes) and multiplied
// with BF16 activations (mma.sync m16n8k16, F32 accumulators); each 128-group's sum is scaled
// once (out += scale * sum), so the only rounding beyond F32 sums is the activations' BF16.
// Deterministic; a token's output depends on its own row only for a fixed split count.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/context.cuh"
#include "core/tensor.h"

namespace ds::cuda {

// BF16: plain BF16 weight rows through the same kernel (no scales); the MoE takes it for decode
// steps (its small-token variants stream the experts at a few tokens per CTA).
enum class WqFormat : uint8_t { W4A16, FP8W, BF16 };

// Whether the format holds W4A16 weights (int4 codes, group-pair scale words).
__host__ __device__ constexpr bool wq_w4(WqFormat f) {
  return f == WqFormat::W4A16;
}

// Whether Backend::matmul / moe_ffn take weights of this dtype through the kernels here.
inline bool wq_dtype(DType t) {
  return t == DType::W4A16 || t == DType::FP8W;
}

// out = x . w^T for F32 x [M, K], quantized w [N, K], F32 out [M, N]. Uses the matmul scratch
// slot for BF16 activations and (M <= kWqSplitMaxM) split-K partial sums. BF16 weights
// (wq_bf16_fits) too, for M <= kWqBf16MaxTokens: the backend sends decode-sized products there that
// the skinny kernel does not take (they went to cuBLAS).
void wq_matmul(const Context& ctx, const TensorView& x, const TensorView& w, const TensorView& out);
// The most tokens (rows of x, or tokens of one MoE step) BF16 weights take here: the largest
// decode variant (16 tokens per CTA).
constexpr int64_t kWqBf16MaxTokens = 16;
// Up to this many weight bytes (larger ones, the LM head, stay with cuBLAS).
constexpr int64_t kWqBf16MaxWeightBytes = int64_t(64) << 20;
bool wq_bf16_fits(const TensorView& w);

// For each b < B: out[b] = x[b] . w[b]^T, BF16 w [B, N, K], F32 x [B, M, K] and out [B, M, N]
// (strides in bytes as TensorView's), through the same kernel (one launch, the batch's row blocks
// side by side): batched_matmul's decode-sized products past the skinny kernel, MLA's absorbed
// W_UK / W_UV at 128 heads (16.8 MB each), which went to cuBLAS at ~1.1 TB/s.
// wq_batched_fits: M <= 8, K a multiple of 8, 16-byte rows and batch strides (x and w).
bool wq_batched_fits(const TensorView& x, const TensorView& w, const TensorView& out);
void wq_batched_matmul(const Context& ctx, const TensorView& x, const TensorView& w,
                       const TensorView& out);

// Split-K (chosen from N, K and the SM count alone, so batch-invariant) only up to this M:
// above it one pass over K, so a token's bits can differ between M <= 64 and M > 64.
constexpr int64_t kWqSplitMaxM = 64;
// Split-K output tiles whose last CTA sums the partials in the kernel (kScratchWqTiles holds
// one counter each); a product with more tiles takes a reduce launch.
constexpr int64_t kWqTileCounters = 8192;
// Groups of 128 k per split of K for an [n, k] weight: about target_ctas CTAs in all, a
// multiple of `unit`, and at least 2 groups a split where K has them.
int wq_split_groups(int64_t n, int64_t k, int target_ctas, int unit);

}  // namespace ds::cuda
