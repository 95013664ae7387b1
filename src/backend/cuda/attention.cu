// Placeholder until the paged attention kernels land: fails loudly.
#include "backend/cuda/attention.cuh"
#include "core/error.h"

namespace ds::cuda {

void paged_attention(const Context&, const AttentionParams&, const AttentionMeta&) {
  throw UnsupportedError("cuda: paged attention is not implemented yet");
}

void mla_attention(const Context&, const MlaAttentionParams&, const AttentionMeta&) {
  throw UnsupportedError("cuda: MLA attention is not implemented yet");
}

}  // namespace ds::cuda
