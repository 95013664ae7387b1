// Decode steps replayed as device graphs (CUDA graphs): one graph per batch-size bucket,
// captured on first use, fed each step by uploading new metadata to fixed addresses.
#pragma once

#include <map>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "engine/scheduler.h"
#include "model/model.h"

namespace ds {

struct DecodeGraphConfig {
  int max_batch = kMaxDecodeGraphBatch;  // largest bucket; bigger decode batches run eagerly
  int max_blocks_per_seq = 0;            // block-table width every captured launch is sized for
};

class DecodeGraphs {
 public:
  DecodeGraphs(Backend& backend, Model& model, KvCache& cache, const DecodeGraphConfig& cfg);
  // Runs the forward of a decode-only step (one token per sequence, each needing logits)
  // through a graph and returns true; false (nothing run) for any other step. logits:
  // [>= bucket rows, vocab] at a fixed address; rows [0, num_seqs) receive the results.
  bool run(const StepBatch& b, const TensorView& logits);
  int captured() const { return int(graphs_.size()); }
  static bool eligible(const StepBatch& b);

 private:
  struct Bucket {
    std::unique_ptr<Buffer> meta;  // tokens, positions, query_start, context_lens, tables, slots
    std::vector<int32_t> host;     // host image of `meta`
    std::vector<int32_t> logit_rows;
    ForwardInput input;
    int graph = -1;
  };
  int bucket_for(int n) const;
  Bucket& bucket(int B);
  void fill(Bucket& k, int B, const StepBatch* b);

  Backend& be_;
  Model& model_;
  KvCache& cache_;
  DecodeGraphConfig cfg_;
  std::map<int, Bucket> buckets_;
  std::map<int, int> graphs_;  // bucket -> graph id
  uint64_t epoch_ = 0;         // backend alloc_epoch() the graphs were captured at
  bool disabled_ = false;      // a capture failed: eager from then on
};

}  // namespace ds
