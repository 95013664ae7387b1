// Dummy weights (--load-format dummy): every tensor a model binds, with its shape, and the
// recipe Backend::fill_random generates it from; no bytes on the host.
#include <cmath>
#include <map>

#include "backend/w4a16.h"
#include "core/error.h"
#include "model/config.h"
#include "model/weights.h"

namespace ds {
namespace {

struct DummyTensor {
  TensorView view;  // shape and dtype; data == nullptr
  DummyInit init;
};

class DummyWeights final : public WeightSource {
 public:
  DummyWeights(const ModelConfig& cfg, uint64_t seed) : seed_(seed) {
    if (cfg.arch == "deepseek_v2")
      add_deepseek(cfg);
    else if (cfg.arch == "llama")
      add_llama(cfg);
    else
      throw UnsupportedError("--load-format dummy: no weight list for architecture '" + cfg.arch +
                             "'");
  }

  std::optional<TensorView> find(const std::string& name) const override {
    const auto it = tensors_.find(name);
    if (it == tensors_.end()) return std::nullopt;
    return it->second.view;
  }
  std::optional<DummyInit> dummy_init(const std::string& name) const override {
    const auto it = tensors_.find(name);
    if (it == tensors_.end()) return std::nullopt;
    return it->second.init;
  }
  std::string describe() const override {
    return "dummy weights (seed " + std::to_string(seed_) + ")";
  }
  uint64_t total_bytes() const override { return bytes_; }
  void prefetch(int, const std::function<void(size_t, size_t)>& progress) const override {
    progress(bytes_, bytes_);
  }

 private:
  enum class Kind { Linear, Embedding, Norm, Output, Router };

  void add(const std::string& name, std::initializer_list<int64_t> dims, Kind kind) {
    DummyTensor t;
    t.view = TensorView::contiguous(nullptr, DType::BF16, dims);
    // FNV-1a of the name, mixed with the seed: each tensor its own stream.
    uint64_t h = 1469598103934665603ull;
    for (char c : name) h = (h ^ uint8_t(c)) * 1099511628211ull;
    t.init.seed = w4a16::mix64(h ^ w4a16::mix64(seed_));
    const float fan_in = float(t.view.cols());
    switch (kind) {
      case Kind::Linear:
        t.init.std = 0.6f / std::sqrt(fan_in);
        break;
      case Kind::Output:
        t.init.std = 3.0f / std::sqrt(fan_in);
        break;
      case Kind::Router:
        t.init.std = 4.0f / std::sqrt(fan_in);
        break;
      case Kind::Embedding:
        t.init.std = 1.0f;
        break;
      case Kind::Norm:
        t.init.mean = 1.0f;
        t.init.std = 0.1f;
        break;
    }
    bytes_ += t.view.nbytes();
    tensors_[name] = t;
  }

  void add_llama(const ModelConfig& c) {
    const int64_t h = c.hidden, q = int64_t(c.heads) * c.head_dim;
    const int64_t kv = int64_t(c.kv_heads) * c.head_dim, f = c.intermediate;
    add("token_embd.weight", {c.vocab, h}, Kind::Embedding);
    add("output_norm.weight", {h}, Kind::Norm);
    if (!c.tied_embeddings) add("output.weight", {c.vocab, h}, Kind::Output);
    for (int l = 0; l < c.layers; ++l) {
      const std::string p = "blk." + std::to_string(l) + ".";
      add(p + "attn_norm.weight", {h}, Kind::Norm);
      add(p + "ffn_norm.weight", {h}, Kind::Norm);
      add(p + "attn_q.weight", {q, h}, Kind::Linear);
      add(p + "attn_k.weight", {kv, h}, Kind::Linear);
      add(p + "attn_v.weight", {kv, h}, Kind::Linear);
      add(p + "attn_output.weight", {h, q}, Kind::Linear);
      add(p + "ffn_gate.weight", {f, h}, Kind::Linear);
      add(p + "ffn_up.weight", {f, h}, Kind::Linear);
      add(p + "ffn_down.weight", {h, f}, Kind::Linear);
    }
  }

  void add_mlp(const std::string& p, int64_t h, int64_t f) {
    add(p + "gate_proj.weight", {f, h}, Kind::Linear);
    add(p + "up_proj.weight", {f, h}, Kind::Linear);
    add(p + "down_proj.weight", {h, f}, Kind::Linear);
  }

  void add_deepseek(const ModelConfig& c) {
    const int64_t h = c.hidden, H = c.heads, R = c.kv_lora_rank, P = c.qk_rope_dim;
    const int64_t qk = c.qk_nope_dim + P, v = c.v_head_dim;
    add("model.embed_tokens.weight", {c.vocab, h}, Kind::Embedding);
    add("model.norm.weight", {h}, Kind::Norm);
    if (!c.tied_embeddings) add("lm_head.weight", {c.vocab, h}, Kind::Output);
    for (int l = 0; l < c.layers; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".", a = p + "self_attn.";
      add(p + "input_layernorm.weight", {h}, Kind::Norm);
      add(p + "post_attention_layernorm.weight", {h}, Kind::Norm);
      if (c.q_lora_rank > 0) {
        add(a + "q_a_proj.weight", {c.q_lora_rank, h}, Kind::Linear);
        add(a + "q_a_layernorm.weight", {c.q_lora_rank}, Kind::Norm);
        add(a + "q_b_proj.weight", {H * qk, c.q_lora_rank}, Kind::Linear);
      } else {
        add(a + "q_proj.weight", {H * qk, h}, Kind::Linear);
      }
      add(a + "kv_a_proj_with_mqa.weight", {R + P, h}, Kind::Linear);
      add(a + "kv_a_layernorm.weight", {R}, Kind::Norm);
      add(a + "kv_b_proj.weight", {H * (c.qk_nope_dim + v), R}, Kind::Linear);
      add(a + "o_proj.weight", {h, H * v}, Kind::Linear);
      if (c.is_moe_layer(l)) {
        add(p + "mlp.gate.weight", {c.moe_experts, h}, Kind::Router);
        for (int e = 0; e < c.moe_experts; ++e)
          add_mlp(p + "mlp.experts." + std::to_string(e) + ".", h, c.moe_intermediate);
        if (c.moe_shared_experts > 0)
          add_mlp(p + "mlp.shared_experts.", h, int64_t(c.moe_shared_experts) * c.moe_intermediate);
      } else {
        add_mlp(p + "mlp.", h, c.intermediate);
      }
    }
  }

  uint64_t seed_;
  uint64_t bytes_ = 0;
  std::map<std::string, DummyTensor> tensors_;
};

}  // namespace

std::unique_ptr<WeightSource> dummy_weights(const ModelConfig& cfg, uint64_t seed) {
  return std::make_unique<DummyWeights>(cfg, seed);
}

}  // namespace ds
