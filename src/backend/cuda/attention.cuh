// Paged attention launchers: GQA prefill/decode over a K/V cache, and MLA over a latent cache.
#pragma once

#include "backend/backend.h"
#include "backend/cuda/context.cuh"

namespace ds::cuda {

// Semantics of Backend::attention (backend.h): queries of variable-length sequences in one
// launch, causal, online softmax; long contexts split over several blocks (split-K).
void paged_attention(const Context& ctx, const AttentionParams& p, const AttentionMeta& meta);

// Semantics of Backend::mla_attention (backend.h).
void mla_attention(const Context& ctx, const MlaAttentionParams& p, const AttentionMeta& meta);

// Which kernel family runs: Auto picks the fastest that supports the shape; tests pin one.
// Simt: F32 arithmetic, every shape. TensorCore: mma.sync with split-BF16 operands (MLA).
// MlaDecode: MLA only, BF16 latent cache, one query per sequence (attention_mla_decode.cuh).
// MlaDecodeBf16: the same kernel with Q and P rounded to BF16 once instead of split into hi + lo
// (half the products; H200, W2 shape 217 vs 239 us). Not Auto's choice: made the default, it
// failed CudaKvFp8.MlaDecodeKernelMatchesReference (FP8 cache, 128 heads: |err| 0.08 on values
// of scale 3, against the hi/lo kernel's bound; its FP8 branch or only the bound, not settled)
// and CudaModels.DependentLaunchChangesNothing on one fixture (greedy tokens differed with PDL
// on and off; not diagnosed) (8aecfd4, H200). DEEPSERVE_MLA_DECODE=bf16 makes Auto take it.
enum class AttentionPath { Auto, Simt, TensorCore, MlaDecode, MlaDecodeBf16 };
void paged_attention_on(const Context& ctx, const AttentionParams& p, const AttentionMeta& meta,
                        AttentionPath path);
void mla_attention_on(const Context& ctx, const MlaAttentionParams& p, const AttentionMeta& meta,
                      AttentionPath path);
// Merge-kernel launches after the MLA decode kernel so far (tests: whether the splits merged in
// clusters instead).
int64_t mla_merge_launches();

}  // namespace ds::cuda
