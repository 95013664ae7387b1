#include "model/model.h"

namespace ds {

uint64_t kv_bytes_per_token_layer(const ModelConfig& cfg, DType dtype) {
  return paged_kv_bytes_per_token(dtype, cfg.cache_heads(), cfg.cache_head_dim(), cfg.cache_has_v(),
                                  cfg.is_mla() ? cfg.kv_lora_rank : 0);
}

KvCache::KvCache(Backend& backend, const ModelConfig& cfg, const KvCacheConfig& kv) : cfg_(kv) {
  DS_CHECK(kv.num_blocks > 0 && kv.block_size > 0, "KV cache needs blocks");
  const int64_t slots = int64_t(kv.num_blocks) * kv.block_size;
  const size_t per_layer = dtype_bytes(kv.dtype, slots * cfg.cache_heads() * cfg.cache_head_dim());
  auto alloc = [&](size_t bytes) {
    buffers_.push_back(backend.alloc(bytes));
    bytes_ += bytes;
    return buffers_.back()->data();
  };
  for (int l = 0; l < cfg.layers; ++l) {
    PagedKv p;
    p.dtype = kv.dtype;
    p.num_blocks = kv.num_blocks;
    p.block_size = kv.block_size;
    p.kv_heads = cfg.cache_heads();
    p.head_dim = cfg.cache_head_dim();
    p.k = alloc(per_layer);
    if (cfg.cache_has_v()) p.v = alloc(per_layer);
    if (p.fp8()) {
      p.rope_split = cfg.is_mla() ? cfg.kv_lora_rank : 0;
      p.k_scale = static_cast<float*>(alloc(size_t(slots * p.k_scale_parts()) * 4));
      if (p.v) p.v_scale = static_cast<float*>(alloc(size_t(slots * p.kv_heads) * 4));
    }
    layers_.push_back(p);
  }
}

}  // namespace ds
