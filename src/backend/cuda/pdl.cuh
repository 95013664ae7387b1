// Programmatic dependent launch (Hopper and later). Every kernel of the CUDA backend starts with
// pdl::enter() and is launched through pdl::launch(), which lets the next kernel in the stream be
// scheduled while this one drains: in a decode graph of ~400 small kernels, the launch gap
// between two dependent kernels is otherwise paid every time.
//
// The contract: a kernel launched with the attribute may start before the kernel ahead of it has
// finished, so it must wait (griddepcontrol.wait) before it reads what that kernel writes or
// writes what it reads. enter() does that first thing, so no kernel touches memory early; it then
// allows its own dependants to launch. Both instructions are no-ops when the kernel was launched
// without the attribute, and are compiled out below sm_90. DEEPSERVE_PDL=0 turns the attribute
// off (for A/B runs and as an escape hatch).
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "backend/cuda/common.cuh"
#include "backend/cuda/pdl.h"

namespace ds::cuda::pdl {

__device__ __forceinline__ void enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// kernel<<<grid, block, smem, stream>>>(args...) in thread-block clusters of `cluster` CTAs
// (sm_90+; grid a multiple of it), with the programmatic-serialization attribute when
// enabled(). Launch errors are thrown, like check_cuda(cudaGetLastError()) after <<<>>>.
template <typename... Params, typename... Args>
void launch_clusters(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                     cudaStream_t stream, dim3 cluster, Args&&... args) {
  cudaLaunchAttribute attr[2] = {};
  unsigned n = 0;
  if (enabled()) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster.x * cluster.y * cluster.z > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cluster.x;
    attr[n].val.clusterDim.y = cluster.y;
    attr[n++].val.clusterDim.z = cluster.z;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = n;
  check_cuda(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...), "kernel launch");
}

// The same without clusters: kernel<<<grid, block, smem, stream>>>(args...).
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
            Args&&... args) {
  launch_clusters(kernel, grid, block, smem, stream, dim3(1, 1, 1), std::forward<Args>(args)...);
}

}  // namespace ds::cuda::pdl
