// Building a TokenizerSpec from GGUF metadata or from Hugging Face tokenizer files.
#include <cctype>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/log.h"
#include "formats/gguf.h"
#include "tokenizer/tokenizer.h"

namespace ds {

namespace {

using nlohmann::json;

// "a b" -> {"a", "b"}; the split is at the first space after the first character, since a
// byte-level token never holds a raw space but the left part may start with one in odd vocabs.
std::pair<std::string, std::string> split_merge(const std::string& m, const std::string& where) {
  size_t pos = m.find(' ', 1);
  if (pos == std::string::npos) throw Error(where + ": malformed merge '" + m + "'");
  return {m.substr(0, pos), m.substr(pos + 1)};
}

json read_json(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error("cannot open " + path.string());
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    throw Error(path.string() + ": invalid JSON: " + e.what());
  }
}

// tokenizer_config.json names tokens either as a string or as {"content": ...}.
std::optional<std::string> token_content(const json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string())
    return v["content"].get<std::string>();
  return std::nullopt;
}

struct HfPreTokenizer {
  std::vector<std::string> patterns;
  bool byte_level = false;
  bool add_prefix_space = false;
};

void read_pre_tokenizer(const json& pt, HfPreTokenizer& out, const std::string& where) {
  if (pt.is_null()) return;
  const std::string type = pt.value("type", "");
  if (type == "Sequence") {
    for (const auto& p : pt.at("pretokenizers")) read_pre_tokenizer(p, out, where);
  } else if (type == "ByteLevel") {
    out.byte_level = true;
    out.add_prefix_space = pt.value("add_prefix_space", false);
    if (pt.value("use_regex", true)) {
      // The GPT-2 regex; tokenizers appends |\s+, which changes nothing (a lone whitespace
      // char that nothing matches is a piece of its own anyway).
      out.patterns.push_back(pre_tokenizer_patterns(PreTokenizer::Gpt2).front());
    }
  } else if (type == "Split") {
    const std::string behavior = pt.value("behavior", "Isolated");
    if (behavior != "Isolated" || pt.value("invert", false))
      throw UnsupportedError(where + ": Split pre-tokenizer with behavior " + behavior);
    const json& pat = pt.at("pattern");
    if (pat.contains("Regex")) {
      out.patterns.push_back(pat["Regex"].get<std::string>());
    } else if (pat.contains("String")) {
      // A literal string: escape ASCII punctuation for the regex engine.
      std::string quoted;
      for (char c : pat["String"].get<std::string>()) {
        const auto u = static_cast<unsigned char>(c);
        if (u < 0x80 && !std::isalnum(u)) quoted += '\\';
        quoted += c;
      }
      out.patterns.push_back(quoted);
    } else {
      throw Error(where + ": Split pre-tokenizer without a pattern");
    }
  } else if (type == "Digits") {
    out.patterns.push_back(pt.value("individual_digits", false) ? "\\p{N}" : "\\p{N}+");
  } else {
    throw UnsupportedError(where + ": pre-tokenizer type '" + type + "'");
  }
}

}  // namespace

TokenizerSpec tokenizer_spec_from_gguf(const GgufFile& f) {
  const std::string where = f.path();
  const std::string model = f.get_string("tokenizer.ggml.model").value_or("");
  if (model != "gpt2")
    throw UnsupportedError(where + ": tokenizer model '" + model +
                           "' (only byte-level BPE, 'gpt2', is supported)");
  TokenizerSpec spec;
  spec.tokens = f.get_string_array("tokenizer.ggml.tokens");
  if (spec.tokens.empty()) throw Error(where + ": no tokenizer.ggml.tokens");
  std::vector<int64_t> types = f.get_int_array("tokenizer.ggml.token_type");
  if (!types.empty()) {
    if (types.size() != spec.tokens.size())
      throw Error(where + ": tokenizer.ggml.token_type has " + std::to_string(types.size()) +
                  " entries for " + std::to_string(spec.tokens.size()) + " tokens");
    spec.types.reserve(types.size());
    for (int64_t t : types)
      spec.types.push_back(t >= 0 && t <= 6 ? static_cast<TokenType>(t) : TokenType::Undefined);
  }
  for (const auto& m : f.get_string_array("tokenizer.ggml.merges"))
    spec.merges.push_back(split_merge(m, where));

  const auto pre_name = f.get_string("tokenizer.ggml.pre");
  if (!pre_name || pre_name->empty()) {
    log_warn(where + ": no tokenizer.ggml.pre; using the 'default' pre-tokenizer");
    spec.pre = PreTokenizer::Default;
  } else if (auto pre = pre_tokenizer_from_name(*pre_name)) {
    spec.pre = *pre;
  } else {
    throw UnsupportedError(where + ": pre-tokenizer '" + *pre_name + "'");
  }
  spec.ignore_merges = spec.pre == PreTokenizer::Llama3;
  spec.add_bos = spec.pre == PreTokenizer::Llama3;
  if (auto v = f.get_bool("tokenizer.ggml.add_bos_token")) spec.add_bos = *v;
  const auto id_of = [&](const char* key) {
    return static_cast<int32_t>(f.get_int(key).value_or(-1));
  };
  spec.bos_id = id_of("tokenizer.ggml.bos_token_id");
  spec.eos_id = id_of("tokenizer.ggml.eos_token_id");
  for (const char* key : {"tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"}) {
    if (int32_t id = id_of(key); id >= 0) spec.extra_eog_ids.push_back(id);
  }
  spec.chat_template = f.get_string("tokenizer.chat_template").value_or("");
  return spec;
}

TokenizerSpec tokenizer_spec_from_hf_json(const std::filesystem::path& tokenizer_json,
                                          const std::filesystem::path& tokenizer_config_json) {
  const std::string where = tokenizer_json.string();
  const json doc = read_json(tokenizer_json);
  TokenizerSpec spec;
  try {
    const json& model = doc.at("model");
    const std::string type = model.value("type", "BPE");
    if (type != "BPE") throw UnsupportedError(where + ": tokenizer model type '" + type + "'");
    const json& vocab = model.at("vocab");
    int64_t max_id = -1;
    for (const auto& [text, id] : vocab.items())
      max_id = std::max<int64_t>(max_id, id.get<int64_t>());
    for (const auto& t : doc.value("added_tokens", json::array()))
      max_id = std::max<int64_t>(max_id, t.at("id").get<int64_t>());
    if (max_id < 0) throw Error(where + ": empty vocabulary");
    spec.tokens.assign(static_cast<size_t>(max_id) + 1, std::string());
    spec.types.assign(spec.tokens.size(), TokenType::Unused);  // ids no entry names
    for (const auto& [text, id] : vocab.items()) {
      spec.tokens[id.get<size_t>()] = text;
      spec.types[id.get<size_t>()] = TokenType::Normal;
    }
    for (const auto& m : model.value("merges", json::array())) {
      if (m.is_string()) {
        spec.merges.push_back(split_merge(m.get<std::string>(), where));
      } else {
        spec.merges.emplace_back(m.at(0).get<std::string>(), m.at(1).get<std::string>());
      }
    }
    spec.ignore_merges = model.value("ignore_merges", false);
    for (const auto& t : doc.value("added_tokens", json::array())) {
      const auto id = t.at("id").get<int32_t>();
      spec.tokens[id] = t.at("content").get<std::string>();
      spec.types[id] = t.value("special", false) ? TokenType::Control : TokenType::UserDefined;
      if (t.value("lstrip", false)) spec.lstrip_ids.push_back(id);
      if (t.value("rstrip", false)) spec.rstrip_ids.push_back(id);
    }

    // llama.cpp ignores normalizers too (GGUF has no field for one); NFC, the common one,
    // only matters for text that is not already NFC.
    const json& norm = doc.value("normalizer", json());
    if (norm.is_object()) {
      const std::string ntype = norm.value("type", "?");
      const bool empty_seq =
          ntype == "Sequence" && norm.value("normalizers", json::array()).empty();
      if (ntype == "NFC") {
        log_info(where + ": NFC normalizer ignored");
      } else if (!empty_seq) {
        log_warn(where + ": normalizer '" + ntype + "' is ignored");
      }
    }
    HfPreTokenizer pre;
    read_pre_tokenizer(doc.value("pre_tokenizer", json()), pre, where);
    if (!pre.byte_level)
      log_warn(where + ": no ByteLevel pre-tokenizer; decoding assumes byte-level tokens anyway");
    spec.split_patterns = pre.patterns;
    spec.add_prefix_space = pre.add_prefix_space;
    spec.pre = pre_tokenizer_from_patterns(pre.patterns);
    if (spec.split_patterns.empty()) spec.split_patterns.push_back("(?s:.+)");  // one word

    // BOS added by the post-processor: TemplateProcessing starting with a special token.
    const json& post = doc.value("post_processor", json());
    std::optional<std::string> post_bos;
    auto read_template = [&](const json& p) {
      if (p.value("type", "") != "TemplateProcessing") return;
      const json& single = p.value("single", json::array());
      if (!single.empty() && single[0].contains("SpecialToken"))
        post_bos = single[0]["SpecialToken"].value("id", "");
    };
    if (post.is_object()) {
      read_template(post);
      for (const auto& p : post.value("processors", json::array())) read_template(p);
    }

    // tokenizer_config.json: bos/eos, add_bos_token, the chat template.
    json config;
    if (!tokenizer_config_json.empty() && std::filesystem::exists(tokenizer_config_json))
      config = read_json(tokenizer_config_json);
    auto find_id = [&](const std::string& text) -> int32_t {
      for (size_t i = spec.tokens.size(); i-- > 0;)
        if (spec.tokens[i] == text && spec.types[i] != TokenType::Unused)
          return static_cast<int32_t>(i);
      return -1;
    };
    if (config.is_object()) {
      if (auto bos = token_content(config.value("bos_token", json()))) spec.bos_id = find_id(*bos);
      if (auto eos = token_content(config.value("eos_token", json()))) spec.eos_id = find_id(*eos);
      const json& tmpl = config.value("chat_template", json());
      if (tmpl.is_string()) {
        spec.chat_template = tmpl.get<std::string>();
      } else if (tmpl.is_array()) {
        for (const auto& t : tmpl)
          if (t.value("name", "") == "default") spec.chat_template = t.value("template", "");
      }
    }
    if (post_bos) {
      int32_t id = find_id(*post_bos);
      if (id >= 0) {
        spec.add_bos = true;
        if (spec.bos_id < 0) spec.bos_id = id;
      }
    }
    if (config.is_object() && config.contains("add_bos_token") &&
        config["add_bos_token"].is_boolean())
      spec.add_bos = config["add_bos_token"].get<bool>();
  } catch (const json::exception& e) {
    throw Error(where + ": unexpected tokenizer.json content: " + e.what());
  }
  return spec;
}

std::unique_ptr<Tokenizer> Tokenizer::from_gguf(const GgufFile& f) {
  return create(tokenizer_spec_from_gguf(f));
}

std::unique_ptr<Tokenizer> Tokenizer::from_hf_json(
    const std::filesystem::path& tokenizer_json,
    const std::filesystem::path& tokenizer_config_json) {
  return create(tokenizer_spec_from_hf_json(tokenizer_json, tokenizer_config_json));
}

}  // namespace ds
