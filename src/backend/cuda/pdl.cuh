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

// kernel<<<grid, block, smem, stream>>>(args...), with the programmatic-serialization attribute
// when enabled(). Launch errors are thrown, like check_cuda(cudaGetLastError()) after <<<>>>.
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
            Args&&... args) {
  cudaLaunchAttribute attr[1] = {};
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = enabled() ? 1 : 0;
  check_cuda(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...), "kernel launch");
}

}  // namespace ds::cuda::pdl
