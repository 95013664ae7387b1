#include "bench/prompts.h"

#include <random>

#include "core/error.h"

namespace ds {
namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

uint64_t request_seed(uint64_t base, uint64_t scenario, uint64_t index) {
  return splitmix64(splitmix64(splitmix64(base) ^ scenario) ^ index);
}

PromptMaker::PromptMaker(PromptConfig cfg) : cfg_(cfg) {
  if (cfg_.text && !cfg_.tokenizer)
    throw Error("text prompts need the model's tokenizer (use prompt: random for token ids)");
  const int vocab = cfg_.tokenizer ? cfg_.tokenizer->vocab_size() : cfg_.vocab;
  for (int32_t id = 0; id < vocab; ++id) {
    // Special and byte tokens would make prompts unlike text (and could end a turn).
    if (cfg_.tokenizer && cfg_.tokenizer->token_type(id) != TokenType::Normal) continue;
    pool_.push_back(id);
  }
  if (pool_.empty()) throw Error("no vocabulary to draw random prompts from");
}

std::vector<int32_t> PromptMaker::draw(int n, uint64_t seed) const {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<size_t> pick(0, pool_.size() - 1);
  std::vector<int32_t> ids(size_t(std::max(n, 0)));
  for (auto& id : ids) id = pool_[pick(rng)];
  return ids;
}

BenchRequest PromptMaker::make(int input_len, uint64_t seed) const {
  BenchRequest r;
  r.seed = seed;
  if (!cfg_.text) {
    r.prompt_ids = draw(input_len, seed);
    return r;
  }
  // Text: random tokens spelled out, re-encoded; the encoding merges differently, so take
  // more until there are enough and cut to length.
  const Tokenizer& tok = *cfg_.tokenizer;
  std::vector<int32_t> ids;
  std::string text;
  for (uint64_t round = 0; int(ids.size()) < input_len && round < 64; ++round) {
    text += tok.decode(draw(input_len, seed + round), /*skip_special=*/true);
    ids = tok.encode(text, tok.add_bos_default(), /*parse_special=*/false);
  }
  if (int(ids.size()) > input_len) ids.resize(size_t(input_len));
  if (cfg_.send_text) r.prompt_text = tok.decode(ids, /*skip_special=*/true);
  r.prompt_ids = std::move(ids);  // online text: the client's own count of the prompt
  return r;
}

}  // namespace ds
