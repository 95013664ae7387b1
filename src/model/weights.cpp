#include "model/weights.h"

#include <regex>

#include "core/error.h"
#include "formats/gguf.h"
#include "formats/safetensors.h"

namespace ds {

WeightQuant weight_quant_from_name(const std::string& name) {
  if (name.empty() || name == "none") return WeightQuant::None;
  if (name == "bf16") return WeightQuant::BF16;
  if (name == "w4a16") return WeightQuant::W4A16;
  if (name == "fp8") return WeightQuant::FP8;
  throw Error("--quantize must be none, bf16, w4a16 or fp8, not '" + name + "'");
}

const char* weight_quant_name(WeightQuant q) {
  switch (q) {
    case WeightQuant::W4A16:
      return "w4a16";
    case WeightQuant::FP8:
      return "fp8";
    case WeightQuant::BF16:
      return "bf16";
    case WeightQuant::None:
      break;
  }
  return "none";
}

TensorView WeightSource::get(const std::string& name) const {
  auto t = find(name);
  if (!t) throw Error(describe() + ": missing tensor '" + name + "'");
  return *t;
}

namespace {

class GgufWeights final : public WeightSource {
 public:
  explicit GgufWeights(std::shared_ptr<const GgufFile> f) : f_(std::move(f)) {}
  std::optional<TensorView> find(const std::string& name) const override {
    const auto* info = f_->find_tensor(name);
    if (!info) return std::nullopt;
    return f_->view(*info);
  }
  std::string describe() const override { return f_->path(); }
  uint64_t total_bytes() const override { return f_->mapping() ? f_->mapping()->size() : 0; }
  void prefetch(int threads, const std::function<void(size_t, size_t)>& progress) const override {
    if (f_->mapping()) f_->mapping()->prefetch(threads, progress);
  }

 private:
  std::shared_ptr<const GgufFile> f_;
};

// GGUF-style name -> Hugging Face llama name; a suffix after ".weight" (an FP8 checkpoint's
// "weight_scale_inv" / "weight_scale") carries over, as do GPTQ / AWQ's "qweight" and friends.
std::string hf_llama_name(const std::string& name) {
  static const std::pair<const char*, const char*> kTop[] = {
      {"token_embd.weight", "model.embed_tokens.weight"},
      {"output_norm.weight", "model.norm.weight"},
      {"output.weight", "lm_head.weight"},
  };
  for (const auto& [g, h] : kTop)
    if (name.starts_with(g)) return h + name.substr(std::string_view(g).size());
  static const std::pair<const char*, const char*> kBlock[] = {
      {"attn_norm", "input_layernorm"},    {"attn_q", "self_attn.q_proj"},
      {"attn_k", "self_attn.k_proj"},      {"attn_v", "self_attn.v_proj"},
      {"attn_output", "self_attn.o_proj"}, {"ffn_norm", "post_attention_layernorm"},
      {"ffn_gate", "mlp.gate_proj"},       {"ffn_up", "mlp.up_proj"},
      {"ffn_down", "mlp.down_proj"},
  };
  // GPTQ / AWQ linears: qweight, qzeros, scales, g_idx instead of weight.
  static const std::regex kBlk(
      R"(blk\.(\d+)\.(\w+)\.(weight(_scale_inv|_scale)?|qweight|qzeros|scales|g_idx))");
  std::smatch m;
  if (std::regex_match(name, m, kBlk))
    for (const auto& [g, h] : kBlock)
      if (m[2] == g) return "model.layers." + m[1].str() + "." + h + "." + m[3].str();
  return name;
}

class SafetensorsWeights final : public WeightSource {
 public:
  explicit SafetensorsWeights(SafetensorsCheckpoint ckpt) : ckpt_(std::move(ckpt)) {}
  std::optional<TensorView> find(const std::string& name) const override {
    const std::string hf = hf_llama_name(name);
    if (!ckpt_.contains(hf)) return std::nullopt;
    return ckpt_.view(hf);
  }
  std::string describe() const override { return ckpt_.dir().string(); }
  uint64_t total_bytes() const override { return ckpt_.total_bytes(); }
  void prefetch(int threads, const std::function<void(size_t, size_t)>& progress) const override {
    const size_t total = total_bytes();
    size_t before = 0;
    for (const auto& shard : ckpt_.shards()) {
      shard.mapping()->prefetch(threads, [&](size_t done, size_t) {
        if (progress) progress(before + done, total);
      });
      before += shard.mapping()->size();
    }
  }

 private:
  SafetensorsCheckpoint ckpt_;
};

}  // namespace

std::unique_ptr<WeightSource> gguf_weights(std::shared_ptr<const GgufFile> file) {
  return std::make_unique<GgufWeights>(std::move(file));
}

std::unique_ptr<WeightSource> safetensors_llama_weights(const std::filesystem::path& dir) {
  return std::make_unique<SafetensorsWeights>(SafetensorsCheckpoint::open(dir));
}

}  // namespace ds
