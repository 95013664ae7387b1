#include "bench/stats.h"

#include <algorithm>
#include <cmath>
#include <map>

namespace ds {

std::optional<double> percentile(std::span<const double> values, double q) {
  if (values.empty()) return std::nullopt;
  std::vector<double> v(values.begin(), values.end());
  std::sort(v.begin(), v.end());
  const double pos = std::clamp(q, 0.0, 100.0) / 100.0 * double(v.size() - 1);
  const size_t lo = size_t(std::floor(pos));
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (pos - double(lo));
}

std::optional<Summary> summarize(std::span<const double> values) {
  if (values.empty()) return std::nullopt;
  Summary s;
  s.count = values.size();
  double sum = 0;
  for (double x : values) sum += x;
  s.mean = sum / double(values.size());
  s.p50 = *percentile(values, 50);
  s.p90 = *percentile(values, 90);
  s.p99 = *percentile(values, 99);
  s.max = *std::max_element(values.begin(), values.end());
  return s;
}

std::optional<MeanStd> mean_std(std::span<const double> values) {
  if (values.empty()) return std::nullopt;
  MeanStd m;
  m.count = values.size();
  for (double x : values) m.mean += x;
  m.mean /= double(values.size());
  double ss = 0;
  for (double x : values) ss += (x - m.mean) * (x - m.mean);
  m.std = std::sqrt(ss / double(values.size()));
  return m;
}

DecodeSteps decode_steps(std::span<const TokenTrace> requests, int max_num_seqs) {
  // Each step end time -> the (request, token index) pairs sampled then.
  struct Tok {
    size_t req;
    size_t index;
  };
  std::map<double, std::vector<Tok>> steps;
  for (size_t r = 0; r < requests.size(); ++r)
    for (size_t j = 0; j < requests[r].token_s.size(); ++j)
      steps[requests[r].token_s[j]].push_back({r, j});
  std::vector<double> ends;
  for (const auto& [t, toks] : steps) ends.push_back(t);

  auto analyse = [&](bool strict) {
    DecodeSteps out;
    for (size_t k = 1; k < ends.size(); ++k) {
      const double prev = ends[k - 1], t = ends[k];
      const auto& toks = steps[t];
      bool decode = true;
      int64_t context = 0;
      for (const Tok& tk : toks) {
        const TokenTrace& tr = requests[tk.req];
        // A first token, or one whose predecessor came earlier than the previous step, means
        // this step also held prefill work (or the sequence had been preempted).
        if (tk.index == 0 || tr.token_s[tk.index - 1] != prev) {
          decode = false;
          break;
        }
        context += tr.prompt_tokens + int64_t(tk.index);
      }
      if (!decode) continue;
      if (strict && int(toks.size()) < max_num_seqs) {
        for (const TokenTrace& tr : requests) {
          const double first = tr.token_s.empty() ? INFINITY : tr.token_s.front();
          if (tr.submit_s < t && first > t) {
            decode = false;  // it may have been prefilled in this step
            break;
          }
        }
      }
      if (!decode) continue;
      out.step_s.push_back(t - prev);
      out.batch.push_back(int(toks.size()));
      out.context.push_back(context);
    }
    return out;
  };
  DecodeSteps strict = analyse(true);
  if (!strict.step_s.empty()) return strict;
  DecodeSteps loose = analyse(false);
  loose.mixed = !loose.step_s.empty();
  return loose;
}

}  // namespace ds
