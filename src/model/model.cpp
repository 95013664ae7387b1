#include "model/model.h"

#include <cmath>

namespace ds {

double WeightBytes::decode_step(int batch) const {
  if (moe_layers == 0 || experts == 0) return double(dense);
  // Expected distinct experts hit by `batch` tokens each choosing top_k of `experts`.
  const double miss = std::pow(1.0 - double(top_k) / experts, batch);
  const double touched = experts * (1.0 - miss);
  return double(dense) + double(per_expert) * touched * moe_layers;
}

}  // namespace ds
