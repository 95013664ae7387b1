// Where the wq kernel (wq_kernel.cuh) puts a pipeline stage's weights in shared memory, and
// which 16-byte copies each of its threads issues to fill it. Host-callable, so the plan is
// checked without a GPU (tests/gpu/test_cuda_wq_plan.cpp).
//
// A stage holds the CTA's kBN weight rows, row_bytes each (kGps groups of a format's codes),
// every row's 16-byte chunks permuted by a_chunk (so the mma fragments' reads spread over the
// banks). The copies: four threads a row, thread tid taking chunks (tid & 3) + 4 j of rows
// (tid >> 2) + 32 p. A warp's copy then reads 64 contiguous bytes of each of 8 rows (whole
// sectors), a thread's copies of one row sit at immediate offsets (64 j) from one address, and
// since the swizzles depend on a row's parity alone and a thread's rows are 32 apart, its
// copies' shared-memory offsets are w_copy_dst(j) plus 32 p rows: the addresses of a stage
// cost one 64-bit add a row, where the per-copy form spent ~15 instructions a copy.
#pragma once

#include <cstdint>

#include "backend/cuda/attention_port.cuh"
#include "backend/cuda/gemm_wq.cuh"

namespace ds::cuda::wqk {

constexpr int kThreads = 128;
constexpr int kBN = 128;  // weight rows per CTA

// Token rows are 16 chunks; lanes (g, t) of step p read chunk 4t + p of row g: the eight
// lanes of a phase (rows 2i, 2i + 1; t = 0..3) land in eight different 16-byte bank groups.
DS_KHD int b_chunk(int r, int c) {
  return c ^ (((c >> 3) & 1) << 1) ^ (r & 1);
}
// Physical 16-byte chunk of weight-row chunk c of a stage of G groups (FP8W rows, 8 chunks a
// group: flip by row parity so the two rows one phase reads sit in different banks; two-group
// W4A16 rows too, whose phases read chunks 4u .. 4u + 3 of two rows; BF16 rows are read like
// token rows).
template <WqFormat F, int G = 1>
DS_KHD int a_chunk(int r, int c) {
  if constexpr (wq_w4(F)) return G == 2 ? c ^ ((r & 1) << 2) : c;
  return F == WqFormat::FP8W ? (c ^ (r & 1)) : b_chunk(r, c);
}

constexpr int kWThreadsPerRow = 4;
constexpr int kWRowsPerPass = kThreads / kWThreadsPerRow;  // 32
constexpr int kWPasses = kBN / kWRowsPerPass;              // rows a thread copies: 4

// The CTA row of thread tid's copy pass p (gate/up: rows kBN / 2 .. are up's).
DS_KHD int w_copy_row(int tid, int p) {
  return tid / kWThreadsPerRow + kWRowsPerPass * p;
}
// The row chunk of thread tid's copy j (of each of its rows): bytes 16 chunk .. + 15.
DS_KHD int w_copy_chunk(int tid, int j) {
  return tid % kWThreadsPerRow + kWThreadsPerRow * j;
}
// Shared-memory offset (in the stage's weights) of copy j of thread tid's pass-0 row; pass p's
// is this plus p * kWRowsPerPass * row_bytes.
template <WqFormat F, int G>
DS_KHD uint32_t w_copy_dst(int tid, int j, int row_bytes) {
  const int r = w_copy_row(tid, 0);
  return uint32_t(r * row_bytes + a_chunk<F, G>(r, w_copy_chunk(tid, j)) * 16);
}

}  // namespace ds::cuda::wqk
