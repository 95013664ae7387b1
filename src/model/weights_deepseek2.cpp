// llama.cpp `deepseek2` GGUF tensors under the Hugging Face DeepSeek-V2 names that
// deepseek_v2.cpp binds: per-expert views into the stacked ffn_*_exps tensors, and kv_b_proj
// rebuilt from the attn_k_b / attn_v_b split that newer converters write.
#include <cstring>
#include <map>
#include <mutex>

#include "backend/cpu/matmul.h"
#include "core/error.h"
#include "formats/gguf.h"
#include "model/config.h"
#include "model/weights.h"

namespace ds {
namespace {

// Hugging Face per-layer name (without "model.layers.N." and ".weight") -> GGUF name part.
constexpr std::pair<const char*, const char*> kLayerNames[] = {
    {"input_layernorm", "attn_norm"},
    {"post_attention_layernorm", "ffn_norm"},
    {"self_attn.q_proj", "attn_q"},
    {"self_attn.q_a_proj", "attn_q_a"},
    {"self_attn.q_a_layernorm", "attn_q_a_norm"},
    {"self_attn.q_b_proj", "attn_q_b"},
    {"self_attn.kv_a_proj_with_mqa", "attn_kv_a_mqa"},
    {"self_attn.kv_a_layernorm", "attn_kv_a_norm"},
    {"self_attn.o_proj", "attn_output"},
    {"mlp.gate_proj", "ffn_gate"},
    {"mlp.up_proj", "ffn_up"},
    {"mlp.down_proj", "ffn_down"},
    {"mlp.gate", "ffn_gate_inp"},
    {"mlp.shared_experts.gate_proj", "ffn_gate_shexp"},
    {"mlp.shared_experts.up_proj", "ffn_up_shexp"},
    {"mlp.shared_experts.down_proj", "ffn_down_shexp"},
};

bool is_float(DType t) {
  return t == DType::F32 || t == DType::F16 || t == DType::BF16;
}

// Matrix `i` of a 3-D [n, rows, cols] view, optionally only rows [r0, r0 + nr).
TensorView matrix(const TensorView& t, int64_t i, int64_t r0, int64_t nr) {
  TensorView m = t;
  m.data = static_cast<uint8_t*>(t.data) + i * t.stride[0] + r0 * t.stride[1];
  m.ndim = 2;
  m.shape = {nr, t.shape[2], 0, 0};
  m.stride = {t.stride[1], t.stride[2], 0, 0};
  return m;
}

class GgufDeepseek2Weights final : public WeightSource {
 public:
  GgufDeepseek2Weights(std::shared_ptr<const GgufFile> f, const ModelConfig& c)
      : f_(std::move(f)),
        heads_(c.heads),
        rank_(c.kv_lora_rank),
        nope_(c.qk_nope_dim),
        v_(c.v_head_dim) {}

  std::optional<TensorView> find(const std::string& name) const override {
    if (name == "model.embed_tokens.weight") return raw("token_embd.weight");
    if (name == "model.norm.weight") return raw("output_norm.weight");
    if (name == "lm_head.weight") return raw("output.weight");
    const std::string pre = "model.layers.", suf = ".weight";
    if (name.rfind(pre, 0) != 0 || name.size() <= pre.size() + suf.size() ||
        name.compare(name.size() - suf.size(), suf.size(), suf) != 0)
      return raw(name);  // GGUF names pass through (tools, dumps)
    const size_t dot = name.find('.', pre.size());
    if (dot == std::string::npos) return std::nullopt;
    const int layer = std::stoi(name.substr(pre.size(), dot - pre.size()));
    const std::string rest = name.substr(dot + 1, name.size() - suf.size() - dot - 1);
    const std::string blk = "blk." + std::to_string(layer) + ".";
    if (rest == "self_attn.kv_b_proj") return kv_b(layer);
    if (rest.rfind("mlp.experts.", 0) == 0) return expert(blk, rest.substr(12));
    for (const auto& [hf, g] : kLayerNames)
      if (rest == hf) return raw(blk + g + suf);
    return std::nullopt;
  }
  std::string describe() const override { return f_->path(); }
  uint64_t total_bytes() const override { return f_->mapping() ? f_->mapping()->size() : 0; }
  void prefetch(int threads, const std::function<void(size_t, size_t)>& progress) const override {
    if (f_->mapping()) f_->mapping()->prefetch(threads, progress);
  }

 private:
  std::optional<TensorView> raw(const std::string& name) const {
    const auto* info = f_->find_tensor(name);
    if (!info) return std::nullopt;
    return f_->view(*info);
  }

  // "E.gate_proj" -> expert E's rows of ffn_gate_exps [E, F, hidden] (or of the fused
  // ffn_gate_up_exps [E, 2F, hidden] some converters write), as a view.
  std::optional<TensorView> expert(const std::string& blk, const std::string& rest) const {
    const size_t dot = rest.find('.');
    if (dot == std::string::npos) return std::nullopt;
    const int64_t e = std::stoll(rest.substr(0, dot));
    const std::string proj = rest.substr(dot + 1);
    const char* g = proj == "gate_proj" ? "gate" : proj == "up_proj" ? "up" : "down";
    if (proj != "gate_proj" && proj != "up_proj" && proj != "down_proj") return std::nullopt;
    if (auto t = raw(blk + "ffn_" + g + "_exps.weight")) {
      if (t->ndim != 3 || e < 0 || e >= t->shape[0]) return std::nullopt;
      return matrix(*t, e, 0, t->shape[1]);
    }
    if (proj == "down_proj") return std::nullopt;
    auto t = raw(blk + "ffn_gate_up_exps.weight");
    if (!t || t->ndim != 3 || e < 0 || e >= t->shape[0] || t->shape[1] % 2 != 0)
      return std::nullopt;
    const int64_t F = t->shape[1] / 2;
    return matrix(*t, e, proj == "gate_proj" ? 0 : F, F);
  }

  // kv_b_proj [H * (nope + v), R]: the legacy attn_kv_b as is, else per head the rows of
  // attn_k_b [H, R, nope] transposed followed by attn_v_b [H, v, R]. Built once per layer,
  // in the parts' dtype when they share a float one, else dequantized to F32.
  std::optional<TensorView> kv_b(int layer) const {
    const std::string blk = "blk." + std::to_string(layer) + ".";
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = kv_b_.find(layer); it != kv_b_.end()) return it->second.view;
    const int64_t H = heads_, R = rank_, nope = nope_, v = v_;
    Owned o;
    if (auto kvb = raw(blk + "attn_kv_b.weight")) {
      if (is_float(kvb->dtype)) return kvb;
      if (kvb->ndim != 2) throw Error(f_->path() + ": " + blk + "attn_kv_b.weight must be 2-D");
      o.view = build(DType::F32, kvb->shape[0], kvb->shape[1], o.bytes);
      for (int64_t r = 0; r < kvb->shape[0]; ++r)
        cpu::dequantize_row(kvb->dtype, kvb->row(r), reinterpret_cast<float*>(o.view.row(r)),
                            kvb->shape[1]);
      return kv_b_.emplace(layer, std::move(o)).first->second.view;
    }
    auto kb = raw(blk + "attn_k_b.weight"), vb = raw(blk + "attn_v_b.weight");
    if (!kb || !vb) return std::nullopt;
    auto shape_is = [](const TensorView& t, int64_t a, int64_t b, int64_t c) {
      return t.ndim == 3 && t.shape[0] == a && t.shape[1] == b && t.shape[2] == c;
    };
    if (!shape_is(*kb, H, R, nope) || !shape_is(*vb, H, v, R))
      throw Error(f_->path() + ": " + blk + "attn_k_b / attn_v_b are " + kb->shape_str() + " / " +
                  vb->shape_str() + ", expected [" + std::to_string(H) + ", " + std::to_string(R) +
                  ", " + std::to_string(nope) + "] / [" + std::to_string(H) + ", " +
                  std::to_string(v) + ", " + std::to_string(R) + "]");
    const DType dt = kb->dtype == vb->dtype && is_float(kb->dtype) ? kb->dtype : DType::F32;
    o.view = build(dt, H * (nope + v), R, o.bytes);
    const size_t es = dtype_info(dt).type_size;
    std::vector<float> row(size_t(std::max(R, nope)));
    auto put = [&](int64_t r, int64_t c, float x) {
      uint8_t* p = o.view.row(r) + c * int64_t(es);
      if (dt == DType::F32) {
        std::memcpy(p, &x, 4);
      } else {
        const uint16_t h = dt == DType::F16 ? f32_to_fp16(x) : f32_to_bf16(x);  // exact
        std::memcpy(p, &h, 2);
      }
    };
    for (int64_t h = 0; h < H; ++h) {
      const int64_t base = h * (nope + v);
      for (int64_t c = 0; c < R; ++c) {  // k_b[h][c][i] -> kv_b[base + i][c]
        cpu::dequantize_row(kb->dtype, matrix(*kb, h, c, 1).data, row.data(), nope);
        for (int64_t i = 0; i < nope; ++i) put(base + i, c, row[size_t(i)]);
      }
      for (int64_t j = 0; j < v; ++j) {  // v_b[h][j][c] -> kv_b[base + nope + j][c]
        cpu::dequantize_row(vb->dtype, matrix(*vb, h, j, 1).data, row.data(), R);
        for (int64_t c = 0; c < R; ++c) put(base + nope + j, c, row[size_t(c)]);
      }
    }
    return kv_b_.emplace(layer, std::move(o)).first->second.view;
  }

  static TensorView build(DType dt, int64_t rows, int64_t cols, std::vector<uint8_t>& bytes) {
    bytes.assign(dtype_bytes(dt, cols) * size_t(rows), 0);
    return TensorView::contiguous(bytes.data(), dt, {rows, cols});
  }

  struct Owned {
    std::vector<uint8_t> bytes;
    TensorView view;  // over bytes (a moved vector keeps its buffer)
  };

  std::shared_ptr<const GgufFile> f_;
  int64_t heads_, rank_, nope_, v_;
  mutable std::mutex mu_;
  mutable std::map<int, Owned> kv_b_;
};

}  // namespace

std::unique_ptr<WeightSource> gguf_deepseek2_weights(std::shared_ptr<const GgufFile> file,
                                                     const ModelConfig& cfg) {
  return std::make_unique<GgufDeepseek2Weights>(std::move(file), cfg);
}

}  // namespace ds
