#include "server/api.h"

#include <algorithm>
#include <charconv>
#include <cmath>

namespace ds {
namespace {

const nlohmann::json* field(const nlohmann::json& body, const char* name) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

[[noreturn]] void bad(const std::string& param, const std::string& message) {
  throw ApiError(400, message, param, "invalid_value");
}

std::optional<double> number(const nlohmann::json& body, const char* name, double lo, double hi) {
  const auto* v = field(body, name);
  if (!v) return std::nullopt;
  if (!v->is_number()) bad(name, std::string("'") + name + "' must be a number");
  const double d = v->get<double>();
  if (!std::isfinite(d) || d < lo || d > hi)
    bad(name, std::string("'") + name + "' must be between " + std::to_string(lo) + " and " +
                  std::to_string(hi));
  return d;
}

std::optional<int64_t> integer(const nlohmann::json& body, const char* name) {
  const auto* v = field(body, name);
  if (!v) return std::nullopt;
  if (!v->is_number_integer()) bad(name, std::string("'") + name + "' must be an integer");
  return v->get<int64_t>();
}

bool boolean(const nlohmann::json& body, const char* name, bool def) {
  const auto* v = field(body, name);
  if (!v) return def;
  if (!v->is_boolean()) bad(name, std::string("'") + name + "' must be a boolean");
  return v->get<bool>();
}

bool is_token_list(const nlohmann::json& v) {
  return v.is_array() && !v.empty() &&
         std::all_of(v.begin(), v.end(), [](const auto& x) { return x.is_number_integer(); });
}

std::vector<int32_t> token_ids(const nlohmann::json& v, const ApiLimits& lim) {
  std::vector<int32_t> ids;
  for (const auto& x : v) {
    const int64_t id = x.get<int64_t>();
    if (id < 0 || id >= lim.vocab)
      bad("prompt", "token id " + std::to_string(id) + " is outside the vocabulary of " +
                        std::to_string(lim.vocab));
    ids.push_back(int32_t(id));
  }
  return ids;
}

std::vector<int32_t> encode(const std::string& text, const ApiLimits& lim, bool special) {
  if (!lim.tokenizer) bad("prompt", "this model has no tokenizer: send token ids");
  return lim.tokenizer->encode(text, lim.tokenizer->add_bos_default(), special);
}

// The prompts, and in `texts` (when set) each one's text (a token-id prompt's decoded ids).
std::vector<std::vector<int32_t>> completion_prompts(const nlohmann::json& body,
                                                     const ApiLimits& lim,
                                                     std::vector<std::string>* texts) {
  const auto* p = field(body, "prompt");
  if (!p) bad("prompt", "'prompt' is required");
  std::vector<std::vector<int32_t>> out;
  auto add = [&](const nlohmann::json& x) {
    if (x.is_string()) {
      out.push_back(encode(x.get<std::string>(), lim, false));
      if (texts) texts->push_back(x.get<std::string>());
    } else {
      out.push_back(token_ids(x, lim));
      if (texts) texts->push_back(lim.tokenizer ? lim.tokenizer->decode(out.back()) : "");
    }
  };
  if (p->is_string() || is_token_list(*p)) {
    add(*p);
  } else if (p->is_array() && !p->empty() && std::all_of(p->begin(), p->end(), [](const auto& x) {
               return x.is_string() || is_token_list(x);
             })) {
    for (const auto& x : *p) add(x);
  } else {
    bad("prompt",
        "'prompt' must be a string, a list of strings, a list of token ids or a list "
        "of token-id lists");
  }
  if (out.size() > 64) bad("prompt", "at most 64 prompts per request");
  return out;
}

std::string message_content(const nlohmann::json& m) {
  const auto* c = field(m, "content");
  if (!c) return "";
  if (c->is_string()) return c->get<std::string>();
  if (c->is_array()) {  // content parts: only text ones are understood
    std::string text;
    for (const auto& part : *c) {
      if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") ||
          !part["text"].is_string())
        bad("messages", "only text content parts are supported");
      text += part["text"].get<std::string>();
    }
    return text;
  }
  bad("messages", "a message's 'content' must be a string or a list of text parts");
}

std::vector<int32_t> chat_prompt(const nlohmann::json& body, const ApiLimits& lim) {
  const auto* ms = field(body, "messages");
  if (!ms || !ms->is_array() || ms->empty())
    bad("messages", "'messages' must be a non-empty list of messages");
  if (!lim.chat || !lim.tokenizer) bad("messages", "this model has no chat template");
  std::vector<ChatMessage> msgs;
  for (const auto& m : *ms) {
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
      bad("messages", "each message must be an object with a string 'role'");
    std::string role = m["role"].get<std::string>();
    if (role == "developer") role = "system";
    if (role != "system" && role != "user" && role != "assistant")
      bad("messages", "unsupported role '" + role + "'");
    msgs.push_back({role, message_content(m)});
  }
  return encode(lim.chat->apply(msgs, true), lim, /*special=*/true);
}

std::vector<std::string> stop_strings(const nlohmann::json& body) {
  const auto* s = field(body, "stop");
  if (!s) return {};
  if (s->is_string()) return {s->get<std::string>()};
  if (!s->is_array() || s->size() > 16)
    bad("stop", "'stop' must be a string or a list of at most 16 strings");
  std::vector<std::string> out;
  for (const auto& x : *s) {
    if (!x.is_string() || x.get_ref<const std::string&>().empty())
      bad("stop", "'stop' entries must be non-empty strings");
    out.push_back(x.get<std::string>());
  }
  return out;
}

// Completions: legacy `logprobs: int (0..5)`. Chat: `logprobs: bool` with `top_logprobs: int
// (0..20)`, the latter only alongside logprobs=true. Returns -1 when none were asked for.
int requested_logprobs(const nlohmann::json& body, bool chat) {
  const auto* lp = field(body, "logprobs");
  const auto* top = field(body, "top_logprobs");
  if (!chat) {
    if (top) bad("top_logprobs", "'top_logprobs' is for chat completions: use 'logprobs'");
    if (!lp) return -1;
    if (!lp->is_number_integer()) bad("logprobs", "'logprobs' must be an integer");
    const int64_t n = lp->get<int64_t>();
    if (n < 0 || n > 5) bad("logprobs", "'logprobs' must be between 0 and 5");
    return int(n);
  }
  if (lp && !lp->is_boolean()) bad("logprobs", "'logprobs' must be a boolean");
  const bool want = lp && lp->get<bool>();
  if (!top) return want ? 0 : -1;
  if (!top->is_number_integer()) bad("top_logprobs", "'top_logprobs' must be an integer");
  const int64_t n = top->get<int64_t>();
  if (n < 0 || n > 20) bad("top_logprobs", "'top_logprobs' must be between 0 and 20");
  if (!want && n > 0) bad("top_logprobs", "'top_logprobs' requires 'logprobs' to be true");
  return want ? int(n) : -1;
}

// OpenAI's logit_bias: {"token id": bias in [-100, 100]}.
std::vector<std::pair<int32_t, float>> logit_bias(const nlohmann::json& body,
                                                  const ApiLimits& lim) {
  const auto* lb = field(body, "logit_bias");
  if (!lb) return {};
  if (!lb->is_object())
    bad("logit_bias", "'logit_bias' must be an object mapping token ids to biases");
  std::vector<std::pair<int32_t, float>> out;
  for (const auto& [key, value] : lb->items()) {
    int64_t id = -1;
    const auto [end, ec] = std::from_chars(key.data(), key.data() + key.size(), id);
    if (ec != std::errc() || end != key.data() + key.size() || id < 0 || id >= lim.vocab)
      bad("logit_bias", "'logit_bias' key '" + key + "' is not a token id in [0, " +
                            std::to_string(lim.vocab) + ")");
    if (!value.is_number() || !std::isfinite(value.get<double>()) || value.get<double>() < -100 ||
        value.get<double>() > 100)
      bad("logit_bias", "'logit_bias' values must be numbers between -100 and 100");
    out.emplace_back(int32_t(id), value.get<float>());
  }
  return out;
}

// Fields that would change the answer but are not implemented: refused rather than ignored.
void refuse_unsupported(const nlohmann::json& body, bool chat) {
  if (const auto best_of = integer(body, "best_of"); best_of && *best_of != 1)
    bad("best_of", "'best_of' other than 1 is not supported");
  if (const auto* rf = field(body, "response_format")) {
    const auto* type = rf->is_object() ? field(*rf, "type") : nullptr;
    if (!type || !type->is_string() || type->get<std::string>() != "text")
      bad("response_format", "'response_format' other than {\"type\": \"text\"} is not supported");
  }
  for (const char* name : {"tools", "functions"})
    if (const auto* t = field(body, name); t && !(t->is_array() && t->empty()))
      bad(name, std::string("'") + name + "' (tool calling) is not supported");
  for (const char* name : {"tool_choice", "function_call"})
    if (const auto* t = field(body, name);
        t && !(t->is_string() && t->get<std::string>() == "none"))
      bad(name, std::string("'") + name + "' other than \"none\" is not supported");
  if (chat && boolean(body, "echo", false)) bad("echo", "'echo' is for completions");
}

}  // namespace

ApiError::ApiError(int status_, const std::string& message, std::string param_, std::string code_)
    : std::runtime_error(message),
      status(status_),
      param(std::move(param_)),
      code(std::move(code_)) {}

std::string ApiError::type() const {
  switch (status) {
    case 401:
      return "authentication_error";
    case 404:
      return "not_found_error";
    case 413:
      return "request_too_large";
    case 503:
      return "service_unavailable";
    default:
      return status >= 500 ? "internal_error" : "invalid_request_error";
  }
}

nlohmann::json error_body(const ApiError& e) {
  return {{"error",
           {{"message", e.what()},
            {"type", e.type()},
            {"param", e.param.empty() ? nlohmann::json() : nlohmann::json(e.param)},
            {"code", e.code.empty() ? nlohmann::json() : nlohmann::json(e.code)}}}};
}

std::string dump_json(const nlohmann::ordered_json& j) {
  return j.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

ApiRequest parse_api_request(const nlohmann::json& body, bool chat, const ApiLimits& lim) {
  if (!body.is_object()) throw ApiError(400, "the request body must be a JSON object");
  if (const auto* m = field(body, "model")) {
    if (!m->is_string()) bad("model", "'model' must be a string");
    if (m->get<std::string>() != lim.model_name)
      throw ApiError(404, "the model '" + m->get<std::string>() + "' does not exist", "model",
                     "model_not_found");
  }
  if (const auto* u = field(body, "user"); u && !u->is_string())
    bad("user", "'user' must be a string");

  refuse_unsupported(body, chat);

  ApiRequest r;
  r.chat = chat;
  r.stream = boolean(body, "stream", false);
  if (const auto* so = field(body, "stream_options")) {
    if (!so->is_object()) bad("stream_options", "'stream_options' must be an object");
    r.include_usage = boolean(*so, "include_usage", false);
  }
  const auto n = integer(body, "n");
  if (n && (*n < 1 || *n > lim.max_n))
    bad("n", "'n' must be between 1 and " + std::to_string(lim.max_n));
  r.n = int(n.value_or(1));
  r.logprobs = requested_logprobs(body, chat);
  r.return_token_ids = boolean(body, "return_token_ids", false) || !lim.tokenizer;
  r.echo = !chat && boolean(body, "echo", false);

  // max_completion_tokens is the newer name; either must be >= 1 when given.
  std::optional<int64_t> max_tokens = integer(body, "max_completion_tokens");
  if (!max_tokens) max_tokens = integer(body, "max_tokens");
  if (max_tokens && *max_tokens < 1) bad("max_tokens", "'max_tokens' must be at least 1");

  SamplingParams sp;  // OpenAI's defaults: plain temperature sampling over the whole vocabulary
  sp.temperature = float(number(body, "temperature", 0, 2).value_or(1.0));
  sp.top_p = float(number(body, "top_p", 0, 1).value_or(1.0));
  if (sp.top_p <= 0) bad("top_p", "'top_p' must be greater than 0");
  sp.top_k = 0;
  sp.min_p = 0;
  sp.presence_penalty = float(number(body, "presence_penalty", -2, 2).value_or(0));
  sp.frequency_penalty = float(number(body, "frequency_penalty", -2, 2).value_or(0));
  if (auto k = integer(body, "top_k")) sp.top_k = int(std::clamp<int64_t>(*k, -1, 1 << 20));
  if (auto mp = number(body, "min_p", 0, 1)) sp.min_p = float(*mp);
  if (auto seed = integer(body, "seed")) sp.seed = uint64_t(*seed);
  sp.logit_bias = logit_bias(body, lim);

  Priority priority = Priority::Standard;
  if (const auto* p = field(body, "priority")) {
    const auto parsed = p->is_string() ? parse_priority(p->get<std::string>()) : std::nullopt;
    if (!parsed) bad("priority", "'priority' must be latency-critical, standard or batch");
    priority = *parsed;
  }
  const bool ignore_eos = boolean(body, "ignore_eos", false);  // an extension, as in vLLM
  std::vector<std::string> stop = stop_strings(body);
  if (chat)
    for (const auto& s : lim.chat_stops) stop.push_back(s);

  if (chat)
    r.prompts.push_back(chat_prompt(body, lim));
  else
    r.prompts = completion_prompts(body, lim, r.echo ? &r.echo_text : nullptr);

  for (const auto& ids : r.prompts) {
    if (ids.empty()) bad("prompt", "the prompt is empty");
    const int64_t room = lim.context - int64_t(ids.size());
    if (room < 1)
      throw ApiError(400,
                     "the prompt has " + std::to_string(ids.size()) +
                         " tokens; this model's context is " + std::to_string(lim.context) +
                         " tokens",
                     chat ? "messages" : "prompt", "context_length_exceeded");
    // Unset: completions default to 16 tokens (as OpenAI's), chat to the rest of the context.
    const int64_t want = max_tokens.value_or(chat ? room : 16);
    for (int i = 0; i < r.n; ++i) {
      EngineRequest er;
      er.prompt = ids;
      er.max_tokens = int(std::min(want, room));
      er.sampling = sp;
      if (sp.seed) er.sampling.seed = *sp.seed + uint64_t(i);  // n choices must differ
      er.stop = stop;
      er.priority = priority;
      er.ignore_eos = ignore_eos;
      er.logprobs = r.logprobs;
      r.engine.push_back(std::move(er));
    }
  }
  return r;
}

}  // namespace ds
