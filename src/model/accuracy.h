// Accuracy of a weight or KV-cache format against a reference (`deepserve accuracy`, issue 14):
// the reference model's greedy continuation of each prompt, then the reference and a variant
// teacher-forced on it (one prefill of prompt + continuation each), compared row by row.
#pragma once

#include <cstdint>
#include <vector>

#include "backend/backend.h"
#include "model/model.h"

namespace ds {

// Logits [ids.size(), vocab] of one prefill of `ids` from an empty cache of `kv_dtype`.
std::vector<float> prefill_logits(Model& model, Backend& be, const ModelConfig& cfg,
                                  const std::vector<int32_t>& ids, DType kv_dtype);
// `prompt` followed by `n` greedy tokens (each the argmax of a fresh prefill's last row).
std::vector<int32_t> greedy_sequence(Model& model, Backend& be, const ModelConfig& cfg,
                                     std::vector<int32_t> prompt, int n, DType kv_dtype);

struct AccuracyStats {
  int64_t positions = 0;    // rows compared
  int64_t agree = 0;        // rows whose argmax equals the reference's
  double max_abs_diff = 0;  // largest |variant - reference| logit
  double max_rel_diff = 0;  // largest (row's max |diff|) / (row's reference max - min)
  double top1() const { return positions ? double(agree) / double(positions) : 0.0; }
};
// Adds the rows of one sequence ([rows, vocab] each) to `s`.
void compare_logits(const std::vector<float>& ref, const std::vector<float>& var, int vocab,
                    AccuracyStats& s);

}  // namespace ds
