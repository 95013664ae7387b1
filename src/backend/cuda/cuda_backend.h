// Host-side queries about CUDA devices and a CUDA backend's memory pool. Plain C++ (no CUDA
// headers), so the CLI and tests can call it; only built when DEEPSERVE_HAVE_CUDA is defined.
#pragma once

#include <cstddef>

#include "backend/backend.h"

namespace ds {

// Number of CUDA devices visible to this process; 0 when there is no driver or no GPU.
int cuda_device_count();

// A CUDA backend's device memory pool: one cudaMalloc of free memory x
// gpu_memory_utilization, sub-allocated for weights, KV caches and scratch.
struct CudaPoolInfo {
  size_t capacity_bytes = 0;      // the whole reservation
  size_t used_bytes = 0;          // held by live buffers (incl. alignment padding)
  size_t free_bytes = 0;          // capacity - used
  size_t largest_free_bytes = 0;  // the biggest single allocation that would succeed now
};

// Throws ds::Error when `backend` is not a CUDA backend.
CudaPoolInfo cuda_pool_info(const Backend& backend);
// A CUDA backend's stream (a cudaStream_t) and device, for collectives enqueued on it (NCCL).
void* cuda_stream_of(const Backend& backend);
int cuda_device_of(const Backend& backend);
// Makes `backend`'s device current on the calling thread (each rank's worker thread).
void cuda_bind_thread(const Backend& backend);

}  // namespace ds
