#include "model/model.h"

#include <cmath>

#include "core/error.h"
#include "parallel/communicator.h"

namespace ds {

void Model::output_logits(Backend& be, const TensorView& x, std::span<const int32_t> rows,
                          TensorView h, const TensorView& norm, float eps, const TensorView& w_out,
                          TensorView logits) const {
  if (rows.empty()) return;  // other tensor-parallel ranks: rank 0 alone makes the logits
  // One copy per run of consecutive rows: a decode step's rows are 0..n-1, so one copy instead
  // of one per sequence (256 in W2's step, each its own launch or graph node).
  for (size_t r = 0; r < rows.size();) {
    size_t end = r + 1;
    while (end < rows.size() && rows[end] == rows[end - 1] + 1) ++end;
    const int64_t first = rows[r], last = rows[end - 1];
    DS_CHECK(first >= 0 && last < x.shape[0], "logit row out of range");
    be.copy(x.slice_rows(first, last + 1), h.slice_rows(int64_t(r), int64_t(end)));
    r = end;
  }
  be.rms_norm(h, norm, eps, h);
  dump("output_norm", h);
  be.matmul(h, w_out, logits);
}

void Model::all_reduce(const TensorView& t) const {
  if (comm_) comm_->all_reduce_sum(t);
}

double WeightBytes::decode_step(int batch) const {
  if (moe_layers == 0 || experts == 0) return double(dense);
  // Expected distinct experts hit by `batch` tokens each choosing top_k of `experts`.
  const double miss = std::pow(1.0 - double(top_k) / experts, batch);
  const double touched = experts * (1.0 - miss);
  return double(dense) + double(per_expert) * touched * moe_layers;
}

}  // namespace ds
