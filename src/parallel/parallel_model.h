// A model split over several ranks (tensor / expert parallelism), driven as one Model by the
// single engine: forward() runs rank 0 on the calling (engine) thread and ranks 1..N-1 on one
// worker thread each, in lock step (the collectives inside the forward are the step's
// barriers); only rank 0 computes logits. Each rank has its own backend (its own GPU, or a
// CPU backend with its share of the threads), its own weights shard and its own KV cache.
#pragma once

#include <functional>
#include <memory>

#include "model/model.h"
#include "parallel/communicator.h"
#include "parallel/shard.h"

namespace ds {

struct ParallelLoad {
  ParallelConfig parallel;
  // Rank r >= 1's backend (rank 0's is the caller's).
  std::function<std::unique_ptr<Backend>(int rank)> make_backend;
  // One architecture's model from a rank's config and weights shard on its backend.
  std::function<std::unique_ptr<Model>(const ModelConfig&, const WeightSource&, Backend&)>
      make_model;
};

// Builds every rank's shard of the model (rank 0 on `rank0`), connected by communicators
// that suit the backends (in-process for CPU, NCCL for CUDA). config() is rank 0's shard:
// the engine's KV cache (the one passed to forward) is rank 0's; the other ranks keep
// theirs, of the same geometry.
std::unique_ptr<Model> make_parallel_model(const ModelConfig& cfg, const WeightSource& weights,
                                           Backend& rank0, const ParallelLoad& load);

// Communicators for these backends: in-process when all are CPU, NCCL when all are CUDA
// (and NCCL was found at build time); throws otherwise.
std::vector<std::unique_ptr<Communicator>> make_communicators(const std::vector<Backend*>& ranks);

}  // namespace ds
