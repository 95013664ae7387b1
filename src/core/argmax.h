// The index of the largest of n floats, the lowest one on ties (greedy sampling). Eight
// independent running maxima instead of one: the single chain re-read v[best] for every
// element, a load behind each compare (~0.25 ms for SmolLM2's 49,152 logits on a 2-core VM,
// most of the engine's host time between CPU decode steps). NaNs never win, and a NaN first
// element wins outright, as in the scalar loop: every lane starts from element 0.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ds {

inline int64_t argmax_first(const float* v, size_t n) {
  if (n == 0) return 0;
  constexpr size_t kLanes = 8;
  if (n < 2 * kLanes) {
    size_t best = 0;
    for (size_t i = 1; i < n; ++i)
      if (v[i] > v[best]) best = i;
    return int64_t(best);
  }
  float bv[kLanes];
  size_t bi[kLanes];
  for (size_t l = 0; l < kLanes; ++l) {
    bv[l] = v[0];  // a later element wins only if greater
    bi[l] = 0;
  }
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (size_t l = 0; l < kLanes; ++l)
      if (v[i + l] > bv[l]) {
        bv[l] = v[i + l];
        bi[l] = i + l;
      }
  for (; i < n; ++i)
    if (v[i] > bv[0]) {
      bv[0] = v[i];
      bi[0] = i;
    }
  // Each lane holds its first maximum; the overall first maximum is the lowest index among
  // the lanes with the largest value.
  size_t best = 0;
  for (size_t l = 1; l < kLanes; ++l)
    if (bv[l] > bv[best] || (bv[l] == bv[best] && bi[l] < bi[best])) best = l;
  return int64_t(bi[best]);
}

}  // namespace ds
