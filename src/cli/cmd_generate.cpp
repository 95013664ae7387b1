#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/error.h"
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

nlohmann::json result_json(size_t index, const std::string& prompt,
                           const std::vector<int32_t>& tokens, const EngineEvent& fin) {
  nlohmann::json j;
  j["index"] = index;
  j["prompt"] = prompt;
  j["text"] = fin.text;
  j["tokens"] = tokens;
  j["finish_reason"] = fin.finish_reason;
  if (!fin.error.empty()) j["error"] = fin.error;
  j["usage"] = {{"prompt_tokens", fin.usage.prompt_tokens},
                {"completion_tokens", fin.usage.completion_tokens},
                {"total_tokens", fin.usage.prompt_tokens + fin.usage.completion_tokens},
                {"cached_prompt_tokens", fin.usage.cached_prompt_tokens}};
  j["timings"] = {{"prompt_tokens_per_s", fin.timings.prompt_tokens_per_s()},
                  {"decode_tokens_per_s", fin.timings.decode_tokens_per_s()},
                  {"queue_ms", fin.timings.queue_s * 1e3},
                  {"ttft_ms", fin.timings.ttft_s * 1e3},
                  {"total_ms", fin.timings.total_s * 1e3}};
  return j;
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

  Session s = open_session(o.model, o.engine);
  const Tokenizer* tok = s.loaded.tokenizer.get();
  std::optional<ChatTemplate> tmpl;
  if (o.chat) tmpl = ChatTemplate::detect(s.loaded.chat_template, s.loaded.config.arch);
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
  }

  // All prompts go to the engine at once; it batches them.
  std::vector<std::shared_ptr<RequestHandle>> handles;
  for (const auto& p : prompts) {
    EngineRequest req;
    req.prompt = p.ids;
    req.max_tokens = o.max_tokens;
    req.sampling = o.sampling;
    req.stop = o.stop;
    if (tmpl)
      for (const auto& st : tmpl->stop_strings()) req.stop.push_back(st);
    req.ignore_eos = o.ignore_eos;
    req.priority = parse_priority(o.priority).value_or(Priority::Standard);
    handles.push_back(s.engine->submit(std::move(req)));
  }
  const bool stream = !o.json && prompts.size() == 1;
  int failures = 0;
  for (size_t idx = 0; idx < prompts.size(); ++idx) {
    std::vector<int32_t> tokens;
    std::string text;
    EngineEvent fin;
    while (auto ev = handles[idx]->next()) {
      if (ev->token >= 0) tokens.push_back(ev->token);
      text += ev->text;
      if (stream && tok) {
        std::fwrite(ev->text.data(), 1, ev->text.size(), stdout);
        std::fflush(stdout);
      } else if (stream && ev->token >= 0) {  // no tokenizer: the ids are the output
        std::printf("%s%d", tokens.size() > 1 ? " " : "", ev->token);
        std::fflush(stdout);
      }
      if (ev->final) fin = std::move(*ev);
    }
    fin.text = text;
    if (!fin.error.empty()) {
      ++failures;
      std::fprintf(stderr, "deepserve: prompt %zu: %s: %s\n", idx, fin.finish_reason.c_str(),
                   fin.error.c_str());
    }
    if (o.json) {
      std::printf("%s\n", result_json(idx, prompts[idx].text, tokens, fin)
                              .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)
                              .c_str());
    } else {
      if (!stream) {
        std::printf("%s", idx ? "\n---\n" : "");
        if (tok) {
          std::printf("%s", text.c_str());
        } else {
          for (size_t i = 0; i < tokens.size(); ++i) std::printf("%s%d", i ? " " : "", tokens[i]);
        }
      }
      std::printf("\n");
      std::fprintf(stderr,
                   "[prompt %d tokens (%d cached), %.1f tok/s | generated %d tokens, %.1f tok/s "
                   "| %s]\n",
                   fin.usage.prompt_tokens, fin.usage.cached_prompt_tokens,
                   fin.timings.prompt_tokens_per_s(), fin.usage.completion_tokens,
                   fin.timings.decode_tokens_per_s(), fin.finish_reason.c_str());
    }
    std::fflush(stdout);
  }
  if (o.stats) {
    const EngineStats st = s.engine->stats();
    nlohmann::json j = {{"steps", st.steps},
                        {"preemptions", st.preemptions},
                        {"prompt_tokens_computed", st.prompt_tokens_computed},
                        {"tokens_generated", st.tokens_generated},
                        {"mean_kv_fragmentation", st.mean_fragmentation},
                        {"peak_kv_usage", st.peak_kv_usage},
                        {"prefix_cache_hit_rate", st.kv.prefix_hit_rate},
                        {"prefix_hit_tokens", st.kv.prefix_hit_tokens}};
    std::fprintf(stderr, "%s\n", j.dump().c_str());
  }
  return failures ? 1 : 0;
}

}  // namespace ds
