#include "model/config.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "formats/gguf.h"

namespace ds {

std::string ModelConfig::summary() const {
  std::string s = arch + " hidden=" + std::to_string(hidden) + " layers=" + std::to_string(layers) +
                  " heads=" + std::to_string(heads) + "/" + std::to_string(kv_heads) +
                  " head_dim=" + std::to_string(head_dim) + " ffn=" + std::to_string(intermediate) +
                  " vocab=" + std::to_string(vocab) + " ctx=" + std::to_string(max_context);
  if (is_mla())
    s += " mla(q_lora=" + std::to_string(q_lora_rank) + " kv_lora=" + std::to_string(kv_lora_rank) +
         " nope=" + std::to_string(qk_nope_dim) + " rope=" + std::to_string(qk_rope_dim) +
         " v=" + std::to_string(v_head_dim) + ")";
  if (moe_experts > 0)
    s += " moe(" + std::to_string(moe_experts) + " experts top-" + std::to_string(moe_top_k) +
         " shared=" + std::to_string(moe_shared_experts) +
         " ffn=" + std::to_string(moe_intermediate) +
         " dense_layers=" + std::to_string(first_k_dense) + ")";
  if (rope.yarn_factor > 0) s += " yarn(x" + std::to_string(rope.yarn_factor) + ")";
  if (!quant_method.empty()) s += " quant=" + quant_method;
  return s;
}

namespace {

int64_t need_int(const GgufFile& f, const std::string& key) {
  auto v = f.get_int(key);
  if (!v) throw Error(f.path() + ": missing metadata key '" + key + "'");
  return *v;
}

void validate(const ModelConfig& c, const std::string& where) {
  auto bad = [&](const std::string& what) { throw Error(where + ": invalid config: " + what); };
  if (c.hidden <= 0 || c.layers <= 0 || c.heads <= 0 || c.kv_heads <= 0 || c.vocab <= 0 ||
      c.intermediate <= 0 || c.head_dim <= 0)
    bad("sizes must be positive (" + c.summary() + ")");
  if (c.heads % c.kv_heads != 0) bad("heads must be a multiple of kv heads");
  if (c.head_dim % 2 != 0 || c.rope.rotary_dim > c.head_dim || c.rope.rotary_dim % 2 != 0)
    bad("head_dim and rotary dim must be even, rotary dim <= head_dim");
  if (!(c.rms_eps > 0) || !(c.rope.theta > 0)) bad("rms eps and rope theta must be positive");
  if (c.is_mla()) {
    if (c.qk_nope_dim <= 0 || c.qk_rope_dim <= 0 || c.v_head_dim <= 0 || c.q_lora_rank < 0)
      bad("MLA dims (qk_nope_head_dim, qk_rope_head_dim, v_head_dim) must be positive");
    if (c.qk_rope_dim % 2 != 0) bad("qk_rope_head_dim must be even");
  }
  if (c.moe_experts > 0) {
    if (c.moe_top_k <= 0 || c.moe_top_k > c.moe_experts || c.moe_intermediate <= 0)
      bad("MoE needs 0 < num_experts_per_tok <= n_routed_experts and moe_intermediate_size > 0");
    if (c.moe_top_k > 16) bad("num_experts_per_tok above 16 is not supported");
    if (c.moe_topk_method == MoeTopk::GroupLimitedGreedy &&
        (c.moe_n_group <= 0 || c.moe_experts % c.moe_n_group != 0 || c.moe_topk_group <= 0 ||
         c.moe_topk_group > c.moe_n_group ||
         c.moe_topk_group * (c.moe_experts / c.moe_n_group) < c.moe_top_k))
      bad("group_limited_greedy needs n_group dividing the experts and enough experts in "
          "topk_group groups for num_experts_per_tok");
  }
}

}  // namespace

namespace {

// llama.cpp's `deepseek2` keys (convert_hf_to_gguf.py, DeepseekV2Model) into deepseek_v2's
// config. Newer converters write the MQA view (key_length = kv_lora + rope, value_length =
// kv_lora) plus key/value_length_mla; older ones only key/value_length per head.
void read_deepseek2_gguf(const GgufFile& f, ModelConfig& c) {
  const std::string a = "deepseek2.";
  c.kv_heads = c.heads;  // the file says 1 (MLA as MQA); every head expands its own K/V
  c.q_lora_rank = int(f.get_int(a + "attention.q_lora_rank").value_or(0));
  c.kv_lora_rank = int(need_int(f, a + "attention.kv_lora_rank"));
  c.qk_rope_dim = int(need_int(f, a + "rope.dimension_count"));
  const auto mla_or = [&](const char* mla_key, const char* key) {
    auto v = f.get_int(a + mla_key);
    return v ? *v : need_int(f, a + key);
  };
  const int64_t qk = mla_or("attention.key_length_mla", "attention.key_length");
  c.v_head_dim = int(mla_or("attention.value_length_mla", "attention.value_length"));
  c.qk_nope_dim = int(qk) - c.qk_rope_dim;
  c.head_dim = int(qk);
  c.attn_scale = 1.0f / std::sqrt(float(c.head_dim));
  c.rope.style = RopeStyle::Adjacent;  // the converter keeps DeepSeek's interleaved pairs
  c.rope.rotary_dim = c.qk_rope_dim;
  c.moe_experts = int(f.get_int(a + "expert_count").value_or(0));
  c.moe_top_k = int(f.get_int(a + "expert_used_count").value_or(0));
  c.moe_shared_experts = int(f.get_int(a + "expert_shared_count").value_or(0));
  c.moe_intermediate = int(f.get_int(a + "expert_feed_forward_length").value_or(0));
  c.first_k_dense = int(f.get_int(a + "leading_dense_block_count").value_or(0));
  c.moe_layer_freq = 1;  // llama.cpp has no key for it: every layer after the dense ones
  // Groups are written from n_group / topk_group; DeepSeek-V2 pairs n_group > 1 with
  // group_limited_greedy (V2-Lite: 1 group, greedy), and the file keeps no topk_method.
  c.moe_n_group = int(f.get_int(a + "expert_group_count").value_or(1));
  c.moe_topk_group = int(f.get_int(a + "expert_group_used_count").value_or(1));
  c.moe_topk_method = c.moe_n_group > 1 ? MoeTopk::GroupLimitedGreedy : MoeTopk::Greedy;
  if (auto g = f.get_int(a + "expert_gating_func"); g && *g != 1)  // 1: softmax
    throw UnsupportedError(f.path() + ": expert_gating_func " + std::to_string(*g) +
                           " is not supported (softmax only)");
  c.moe_norm_topk_prob = f.get_bool(a + "expert_weights_norm").value_or(false);
  c.moe_routed_scaling = float(f.get_float(a + "expert_weights_scale").value_or(1.0));
  // YaRN. The converter keeps mscale_all_dim as yarn_log_multiplier = 0.1 * mscale_all_dim
  // and drops mscale; llama.cpp then takes mscale = mscale_all_dim (true of DeepSeek's
  // checkpoints), so cos/sin are unscaled and the softmax scale gains mscale_all_dim's term.
  const std::string type = f.get_string(a + "rope.scaling.type").value_or("none");
  const float factor = float(f.get_float(a + "rope.scaling.factor").value_or(1.0));
  if (type == "linear") {
    c.rope.freq_scale = 1.0f / factor;
  } else if (type == "yarn") {
    c.rope.yarn_factor = factor;
    c.rope.yarn_original_max_position =
        int(f.get_int(a + "rope.scaling.original_context_length").value_or(0));
    c.rope.yarn_beta_fast = float(f.get_float(a + "rope.scaling.yarn_beta_fast").value_or(32.0));
    c.rope.yarn_beta_slow = float(f.get_float(a + "rope.scaling.yarn_beta_slow").value_or(1.0));
    const auto log_mul = f.get_float(a + "rope.scaling.yarn_log_multiplier");
    c.rope.attn_factor = log_mul ? 1.0f : yarn_mscale(factor, 1.0f);
    if (auto af = f.get_float(a + "rope.scaling.yarn_attn_factor")) c.rope.attn_factor = float(*af);
    if (log_mul) {
      const float m = yarn_mscale(factor, float(*log_mul / 0.1));
      c.attn_scale *= m * m;
    }
    if (c.rope.yarn_original_max_position <= 0)
      throw Error(f.path() + ": yarn rope scaling needs rope.scaling.original_context_length");
  } else if (type != "none") {
    throw UnsupportedError(f.path() + ": rope scaling type '" + type +
                           "' is not supported (supported: none, linear, yarn)");
  }
}

}  // namespace

ModelConfig config_from_gguf(const GgufFile& f) {
  ModelConfig c;
  c.arch = f.get_string("general.architecture").value_or("");
  if (c.arch != "llama" && c.arch != "deepseek2")
    throw UnsupportedError(f.path() + ": architecture '" + c.arch +
                           "' is not supported from GGUF (supported: llama, deepseek2)");
  c.name = f.get_string("general.name").value_or("");
  const std::string a = c.arch + ".";
  c.hidden = int(need_int(f, a + "embedding_length"));
  c.layers = int(need_int(f, a + "block_count"));
  c.heads = int(need_int(f, a + "attention.head_count"));
  c.kv_heads = int(f.get_int(a + "attention.head_count_kv").value_or(c.heads));
  c.intermediate = int(need_int(f, a + "feed_forward_length"));
  c.max_context = f.get_int(a + "context_length").value_or(2048);
  c.rms_eps = float(f.get_float(a + "attention.layer_norm_rms_epsilon").value_or(1e-5));
  c.head_dim = c.heads > 0 ? c.hidden / c.heads : 0;
  c.rope.style = RopeStyle::Adjacent;  // convert_hf_to_gguf permutes Q/K rows for this
  c.rope.theta = float(f.get_float(a + "rope.freq_base").value_or(10000.0));
  c.rope.rotary_dim = int(f.get_int(a + "rope.dimension_count").value_or(c.head_dim));
  const auto& tokens = f.get_string_array("tokenizer.ggml.tokens");
  c.vocab = int(f.get_int(a + "vocab_size").value_or(int64_t(tokens.size())));
  if (const auto* emb = f.find_tensor("token_embd.weight"); emb && emb->dims.size() == 2)
    c.vocab = int(emb->dims[1]);
  c.tied_embeddings = f.find_tensor("output.weight") == nullptr;
  c.bos_id = int(f.get_int("tokenizer.ggml.bos_token_id").value_or(-1));
  c.eos_id = int(f.get_int("tokenizer.ggml.eos_token_id").value_or(-1));
  if (c.arch == "deepseek2") {
    read_deepseek2_gguf(f, c);
    c.arch = "deepseek_v2";  // the model's name here, whatever the file format calls it
  }
  validate(c, f.path());
  return c;
}

namespace {

// Reads a JSON object with typed accessors whose errors name the file and the key.
struct JsonReader {
  const nlohmann::json& j;
  const std::string& path;
  int64_t get_int(const char* key, int64_t def) const {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) return def;
    if (!it->is_number_integer()) throw Error(path + ": '" + key + "' must be an integer");
    return it->get<int64_t>();
  }
  double get_float(const char* key, double def) const {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) return def;
    if (!it->is_number()) throw Error(path + ": '" + key + "' must be a number");
    return it->get<double>();
  }
  bool get_bool(const char* key, bool def) const {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) return def;
    if (!it->is_boolean()) throw Error(path + ": '" + key + "' must be true or false");
    return it->get<bool>();
  }
  std::string get_string(const char* key, const std::string& def) const {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) return def;
    if (!it->is_string()) throw Error(path + ": '" + key + "' must be a string");
    return it->get<std::string>();
  }
};

// RoPE theta and scaling from either layout: published checkpoints have top-level
// `rope_theta` and a `rope_scaling` object; transformers 5 writes one `rope_parameters`
// object holding rope_theta, rope_type and the scaling keys.
void read_rope(const nlohmann::json& j, const std::string& path, ModelConfig& c) {
  const JsonReader top{j, path};
  double theta = top.get_float("rope_theta", 10000.0);
  const nlohmann::json* scaling = nullptr;
  for (const char* key : {"rope_parameters", "rope_scaling"})
    if (auto it = j.find(key); it != j.end() && it->is_object()) {
      scaling = &*it;
      break;
    }
  if (!scaling) {
    c.rope.theta = float(theta);
    return;
  }
  const JsonReader r{*scaling, path};
  theta = r.get_float("rope_theta", theta);
  c.rope.theta = float(theta);
  std::string type = r.get_string("rope_type", r.get_string("type", "default"));
  if (type == "default" || type == "none") return;
  if (type == "linear") {
    c.rope.freq_scale = float(1.0 / r.get_float("factor", 1.0));
    return;
  }
  if (type != "yarn")
    throw UnsupportedError(path + ": rope scaling type '" + type +
                           "' is not supported (supported: default, linear, yarn)");
  const double factor = r.get_float("factor", 1.0);
  c.rope.yarn_factor = float(factor);
  c.rope.yarn_original_max_position =
      int(r.get_int("original_max_position_embeddings", c.max_context));
  c.rope.yarn_beta_fast = float(r.get_float("beta_fast", 32.0));
  c.rope.yarn_beta_slow = float(r.get_float("beta_slow", 1.0));
  // cos/sin scale: mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are
  // given, else mscale(factor, 1) (transformers' rule; DeepSeek's checkpoints give both).
  // The softmax scale gains mscale(factor, mscale_all_dim)^2.
  const float mscale = float(r.get_float("mscale", 0.0));
  const float mscale_all_dim = float(r.get_float("mscale_all_dim", 0.0));
  if (auto af = scaling->find("attention_factor"); af != scaling->end() && af->is_number())
    c.rope.attn_factor = af->get<float>();
  else if (mscale != 0.0f && mscale_all_dim != 0.0f)
    c.rope.attn_factor =
        yarn_mscale(float(factor), mscale) / yarn_mscale(float(factor), mscale_all_dim);
  else
    c.rope.attn_factor = yarn_mscale(float(factor), 1.0f);
  if (mscale_all_dim != 0.0f && c.attn_scale > 0) {
    const float m = yarn_mscale(float(factor), mscale_all_dim);
    c.attn_scale *= m * m;
  }
  if (c.rope.yarn_original_max_position <= 0)
    throw Error(path + ": yarn rope scaling needs original_max_position_embeddings");
}

void read_deepseek(const JsonReader& r, ModelConfig& c) {
  c.q_lora_rank = int(r.get_int("q_lora_rank", 0));
  c.kv_lora_rank = int(r.get_int("kv_lora_rank", 0));
  c.qk_nope_dim = int(r.get_int("qk_nope_head_dim", 0));
  c.qk_rope_dim = int(r.get_int("qk_rope_head_dim", 0));
  c.v_head_dim = int(r.get_int("v_head_dim", 0));
  if (c.kv_lora_rank <= 0) throw Error(r.path + ": deepseek_v2 needs kv_lora_rank > 0");
  c.head_dim = c.qk_nope_dim + c.qk_rope_dim;
  c.kv_heads = c.heads;  // every head has its own expanded K/V (from the shared latent)
  c.attn_scale = 1.0f / std::sqrt(float(c.head_dim));
  c.rope.style = RopeStyle::Adjacent;  // DeepSeek rotates (2i, 2i+1) pairs of q_pe / k_pe
  c.rope.rotary_dim = c.qk_rope_dim;
  c.moe_experts = int(r.get_int("n_routed_experts", 0));
  c.moe_top_k = int(r.get_int("num_experts_per_tok", 0));
  c.moe_shared_experts = int(r.get_int("n_shared_experts", 0));
  c.moe_intermediate = int(r.get_int("moe_intermediate_size", 0));
  c.first_k_dense = int(r.get_int("first_k_dense_replace", 0));
  c.moe_layer_freq = int(r.get_int("moe_layer_freq", 1));
  const std::string method = r.get_string("topk_method", "greedy");
  if (method == "greedy")
    c.moe_topk_method = MoeTopk::Greedy;
  else if (method == "group_limited_greedy")
    c.moe_topk_method = MoeTopk::GroupLimitedGreedy;
  else
    throw UnsupportedError(r.path + ": topk_method '" + method +
                           "' is not supported (greedy, group_limited_greedy)");
  const std::string scoring = r.get_string("scoring_func", "softmax");
  if (scoring != "softmax")
    throw UnsupportedError(r.path + ": scoring_func '" + scoring + "' is not supported");
  c.moe_n_group = int(r.get_int("n_group", 1));
  c.moe_topk_group = int(r.get_int("topk_group", 1));
  c.moe_norm_topk_prob = r.get_bool("norm_topk_prob", false);
  c.moe_routed_scaling = float(r.get_float("routed_scaling_factor", 1.0));
}

// GPTQ / AWQ quantization_config (AutoGPTQ / gptqmodel and AutoAWQ / transformers' names).
Int4Format read_int4(const nlohmann::json& q, const std::string& path) {
  const JsonReader r{q, path};
  const std::string m = r.get_string("quant_method", "");
  const int64_t bits = r.get_int("bits", r.get_int("w_bit", 4));
  if (bits != 4)
    throw UnsupportedError(path + ": " + m + " with " + std::to_string(bits) +
                           " bits is not supported (only 4-bit GPTQ / AWQ)");
  Int4Format f;
  f.group_size = r.get_int("group_size", r.get_int("q_group_size", 128));
  if (f.group_size == 0 || f.group_size < -1)
    throw Error(path + ": " + m + " group_size " + std::to_string(f.group_size) + " is invalid");
  if (m == "awq") {
    f.kind = Int4Format::Kind::Awq;
    std::string v = r.get_string("version", "gemm");
    std::transform(v.begin(), v.end(), v.begin(),
                   [](unsigned char ch) { return std::tolower(ch); });
    if (v != "gemm")
      throw UnsupportedError(path + ": AWQ version '" + v +
                             "' is not supported (only GEMM's packing)");
    if (!r.get_bool("zero_point", true))
      throw UnsupportedError(path + ": AWQ without zero points is not supported");
    f.sym = false;
    f.zeros_minus_one = false;
    return f;
  }
  f.sym = r.get_bool("sym", true);
  f.desc_act = r.get_bool("desc_act", false);
  const std::string cf = r.get_string("checkpoint_format", "gptq");
  if (cf != "gptq" && cf != "gptq_v2")
    throw UnsupportedError(path + ": GPTQ checkpoint_format '" + cf +
                           "' is not supported (gptq or gptq_v2)");
  f.zeros_minus_one = cf == "gptq";
  return f;
}

}  // namespace

ModelConfig config_from_hf_json(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw Error(path + ": cannot open");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw Error(path + ": invalid JSON: " + e.what());
  }
  if (!j.is_object()) throw Error(path + ": config.json must hold a JSON object");
  const JsonReader r{j, path};
  ModelConfig c;
  c.arch = r.get_string("model_type", "");
  if (c.arch != "llama" && c.arch != "deepseek_v2")
    throw UnsupportedError(path + ": model_type '" + c.arch +
                           "' is not supported (supported: llama, deepseek_v2)");
  c.name = r.get_string("_name_or_path", "");
  c.hidden = int(r.get_int("hidden_size", 0));
  c.layers = int(r.get_int("num_hidden_layers", 0));
  c.heads = int(r.get_int("num_attention_heads", 0));
  c.kv_heads = int(r.get_int("num_key_value_heads", c.heads));
  c.intermediate = int(r.get_int("intermediate_size", 0));
  c.vocab = int(r.get_int("vocab_size", 0));
  c.max_context = r.get_int("max_position_embeddings", 2048);
  c.rms_eps = float(r.get_float("rms_norm_eps", 1e-6));
  c.tied_embeddings = r.get_bool("tie_word_embeddings", false);
  if (c.arch == "deepseek_v2") {
    read_deepseek(r, c);
  } else {
    c.head_dim = int(r.get_int("head_dim", c.heads ? c.hidden / c.heads : 0));
    c.rope.style = RopeStyle::RotateHalf;
    c.rope.rotary_dim = c.head_dim;
  }
  read_rope(j, path, c);
  if (auto q = j.find("quantization_config"); q != j.end() && q->is_object()) {
    if (auto m = q->find("quant_method"); m != q->end() && m->is_string()) c.quant_method = *m;
    // FP8 block scales must be 128 x 128 (FP8W's groups); per-channel checkpoints name none.
    if (auto b = q->find("weight_block_size"); c.quant_method == "fp8" && b != q->end() &&
                                               !b->is_null() &&
                                               *b != nlohmann::json::array({128, 128}))
      throw UnsupportedError(path + ": FP8 weight_block_size " + b->dump() +
                             " is not supported (only [128, 128] block scales or per-channel)");
    if (c.quant_method == "gptq" || c.quant_method == "awq") c.int4 = read_int4(*q, path);
  }
  if (auto b = j.find("bos_token_id"); b != j.end() && b->is_number_integer()) c.bos_id = *b;
  if (auto e = j.find("eos_token_id"); e != j.end()) {
    if (e->is_number_integer())
      c.eos_id = *e;
    else if (e->is_array() && !e->empty() && e->front().is_number_integer())
      c.eos_id = e->front();
  }
  validate(c, path);
  return c;
}

}  // namespace ds
