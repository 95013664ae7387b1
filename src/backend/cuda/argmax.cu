#include "backend/cuda/argmax.cuh"
#include "backend/cuda/pdl.cuh"

namespace ds::cuda {
namespace {

// (value, index) with "greater value, then lower index" as the order.
struct Best {
  float v;
  int32_t i;
};

__device__ inline Best better(Best a, Best b) {
  if (b.v > a.v || (b.v == a.v && b.i < a.i)) return b;
  return a;
}

// One block per row; NaNs never win (comparisons with NaN are false).
__global__ void argmax_kernel(const float* logits, int64_t V, int64_t ld, int32_t* ids) {
  pdl::enter();
  const float* row = logits + blockIdx.x * ld;
  Best best{-INFINITY, INT32_MAX};
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x)
    best = better(best, Best{row[i], int32_t(i)});
  for (int off = 16; off > 0; off >>= 1) {
    Best o{__shfl_down_sync(0xffffffffu, best.v, off), __shfl_down_sync(0xffffffffu, best.i, off)};
    best = better(best, o);
  }
  __shared__ Best warp_best[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_best[warp] = best;
  __syncthreads();
  if (warp == 0) {
    const int nwarps = blockDim.x / 32;
    best = lane < nwarps ? warp_best[lane] : Best{-INFINITY, INT32_MAX};
    for (int off = 16; off > 0; off >>= 1) {
      Best o{__shfl_down_sync(0xffffffffu, best.v, off),
             __shfl_down_sync(0xffffffffu, best.i, off)};
      best = better(best, o);
    }
    // A row of all -inf/NaN yields index 0, like a host argmax starting from element 0.
    if (lane == 0) ids[blockIdx.x] = best.i == INT32_MAX ? 0 : best.i;
  }
}

}  // namespace

void launch_argmax(const float* logits, int64_t rows, int64_t V, int64_t ld, int32_t* ids,
                   cudaStream_t stream) {
  if (rows <= 0) return;
  pdl::launch(argmax_kernel, unsigned(rows), 1024, 0, stream, logits, V, ld, ids);
}

}  // namespace ds::cuda
