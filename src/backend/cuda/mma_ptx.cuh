// Inline-PTX wrappers the tensor-core kernels share (moe_grouped.cu, attention_mla_decode.cu):
// cp.async copies into shared memory, ldmatrix fragment loads and the BF16 m16n8k16 mma.sync,
// with the fragment layouts of the PTX ISA.
#pragma once

#include <cstdint>

namespace ds::cuda::ptx {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared; zero-filled (nothing read) when !valid.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
}
// Three 16-byte copies kStride bytes apart (src, src + kStride, src + 2 kStride to the same
// offsets from dst), the third only where `third` holds (a predicated instruction, not a
// branch); 16 zero bytes each where `zero` holds (cp.async's ignore-src predicate). The
// offsets are immediates of one address pair, so the copies cost no address arithmetic.
template <int kStride>
__device__ __forceinline__ void cp_async16_x3(uint32_t dst, const void* src, bool zero,
                                              bool third) {
  asm volatile(
      "{\n .reg .pred z, t;\n setp.ne.b32 z, %2, 0;\n setp.ne.b32 t, %3, 0;\n"
      " cp.async.cg.shared.global [%0], [%1], 16, z;\n"
      " cp.async.cg.shared.global [%0+%4], [%1+%4], 16, z;\n"
      " @t cp.async.cg.shared.global [%0+%5], [%1+%5], 16, z;\n}\n" ::"r"(dst),
      "l"(src), "r"(int(zero)), "r"(int(third)), "n"(kStride), "n"(2 * kStride));
}
// 16 bytes global -> shared at immediate offsets from both addresses (kDst bytes past dst,
// kSrc past src); src_bytes 16 copies them, 0 writes 16 zero bytes and reads nothing.
template <int kDst, int kSrc>
__device__ __forceinline__ void cp_async16_at(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0+%3], [%1+%4], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes), "n"(kDst), "n"(kSrc));
}
// cp_async16_at where `on` holds; nothing at all (no copy, no zeros) where it does not.
template <int kDst, int kSrc>
__device__ __forceinline__ void cp_async16_at_if(uint32_t dst, const void* src, uint32_t src_bytes,
                                                 bool on) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n"
      " @p cp.async.cg.shared.global [%0+%3], [%1+%4], 16, %2;\n}\n" ::"r"(dst),
      "l"(src), "r"(src_bytes), "n"(kDst), "n"(kSrc), "r"(int(on)));
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
// Waits until at most N committed groups of this thread are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Four (two) 8x8 b16 matrices; lane l addresses row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr));
}
// Transposed: the B fragment of a row-major [k][n] tile.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// c += a (16x16 row-major) . b (16x8 "col"), F32 accumulators, with 16-bit inputs of PTX type T
// ("bf16" or "f16"); the function bodies below.
#define DS_MMA_M16N8K16(T)                                                              \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." T "." T                         \
               ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n" \
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                         \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))

// BF16 inputs.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  DS_MMA_M16N8K16("bf16");
}

// FP16 inputs.
__device__ __forceinline__ void mma_f16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  DS_MMA_M16N8K16("f16");
}

#undef DS_MMA_M16N8K16

}  // namespace ds::cuda::ptx
