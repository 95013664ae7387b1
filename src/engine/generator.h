// Runs one request at a time over a model: chunked prefill, then sampled decode with
// streaming detokenization and stop conditions. (The batching engine builds on the same
// Model/KvCache interfaces.)
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/sampler.h"
#include "model/model.h"
#include "tokenizer/tokenizer.h"

namespace ds {

struct GenerateRequest {
  std::vector<int32_t> prompt;
  int max_tokens = 128;
  SamplingParams sampling;
  std::vector<std::string> stop;  // stop strings: the text ends before the first match
  bool ignore_eos = false;
};

struct GenerateResult {
  std::vector<int32_t> tokens;  // generated ids (a stop string's tokens included)
  std::string text;             // generated text, stop string excluded
  std::string finish_reason;    // "stop" (EOS or stop string), "length", "cancelled"
  int prompt_tokens = 0;
  int cached_prompt_tokens = 0;  // prompt tokens reused from the previous request's cache
  double prompt_seconds = 0;
  double decode_seconds = 0;  // from the first to the last generated token
  double prompt_tokens_per_s() const;
  double decode_tokens_per_s() const;
};

// Called for each generated token with the text it completes (may be empty while a UTF-8
// sequence or a possible stop string is pending). Return false to cancel.
using TokenCallback = std::function<bool(int32_t id, std::string_view text_delta)>;

struct GeneratorOptions {
  int prefill_chunk = 512;  // prompt tokens per forward
};

class Generator {
 public:
  Generator(Model& model, Backend& backend, const Tokenizer* tokenizer, KvCache& cache,
            const GeneratorOptions& opts = {});
  // Reuses the cached prefix of the previous request (chat turns), recomputes the rest.
  GenerateResult generate(const GenerateRequest& req, const TokenCallback& on_token = {});
  int64_t context_capacity() const;

 private:
  void run(std::span<const int32_t> tokens, int start_pos, bool want_logits);

  Model& model_;
  Backend& backend_;
  const Tokenizer* tok_;
  KvCache& cache_;
  GeneratorOptions opts_;
  std::vector<int32_t> cached_;  // tokens whose K/V sit in the cache, in order
  std::vector<int32_t> block_table_, positions_, slots_, query_start_, context_lens_;
  std::unique_ptr<Buffer> logits_buf_;
  std::vector<float> logits_;  // host copy of the last row
};

}  // namespace ds
