#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <unordered_map>

#include "core/argmax.h"
#include "core/error.h"

namespace ds {

int32_t argmax(std::span<const float> v) {
  return int32_t(argmax_first(v.data(), v.size()));
}

Sampler::Sampler(const SamplingParams& p)
    : p_(p), seed_(p.seed ? *p.seed : std::random_device{}()), rng_(seed_) {
  if (!(p.temperature >= 0) && !(p.temperature < 0)) throw Error("temperature is NaN");
  if (p.top_p <= 0) throw Error("top_p must be > 0");
  if (p.min_p > 1) throw Error("min_p must be <= 1");
  if (p.repetition_penalty <= 0) throw Error("repetition_penalty must be > 0");
  for (const auto& [id, bias] : p.logit_bias)
    if (id < 0 || !std::isfinite(bias))
      throw Error("logit_bias needs token ids >= 0 and finite biases");
}

SampleRow Sampler::sample_row(uint64_t counter) const {
  SampleRow r;
  r.temperature = p_.temperature;
  r.top_k = p_.top_k;
  r.top_p = p_.top_p;
  r.min_p = p_.min_p;
  r.seed = seed_;
  r.counter = counter;
  return r;
}

int32_t Sampler::sample(std::span<const float> logits, std::span<const int32_t> history) {
  const bool penalize = penalizes();
  const bool greedy = p_.temperature <= 0.0f;
  if (greedy && !adjusts_logits()) return argmax(logits);

  cand_.resize(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) cand_[i] = {logits[i], int32_t(i)};
  for (const auto& [id, bias] : p_.logit_bias)
    if (size_t(id) < cand_.size()) cand_[size_t(id)].first += bias;
  if (penalize) {
    const size_t n = p_.penalty_last_n < 0 ? history.size()
                                           : std::min(history.size(), size_t(p_.penalty_last_n));
    std::unordered_map<int32_t, int> counts;
    for (size_t i = history.size() - n; i < history.size(); ++i) ++counts[history[i]];
    for (const auto& [id, c] : counts) {
      if (id < 0 || size_t(id) >= cand_.size()) continue;
      float& l = cand_[size_t(id)].first;
      l = l > 0 ? l / p_.repetition_penalty : l * p_.repetition_penalty;
      l -= float(c) * p_.frequency_penalty + p_.presence_penalty;
    }
  }
  auto by_logit = [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  if (greedy) return std::min_element(cand_.begin(), cand_.end(), by_logit)->second;

  size_t n = cand_.size();
  if (p_.top_k > 0 && size_t(p_.top_k) < n) {
    std::partial_sort(cand_.begin(), cand_.begin() + p_.top_k, cand_.end(), by_logit);
    n = size_t(p_.top_k);
  } else {
    std::sort(cand_.begin(), cand_.end(), by_logit);
  }
  // Softmax at temperature 1 for the nucleus and min-p cut-offs, as llama.cpp orders them.
  std::vector<double>& prob = prob_;
  prob.resize(n);
  double sum = 0;
  for (size_t i = 0; i < n; ++i) sum += prob[i] = std::exp(double(cand_[i].first - cand_[0].first));
  if (p_.top_p < 1.0f) {
    double cum = 0;
    for (size_t i = 0; i < n; ++i) {
      cum += prob[i] / sum;
      if (cum >= p_.top_p) {
        n = i + 1;
        break;
      }
    }
  }
  if (p_.min_p > 0.0f) {
    size_t keep = 1;
    while (keep < n && prob[keep] >= p_.min_p * prob[0]) ++keep;
    n = keep;
  }
  // Temperature last, on the survivors.
  double total = 0;
  for (size_t i = 0; i < n; ++i)
    total += prob[i] = std::exp(double(cand_[i].first - cand_[0].first) / p_.temperature);
  std::uniform_real_distribution<double> u(0.0, total);
  double r = u(rng_);
  for (size_t i = 0; i < n; ++i) {
    r -= prob[i];
    if (r <= 0) return cand_[i].second;
  }
  return cand_[n - 1].second;
}

}  // namespace ds
