// Row-wise argmax of F32 logits (greedy sampling on the device).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace ds::cuda {

// ids[r] = lowest index of the maximum of logits[r, 0..V); logits rows are ld floats apart.
void launch_argmax(const float* logits, int64_t rows, int64_t V, int64_t ld, int32_t* ids,
                   cudaStream_t stream);

}  // namespace ds::cuda
