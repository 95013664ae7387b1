#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/commands.h"
#include "core/error.h"
#include "engine/generator.h"
#include "tokenizer/chat_template.h"

namespace ds {
namespace {

std::vector<std::string> read_lines(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw Error(path + ": cannot open prompts file");
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) lines.push_back(line);
  return lines;
}

std::vector<int32_t> read_ids(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw Error(path + ": cannot open token-ids file");
  std::vector<int32_t> ids;
  std::string w;
  while (in >> w) {
    try {
      size_t used = 0;
      const long v = std::stol(w, &used);
      if (used != w.size() || v < 0 || v > INT32_MAX) throw std::invalid_argument(w);
      ids.push_back(int32_t(v));
    } catch (const std::logic_error&) {
      throw Error(path + ": '" + w + "' is not a token id");
    }
  }
  return ids;
}

}  // namespace

int run_generate(const GenerateOptions& o) {
  struct Prompt {
    std::string text;
    std::vector<int32_t> ids;
  };
  std::vector<Prompt> prompts;
  for (const auto& p : o.prompts) prompts.push_back({p, {}});
  if (!o.prompts_file.empty())
    for (auto& p : read_lines(o.prompts_file)) prompts.push_back({std::move(p), {}});
  if (!o.prompt_ids_file.empty()) prompts.push_back({"", read_ids(o.prompt_ids_file)});
  if (prompts.empty()) throw Error("no prompt: give -p TEXT, --prompts-file or --prompt-ids-file");

  Session s = open_session(o.model, 0);
  const Tokenizer* tok = s.loaded.tokenizer.get();
  std::optional<ChatTemplate> tmpl;
  if (o.chat) tmpl = ChatTemplate::detect(s.loaded.chat_template, s.loaded.config.arch);
  int64_t longest = 0;
  for (auto& p : prompts) {
    if (!p.ids.empty()) continue;
    if (!tok) throw Error(s.loaded.path + " has no tokenizer: use --prompt-ids-file");
    std::string text = p.text;
    if (tmpl) {
      std::vector<ChatMessage> msgs;
      if (!o.system.empty()) msgs.push_back({"system", o.system});
      msgs.push_back({"user", p.text});
      text = tmpl->apply(msgs, true);
    }
    p.ids = tok->encode(text, tok->add_bos_default(), /*parse_special=*/o.chat);
    longest = std::max<int64_t>(longest, int64_t(p.ids.size()));
  }
  if (longest + o.max_tokens > s.cache->capacity_tokens() &&
      s.cache->capacity_tokens() < s.loaded.config.max_context && o.model.ctx_size == 0) {
    // Grow the cache to fit the longest request, up to the model's context.
    ModelOptions mo = o.model;
    mo.ctx_size = int(std::min<int64_t>(longest + o.max_tokens, s.loaded.config.max_context));
    KvCacheConfig kv;
    kv.num_blocks = (mo.ctx_size + 15) / 16;
    s.cache = std::make_unique<KvCache>(*s.backend, s.loaded.config, kv);
  }

  Generator gen(*s.loaded.model, *s.backend, tok, *s.cache);
  for (size_t idx = 0; idx < prompts.size(); ++idx) {
    const Prompt& p = prompts[idx];
    GenerateRequest req;
    req.prompt = p.ids;
    req.max_tokens = o.max_tokens;
    req.sampling = o.sampling;
    req.stop = o.stop;
    if (tmpl)
      for (const auto& st : tmpl->stop_strings()) req.stop.push_back(st);
    req.ignore_eos = o.ignore_eos;
    GenerateResult r;
    if (o.json) {
      r = gen.generate(req);
      nlohmann::json j;
      j["index"] = idx;
      j["prompt"] = p.text;
      j["text"] = r.text;
      j["tokens"] = r.tokens;
      j["finish_reason"] = r.finish_reason;
      j["usage"] = {{"prompt_tokens", r.prompt_tokens},
                    {"completion_tokens", r.tokens.size()},
                    {"total_tokens", r.prompt_tokens + int(r.tokens.size())}};
      j["timings"] = {{"prompt_tokens_per_s", r.prompt_tokens_per_s()},
                      {"decode_tokens_per_s", r.decode_tokens_per_s()},
                      {"prompt_ms", r.prompt_seconds * 1e3},
                      {"decode_ms", r.decode_seconds * 1e3}};
      std::printf("%s\n", j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
    } else {
      r = gen.generate(req, [](int32_t, std::string_view delta) {
        std::fwrite(delta.data(), 1, delta.size(), stdout);
        std::fflush(stdout);
        return true;
      });
      std::printf("\n");
      std::fprintf(stderr,
                   "[prompt %d tokens, %.1f tok/s | generated %zu tokens, %.1f tok/s | %s]\n",
                   r.prompt_tokens, r.prompt_tokens_per_s(), r.tokens.size(),
                   r.decode_tokens_per_s(), r.finish_reason.c_str());
    }
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace ds
