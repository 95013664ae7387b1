#include <cuda_runtime.h>

#include <array>
#include <atomic>

#include "backend/cuda/common.cuh"
#include "backend/cuda/pdl.h"
#include "backend/cuda/switches.h"

namespace ds::cuda::pdl {

bool enabled() {
  return g_pdl.on() && hopper();
}

long long prefetch_bytes(PrefetchKind kind) {
  if (!g_prefetch.on() || (g_prefetch_kinds.get() & int(kind)) == 0 || !hopper()) return 0;
  return g_prefetch_cap.get();
}

bool hopper() {
  // Per device: 0 unknown, 1 no (before sm_90), 2 yes. Launches are frequent, the query is not.
  static std::array<std::atomic<int>, 64> known{};
  int dev = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  if (dev < 0 || dev >= int(known.size())) return false;
  int k = known[size_t(dev)].load(std::memory_order_relaxed);
  if (k == 0) {
    int major = 0;
    check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev),
               "cudaDeviceGetAttribute");
    k = major >= 9 ? 2 : 1;
    known[size_t(dev)].store(k, std::memory_order_relaxed);
  }
  return k == 2;
}

}  // namespace ds::cuda::pdl
