// ISA-neutral helpers shared by the kernel files of every ISA: no intrinsics here, so the
// *_avx2.cpp and *_avx512.cpp files can both include it (everything has internal linkage).
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "backend/cpu/matmul_kernels.h"

namespace ds::cpu::detail {
namespace {

// A local helper instead of std::min: no library template gets instantiated with AVX-512
// flags and then merged by the linker into code that runs on other CPUs.
constexpr int64_t imin(int64_t a, int64_t b) {
  return a < b ? a : b;
}

template <DType T>
using TypeTag = std::integral_constant<DType, T>;

// Calls f(TypeTag<T>{}) for the first T of Ts equal to wtype, or for the last of Ts when
// none is: turns a job's runtime weight type into a kernel's template argument.
template <DType First, DType... Rest, class F>
void with_type(DType wtype, F&& f) {
  if constexpr (sizeof...(Rest) == 0) {
    f(TypeTag<First>{});
  } else {
    if (wtype == First) return f(TypeTag<First>{});
    with_type<Rest...>(wtype, f);
  }
}

// Bytes and elements of one block of each type the block-quantized kernels take.
template <DType T>
constexpr int kBlockBytes = T == DType::Q4_0   ? sizeof(BlockQ4_0)
                            : T == DType::Q4_1 ? sizeof(BlockQ4_1)
                            : T == DType::Q5_0 ? sizeof(BlockQ5_0)
                            : T == DType::Q5_1 ? sizeof(BlockQ5_1)
                            : T == DType::Q8_0 ? sizeof(BlockQ8_0)
                            : T == DType::Q4_K ? sizeof(BlockQ4_K)
                            : T == DType::Q5_K ? sizeof(BlockQ5_K)
                                               : sizeof(BlockQ6_K);
template <DType T>
constexpr int kBlockElems = T == DType::Q4_K || T == DType::Q5_K || T == DType::Q6_K ? 256 : 32;

}  // namespace
}  // namespace ds::cpu::detail
