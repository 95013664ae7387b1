// Helpers shared by the block manager and scheduler tests.
#pragma once

#include <cstdint>
#include <numeric>
#include <vector>

namespace ds::test {

// n consecutive token ids starting at `first`.
inline std::vector<int32_t> iota_tokens(int n, int32_t first) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), first);
  return v;
}

}  // namespace ds::test
