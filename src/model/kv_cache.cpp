#include "model/model.h"

namespace ds {

KvCache::KvCache(Backend& backend, const ModelConfig& cfg, const KvCacheConfig& kv) : cfg_(kv) {
  DS_CHECK(kv.num_blocks > 0 && kv.block_size > 0, "KV cache needs blocks");
  const size_t per_layer = dtype_bytes(
      kv.dtype, int64_t(kv.num_blocks) * kv.block_size * cfg.cache_heads() * cfg.cache_head_dim());
  for (int l = 0; l < cfg.layers; ++l) {
    PagedKv p;
    p.dtype = kv.dtype;
    p.num_blocks = kv.num_blocks;
    p.block_size = kv.block_size;
    p.kv_heads = cfg.cache_heads();
    p.head_dim = cfg.cache_head_dim();
    buffers_.push_back(backend.alloc(per_layer));
    p.k = buffers_.back()->data();
    bytes_ += per_layer;
    if (cfg.cache_has_v()) {
      buffers_.push_back(backend.alloc(per_layer));
      p.v = buffers_.back()->data();
      bytes_ += per_layer;
    }
    layers_.push_back(p);
  }
}

}  // namespace ds
