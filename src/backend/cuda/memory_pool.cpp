#include "backend/cuda/memory_pool.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <iterator>
#include <string>

#include "core/error.h"

namespace ds::cuda {
namespace {

std::string mib(size_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MiB", double(bytes) / (1024.0 * 1024.0));
  return buf;
}

}  // namespace

RangeAllocator::RangeAllocator(size_t capacity, size_t alignment)
    : capacity_(capacity / alignment * alignment), alignment_(alignment) {
  DS_CHECK(alignment > 0 && (alignment & (alignment - 1)) == 0, "alignment must be a power of 2");
  if (capacity_ > 0) free_.emplace(0, capacity_);
}

std::optional<size_t> RangeAllocator::allocate(size_t bytes) {
  const size_t want = (std::max<size_t>(bytes, 1) + alignment_ - 1) / alignment_ * alignment_;
  if (want < bytes) return std::nullopt;  // overflow
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < want) continue;
    const size_t offset = it->first, rest = it->second - want;
    free_.erase(it);
    if (rest > 0) free_.emplace(offset + want, rest);
    in_use_.emplace(offset, want);
    used_ += want;
    return offset;
  }
  return std::nullopt;
}

void RangeAllocator::release(size_t offset) {
  auto u = in_use_.find(offset);
  DS_CHECK(u != in_use_.end(), "release of an offset that was not allocated");
  size_t start = offset, size = u->second;
  used_ -= size;
  in_use_.erase(u);
  auto next = free_.lower_bound(start);
  if (next != free_.end() && next->first == start + size) {  // merge with the range after
    size += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {  // merge with the range before
    auto prev = std::prev(next);
    if (prev->first + prev->second == start) {
      start = prev->first;
      size += prev->second;
      free_.erase(prev);
    }
  }
  free_.emplace(start, size);
}

size_t RangeAllocator::largest_free() const {
  size_t best = 0;
  for (const auto& [offset, size] : free_) best = std::max(best, size);
  return best;
}

DevicePool::DevicePool(size_t bytes, double utilization)
    : utilization_(utilization), ranges_(bytes, kAlignment) {
  const size_t cap = ranges_.capacity();
  const cudaError_t e = cudaMalloc(&base_, std::max<size_t>(cap, kAlignment));
  if (e != cudaSuccess)
    throw Error("CUDA: cannot reserve the memory pool (" + mib(cap) +
                "): " + cudaGetErrorString(e) + "; lower --gpu-memory-utilization");
}

DevicePool::~DevicePool() {
  cudaFree(base_);
}

void* DevicePool::allocate(size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::optional<size_t> off = ranges_.allocate(bytes);
  if (!off) {
    const size_t free = ranges_.capacity() - ranges_.used();
    char util[32];
    std::snprintf(util, sizeof util, "%.2f", utilization_);
    throw Error("CUDA memory pool exhausted: asked for " + mib(bytes) + ", " + mib(free) +
                " free of " + mib(ranges_.capacity()) + " (largest free block " +
                mib(ranges_.largest_free()) + "); raise --gpu-memory-utilization (now " + util +
                ") or lower --kv-cache-tokens");
  }
  return static_cast<char*>(base_) + *off;
}

void DevicePool::release(void* p) {
  std::lock_guard<std::mutex> lock(mu_);
  ranges_.release(size_t(static_cast<char*>(p) - static_cast<char*>(base_)));
}

CudaPoolInfo DevicePool::info() const {
  std::lock_guard<std::mutex> lock(mu_);
  CudaPoolInfo i;
  i.capacity_bytes = ranges_.capacity();
  i.used_bytes = ranges_.used();
  i.free_bytes = i.capacity_bytes - i.used_bytes;
  i.largest_free_bytes = ranges_.largest_free();
  return i;
}

}  // namespace ds::cuda
