// The MLA prefill kernel's index math on the host (mla_prefill.cuh is the kernels' own code):
// the shared-memory swizzle is a bijection whose ldmatrix phases hit 8 distinct bank groups,
// and query tiles cover every query once, see exactly the keys causality allows, and skip the
// per-element mask only on key tiles where no row of the tile would mask anything.
#include <gtest/gtest.h>

#include <set>
#include <vector>

#include "backend/cuda/mla_prefill.cuh"

namespace ds {
namespace {

using namespace cuda::mla_prefill_detail;

TEST(MlaPrefillSim, SwizzleIsBijectiveAndConflictFree) {
  for (int chunks : {kQk / 8, kV / 8}) {
    std::set<int> seen;
    for (int r = 0; r < kBlockN; ++r)
      for (int c = 0; c < chunks; ++c) {
        const int off = swizzle(r, c, chunks);
        EXPECT_EQ(off / 16 / chunks, r) << "chunk left its row";
        EXPECT_TRUE(seen.insert(off).second) << "offset used twice: row " << r << " chunk " << c;
      }
    // One ldmatrix phase: 8 consecutive rows, the same logical chunk -> 8 distinct bank groups.
    for (int r0 = 0; r0 < kBlockN; r0 += 8)
      for (int c = 0; c < chunks; ++c) {
        std::set<int> groups;
        for (int r = r0; r < r0 + 8; ++r) groups.insert((swizzle(r, c, chunks) / 16) % 8);
        EXPECT_EQ(groups.size(), 8u) << "bank conflict at rows " << r0 << " chunk " << c;
      }
  }
}

TEST(MlaPrefillSim, QueryTilesCoverQueriesAndKeys) {
  const int lens[] = {1, 7, 63, 64, 65, 97, 128, 200, 1000};
  for (bool causal : {true, false})
    for (int nq : lens)
      for (int prefix : {0, 1, 5, 64, 130}) {
        const int ctx = nq + prefix;
        std::vector<int> covered(size_t(nq), 0);
        for (int qt = 0; qt * kBlockM < nq + kBlockM; ++qt) {
          const QueryTile t = query_tile(qt, nq, ctx, causal);
          if (t.q_begin >= nq) {
            EXPECT_EQ(t.n_tiles, 0);
            continue;
          }
          int last_visible = 0;
          for (int i = t.q_begin; i < t.q_end; ++i) {
            ++covered[size_t(i)];
            const int pos = t.pos0 + (i - t.q_begin);
            EXPECT_EQ(pos, ctx - nq + i);
            const int visible = causal ? pos + 1 : ctx;  // keys [0, visible)
            last_visible = std::max(last_visible, visible);
            EXPECT_LE(visible, t.n_tiles * kBlockN) << "a visible key is never loaded";
            // Tiles before first_masked: every key visible to every row of the tile.
            for (int k = 0; k < t.first_masked; ++k)
              EXPECT_LE((k + 1) * kBlockN, visible)
                  << "nq " << nq << " ctx " << ctx << " tile " << k << " needs a mask";
          }
          EXPECT_EQ(t.n_keys, last_visible);
          EXPECT_LE(t.n_keys, ctx);
          EXPECT_EQ(t.n_tiles, (t.n_keys + kBlockN - 1) / kBlockN);
        }
        for (int i = 0; i < nq; ++i) EXPECT_EQ(covered[size_t(i)], 1) << "query " << i;
      }
}

TEST(MlaPrefillSim, GatheredRowsArePaddedPerSequence) {
  EXPECT_EQ(gathered_row(0, 0, 100), 0);
  EXPECT_EQ(gathered_row(2, 5, 100), 205);
  EXPECT_EQ(gathered_row(40000, 32767, 32768), int64_t(40000) * 32768 + 32767);  // no overflow
}

}  // namespace
}  // namespace ds
