// Hyperparameters of a model, read once from GGUF metadata or config.json.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "backend/backend.h"

namespace ds {

class GgufFile;

// A 4-bit GPTQ or AWQ checkpoint's quantization_config (its linears are `qweight` / `qzeros` /
// `scales` [/ `g_idx`] tensors instead of `weight`).
struct Int4Format {
  enum class Kind : uint8_t { Gptq, Awq } kind = Kind::Gptq;
  int64_t group_size = 128;     // inputs (K) per scale; -1: the whole row
  bool sym = true;              // GPTQ: symmetric (zeros are 8 when stored exactly)
  bool desc_act = false;        // GPTQ act-order: g_idx maps input k to its group
  bool zeros_minus_one = true;  // GPTQ v1 (checkpoint_format "gptq") stores zero - 1
};

struct ModelConfig {
  std::string arch;  // "llama" or "deepseek_v2"
  std::string name;
  int hidden = 0;  // d_model
  int layers = 0;
  int heads = 0;     // query heads
  int kv_heads = 0;  // grouped-query kv heads
  int head_dim = 0;
  int intermediate = 0;  // MLP inner size
  int vocab = 0;
  int64_t max_context = 0;
  float rms_eps = 1e-5f;
  RopeParams rope;
  bool tied_embeddings = false;
  int bos_id = -1;
  int eos_id = -1;

  // deepseek_v2: multi-head latent attention (heads, head_dim = nope + rope for queries).
  int q_lora_rank = 0;  // 0: plain q_proj
  int kv_lora_rank = 0;
  int qk_nope_dim = 0;
  int qk_rope_dim = 0;
  int v_head_dim = 0;
  float attn_scale = 0;  // softmax scale; 0 = 1/sqrt(head_dim)
  // deepseek_v2: DeepSeekMoE. Layers >= first_k_dense (every moe_layer_freq-th) are MoE.
  int moe_experts = 0;  // routed experts per MoE layer; 0 = dense model
  int moe_top_k = 0;
  int moe_shared_experts = 0;
  int moe_intermediate = 0;
  int first_k_dense = 0;
  int moe_layer_freq = 1;
  MoeTopk moe_topk_method = MoeTopk::Greedy;
  int moe_n_group = 1;
  int moe_topk_group = 1;
  bool moe_norm_topk_prob = false;
  float moe_routed_scaling = 1.0f;
  // Tensor / expert parallelism (src/parallel/shard.h): a rank's config holds its share of
  // heads and MLP widths above; under expert parallelism it binds routed experts
  // [moe_expert_begin, moe_expert_begin + moe_local_experts) only.
  int tp_size = 1;
  int tp_rank = 0;
  int moe_expert_begin = 0;
  int moe_local_experts = 0;  // 0: all moe_experts
  int moe_shared_intermediate =
      0;  // shared experts' MLP width; 0: shared experts * moe_intermediate

  bool is_mla() const { return kv_lora_rank > 0; }
  bool is_moe_layer(int l) const {
    return moe_experts > 0 && l >= first_k_dense && moe_layer_freq > 0 &&
           (l - first_k_dense) % moe_layer_freq == 0;
  }
  // The K/V cache geometry: MLA caches one latent row per token (1 "head" of R + P values,
  // no separate V); GQA caches kv_heads x head_dim for K and for V.
  int cache_heads() const { return is_mla() ? 1 : kv_heads; }
  int cache_head_dim() const { return is_mla() ? kv_lora_rank + qk_rope_dim : head_dim; }
  bool cache_has_v() const { return !is_mla(); }
  int local_experts() const { return moe_local_experts > 0 ? moe_local_experts : moe_experts; }
  int64_t shared_ffn() const {
    return moe_shared_intermediate > 0 ? moe_shared_intermediate
                                       : int64_t(moe_shared_experts) * moe_intermediate;
  }

  // config.json's quantization_config.quant_method ("fp8" for an FP8 checkpoint, whose F8_E4M3
  // weights carry `weight_scale_inv` or `weight_scale` tensors); "" when absent.
  std::string quant_method;
  // Set when quant_method is "gptq" or "awq" (4 bits; AWQ version "gemm").
  std::optional<Int4Format> int4;

  std::string summary() const;  // one line for logs
};

// llama-family hyperparameters from GGUF metadata ("<arch>.block_count", ...).
ModelConfig config_from_gguf(const GgufFile& f);
// llama or deepseek_v2 hyperparameters from a Hugging Face config.json, in the published
// checkpoints' layout (rope_scaling, top-level rope_theta) or transformers 5's
// (rope_parameters).
ModelConfig config_from_hf_json(const std::string& path);

}  // namespace ds
