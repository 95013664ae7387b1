// Paged attention compiled for AVX-512: the shared kernel body under this file's flags.
#include "backend/cpu/attention.h"

#include "backend/cpu/attention_kernel.h"

namespace ds::cpu::detail {

void attention_avx512(const AttentionParams& p, const AttentionMeta& meta,
                      const AttentionItem& item, AttentionScratch& scratch) {
  attention_dispatch(p, meta, item, scratch);
}

}  // namespace ds::cpu::detail
