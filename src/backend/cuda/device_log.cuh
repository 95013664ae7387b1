// The kernels' side of device_log.h: claiming a record, and the clocks to stamp it with.
#pragma once

#include <cstdint>

namespace ds::cuda::device_log {

// The record this call may fill (`words` words), or null: the log is off, the record is one of
// the first `skip` (warm-up) or past `cap`. Every call counts one, logged or not.
__device__ __forceinline__ unsigned long long* claim(unsigned long long* log, int cap,
                                                     long long skip, int words) {
  if (log == nullptr) return nullptr;
  const unsigned long long n = atomicAdd(log, 1ull);
  const auto s = static_cast<unsigned long long>(skip);
  if (n < s || n - s >= static_cast<unsigned long long>(cap)) return nullptr;
  return log + (n - s + 1) * static_cast<unsigned long long>(words);
}

// The GPU's global nanosecond timer (the same on every SM).
__device__ __forceinline__ unsigned long long globaltimer() {
  unsigned long long t = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ unsigned smid() {
  unsigned id = 0;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}

}  // namespace ds::cuda::device_log
