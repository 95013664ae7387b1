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

// Weight formats the binder may convert the big matmul weights to at load time (--quantize):
// None keeps the checkpoint's; BF16 converts F32 / F16 / FP8 / GGUF-block weights to BF16 (a
// reference for the others: `accuracy --quantize bf16` on a GGUF file).
enum class WeightQuant : uint8_t { None, W4A16, FP8, BF16 };
// "none", "bf16", "w4a16" or "fp8" (FP8W); throws for anything else.
WeightQuant weight_quant_from_name(const std::string& name);
const char* weight_quant_name(WeightQuant q);

// How a dummy weight is generated (--load-format dummy): Backend::fill_random's seed and
// distribution; the source's views of such weights have shapes and dtypes but no data.
struct DummyInit {
  uint64_t seed = 0;
  float mean = 0.0f;
  float std = 1.0f;
};

class WeightSource {
 public:
  virtual ~WeightSource() = default;
  // Set for generated (dummy) weights, whose views carry no data: WeightBinder generates them
  // in backend memory instead of reading them.
  virtual std::optional<DummyInit> dummy_init(const std::string& /*name*/) const {
    return std::nullopt;
  }
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
// Random weights with the shapes `cfg` implies, under the names the architecture binds
// (llama: GGUF names; deepseek_v2: Hugging Face names), BF16, deterministic for a seed:
// linears ~ N(0, (0.6 / sqrt(fan_in))^2), embeddings N(0, 1), norms 1 + N(0, 0.1^2), the
// output projection and the MoE router with larger gains so logits and routing are sharp.
std::unique_ptr<WeightSource> dummy_weights(const ModelConfig& cfg, uint64_t seed);
// Hugging Face llama names (model.layers.N.self_attn.q_proj.weight, ...).
std::unique_ptr<WeightSource> safetensors_llama_weights(const std::filesystem::path& dir);

}  // namespace ds
