#include "bench/sse.h"

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace ds {

std::vector<std::string> SseParser::feed(std::string_view bytes) {
  std::vector<std::string> out;
  for (char c : bytes) {
    if (last_cr_) {
      last_cr_ = false;
      if (c == '\n') continue;  // the \n of a \r\n pair
    }
    if (c == '\r' || c == '\n') {
      last_cr_ = c == '\r';
      line(partial_, out);
      partial_.clear();
    } else {
      partial_ += c;
    }
  }
  return out;
}

void SseParser::line(std::string_view l, std::vector<std::string>& out) {
  if (l.empty()) {  // blank line: dispatch
    if (has_data_) out.push_back(data_);
    data_.clear();
    has_data_ = false;
    return;
  }
  if (l.front() == ':') return;  // comment
  const size_t colon = l.find(':');
  const std::string_view field = l.substr(0, colon);
  std::string_view value = colon == std::string_view::npos ? "" : l.substr(colon + 1);
  if (!value.empty() && value.front() == ' ') value.remove_prefix(1);
  if (field != "data") return;
  if (has_data_) data_ += '\n';
  data_ += value;
  has_data_ = true;
}

CompletionChunk parse_completion_chunk(std::string_view data) {
  CompletionChunk c;
  if (data == "[DONE]") {
    c.done = true;
    return c;
  }
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(data);
  } catch (const nlohmann::json::parse_error& e) {
    throw Error("a stream event is not JSON: " + std::string(data.substr(0, 200)));
  }
  if (!j.is_object()) throw Error("a stream event is not a JSON object");
  if (auto e = j.find("error"); e != j.end() && !e->is_null()) {
    c.error = e->is_object() && e->contains("message") && (*e)["message"].is_string()
                  ? (*e)["message"].get<std::string>()
                  : e->dump();
    return c;
  }
  if (auto ch = j.find("choices"); ch != j.end() && ch->is_array() && !ch->empty()) {
    const auto& choice = (*ch)[0];
    c.has_choice = true;
    if (auto t = choice.find("text"); t != choice.end() && t->is_string())
      c.text = t->get<std::string>();
    if (auto d = choice.find("delta"); d != choice.end() && d->is_object())
      if (auto t = d->find("content"); t != d->end() && t->is_string())
        c.text = t->get<std::string>();
    if (auto f = choice.find("finish_reason"); f != choice.end() && f->is_string())
      c.finish_reason = f->get<std::string>();
    if (auto ids = choice.find("token_ids"); ids != choice.end() && ids->is_array())
      c.token_ids = int(ids->size());
    if (auto lp = choice.find("logprobs"); lp != choice.end() && lp->is_object())
      if (auto toks = lp->find("tokens"); toks != lp->end() && toks->is_array())
        c.logprob_tokens = int(toks->size());
  }
  if (auto u = j.find("usage"); u != j.end() && u->is_object()) {
    if (auto p = u->find("prompt_tokens"); p != u->end() && p->is_number_integer())
      c.prompt_tokens = p->get<int>();
    if (auto p = u->find("completion_tokens"); p != u->end() && p->is_number_integer())
      c.completion_tokens = p->get<int>();
  }
  return c;
}

}  // namespace ds
