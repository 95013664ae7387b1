// A model: hyperparameters, bound weights and a batched forward over a paged KV cache.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "model/config.h"
#include "model/weights.h"

namespace ds {

class Communicator;

// The largest decode batch the engine captures a CUDA graph for by default (bigger batches run
// eagerly). Models size their decode-only scratch for it, so no graphed batch regrows it.
constexpr int kMaxDecodeGraphBatch = 512;

struct KvCacheConfig {
  int num_blocks = 0;
  int block_size = 16;
  DType dtype = DType::F32;
};

// Bytes one token takes in one layer's KV cache of `dtype` (FP8: codes plus scales).
uint64_t kv_bytes_per_token_layer(const ModelConfig& cfg, DType dtype);

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
  std::span<const int32_t> tokens;  // [num_tokens] on the host
  // Step metadata in the backend's memory (what kernels read) and the same on the host (for
  // host-side decisions such as gathering a sequence's context). On the CPU they coincide.
  AttentionMeta meta;
  AttentionMeta host_meta;
  const int32_t* device_tokens = nullptr;  // tokens in backend memory; null: tokens.data()
  std::span<const int32_t> logit_rows;     // token rows whose next-token logits are wanted
  const int32_t* token_ids() const { return device_tokens ? device_tokens : tokens.data(); }
};

// Sees named intermediate tensors ("blk.3.attn_norm") so a forward can be diffed layer by
// layer against a reference.
using DebugHook = std::function<void(const std::string& name, const TensorView& t)>;

// Bytes of weights a decode step reads, for roofline estimates: `dense` every step, plus
// `per_expert` for each routed expert touched in each of `moe_layers` layers.
struct WeightBytes {
  uint64_t total = 0;
  uint64_t dense = 0;
  uint64_t per_expert = 0;  // one routed expert of one layer
  int moe_layers = 0;
  int experts = 0;  // routed experts per MoE layer
  int top_k = 0;
  // Expected bytes per decode step of `batch` sequences under uniform random routing.
  double decode_step(int batch) const;
};

// Tokens routed to each expert so far, one entry per MoE layer.
struct ExpertLoad {
  int layer = 0;
  std::vector<int64_t> tokens;  // [experts]
};

class Model {
 public:
  virtual ~Model() = default;
  virtual const ModelConfig& config() const = 0;
  virtual WeightBytes weight_bytes() const = 0;
  // KV cache bytes one token takes over all layers at the given cache dtype.
  virtual uint64_t kv_bytes_per_token(DType kv_dtype) const = 0;
  // Routed-expert counters (empty for dense models). Synchronizes with the backend.
  virtual std::vector<ExpertLoad> expert_load() { return {}; }
  // logits: [logit_rows.size(), vocab] F32 on the backend.
  virtual void forward(const ForwardInput& in, KvCache& cache, TensorView logits) = 0;
  virtual void set_debug_hook(DebugHook hook) { debug_ = std::move(hook); }
  // Tensor parallelism: this rank's partial sums (row-split projections) are summed over the
  // group through `comm`; null (the default) for a single rank.
  void set_communicator(Communicator* comm) { comm_ = comm; }
  // Ranks the model runs on; the engine captures decode graphs only for one.
  virtual int ranks() const { return 1; }
  // The engine copied KV block src to dst in its cache (copy-on-write); a model that keeps
  // more caches (other ranks') copies there too.
  virtual void mirror_block_copy(int /*src*/, int /*dst*/) {}
  // Bound weights per format ("BF16", "W4A16", "F32" norms, ...): (bytes, parameters).
  const std::map<std::string, std::pair<uint64_t, uint64_t>>& weight_formats() const {
    return formats_;
  }

 protected:
  std::map<std::string, std::pair<uint64_t, uint64_t>> formats_;
  void dump(const char* name, const TensorView& t) const {
    if (debug_) debug_(name, t);
  }
  // The last step of every forward: only the rows that need logits are gathered (x rows ->
  // h), normalized and projected to the vocabulary.
  void output_logits(Backend& be, const TensorView& x, std::span<const int32_t> rows, TensorView h,
                     const TensorView& norm, float eps, const TensorView& w_out,
                     TensorView logits) const;
  void dump(int layer, const char* name, const TensorView& t) const {
    if (debug_) debug_("blk." + std::to_string(layer) + "." + name, t);
  }
  // Sums t (contiguous F32, this rank's partial result) over the tensor-parallel group.
  void all_reduce(const TensorView& t) const;
  DebugHook debug_;
  Communicator* comm_ = nullptr;
};

std::unique_ptr<Model> make_llama(const ModelConfig& cfg, const WeightSource& weights,
                                  Backend& backend, WeightQuant quantize = WeightQuant::None);

struct DeepseekOptions {
  bool mla_expanded = false;  // attention through expanded per-head K/V instead of absorbed
  WeightQuant quantize = WeightQuant::None;  // load-time format of the big matmul weights
};
std::unique_ptr<Model> make_deepseek_v2(const ModelConfig& cfg, const WeightSource& weights,
                                        Backend& backend, const DeepseekOptions& opts = {});

}  // namespace ds
