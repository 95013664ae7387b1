// Benchmark prompts: random token ids (work with any checkpoint, tokenizer or not) or text
// made of random tokens, reproducible from a seed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bench/target.h"
#include "tokenizer/tokenizer.h"

namespace ds {

struct PromptConfig {
  const Tokenizer* tokenizer = nullptr;  // null: ids are drawn from [0, vocab)
  int vocab = 0;
  bool text = false;       // text prompts (need the tokenizer)
  bool send_text = false;  // online: send the text itself; offline: its token ids
};

class PromptMaker {
 public:
  explicit PromptMaker(PromptConfig cfg);
  // A prompt of `input_len` tokens (text prompts: about that many, as the tokenizer counts).
  BenchRequest make(int input_len, uint64_t seed) const;
  const std::vector<int32_t>& pool() const { return pool_; }

 private:
  std::vector<int32_t> draw(int n, uint64_t seed) const;

  PromptConfig cfg_;
  std::vector<int32_t> pool_;  // ids prompts are drawn from: normal tokens only
};

// A well-mixed seed for request `index` of scenario `scenario` (splitmix64 of the three).
uint64_t request_seed(uint64_t base, uint64_t scenario, uint64_t index);

}  // namespace ds
