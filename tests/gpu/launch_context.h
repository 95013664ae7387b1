// A stream and scratch buffers of a GPU test's own (a cuda::Context), so attention launchers can
// be called directly with a pinned kernel path, apart from the backend's wiring.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <map>

#include "backend/cuda/context.cuh"

namespace ds {

inline void cuda_ok(cudaError_t e, const char* what) {
  ASSERT_EQ(e, cudaSuccess) << what << ": " << cudaGetErrorString(e);
}

// A stream and scratch buffers of the test's own, growing on demand like the backend's.
class LaunchContext {
 public:
  LaunchContext() {
    cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
    int sms = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    ctx_.stream = stream_;
    ctx_.sm_count = sms;
    ctx_.scratch = [this](int slot, size_t bytes) -> void* {
      Scratch& s = scratch_[slot];
      if (s.bytes < bytes) {
        if (s.ptr) cudaFree(s.ptr);
        s.ptr = nullptr;
        s.bytes = 0;
        if (cudaMalloc(&s.ptr, bytes) != cudaSuccess) return nullptr;
        s.bytes = bytes;
      }
      return s.ptr;
    };
  }
  ~LaunchContext() {
    for (auto& [slot, s] : scratch_) cudaFree(s.ptr);
    cudaStreamDestroy(stream_);
  }
  const cuda::Context& get() const { return ctx_; }
  cudaStream_t stream() const { return stream_; }

 private:
  struct Scratch {
    void* ptr = nullptr;
    size_t bytes = 0;
  };
  cudaStream_t stream_ = nullptr;
  cuda::Context ctx_;
  std::map<int, Scratch> scratch_;
};

inline LaunchContext& launch_context() {
  static LaunchContext c;
  return c;
}

}  // namespace ds
