// Paged attention compiled for AVX-512: the shared kernel body under this file's flags.
#include "backend/cpu/attention.h"

#include "backend/cpu/attention_kernel.h"

namespace ds::cpu::detail {

void attention_avx512(const AttentionParams& p, const AttentionMeta& meta,
                      const AttentionItem& item, AttentionScratch& scratch) {
  attention_dispatch(p, meta, item, scratch);
}

void kv_store_avx512(const float* src, int64_t n, DType dtype, void* dst) {
  narrow_row(src, n, dtype, static_cast<uint8_t*>(dst));
}

}  // namespace ds::cpu::detail
