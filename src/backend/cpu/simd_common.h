// What the *_avx2.cpp and *_avx512.cpp kernel files share before their ISA helpers:
// the intrinsics header (each file's compile flags decide which intrinsics it may use)
// and the unroll pragma. Include only from those files and their headers.
#pragma once

// GCC 12 warns inside its own intrinsics headers (the _mm*_undefined_* idiom, GCC bug
// 105593); the pragma covers the header's lines, not ours.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <cstdint>

// Fully unrolls a register-tile loop early, so GCC keeps accumulator arrays in registers
// (without it, it also stores every accumulator to the stack on every iteration).
#define DS_UNROLL _Pragma("GCC unroll 16")
