// CPU paged attention: one kernel call computes some query heads of one token that share a
// kv head; the backend spreads such work items over its thread pool.
#pragma once

#include <cstdint>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/cpu_features.h"

namespace ds::cpu {

// One work item: query heads [head_begin, head_end) of token `token`, all in kv group `kvh`.
// Each head's output depends only on its query row and its sequence's cached keys/values,
// never on which other heads, tokens or threads share the call (batch-invariant).
struct AttentionItem {
  int token = 0;
  int seq = 0;
  int kvh = 0;
  int head_begin = 0, head_end = 0;
};

// Per-thread working memory of the kernel; grows on demand and is reused across calls.
struct AttentionScratch {
  std::vector<float> buf;
  float* reserve(int64_t floats) {  // contents not preserved
    if (int64_t(buf.size()) < floats) buf.resize(size_t(floats));
    return buf.data();
  }
};

using AttentionKernel = void (*)(const AttentionParams& p, const AttentionMeta& meta,
                                 const AttentionItem& item, AttentionScratch& scratch);

// The kernel for an ISA family. All variants compute bit-identical results (same operation
// order, no fused multiply-add), so the ISA only changes speed.
AttentionKernel attention_kernel(Isa isa);

// Writes n F32 values into a cache row of `dtype` (F32, F16, BF16), rounding to nearest
// even; every ISA stores the same bits (NaN payloads aside).
using KvStoreKernel = void (*)(const float* src, int64_t n, DType dtype, void* dst);
KvStoreKernel kv_store_kernel(Isa isa);

namespace detail {
void kv_store_generic(const float* src, int64_t n, DType dtype, void* dst);
void kv_store_avx2(const float* src, int64_t n, DType dtype, void* dst);
void kv_store_avx512(const float* src, int64_t n, DType dtype, void* dst);
void attention_generic(const AttentionParams& p, const AttentionMeta& meta,
                       const AttentionItem& item, AttentionScratch& scratch);
void attention_avx2(const AttentionParams& p, const AttentionMeta& meta, const AttentionItem& item,
                    AttentionScratch& scratch);
void attention_avx512(const AttentionParams& p, const AttentionMeta& meta,
                      const AttentionItem& item, AttentionScratch& scratch);
}  // namespace detail

}  // namespace ds::cpu
