#include "model/config.h"

#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "formats/gguf.h"

namespace ds {

std::string ModelConfig::summary() const {
  return arch + " hidden=" + std::to_string(hidden) + " layers=" + std::to_string(layers) +
         " heads=" + std::to_string(heads) + "/" + std::to_string(kv_heads) +
         " head_dim=" + std::to_string(head_dim) + " ffn=" + std::to_string(intermediate) +
         " vocab=" + std::to_string(vocab) + " ctx=" + std::to_string(max_context);
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
}

}  // namespace

ModelConfig config_from_gguf(const GgufFile& f) {
  ModelConfig c;
  c.arch = f.get_string("general.architecture").value_or("");
  if (c.arch != "llama")
    throw UnsupportedError(f.path() + ": architecture '" + c.arch +
                           "' is not supported from GGUF (supported: llama)");
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
  validate(c, f.path());
  return c;
}

ModelConfig config_from_hf_json(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw Error(path + ": cannot open");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw Error(path + ": invalid JSON: " + e.what());
  }
  auto get_int = [&](const char* key, int64_t def) -> int64_t {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) return def;
    if (!it->is_number_integer()) throw Error(path + ": '" + key + "' must be an integer");
    return it->get<int64_t>();
  };
  auto get_float = [&](const char* key, double def) -> double {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) return def;
    if (!it->is_number()) throw Error(path + ": '" + key + "' must be a number");
    return it->get<double>();
  };
  ModelConfig c;
  c.arch = j.value("model_type", "");
  if (c.arch != "llama")
    throw UnsupportedError(path + ": model_type '" + c.arch + "' is not supported yet");
  c.name = j.value("_name_or_path", "");
  c.hidden = int(get_int("hidden_size", 0));
  c.layers = int(get_int("num_hidden_layers", 0));
  c.heads = int(get_int("num_attention_heads", 0));
  c.kv_heads = int(get_int("num_key_value_heads", c.heads));
  c.intermediate = int(get_int("intermediate_size", 0));
  c.vocab = int(get_int("vocab_size", 0));
  c.max_context = get_int("max_position_embeddings", 2048);
  c.rms_eps = float(get_float("rms_norm_eps", 1e-6));
  c.head_dim = int(get_int("head_dim", c.heads ? c.hidden / c.heads : 0));
  c.rope.style = RopeStyle::RotateHalf;
  // transformers 5 nests rope_theta inside rope_parameters.
  double theta = get_float("rope_theta", 10000.0);
  if (auto rp = j.find("rope_parameters"); rp != j.end() && rp->is_object())
    theta = rp->value("rope_theta", theta);
  c.rope.theta = float(theta);
  c.rope.rotary_dim = c.head_dim;
  c.tied_embeddings = j.value("tie_word_embeddings", false);
  if (auto b = j.find("bos_token_id"); b != j.end() && b->is_number_integer()) c.bos_id = *b;
  if (auto e = j.find("eos_token_id"); e != j.end() && e->is_number_integer()) c.eos_id = *e;
  validate(c, path);
  return c;
}

}  // namespace ds
