// Token sampling on the device (Backend::sample): greedy, temperature, top-k, top-p, min-p.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/sampling.h"

namespace ds::cuda {

struct SampleArgs {
  const float* logits = nullptr;  // [rows, vocab], rows ld floats apart
  int64_t rows = 0;
  int64_t vocab = 0;
  int64_t ld = 0;
  const SampleRow* params = nullptr;  // [rows], device memory
  int32_t* ids = nullptr;             // [rows] out
};

// One CTA per row; no host synchronization, no scratch memory, grid sized by `rows` alone
// (graph-safe). Picks the same token as cpu::sample_row except where float rounding moves a
// filter boundary or the draw across a token boundary.
void launch_sample(const SampleArgs& a, cudaStream_t stream);

}  // namespace ds::cuda
