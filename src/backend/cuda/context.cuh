// What every CUDA op launcher gets from the backend: its stream and scratch memory.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <functional>

namespace ds::cuda {

struct Context {
  cudaStream_t stream = nullptr;
  int sm_count = 0;
  // Device scratch owned by the backend, one buffer per `slot` (use a distinct slot per op
  // family); grows on demand, so call it outside CUDA-graph capture with the largest size
  // first, or size it from bounds that do not change between replays.
  std::function<void*(int slot, size_t bytes)> scratch;
  // The most bytes scratch(slot, ...) can hand out now without running the pool dry: the
  // slot's own size or the pool's largest free range (an under-estimate: the slot's range may
  // join a free neighbour when it grows). May be empty (test contexts): no limit known.
  std::function<size_t(int slot)> scratch_room;
};

// Scratch slots, one per op family, so buffers of different ops never alias.
enum ScratchSlot : int {
  kScratchMatmul = 0,
  kScratchAttention = 1,
  kScratchMla = 2,
  kScratchMoe = 3,
  kScratchMlaPrefill = 4,
  kScratchDequant = 5,  // a quantized weight expanded to BF16 (wq_dequant.cuh)
  kScratchCount = 6,
};

}  // namespace ds::cuda
