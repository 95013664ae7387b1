// Paged attention: the baseline-ISA kernel and the per-ISA dispatch.
#include "backend/cpu/attention.h"

#include "backend/cpu/attention_kernel.h"

namespace ds::cpu {

namespace detail {
void attention_generic(const AttentionParams& p, const AttentionMeta& meta,
                       const AttentionItem& item, AttentionScratch& scratch) {
  attention_dispatch(p, meta, item, scratch);
}
}  // namespace detail

AttentionKernel attention_kernel(Isa isa) {
  switch (isa) {
    case Isa::Scalar:
      return detail::attention_generic;
    case Isa::Avx2:
      return detail::attention_avx2;
    case Isa::Avx512Vnni:
    case Isa::Amx:
      return detail::attention_avx512;
  }
  return detail::attention_generic;
}

}  // namespace ds::cpu
