// Server-sent events as OpenAI-compatible servers stream them, and the completion chunks they
// carry.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace ds {

// Incremental parser: feed bytes as they arrive, get the `data` of each complete event.
// Events end at a blank line; lines may end in \n, \r\n or \r; multi-line data is joined with
// \n; comments (":...") and other fields are ignored.
class SseParser {
 public:
  std::vector<std::string> feed(std::string_view bytes);

 private:
  void line(std::string_view l, std::vector<std::string>& out);

  std::string partial_;  // an incomplete line
  std::string data_;     // the event being assembled
  bool has_data_ = false;
  bool last_cr_ = false;  // the previous chunk ended in \r: a following \n belongs to it
};

// One decoded `/v1/completions` stream event.
struct CompletionChunk {
  bool done = false;  // "[DONE]"
  std::string error;  // an error object's message (the stream failed)
  bool has_choice = false;
  std::string text;           // choices[0].text (or a chat delta's content)
  std::string finish_reason;  // "" until the end
  int logprob_tokens = 0;     // entries in choices[0].logprobs.tokens
  int token_ids = -1;         // entries in choices[0].token_ids; -1 when it has none
  std::optional<int> prompt_tokens, completion_tokens;  // usage, when the chunk has it
};

// Parses one event's data; throws ds::Error when it is not JSON.
CompletionChunk parse_completion_chunk(std::string_view data);

}  // namespace ds
