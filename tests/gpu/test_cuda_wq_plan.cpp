// The wq kernel's copy plan (wq_copy_plan.h), checked on the host: every 16-byte chunk of a
// pipeline stage's weight rows is copied exactly once, from the row and byte offset the copy
// reads, to the shared-memory slot where the mma fragments look for it (a_chunk's swizzle),
// with the offsets a thread adds as immediates. Needs no GPU (CI runs it).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "backend/cuda/wq_copy_plan.h"

namespace ds::cuda::wqk {
namespace {

// Stage shapes of the formats' kernels: (format, groups a stage, bytes a row and stage).
template <WqFormat F, int G>
void check_weight_copies(int row_bytes, const std::string& what) {
  SCOPED_TRACE(what);
  const int chunks = row_bytes / 16;
  ASSERT_EQ(chunks % kWThreadsPerRow, 0);
  const int per_row = chunks / kWThreadsPerRow;  // chunks a thread copies of a row
  // The swizzle is a permutation of each row's chunks.
  for (int r = 0; r < kBN; ++r) {
    std::vector<int> hit(size_t(chunks), 0);
    for (int c = 0; c < chunks; ++c) {
      const int pc = a_chunk<F, G>(r, c);
      ASSERT_GE(pc, 0);
      ASSERT_LT(pc, chunks);
      ++hit[size_t(pc)];
    }
    for (int c = 0; c < chunks; ++c) ASSERT_EQ(hit[size_t(c)], 1) << "row " << r;
  }
  std::vector<int> copied(size_t(kBN) * size_t(chunks), 0);
  for (int tid = 0; tid < kThreads; ++tid) {
    for (int p = 0; p < kWPasses; ++p) {
      const int r = w_copy_row(tid, p);
      ASSERT_GE(r, 0);
      ASSERT_LT(r, kBN);
      for (int j = 0; j < per_row; ++j) {
        const int c = w_copy_chunk(tid, j);
        ASSERT_LT(c, chunks);
        // The kernel's source: the thread's row address plus the immediate 64 j.
        EXPECT_EQ(c * 16, w_copy_chunk(tid, 0) * 16 + 64 * j);
        // Its destination: w_copy_dst(j) plus the immediate p rows of 32; where the
        // consumer (run_cta's fragment loads) reads row r's chunk c.
        const uint32_t dst =
            w_copy_dst<F, G>(tid, j, row_bytes) + uint32_t(p * kWRowsPerPass * row_bytes);
        EXPECT_EQ(dst, uint32_t(r * row_bytes + a_chunk<F, G>(r, c) * 16))
            << "tid " << tid << " pass " << p << " copy " << j;
        ++copied[size_t(r) * size_t(chunks) + size_t(c)];
      }
    }
  }
  for (int r = 0; r < kBN; ++r)
    for (int c = 0; c < chunks; ++c)
      EXPECT_EQ(copied[size_t(r) * size_t(chunks) + size_t(c)], 1) << "row " << r << " chunk " << c;
  // A warp's copy j of a pass reads whole 32-byte sectors: 8 rows, 64 contiguous bytes each.
  for (int w = 0; w < kThreads / 32; ++w)
    for (int p = 0; p < kWPasses; ++p)
      for (int j = 0; j < per_row; ++j) {
        std::vector<int> bytes_of_row(size_t(kBN), 0);
        int lo = 1 << 30, hi = -1;
        for (int lane = 0; lane < 32; ++lane) {
          const int tid = 32 * w + lane, r = w_copy_row(tid, p);
          ++bytes_of_row[size_t(r)];
          const int at = w_copy_chunk(tid, j) * 16;
          lo = std::min(lo, at);
          hi = std::max(hi, at + 16);
        }
        int rows = 0;
        for (int n : bytes_of_row)
          if (n > 0) {
            EXPECT_EQ(n, kWThreadsPerRow);
            ++rows;
          }
        EXPECT_EQ(rows, 8);
        EXPECT_EQ(hi - lo, 64);
        EXPECT_EQ(lo % 64, 0);
      }
}

TEST(WqCopyPlan, WeightCopiesFillEveryStageSlotOnce) {
  // W4A16: 64 bytes a group (one group a stage for prefill tiles, two for decode).
  check_weight_copies<WqFormat::W4A16, 1>(64, "W4A16, one group");
  check_weight_copies<WqFormat::W4A16, 2>(128, "W4A16, two groups");
  // FP8W: 128 bytes a group.
  check_weight_copies<WqFormat::FP8W, 1>(128, "FP8W, one group");
  check_weight_copies<WqFormat::FP8W, 2>(256, "FP8W, two groups");
  // BF16: 256 bytes a group, one a stage.
  check_weight_copies<WqFormat::BF16, 1>(256, "BF16");
}

TEST(WqCopyPlan, GateUpRowsSplitBetweenTheMatrices) {
  // Rows kBN / 2 .. of a gate/up CTA are up's: a thread's passes 0, 1 read gate's rows and
  // 2, 3 the same rows of up, so both halves land in the same threads' copies.
  for (int tid = 0; tid < kThreads; ++tid)
    for (int p = 0; p < kWPasses; ++p) {
      const int r = w_copy_row(tid, p);
      EXPECT_EQ(r >= kBN / 2, p >= kWPasses / 2);
      if (p >= kWPasses / 2) EXPECT_EQ(r - kBN / 2, w_copy_row(tid, p - kWPasses / 2));
    }
}

}  // namespace
}  // namespace ds::cuda::wqk
