// Programmatic dependent launch (Hopper and later). Every kernel of the CUDA backend starts with
// pdl::enter() and is launched through pdl::launch(), which lets the next kernel in the stream be
// scheduled while this one drains: in a decode graph of ~400 small kernels, the launch gap
// between two dependent kernels is otherwise paid every time.
//
// The contract: a kernel launched with the attribute may start before the kernel ahead of it has
// finished, so it must wait (griddepcontrol.wait) before it reads what that kernel writes or
// writes what it reads. enter() waits, then allows its own dependants to launch, so when a kernel
// starts, every kernel two or more launches ahead of it has finished: only the one just ahead may
// still run. Before enter() a kernel may therefore read what no kernel writes (weights: the
// skinny GEMM's first weight step) and what only earlier kernels wrote (the MLA decode's cache
// rows, written by mla_prepare before the W_uk product: MlaAttentionParams::cache_settled);
// everything else comes after it. Both instructions are no-ops when the kernel was launched
// without the attribute, and are compiled out below sm_90. DEEPSERVE_PDL=0 turns the attribute
// off (for A/B runs and as an escape hatch).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

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

// Asks L2 for the bytes [p, p + bytes), widened to 16-byte bounds, without waiting for them
// (cp.async.bulk.prefetch, sm_90; nothing below it). With pdl::prefetch_bytes (opt-in), a kernel
// calls it before enter() for its weights, which no kernel of a forward writes, so the fetch
// can overlap the tail of the kernel ahead. Measured on the H200 it slowed the BF16 decode
// steps (W3 3.16 -> 3.28 ms) and sped up only W1q. Keep each call to the part of the weights
// the calling CTA reads: one CTA's bulk prefetches go through its own SM, and 16 MB asked by
// the one-CTA token-list kernel doubled a MoE layer (docs/PERFORMANCE.md, thirteenth session). A
// hint only: it returns nothing and changes no result. L2 is the point of coherence, so even a line
// the kernel ahead is still writing is read correctly later. The range must lie inside one
// allocation (allocations are 256-byte aligned, so widening to 16 bytes stays inside).
__device__ __forceinline__ void prefetch_l2(const void* p, int64_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr uint64_t kPiece = 1u << 16;  // bytes per bulk prefetch
  const uint64_t from = uint64_t(__cvta_generic_to_global(p));
  uint64_t a = from & ~uint64_t(15);
  const uint64_t end = bytes > 0 ? (from + uint64_t(bytes) + 15) & ~uint64_t(15) : a;
  for (; a < end; a += kPiece) {
    const uint32_t n = uint32_t(end - a < kPiece ? end - a : kPiece);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a), "r"(n));
  }
#else
  (void)p;
  (void)bytes;
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
