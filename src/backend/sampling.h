// Shared by every implementation of Backend::sample (the CPU reference and the CUDA kernel):
// the per-row parameters and the counter-based random draw. Plain C++ that nvcc also compiles
// for the device, so both sides draw bit-identical uniforms.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define DS_HOST_DEVICE __host__ __device__
#else
#define DS_HOST_DEVICE
#endif

namespace ds {

// One row of Backend::sample, in backend memory (32 bytes; the engine uploads B of them per
// step). Filters apply in llama.cpp's order: top-k, top-p, min-p at temperature 1, then the
// temperature on the survivors.
struct SampleRow {
  float temperature = 0.0f;  // <= 0: greedy (argmax, the lowest index among equal maxima)
  int32_t top_k = 0;         // <= 0 (or >= vocab): off
  float top_p = 1.0f;        // >= 1: off
  float min_p = 0.0f;        // <= 0: off; keeps p_i >= min_p * p_max
  uint64_t seed = 0;
  uint64_t counter = 0;  // the draw is a pure function of (seed, counter)
};
static_assert(sizeof(SampleRow) == 32, "SampleRow is uploaded as raw bytes");

// splitmix64's finalizer: a bijective 64-bit mix with full avalanche.
DS_HOST_DEVICE constexpr uint64_t sample_mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// 64 random bits as a pure function of (seed, counter): no generator state, so a captured
// graph or a reordered batch draws the same value.
DS_HOST_DEVICE constexpr uint64_t sample_hash(uint64_t seed, uint64_t counter) {
  return sample_mix64(sample_mix64(seed ^ 0x243f6a8885a308d3ull) +
                      sample_mix64(counter + 0x9e3779b97f4a7c15ull));
}

// Uniform in [0, 1) with 53 random bits.
DS_HOST_DEVICE constexpr double sample_uniform(uint64_t seed, uint64_t counter) {
  return double(sample_hash(seed, counter) >> 11) * 0x1p-53;
}

}  // namespace ds
