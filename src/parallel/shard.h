// Tensor and expert parallel sharding: which part of each weight a rank binds. A model file
// stays unaware of it: it is built on a per-rank config (heads, MLP widths and the expert
// range already divided) and a WeightSource that hands out the rank's slice of each tensor
// by name; the model's only parallel code is an all-reduce after each row-split projection.
#pragma once

#include <memory>
#include <string>

#include "model/config.h"
#include "model/weights.h"

namespace ds {

struct ParallelConfig {
  int tensor_parallel_size = 1;
  // Routed experts split by id over the tensor-parallel ranks (EP = TP, as in vLLM); off:
  // every expert is split by columns like a dense MLP.
  bool expert_parallel = false;
  int expert_parallel_size() const { return expert_parallel ? tensor_parallel_size : 1; }
};

// How one tensor is divided: Rows (column-parallel projections: q/k/v, gate/up, MLA's q_b and
// kv_b), Cols (row-parallel: o_proj, down_proj, whose partial outputs are summed), or
// Replicate (embeddings, lm_head, norms, the router, MLA's q_a/kv_a, experts under EP).
enum class Split : uint8_t { Replicate, Rows, Cols };
Split split_of(const std::string& name, const ParallelConfig& p);

// Rank `rank`'s config: heads, kv_heads, intermediate and the MoE sizes divided, the expert
// range set. Throws a clear Error when a size does not divide by the group size.
ModelConfig shard_config(const ModelConfig& cfg, const ParallelConfig& p, int rank);

// `full` seen through rank `rank`'s slices (split_of). Row slices are views of the mapped
// file; column slices are copied once per tensor into host memory the source owns, so it must
// outlive the model bound from it. Dummy weights keep their recipe at the slice's shape.
std::unique_ptr<WeightSource> sharded_weights(const WeightSource& full, const ParallelConfig& p,
                                              int rank);

}  // namespace ds
