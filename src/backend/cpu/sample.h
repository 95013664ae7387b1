// The reference implementation of Backend::sample: sort-based, in double. The CPU backend
// runs it directly; the base Backend::sample runs it on a host copy of the logits.
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "backend/sampling.h"

namespace ds {
class ThreadPool;
}

namespace ds::cpu {

// What the reference decided, for tests that compare another implementation with it and must
// tell a real difference from a float rounding at a boundary.
struct SampleTrace {
  std::vector<int32_t> kept;  // the ids the draw chose from, ascending
  double u = 0;               // the uniform draw
  // How far (in probability) the top-p cut-off and the min-p threshold were from flipping a
  // token in or out of the kept set; infinity when no such filter cut.
  double filter_margin = INFINITY;
  // How far u * total lay from the ends of the chosen token's CDF interval, over the total.
  double draw_margin = INFINITY;
};

// Picks one token from a row of logits. Greedy (temperature <= 0 or top_k == 1) is the
// lowest index among the maxima. Otherwise, over the order (logit descending, index
// ascending): keep the first top_k; of those the shortest prefix whose softmax (temperature
// 1, renormalised over the top_k) reaches top_p; of those the ones with p >= min_p * p_max.
// Then u = sample_uniform(seed, counter) picks, by inverse CDF in index order, from the kept
// tokens' softmax at `temperature`. A row whose maximum is not finite gives its argmax.
int32_t sample_row(std::span<const float> logits, const SampleRow& p, SampleTrace* trace = nullptr);

// ids[r] = sample_row(row r of logits, rows[r]) for r < num_rows; logits rows are `ld` floats
// apart. Rows are spread over `pool` when one is given.
void sample_rows(const float* logits, int64_t num_rows, int64_t vocab, int64_t ld,
                 const SampleRow* rows, int32_t* ids, ThreadPool* pool);

}  // namespace ds::cpu
