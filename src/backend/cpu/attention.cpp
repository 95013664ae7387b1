// Paged attention: the baseline-ISA kernel and the per-ISA dispatch.
#include "backend/cpu/attention.h"

#include "backend/cpu/attention_kernel.h"
#include "backend/cpu/isa_dispatch.h"
#include "backend/fp8w.h"

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

const std::array<float, 256>& fp8_decode_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c) t[size_t(c)] = fp8w::decode(uint8_t(c));
    return t;
  }();
  return table;
}

KvStoreKernel kv_store_kernel(Isa isa) {
  return by_isa<KvStoreKernel>(isa, detail::kv_store_generic, detail::kv_store_avx2,
                               detail::kv_store_avx512);
}

AttentionKernel attention_kernel(Isa isa) {
  return by_isa<AttentionKernel>(isa, detail::attention_generic, detail::attention_avx2,
                                 detail::attention_avx512);
}

}  // namespace ds::cpu
