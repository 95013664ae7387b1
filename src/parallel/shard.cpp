#include "parallel/shard.h"

#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include "core/error.h"

namespace ds {

namespace {

bool ends_with(const std::string& s, const char* tail) {
  const size_t n = std::strlen(tail);
  return s.size() >= n && s.compare(s.size() - n, n, tail) == 0;
}
bool contains(const std::string& s, const char* part) {
  return s.find(part) != std::string::npos;
}

void require_divides(int n, int size, const char* what) {
  if (n % size != 0)
    throw Error("tensor parallel size " + std::to_string(size) + " does not divide " + what + " (" +
                std::to_string(n) + ")");
}

}  // namespace

Split split_of(const std::string& name, const ParallelConfig& p) {
  // Routed experts under EP live whole on their owner rank (the model binds only its own).
  if (p.expert_parallel && contains(name, ".mlp.experts.")) return Split::Replicate;
  // Llama (GGUF names) and DeepSeek-V2 (Hugging Face names).
  for (const char* t : {".attn_q.weight", ".attn_k.weight", ".attn_v.weight", ".ffn_gate.weight",
                        ".ffn_up.weight", "self_attn.q_proj.weight", "self_attn.q_b_proj.weight",
                        "self_attn.kv_b_proj.weight", "gate_proj.weight", "up_proj.weight"})
    if (ends_with(name, t)) return Split::Rows;
  for (const char* t :
       {".attn_output.weight", ".ffn_down.weight", "self_attn.o_proj.weight", "down_proj.weight"})
    if (ends_with(name, t)) return Split::Cols;
  return Split::Replicate;
}

ModelConfig shard_config(const ModelConfig& cfg, const ParallelConfig& p, int rank) {
  const int n = p.tensor_parallel_size;
  DS_CHECK(n >= 1 && rank >= 0 && rank < n, "bad tensor parallel rank");
  ModelConfig s = cfg;
  s.tp_size = n;
  s.tp_rank = rank;
  if (n == 1) return s;
  require_divides(cfg.heads, n, "num_attention_heads");
  s.heads = cfg.heads / n;
  if (!cfg.is_mla()) {  // MLA caches one latent per token that every head reads: no KV split
    require_divides(cfg.kv_heads, n, "num_key_value_heads");
    s.kv_heads = cfg.kv_heads / n;
  } else {
    s.kv_heads = s.heads;
  }
  bool dense_layers = cfg.moe_experts == 0;
  for (int l = 0; l < cfg.layers; ++l) dense_layers = dense_layers || !cfg.is_moe_layer(l);
  if (dense_layers) {
    require_divides(cfg.intermediate, n, "intermediate_size");
    s.intermediate = cfg.intermediate / n;
  }
  if (cfg.moe_experts > 0) {
    const int shared = cfg.moe_shared_experts * cfg.moe_intermediate;
    if (shared > 0) {
      require_divides(shared, n, "the shared experts' intermediate size");
      s.moe_shared_intermediate = shared / n;
    }
    if (p.expert_parallel) {
      require_divides(cfg.moe_experts, n, "n_routed_experts (expert parallel)");
      s.moe_local_experts = cfg.moe_experts / n;
      s.moe_expert_begin = rank * s.moe_local_experts;
    } else {
      require_divides(cfg.moe_intermediate, n, "moe_intermediate_size");
      s.moe_intermediate = cfg.moe_intermediate / n;
    }
  }
  return s;
}

namespace {

class ShardedWeights final : public WeightSource {
 public:
  ShardedWeights(const WeightSource& full, const ParallelConfig& p, int rank)
      : full_(full), p_(p), rank_(rank) {}

  std::optional<DummyInit> dummy_init(const std::string& name) const override {
    auto init = full_.dummy_init(name);
    // A shard of a generated tensor is generated at its own shape: distinct per rank.
    if (init && split_of(name, p_) != Split::Replicate)
      init->seed ^= 0x9e3779b97f4a7c15ull * uint64_t(rank_ + 1);
    return init;
  }

  std::optional<TensorView> find(const std::string& name) const override {
    const auto t = full_.find(name);
    if (!t || p_.tensor_parallel_size == 1) return t;
    const Split s = split_of(name, p_);
    if (s == Split::Replicate || t->ndim != 2) return t;
    const int n = p_.tensor_parallel_size;
    const int64_t dim = s == Split::Rows ? t->shape[0] : t->shape[1];
    if (dim % n != 0)
      throw Error("tensor '" + name + "' " + t->shape_str() + " does not split " +
                  std::to_string(n) + " ways");
    const int64_t part = dim / n;
    if (s == Split::Rows) {
      if (!t->data) {  // dummy: shape only
        TensorView v = *t;
        v.shape[0] = part;
        return v;
      }
      return t->slice_rows(part * rank_, part * (rank_ + 1));
    }
    return column_slice(name, *t, part);
  }

  std::string describe() const override {
    return full_.describe() + " (rank " + std::to_string(rank_) + " of " +
           std::to_string(p_.tensor_parallel_size) + ")";
  }
  uint64_t total_bytes() const override { return full_.total_bytes(); }
  void prefetch(int threads, const std::function<void(size_t, size_t)>& progress) const override {
    full_.prefetch(threads, progress);
  }

 private:
  // Columns [rank * part, (rank + 1) * part) of every row, copied contiguous once.
  TensorView column_slice(const std::string& name, const TensorView& t, int64_t part) const {
    const DTypeInfo& info = dtype_info(t.dtype);
    if (part % info.block_size != 0)
      throw Error("tensor '" + name + "': a " + std::to_string(part) + "-column shard splits " +
                  std::string(dtype_name(t.dtype)) + " blocks");
    TensorView v = TensorView::contiguous(nullptr, t.dtype, {t.shape[0], part}, t.device);
    if (!t.data) return v;
    std::lock_guard lock(mu_);
    auto& bytes = copies_[name];
    const size_t row = size_t(dtype_bytes(t.dtype, part));
    if (bytes.empty()) {
      bytes.resize(row * size_t(t.shape[0]));
      const size_t off = size_t(dtype_bytes(t.dtype, part * rank_));
      for (int64_t r = 0; r < t.shape[0]; ++r)
        std::memcpy(bytes.data() + size_t(r) * row, t.row(r) + off, row);
    }
    v.data = bytes.data();
    return v;
  }

  const WeightSource& full_;
  ParallelConfig p_;
  int rank_;
  mutable std::mutex mu_;
  mutable std::map<std::string, std::vector<uint8_t>> copies_;
};

}  // namespace

std::unique_ptr<WeightSource> sharded_weights(const WeightSource& full, const ParallelConfig& p,
                                              int rank) {
  return std::make_unique<ShardedWeights>(full, p, rank);
}

}  // namespace ds
