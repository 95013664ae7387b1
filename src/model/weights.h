// Where a model's weights come from: a GGUF file or a safetensors checkpoint, addressed by
// GGUF-style names ("blk.3.attn_q.weight") whatever the file calls them.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "core/tensor.h"

namespace ds {

class GgufFile;
struct ModelConfig;

class WeightSource {
 public:
  virtual ~WeightSource() = default;
  virtual std::optional<TensorView> find(const std::string& name) const = 0;
  // Throws Error naming the tensor and the file when absent.
  TensorView get(const std::string& name) const;
  virtual std::string describe() const = 0;
  virtual uint64_t total_bytes() const = 0;
  // Reads every weight page once (progress(done, total) as it goes).
  virtual void prefetch(int threads, const std::function<void(size_t, size_t)>& progress) const = 0;
};

std::unique_ptr<WeightSource> gguf_weights(std::shared_ptr<const GgufFile> file);
// A llama.cpp `deepseek2` GGUF under the Hugging Face DeepSeek-V2 names deepseek_v2 binds
// (model.layers.N.mlp.experts.E.gate_proj.weight, ...): stacked experts as per-expert views,
// kv_b_proj rebuilt from attn_k_b / attn_v_b (weights_deepseek2.cpp).
std::unique_ptr<WeightSource> gguf_deepseek2_weights(std::shared_ptr<const GgufFile> file,
                                                     const ModelConfig& cfg);
// Hugging Face llama names (model.layers.N.self_attn.q_proj.weight, ...).
std::unique_ptr<WeightSource> safetensors_llama_weights(const std::filesystem::path& dir);

}  // namespace ds
