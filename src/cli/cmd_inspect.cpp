#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/error.h"
#include "formats/gguf.h"
#include "formats/safetensors.h"

namespace ds {
namespace {

struct TensorRow {
  std::string name, dtype, shape;
  std::vector<int64_t> dims;
  uint64_t bytes;
};

std::vector<TensorRow> tensor_rows(const LoadedModel& m) {
  std::vector<TensorRow> rows;
  auto shape_of = [](const std::vector<int64_t>& d) {
    std::string s = "[";
    for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
    return s + "]";
  };
  if (m.format == "dummy") return rows;  // no file: only the bound formats below
  if (m.gguf) {
    for (const auto& t : m.gguf->tensors()) {
      std::vector<int64_t> d(t.dims.rbegin(), t.dims.rend());  // row-major, like safetensors
      rows.push_back({t.name, std::string(dtype_name(t.dtype)), shape_of(d), d, t.nbytes});
    }
  } else {
    const auto ckpt = SafetensorsCheckpoint::open(m.path);
    for (const auto& n : ckpt.tensor_names()) {
      const auto& t = ckpt.tensor(n);
      rows.push_back({n, std::string(dtype_name(t.dtype)), shape_of(t.shape), t.shape, t.nbytes});
    }
  }
  return rows;
}

const char* topk_method_name(const ModelConfig& c) {
  return c.moe_topk_method == MoeTopk::GroupLimitedGreedy ? "group_limited_greedy" : "greedy";
}

}  // namespace

// Per dtype of the file's tensors, or of the bound weights: (bytes, parameters).
using Formats = std::map<std::string, std::pair<uint64_t, uint64_t>>;

Formats file_formats(const std::vector<TensorRow>& rows) {
  Formats f;
  for (const auto& r : rows) {
    uint64_t n = 1;
    for (int64_t d : r.dims) n *= uint64_t(d);
    f[r.dtype].first += r.bytes;
    f[r.dtype].second += n;
  }
  return f;
}

nlohmann::json formats_json(const Formats& f) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [name, bp] : f)
    j[name] = {{"bytes", bp.first},
               {"params", bp.second},
               {"bytes_per_param", bp.second ? double(bp.first) / double(bp.second) : 0.0}};
  return j;
}

void print_formats(const char* title, const Formats& f) {
  std::printf("%s\n", title);
  for (const auto& [name, bp] : f)
    std::printf("  %-8s %12.3f GB %16llu params %7.3f bytes/param\n", name.c_str(),
                double(bp.first) / 1e9, static_cast<unsigned long long>(bp.second),
                bp.second ? double(bp.first) / double(bp.second) : 0.0);
}

int run_inspect(const InspectOptions& o) {
  LoadOptions lo;
  lo.dummy = load_format_is_dummy(o.load_format);
  lo.quantize = weight_quant_from_name(o.quantize);
  LoadedModel m = open_model_metadata(o.path, lo.dummy);
  const ModelConfig& c = m.config;
  const auto rows = tensor_rows(m);
  const bool plan =
      lo.dummy || lo.quantize != WeightQuant::None || c.quant_method == "fp8" || c.int4.has_value();
  const Formats bound = plan ? plan_weight_formats(o.path, lo) : Formats{};
  const Tokenizer* tok = m.tokenizer.get();
  if (o.json) {
    nlohmann::json j;
    j["path"] = m.path;
    j["format"] = m.format;
    if (m.gguf) j["gguf_version"] = m.gguf->version();
    j["architecture"] = c.arch;
    j["name"] = c.name;
    j["hyperparameters"] = {
        {"hidden", c.hidden},
        {"layers", c.layers},
        {"heads", c.heads},
        {"kv_heads", c.kv_heads},
        {"head_dim", c.head_dim},
        {"intermediate", c.intermediate},
        {"vocab", c.vocab},
        {"max_context", c.max_context},
        {"rms_eps", c.rms_eps},
        {"rope_theta", c.rope.theta},
        {"rotary_dim", c.rope.rotary_dim},
        {"rope_style", c.rope.style == RopeStyle::Adjacent ? "adjacent" : "rotate_half"},
        {"tied_embeddings", c.tied_embeddings}};
    if (c.is_mla())
      j["mla"] = {{"q_lora_rank", c.q_lora_rank},
                  {"kv_lora_rank", c.kv_lora_rank},
                  {"qk_nope_dim", c.qk_nope_dim},
                  {"qk_rope_dim", c.qk_rope_dim},
                  {"v_head_dim", c.v_head_dim}};
    if (c.moe_experts > 0)
      j["moe"] = {{"experts", c.moe_experts},
                  {"top_k", c.moe_top_k},
                  {"topk_method", topk_method_name(c)},
                  {"n_group", c.moe_n_group},
                  {"topk_group", c.moe_topk_group},
                  {"shared_experts", c.moe_shared_experts},
                  {"expert_intermediate", c.moe_intermediate},
                  {"dense_layers", c.first_k_dense},
                  {"norm_topk_prob", c.moe_norm_topk_prob},
                  {"routed_scaling", c.moe_routed_scaling}};
    if (c.rope.yarn_factor > 0)
      j["yarn"] = {{"factor", c.rope.yarn_factor},
                   {"original_max_position", c.rope.yarn_original_max_position}};
    if (tok)
      j["tokenizer"] = {
          {"vocab_size", tok->vocab_size()},   {"bos_id", tok->bos_id()},
          {"eos_id", tok->eos_id()},           {"eog_ids", tok->eog_ids()},
          {"add_bos", tok->add_bos_default()}, {"has_chat_template", !m.chat_template.empty()}};
    if (m.gguf) {
      nlohmann::json md = nlohmann::json::object();
      for (const auto& [k, v] : m.gguf->metadata())
        md[k] = v.to_string(o.all_metadata ? SIZE_MAX : 8);
      j["metadata"] = md;
    }
    nlohmann::json ts = nlohmann::json::array();
    uint64_t total = 0;
    for (const auto& r : rows) {
      ts.push_back({{"name", r.name}, {"dtype", r.dtype}, {"shape", r.dims}, {"bytes", r.bytes}});
      total += r.bytes;
    }
    j["tensors"] = ts;
    j["tensor_bytes"] = total;
    j["file_formats"] = formats_json(file_formats(rows));
    if (plan) {
      j["bound_formats"] = formats_json(bound);
      j["quantize"] = weight_quant_name(lo.quantize);
    }
    std::printf("%s\n", j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
    return 0;
  }
  std::printf("file:          %s (%s%s)\n", m.path.c_str(), m.format.c_str(),
              m.gguf ? (" v" + std::to_string(m.gguf->version())).c_str() : "");
  std::printf("architecture:  %s%s%s\n", c.arch.c_str(),
              c.name.empty() ? "" : "  name: ", c.name.c_str());
  std::printf(
      "hidden %d, layers %d, heads %d (kv %d), head_dim %d, ffn %d, vocab %d, context %lld\n",
      c.hidden, c.layers, c.heads, c.kv_heads, c.head_dim, c.intermediate, c.vocab,
      static_cast<long long>(c.max_context));
  std::printf("rms_eps %g, rope theta %g (%s, %d dims), tied embeddings: %s\n", double(c.rms_eps),
              double(c.rope.theta),
              c.rope.style == RopeStyle::Adjacent ? "adjacent pairs" : "rotate-half",
              c.rope.rotary_dim, c.tied_embeddings ? "yes" : "no");
  if (c.is_mla())
    std::printf("mla:           q_lora %d, kv_lora %d, qk %d nope + %d rope, v %d\n", c.q_lora_rank,
                c.kv_lora_rank, c.qk_nope_dim, c.qk_rope_dim, c.v_head_dim);
  if (c.moe_experts > 0)
    std::printf(
        "moe:           %d experts, top-%d (%s, %d groups / %d), %d shared, expert ffn %d, "
        "%d dense layers, norm_topk_prob %s, routed scaling %g\n",
        c.moe_experts, c.moe_top_k, topk_method_name(c), c.moe_n_group, c.moe_topk_group,
        c.moe_shared_experts, c.moe_intermediate, c.first_k_dense,
        c.moe_norm_topk_prob ? "yes" : "no", double(c.moe_routed_scaling));
  if (c.rope.yarn_factor > 0)
    std::printf("yarn:          factor %g, original context %d\n", double(c.rope.yarn_factor),
                c.rope.yarn_original_max_position);
  if (tok)
    std::printf("tokenizer:     %d tokens, bos %d, eos %d, add_bos %s, chat template: %s\n",
                tok->vocab_size(), tok->bos_id(), tok->eos_id(),
                tok->add_bos_default() ? "yes" : "no", m.chat_template.empty() ? "none" : "yes");
  else
    std::printf("tokenizer:     none (token-id input only)\n");
  if (m.gguf) {
    std::printf("\nmetadata (%zu keys):\n", m.gguf->metadata().size());
    for (const auto& [k, v] : m.gguf->metadata())
      std::printf("  %-40s %s\n", k.c_str(), v.to_string(o.all_metadata ? SIZE_MAX : 8).c_str());
  }
  uint64_t total = 0;
  std::printf("\ntensors (%zu):\n", rows.size());
  for (const auto& r : rows) {
    std::printf("  %-40s %-6s %-20s %10llu\n", r.name.c_str(), r.dtype.c_str(), r.shape.c_str(),
                static_cast<unsigned long long>(r.bytes));
    total += r.bytes;
  }
  std::printf("total tensor bytes: %.1f MB\n", double(total) / 1e6);
  if (!rows.empty()) print_formats("\nformats in the file:", file_formats(rows));
  if (plan)
    print_formats(("\nbound weights (--quantize " + std::string(weight_quant_name(lo.quantize)) +
                   (lo.dummy ? ", dummy" : "") + "):")
                      .c_str(),
                  bound);
  return 0;
}

}  // namespace ds
