// Multi-head latent attention compiled for AVX2: the shared kernel body under this file's flags.
#include "backend/cpu/mla_attention.h"

#include "backend/cpu/mla_attention_kernel.h"

namespace ds::cpu::detail {

void mla_avx2(const MlaAttentionParams& p, const AttentionMeta& meta, const MlaItem& item,
              MlaScratch& scratch) {
  mla_body(p, meta, item, scratch);
}

}  // namespace ds::cpu::detail
