// A model: hyperparameters, bound weights and a batched forward over a paged KV cache.
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "model/config.h"
#include "model/weights.h"

namespace ds {

struct KvCacheConfig {
  int num_blocks = 0;
  int block_size = 16;
  DType dtype = DType::F32;
};

// Per-layer paged K/V storage, allocated on the model's backend.
class KvCache {
 public:
  KvCache(Backend& backend, const ModelConfig& cfg, const KvCacheConfig& kv);
  const PagedKv& layer(int l) const { return layers_[size_t(l)]; }
  int num_blocks() const { return cfg_.num_blocks; }
  int block_size() const { return cfg_.block_size; }
  int64_t capacity_tokens() const { return int64_t(cfg_.num_blocks) * cfg_.block_size; }
  size_t bytes() const { return bytes_; }

 private:
  KvCacheConfig cfg_;
  std::vector<std::unique_ptr<Buffer>> buffers_;
  std::vector<PagedKv> layers_;
  size_t bytes_ = 0;
};

struct ForwardInput {
  std::span<const int32_t> tokens;      // [num_tokens]
  AttentionMeta meta;                   // positions, sequences, block tables, slot mapping
  std::span<const int32_t> logit_rows;  // token rows whose next-token logits are wanted
};

// Sees named intermediate tensors ("blk.3.attn_norm") so a forward can be diffed layer by
// layer against a reference.
using DebugHook = std::function<void(const std::string& name, const TensorView& t)>;

class Model {
 public:
  virtual ~Model() = default;
  virtual const ModelConfig& config() const = 0;
  // logits: [logit_rows.size(), vocab] F32 on the backend.
  virtual void forward(const ForwardInput& in, KvCache& cache, TensorView logits) = 0;
  void set_debug_hook(DebugHook hook) { debug_ = std::move(hook); }

 protected:
  void dump(const char* name, const TensorView& t) const {
    if (debug_) debug_(name, t);
  }
  void dump(int layer, const char* name, const TensorView& t) const {
    if (debug_) debug_("blk." + std::to_string(layer) + "." + name, t);
  }
  DebugHook debug_;
};

std::unique_ptr<Model> make_llama(const ModelConfig& cfg, const WeightSource& weights,
                                  Backend& backend);

}  // namespace ds
