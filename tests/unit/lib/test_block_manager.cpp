#include <gtest/gtest.h>

#include "sched_test_util.h"

#include <numeric>
#include <random>

#include "core/error.h"
#include "engine/block_manager.h"

namespace ds {
namespace {

BlockManagerConfig config(int num_blocks, int block_size,
                          AllocationMode mode = AllocationMode::Dynamic, bool prefix = true) {
  BlockManagerConfig c;
  c.num_blocks = num_blocks;
  c.block_size = block_size;
  c.mode = mode;
  c.enable_prefix_cache = prefix;
  return c;
}

using test::iota_tokens;

std::vector<int32_t> concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

TEST(BlockManager, AllocatesPromptBlocksAndMapsSlots) {
  BlockManager bm(config(8, 4));
  const auto prompt = iota_tokens(10, 0);
  EXPECT_EQ(bm.allocate(1, prompt, 100), 0);
  ASSERT_EQ(bm.block_table(1).size(), 3u);  // dynamic: the prompt only
  EXPECT_EQ(bm.num_slots(1), 10);
  const auto& t = bm.block_table(1);
  EXPECT_EQ(bm.slot(1, 0), int64_t(t[0]) * 4);
  EXPECT_EQ(bm.slot(1, 9), int64_t(t[2]) * 4 + 1);
  EXPECT_THROW(bm.slot(1, 10), Error);
  auto st = bm.stats();
  EXPECT_EQ(st.used_blocks, 3);
  EXPECT_EQ(st.free_blocks, 5);
  EXPECT_DOUBLE_EQ(st.fragmentation, 2.0 / 12.0);
  bm.check_invariants();
  EXPECT_TRUE(bm.grow(1, 2));  // fills the third block
  EXPECT_EQ(bm.block_table(1).size(), 3u);
  EXPECT_TRUE(bm.grow(1, 1));
  EXPECT_EQ(bm.block_table(1).size(), 4u);
  bm.free(1);
  EXPECT_EQ(bm.stats().free_blocks, 8);
  bm.check_invariants();
}

TEST(BlockManager, FailedAllocationOrGrowthChangesNothing) {
  BlockManager bm(config(4, 4));
  ASSERT_EQ(bm.allocate(1, iota_tokens(12, 0), 8), 0);
  EXPECT_FALSE(bm.allocate(2, iota_tokens(5, 100), 8).has_value());
  EXPECT_FALSE(bm.has(2));
  EXPECT_TRUE(bm.can_grow(1, 4));
  EXPECT_FALSE(bm.can_grow(1, 5));
  EXPECT_FALSE(bm.grow(1, 5));
  EXPECT_EQ(bm.num_slots(1), 12);
  EXPECT_EQ(bm.stats().free_blocks, 1);
  bm.check_invariants();
  EXPECT_THROW(bm.allocate(1, iota_tokens(1, 0), 1), Error);  // id already live
}

TEST(BlockManager, SharedSystemPromptIsComputedOnce) {
  BlockManager bm(config(100, 16));
  const auto system = iota_tokens(400, 1000);  // 25 full blocks
  const auto a = concat(system, iota_tokens(10, 0));
  ASSERT_EQ(bm.allocate(1, a, 32), 0);
  bm.commit(1, a);
  EXPECT_EQ(bm.stats().prefix_hit_tokens, 0);

  const auto b = concat(system, iota_tokens(7, 50));
  ASSERT_EQ(bm.allocate(2, b, 32), 400);  // every block of the system prompt is reused
  for (int i = 0; i < 25; ++i)
    EXPECT_EQ(bm.block_table(2)[size_t(i)], bm.block_table(1)[size_t(i)]);
  EXPECT_NE(bm.block_table(2)[25], bm.block_table(1)[25]);
  EXPECT_EQ(bm.num_committed(2), 400);

  // Exactly the system prompt: its last block is recomputed for the logits.
  ASSERT_EQ(bm.allocate(3, system, 32), 400 - 16);
  auto st = bm.stats();
  EXPECT_EQ(st.prefix_query_tokens, 410 + 407 + 400);
  EXPECT_EQ(st.prefix_hit_tokens, 400 + 384);
  EXPECT_NEAR(st.prefix_hit_rate, 784.0 / 1217.0, 1e-12);
  EXPECT_EQ(st.used_blocks, 26 + 1 + 1);  // shared blocks count once
  bm.check_invariants();

  // The recomputed last block duplicates a cached one: it stays out of the cache.
  bm.commit(3, std::span(system).subspan(384));
  bm.free(3);
  bm.check_invariants();
  bm.free(1);
  bm.free(2);
  st = bm.stats();
  EXPECT_EQ(st.used_blocks, 0);
  EXPECT_EQ(st.evictable_blocks, 25);  // the full blocks of `a`; partial tails went free
  bm.check_invariants();
  // Unreferenced cached blocks still serve hits.
  EXPECT_EQ(bm.allocate(4, b, 32), 400);
  EXPECT_EQ(bm.stats().evictable_blocks, 0);
  bm.check_invariants();
}

TEST(BlockManager, OnlyFullBlocksAreCached) {
  BlockManager bm(config(16, 16));
  const auto p = iota_tokens(20, 0);
  ASSERT_EQ(bm.allocate(1, p, 8), 0);
  bm.commit(1, p);
  ASSERT_EQ(bm.allocate(2, concat(p, iota_tokens(30, 500)), 8), 16);
  bm.free(1);
  bm.free(2);
  bm.check_invariants();
}

TEST(BlockManager, PrefixCacheOffMeansNoHits) {
  BlockManager bm(config(16, 4, AllocationMode::Dynamic, false));
  const auto p = iota_tokens(20, 0);
  ASSERT_EQ(bm.allocate(1, p, 8), 0);
  bm.commit(1, p);
  EXPECT_EQ(bm.allocate(2, p, 8), 0);
  bm.free(1);
  EXPECT_EQ(bm.stats().evictable_blocks, 0);
  EXPECT_EQ(bm.stats().prefix_query_tokens, 0);
  bm.check_invariants();
}

TEST(BlockManager, ForkSharesBlocksAndCopiesOnWrite) {
  BlockManager bm(config(16, 4));
  const auto p = iota_tokens(6, 0);
  ASSERT_EQ(bm.allocate(1, p, 8), 0);
  bm.commit(1, p);
  ASSERT_TRUE(bm.fork(1, 2));
  EXPECT_EQ(bm.block_table(1), bm.block_table(2));
  EXPECT_EQ(bm.stats().used_blocks, 2);
  bm.check_invariants();

  const int shared_partial = bm.block_table(1)[1];
  ASSERT_TRUE(bm.grow(2, 1));  // writes position 6 into the shared, partly filled block
  EXPECT_EQ(bm.block_table(2)[0], bm.block_table(1)[0]);  // the full block stays shared
  EXPECT_NE(bm.block_table(2)[1], shared_partial);
  EXPECT_EQ(bm.block_table(1)[1], shared_partial);
  const auto copies = bm.take_pending_copies();
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0], BlockCopy(shared_partial, bm.block_table(2)[1]));
  EXPECT_TRUE(bm.take_pending_copies().empty());
  ASSERT_TRUE(bm.grow(1, 1));  // now exclusive: written in place
  EXPECT_EQ(bm.block_table(1)[1], shared_partial);
  EXPECT_TRUE(bm.take_pending_copies().empty());
  bm.check_invariants();

  // A fork on a block boundary needs no copy.
  bm.commit(1, std::vector<int32_t>{6});
  ASSERT_TRUE(bm.grow(1, 1));
  bm.commit(1, std::vector<int32_t>{7});
  ASSERT_TRUE(bm.fork(1, 3));
  ASSERT_TRUE(bm.grow(3, 1));
  ASSERT_TRUE(bm.grow(1, 1));
  EXPECT_TRUE(bm.take_pending_copies().empty());
  EXPECT_NE(bm.block_table(3)[2], bm.block_table(1)[2]);
  bm.check_invariants();
  EXPECT_THROW(bm.fork(1, 4), Error);  // 1 has an uncomputed slot
  for (SeqId id : {1, 2, 3}) bm.free(id);
  EXPECT_EQ(bm.stats().used_blocks, 0);
  bm.check_invariants();
}

TEST(BlockManager, CopyIntoAFreedBlockIsDropped) {
  BlockManager bm(config(8, 4));
  const auto p = iota_tokens(5, 0);
  ASSERT_EQ(bm.allocate(1, p, 8), 0);
  bm.commit(1, p);
  ASSERT_TRUE(bm.fork(1, 2));
  ASSERT_TRUE(bm.grow(2, 1));
  bm.free(2);
  EXPECT_TRUE(bm.take_pending_copies().empty());
  bm.check_invariants();
}

TEST(BlockManager, StaticModeReservesUpFront) {
  BlockManager bm(config(16, 4, AllocationMode::Static));
  const auto p = iota_tokens(6, 0);
  ASSERT_EQ(bm.allocate(1, p, 10), 0);
  EXPECT_EQ(bm.block_table(1).size(), 4u);  // 16 tokens
  EXPECT_EQ(bm.blocks_needed(iota_tokens(6, 100), 10), 4);
  bm.commit(1, p);
  const int before = bm.stats().free_blocks;
  ASSERT_TRUE(bm.grow(1, 10));
  EXPECT_EQ(bm.stats().free_blocks, before);
  EXPECT_DOUBLE_EQ(bm.stats().fragmentation, 0.0);

  // A static fork keeps the full blocks shared and gets its own reservation for the rest.
  BlockManager st(config(8, 4, AllocationMode::Static));
  ASSERT_EQ(st.allocate(1, p, 6), 0);  // 3 blocks
  st.commit(1, p);
  ASSERT_TRUE(st.fork(1, 2));
  EXPECT_EQ(st.block_table(2)[0], st.block_table(1)[0]);
  EXPECT_NE(st.block_table(2)[1], st.block_table(1)[1]);
  const auto copies = st.take_pending_copies();
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0], BlockCopy(st.block_table(1)[1], st.block_table(2)[1]));
  EXPECT_EQ(st.stats().free_blocks, 8 - 5);
  EXPECT_TRUE(st.fork(1, 3));  // 2 more blocks of the 3 free
  EXPECT_FALSE(st.fork(1, 4));
  EXPECT_FALSE(st.has(4));
  st.check_invariants();
}

TEST(BlockManager, EvictsTailBlocksBeforeTheirPrefix) {
  BlockManager bm(config(4, 4));
  const auto x = iota_tokens(9, 0);  // two full blocks and a partial one
  ASSERT_EQ(bm.allocate(1, x, 4), 0);
  bm.commit(1, x);
  const auto tx = bm.block_table(1);
  bm.free(1);
  EXPECT_EQ(bm.stats().evictable_blocks, 2);
  EXPECT_EQ(bm.stats().free_blocks, 2);
  // Three blocks: the two free ones, then the least recently released: x's second block.
  ASSERT_EQ(bm.allocate(2, iota_tokens(12, 500), 4), 0);
  EXPECT_EQ(bm.block_table(2)[2], tx[1]);
  EXPECT_EQ(bm.stats().evictions, 1);
  bm.free(2);
  EXPECT_EQ(bm.allocate(3, x, 4), 4);  // x's first block survived
  bm.check_invariants();
}

TEST(BlockManager, EvictsLeastRecentlyUsedCachedBlocks) {
  BlockManager bm(config(6, 4));
  const auto x = iota_tokens(5, 0), y = iota_tokens(5, 100);
  ASSERT_EQ(bm.allocate(1, x, 4), 0);
  ASSERT_EQ(bm.allocate(2, y, 4), 0);
  bm.commit(1, x);
  bm.commit(2, y);
  const auto ty = bm.block_table(2);
  bm.free(1);
  bm.free(2);                          // LRU order: x's block, then y's
  ASSERT_EQ(bm.allocate(3, x, 4), 4);  // a hit makes x's block the most recently used
  bm.free(3);
  bm.check_invariants();
  ASSERT_EQ(bm.allocate(4, iota_tokens(20, 500), 4), 0);  // 4 free blocks, then evicts y's
  EXPECT_EQ(bm.block_table(4)[4], ty[0]);
  EXPECT_EQ(bm.stats().evictions, 1);
  bm.free(4);
  EXPECT_EQ(bm.allocate(5, x, 4), 4);
  EXPECT_EQ(bm.allocate(6, y, 4), 0);
  bm.check_invariants();
}

TEST(BlockManager, CommitPastSlotsThrows) {
  BlockManager bm(config(4, 4));
  ASSERT_EQ(bm.allocate(1, iota_tokens(3, 0), 4), 0);
  EXPECT_THROW(bm.commit(1, iota_tokens(4, 0)), Error);
  EXPECT_THROW(bm.free(2), Error);
}

// The report's comparison: a mixed-length workload where requests stop well before max_tokens.
TEST(BlockManager, StaticFragmentsFarMoreThanDynamic) {
  auto run = [](AllocationMode mode) {
    BlockManager bm(config(4096, 16, mode, false));
    std::mt19937 rng(7);
    const int max_tokens = 512;
    for (SeqId id = 0; id < 32; ++id) {
      const int prompt_len = std::uniform_int_distribution<int>(8, 512)(rng);
      const int generated = std::uniform_int_distribution<int>(1, max_tokens)(rng);
      const auto prompt = iota_tokens(prompt_len, 0);
      EXPECT_TRUE(bm.allocate(id, prompt, max_tokens).has_value());
      bm.commit(id, prompt);
      for (int g = 0; g < generated; ++g) {
        EXPECT_TRUE(bm.grow(id, 1));
        bm.commit(id, std::vector<int32_t>{g});
      }
    }
    bm.check_invariants();
    return bm.stats().fragmentation;
  };
  const double dynamic = run(AllocationMode::Dynamic), fixed = run(AllocationMode::Static);
  EXPECT_LT(dynamic, 0.05);
  EXPECT_GT(fixed, 0.25);
  EXPECT_GT(fixed, 5 * dynamic);
}

}  // namespace
}  // namespace ds
