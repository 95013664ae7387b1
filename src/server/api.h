// The OpenAI request schema: validation of completions / chat-completions bodies into engine
// requests, and the error objects the API returns.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace ds {

// A client-visible failure: becomes {"error": {message, type, param, code}} with `status`.
struct ApiError : std::runtime_error {
  ApiError(int status, const std::string& message, std::string param = {}, std::string code = {});
  int status;
  std::string param;
  std::string code;
  std::string type() const;  // "invalid_request_error", "authentication_error", ...
};

nlohmann::json error_body(const ApiError& e);

// Compact JSON text; invalid UTF-8 in strings is replaced, never thrown on.
std::string dump_json(const nlohmann::ordered_json& j);

// What validation needs to know about the model being served.
struct ApiLimits {
  const Tokenizer* tokenizer = nullptr;  // null: only token-id prompts
  const ChatTemplate* chat = nullptr;    // null: chat completions are refused
  std::vector<std::string> chat_stops;   // the template's end-of-turn texts
  int32_t vocab = 0;
  int64_t context = 0;  // prompt + generated tokens at most
  std::string model_name;
  int max_n = 16;
};

struct ApiRequest {
  bool chat = false;
  std::vector<std::vector<int32_t>> prompts;  // one per prompt; each is submitted n times
  int n = 1;
  bool stream = false;
  bool include_usage = false;
  int logprobs = -1;  // -1: none; else alternatives per token (completions 0..5, chat 0..20)
  // Each choice carries its generated `token_ids` (streamed: each chunk its step's ids, so a
  // chunk goes out for every token): asked for with `return_token_ids`, always when the model
  // has no tokenizer.
  bool return_token_ids = false;
  // Completions with echo: each prompt's text, which its choices begin with (the text as sent,
  // or the decoded ids of a token-id prompt).
  bool echo = false;
  std::vector<std::string> echo_text;  // [prompts.size()]
  std::vector<EngineRequest> engine;   // prompts.size() * n, prompt-major
};

// Validates `body` (already parsed JSON) and tokenizes its prompt(s); throws ApiError.
ApiRequest parse_api_request(const nlohmann::json& body, bool chat, const ApiLimits& limits);

}  // namespace ds
