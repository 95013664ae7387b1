// Paged attention compiled for AVX2: the shared kernel body under this file's flags.
#include "backend/cpu/attention.h"

#include "backend/cpu/attention_kernel.h"

namespace ds::cpu::detail {

void attention_avx2(const AttentionParams& p, const AttentionMeta& meta, const AttentionItem& item,
                    AttentionScratch& scratch) {
  attention_dispatch(p, meta, item, scratch);
}

}  // namespace ds::cpu::detail
