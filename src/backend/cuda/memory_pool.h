// The CUDA backend's device memory: one reservation sub-allocated first-fit, so weights, KV
// caches and scratch stay inside the --gpu-memory-utilization budget and freeing is cheap.
#pragma once

#include <cstddef>
#include <map>
#include <mutex>
#include <optional>
#include <unordered_map>

#include "backend/cuda/cuda_backend.h"

namespace ds::cuda {

// First-fit over byte offsets [0, capacity) with coalescing of neighbouring free ranges.
// Every range starts at a multiple of `alignment`. Plain bookkeeping: no device calls.
class RangeAllocator {
 public:
  RangeAllocator(size_t capacity, size_t alignment);
  // Offset of a new range of at least `bytes` (0 counts as 1); nullopt when nothing fits.
  std::optional<size_t> allocate(size_t bytes);
  // Frees the range allocate() returned at `offset`; throws on an unknown offset.
  void release(size_t offset);
  size_t capacity() const { return capacity_; }
  size_t used() const { return used_; }
  size_t largest_free() const;
  size_t alignment() const { return alignment_; }

 private:
  size_t capacity_, alignment_, used_ = 0;
  std::map<size_t, size_t> free_;              // offset -> size, ordered for coalescing
  std::unordered_map<size_t, size_t> in_use_;  // offset -> size
};

// One cudaMalloc of `bytes` on the current device, handed out through a RangeAllocator.
// Thread-safe. Callers order reuse themselves (the backend has one stream, so memory freed
// while kernels still read it is only rewritten by work queued after them).
class DevicePool {
 public:
  // utilization is only quoted in the exhaustion message.
  DevicePool(size_t bytes, double utilization);
  ~DevicePool();
  DevicePool(const DevicePool&) = delete;
  DevicePool& operator=(const DevicePool&) = delete;

  // Throws ds::Error naming the request, what is left and the flags to change when full.
  void* allocate(size_t bytes);
  void release(void* p);
  CudaPoolInfo info() const;

  static constexpr size_t kAlignment = 256;

 private:
  void* base_ = nullptr;
  double utilization_;
  mutable std::mutex mu_;
  RangeAllocator ranges_;
};

}  // namespace ds::cuda
