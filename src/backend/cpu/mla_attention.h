// CPU multi-head latent attention (DeepSeek-V2, absorbed form) over a paged latent cache:
// float64 dot products, softmax and weighted sums, spread over the thread pool and compiled
// per ISA family (all families compute the same bits).
#pragma once

#include <vector>

#include "backend/backend.h"
#include "backend/cpu/cpu_features.h"

namespace ds {
class ThreadPool;
}

namespace ds::cpu {

// Working memory of one pool thread; grows on demand and is reused across calls.
struct MlaScratch {
  std::vector<double> d;
  double* reserve(size_t n) {  // contents not preserved
    if (d.size() < n) d.resize(n);
    return d.data();
  }
};

// backend.h's mla_attention. A token finds its sequence and the cache positions it may see
// as in paged attention (query_start, context_lens, block_tables). Each (token, head)
// result is computed in a fixed order from its own query rows and its sequence's cache
// alone, so it does not depend on the batch, the thread count, the work split or the ISA.
// `scratch` holds one entry per pool thread (resized here).
void mla_attention(const MlaAttentionParams& p, const AttentionMeta& meta, ThreadPool& pool,
                   Isa isa, std::vector<MlaScratch>& scratch);

namespace detail {
// Heads [head_begin, head_end) of one token of sequence `seq`.
struct MlaItem {
  int token = 0, seq = 0, head_begin = 0, head_end = 0;
};
using MlaKernel = void (*)(const MlaAttentionParams& p, const AttentionMeta& meta,
                           const MlaItem& item, MlaScratch& scratch);
void mla_generic(const MlaAttentionParams& p, const AttentionMeta& meta, const MlaItem& item,
                 MlaScratch& scratch);
void mla_avx2(const MlaAttentionParams& p, const AttentionMeta& meta, const MlaItem& item,
              MlaScratch& scratch);
void mla_avx512(const MlaAttentionParams& p, const AttentionMeta& meta, const MlaItem& item,
                MlaScratch& scratch);
}  // namespace detail

}  // namespace ds::cpu
