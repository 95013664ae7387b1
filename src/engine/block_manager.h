// Paged KV-cache bookkeeping: which cache blocks each sequence owns, shared prefixes,
// copy-on-write and a prefix cache of full blocks. Plain C++: it never touches K/V data; the
// engine performs the block copies it asks for.
#pragma once

#include <cstdint>
#include <list>
#include <optional>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "engine/request.h"

namespace ds {

enum class AllocationMode : uint8_t {
  Dynamic,  // paged: blocks are taken as tokens arrive
  Static,   // a sequence reserves prompt + max_new_tokens up front (naive deployments)
};

struct BlockManagerConfig {
  int num_blocks = 0;
  int block_size = 16;  // tokens per block
  AllocationMode mode = AllocationMode::Dynamic;
  bool enable_prefix_cache = true;
};

struct BlockManagerStats {
  int total_blocks = 0;
  int free_blocks = 0;       // never-cached or dropped blocks, ready to use
  int used_blocks = 0;       // referenced by at least one sequence
  int evictable_blocks = 0;  // cached full blocks nobody references; reusable until evicted
  double usage = 0;          // used_blocks / total_blocks
  // Over live sequences (a shared block counts once per sequence): slots reserved in their
  // blocks versus slots holding a token.
  int64_t reserved_slots = 0;
  int64_t used_slots = 0;
  double fragmentation = 0;         // (reserved - used) / reserved; 0 when nothing is reserved
  int64_t prefix_query_tokens = 0;  // prompt tokens looked up (recomputes after preemption too)
  int64_t prefix_hit_tokens = 0;    // of those, served from cached blocks
  double prefix_hit_rate = 0;       // hit / query tokens
  int64_t evictions = 0;            // cached blocks dropped to make room
};

// A (source block, destination block) copy of K/V that the engine must perform before the
// next forward (copy-on-write of a shared, partly filled block).
using BlockCopy = std::pair<int, int>;

class BlockManager {
 public:
  explicit BlockManager(const BlockManagerConfig& cfg);

  const BlockManagerConfig& config() const { return cfg_; }
  int block_size() const { return cfg_.block_size; }
  int num_blocks() const { return cfg_.num_blocks; }
  int blocks_for(int64_t tokens) const;  // blocks that hold `tokens` tokens

  // Blocks allocate() would take from the free and evictable pools (prefix hits excluded).
  int blocks_needed(std::span<const int32_t> prompt, int max_new_tokens) const;
  bool can_allocate(std::span<const int32_t> prompt, int max_new_tokens) const {
    return blocks_needed(prompt, max_new_tokens) <= num_available_blocks();
  }
  // Gives a new sequence the blocks it needs to start (dynamic: the prompt; static: prompt +
  // max_new_tokens), reusing cached full prefix blocks. Returns how many leading prompt tokens
  // are already computed: a multiple of block_size, always < prompt.size() so the last one is
  // recomputed for its logits. nullopt if it does not fit (nothing changed).
  std::optional<int> allocate(SeqId id, std::span<const int32_t> prompt, int max_new_tokens);

  // Room for n more token slots: new blocks when the table is full, and a copy-on-write of the
  // partly filled last block if another sequence shares it (recorded as a pending copy).
  bool can_grow(SeqId id, int n) const;
  bool grow(SeqId id, int n);  // false (nothing changed) if the blocks are not there

  // Reports tokens whose K/V are now computed, in order. A block that becomes full is hashed
  // (chained with its predecessor) and registered in the prefix cache.
  void commit(SeqId id, std::span<const int32_t> tokens);

  // The child shares the parent's blocks (the parent must have committed all its slots).
  // Static mode gives the child its own reservation past the shared full blocks; returns false
  // (nothing changed) if those blocks are not available. Dynamic mode always succeeds.
  bool fork(SeqId parent, SeqId child);

  // Drops the sequence's references: full cached blocks become evictable (the sequence's tail
  // first, since a prefix is likelier to be shared), others return to the free list.
  void free(SeqId id);

  // Copies recorded since the last call, in order; the engine performs them before the forward.
  std::vector<BlockCopy> take_pending_copies();

  bool has(SeqId id) const { return seqs_.count(id) != 0; }
  const std::vector<int32_t>& block_table(SeqId id) const;
  int num_slots(SeqId id) const;               // token positions that have a cache slot
  int num_committed(SeqId id) const;           // positions reported computed (incl. prefix hits)
  int64_t slot(SeqId id, int position) const;  // block * block_size + offset
  int num_available_blocks() const { return int(free_.size() + evictable_.size()); }
  // Blocks that free(id) would return to the pools (those no other sequence references).
  int num_exclusive_blocks(SeqId id) const;
  int num_sequences() const { return int(seqs_.size()); }

  BlockManagerStats stats() const;
  // Throws ds::Error naming the first violated invariant.
  void check_invariants() const;

 private:
  struct Block {
    int ref_count = 0;
    bool cached = false;  // registered in cache_ under `hash`
    uint64_t hash = 0;
    uint64_t parent_hash = 0;
    std::vector<int32_t> tokens;   // a cached block's tokens, compared on lookup (no false hits)
    std::list<int>::iterator lru;  // position in evictable_ while cached with no references
  };
  struct SeqBlocks {
    std::vector<int32_t> table;
    int len = 0;                   // positions with a slot
    int committed = 0;             // positions whose K/V are computed
    uint64_t chain = 0;            // hash of the last full committed block (root seed if none)
    std::vector<int32_t> partial;  // committed tokens of the block being filled
  };

  // Cached blocks that hold the longest prefix of `prompt` (leaving >= 1 token to compute).
  std::vector<int> lookup(std::span<const int32_t> prompt, uint64_t* chain) const;
  int take_block();            // from the free list, else evicts the least recently used
  void acquire_cached(int b);  // adds a reference to a cached block
  void release(int b);
  void register_full_block(int b, uint64_t hash, uint64_t parent, std::span<const int32_t> toks);
  SeqBlocks& seq(SeqId id);
  const SeqBlocks& seq(SeqId id) const;

  BlockManagerConfig cfg_;
  std::vector<Block> blocks_;
  std::vector<int> free_;                    // stack: the lowest ids come out first
  std::list<int> evictable_;                 // front = least recently released
  std::unordered_map<uint64_t, int> cache_;  // chained block hash -> block
  std::unordered_map<SeqId, SeqBlocks> seqs_;
  std::vector<BlockCopy> pending_copies_;
  int64_t query_tokens_ = 0, hit_tokens_ = 0, evictions_ = 0;
};

}  // namespace ds
