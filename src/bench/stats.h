// Statistics over measured samples: percentile summaries, mean and standard deviation, and
// decode step times recovered from the engine's per-token timestamps.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace ds {

struct Summary {
  double mean = 0, p50 = 0, p90 = 0, p99 = 0, max = 0;
  size_t count = 0;
};

// Percentile q in [0, 100] of unsorted values, linear between closest ranks (numpy's
// default). nullopt for no values.
std::optional<double> percentile(std::span<const double> values, double q);
std::optional<Summary> summarize(std::span<const double> values);

struct MeanStd {
  double mean = 0;
  double std = 0;  // population standard deviation
  size_t count = 0;
};
std::optional<MeanStd> mean_std(std::span<const double> values);

// What the step analysis needs of one request: when it was submitted, how long its prompt
// was, and when each of its tokens arrived (seconds on one steady clock).
struct TokenTrace {
  double submit_s = 0;
  int prompt_tokens = 0;
  std::vector<double> token_s;
};

// Engine steps seen through token timestamps: every token sampled in one step carries the
// same time, so the distinct times are step ends and their spacing is the step time.
struct DecodeSteps {
  std::vector<double> step_s;    // duration of each pure decode step
  std::vector<int> batch;        // sequences decoded in it
  std::vector<int64_t> context;  // sum over those sequences of the tokens attended to
  bool mixed = false;  // no pure decode step was found: steps with prefill work are included
};

// A step counts as pure decode when each of its tokens continues a sequence that sampled in
// the previous step and no request was waiting for its first token while there was room in
// the batch (max_num_seqs) for its prefill. When no step qualifies (a queue that never
// drains), every step whose tokens are all non-first is taken, and `mixed` says so.
DecodeSteps decode_steps(std::span<const TokenTrace> requests, int max_num_seqs);

}  // namespace ds
