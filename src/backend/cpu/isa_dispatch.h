// Picks the variant of a kernel compiled for an ISA family (AMX runs the AVX-512 ones).
#pragma once

#include "backend/cpu/cpu_features.h"

namespace ds::cpu {

template <class Fn>
Fn by_isa(Isa isa, Fn generic, Fn avx2, Fn avx512) {
  switch (isa) {
    case Isa::Scalar:
      return generic;
    case Isa::Avx2:
      return avx2;
    case Isa::Avx512Vnni:
    case Isa::Amx:
      return avx512;
  }
  return generic;
}

}  // namespace ds::cpu
