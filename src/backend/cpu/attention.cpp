// Paged attention: the baseline-ISA kernel and the per-ISA dispatch.
#include "backend/cpu/attention.h"

#include "backend/cpu/attention_kernel.h"

namespace ds::cpu {

namespace detail {
void attention_generic(const AttentionParams& p, const AttentionMeta& meta,
                       const AttentionItem& item, AttentionScratch& scratch) {
  attention_dispatch(p, meta, item, scratch);
}
void kv_store_generic(const float* src, int64_t n, DType dtype, void* dst) {
  narrow_row(src, n, dtype, static_cast<uint8_t*>(dst));
}
}  // namespace detail

KvStoreKernel kv_store_kernel(Isa isa) {
  switch (isa) {
    case Isa::Scalar:
      return detail::kv_store_generic;
    case Isa::Avx2:
      return detail::kv_store_avx2;
    case Isa::Avx512Vnni:
    case Isa::Amx:
      return detail::kv_store_avx512;
  }
  return detail::kv_store_generic;
}

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
