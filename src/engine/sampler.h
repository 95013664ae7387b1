// Token sampling: logit biases and penalties, then top-k / top-p / min-p filtering, then
// temperature.
#pragma once

#include <cstdint>
#include <optional>
#include <random>
#include <span>
#include <utility>
#include <vector>

#include "backend/sampling.h"

namespace ds {

struct SamplingParams {
  float temperature = 0.8f;         // <= 0 means greedy
  int top_k = 40;                   // <= 0 disables
  float top_p = 0.95f;              // >= 1 disables
  float min_p = 0.05f;              // <= 0 disables
  float repetition_penalty = 1.0f;  // 1 disables; divides positive logits, multiplies negative
  float presence_penalty = 0.0f;    // subtracted once from every token already seen
  float frequency_penalty = 0.0f;   // subtracted per occurrence
  int penalty_last_n = 64;          // how many recent tokens the penalties look at (-1 = all)
  // (token id, bias) added to those logits before anything else (OpenAI's logit_bias; -100 and
  // 100 in effect ban and force a token).
  std::vector<std::pair<int32_t, float>> logit_bias;
  std::optional<uint64_t> seed;  // unset: drawn from the system's entropy source
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& p);
  // Picks the next token from one row of logits; `history` holds the prompt and the tokens
  // generated so far (for penalties). Logits are not modified.
  int32_t sample(std::span<const float> logits, std::span<const int32_t> history);
  uint64_t seed() const { return seed_; }
  // No penalties or biases: the pick depends on the logits row alone, so Backend::sample can
  // make it on the device (drawing from sample_uniform(seed, counter) instead of this
  // sampler's generator).
  bool device_sampleable() const { return !adjusts_logits(); }
  // Backend::sample's parameters for this request's token number `counter` (0 = the first
  // generated token), so a seeded request draws the same whatever batch it runs in.
  SampleRow sample_row(uint64_t counter) const;
  const SamplingParams& params() const { return p_; }

 private:
  bool penalizes() const {
    return p_.repetition_penalty != 1.0f || p_.presence_penalty != 0.0f ||
           p_.frequency_penalty != 0.0f;
  }
  bool adjusts_logits() const { return penalizes() || !p_.logit_bias.empty(); }

  SamplingParams p_;
  uint64_t seed_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int32_t>> cand_;  // scratch: (logit, id)
  std::vector<double> prob_;                     // scratch: unnormalised probabilities
};

// Index of the largest value; ties go to the lowest index.
int32_t argmax(std::span<const float> v);

}  // namespace ds
