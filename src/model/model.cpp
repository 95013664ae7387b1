#include "model/model.h"

#include <cmath>

#include "core/error.h"
#include "parallel/communicator.h"

namespace ds {

void Model::output_logits(Backend& be, const TensorView& x, std::span<const int32_t> rows,
                          TensorView h, const TensorView& norm, float eps, const TensorView& w_out,
                          TensorView logits) const {
  if (rows.empty()) return;  // other tensor-parallel ranks: rank 0 alone makes the logits
  for (size_t r = 0; r < rows.size(); ++r) {
    const int32_t row = rows[r];
    DS_CHECK(row >= 0 && row < x.shape[0], "logit row out of range");
    be.copy(x.slice_rows(row, row + 1), h.slice_rows(int64_t(r), int64_t(r) + 1));
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
