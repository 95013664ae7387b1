#include "engine/block_manager.h"

#include <algorithm>
#include <string>

#include "core/error.h"

namespace ds {
namespace {

constexpr uint64_t kRootHash = 0x6a09e667f3bcc908ull;  // parent hash of a sequence's first block

uint64_t mix(uint64_t x) {  // splitmix64 finalizer
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Chained: a block's hash covers every token before it, so equal hashes mean equal prefixes.
uint64_t hash_block(uint64_t parent, std::span<const int32_t> tokens) {
  uint64_t h = mix(parent + 0x9e3779b97f4a7c15ull);
  for (int32_t t : tokens) h = mix(h + uint32_t(t) + 0x9e3779b97f4a7c15ull);
  return h;
}

[[noreturn]] void violated(const std::string& what) {
  throw Error("block manager invariant violated: " + what);
}

}  // namespace

BlockManager::BlockManager(const BlockManagerConfig& cfg) : cfg_(cfg) {
  DS_CHECK(cfg.num_blocks > 0, "the KV cache needs at least one block");
  DS_CHECK(cfg.block_size > 0, "block_size must be positive");
  blocks_.resize(size_t(cfg.num_blocks));
  free_.reserve(size_t(cfg.num_blocks));
  for (int b = cfg.num_blocks - 1; b >= 0; --b) free_.push_back(b);
}

int BlockManager::blocks_for(int64_t tokens) const {
  return int((tokens + cfg_.block_size - 1) / cfg_.block_size);
}

BlockManager::SeqBlocks& BlockManager::seq(SeqId id) {
  auto it = seqs_.find(id);
  DS_CHECK(it != seqs_.end(), "unknown sequence " + std::to_string(id));
  return it->second;
}

const BlockManager::SeqBlocks& BlockManager::seq(SeqId id) const {
  auto it = seqs_.find(id);
  DS_CHECK(it != seqs_.end(), "unknown sequence " + std::to_string(id));
  return it->second;
}

std::vector<int> BlockManager::lookup(std::span<const int32_t> prompt, uint64_t* chain) const {
  std::vector<int> hits;
  uint64_t h = kRootHash;
  if (cfg_.enable_prefix_cache) {
    const size_t bs = size_t(cfg_.block_size);
    const size_t max_blocks = (prompt.size() - 1) / bs;  // the last token is always recomputed
    for (size_t i = 0; i < max_blocks; ++i) {
      const auto toks = prompt.subspan(i * bs, bs);
      const uint64_t next = hash_block(h, toks);
      auto it = cache_.find(next);
      if (it == cache_.end()) break;
      const Block& b = blocks_[size_t(it->second)];
      if (b.parent_hash != h || !std::equal(toks.begin(), toks.end(), b.tokens.begin())) break;
      hits.push_back(it->second);
      h = next;
    }
  }
  *chain = h;
  return hits;
}

int BlockManager::blocks_needed(std::span<const int32_t> prompt, int max_new_tokens) const {
  DS_CHECK(!prompt.empty(), "empty prompt");
  uint64_t chain = 0;
  const std::vector<int> hits = lookup(prompt, &chain);
  const int64_t tokens =
      int64_t(prompt.size()) + (cfg_.mode == AllocationMode::Static ? max_new_tokens : 0);
  int n = blocks_for(tokens) - int(hits.size());
  // An unreferenced hit leaves the evictable pool, so it costs the pool a block too.
  for (int b : hits) n += blocks_[size_t(b)].ref_count == 0;
  return n;
}

int BlockManager::take_block() {
  int b;
  if (!free_.empty()) {
    b = free_.back();
    free_.pop_back();
  } else {
    DS_CHECK(!evictable_.empty(), "out of KV blocks");
    b = evictable_.front();
    evictable_.pop_front();
    Block& blk = blocks_[size_t(b)];
    cache_.erase(blk.hash);
    blk.cached = false;
    blk.tokens.clear();
    ++evictions_;
  }
  blocks_[size_t(b)].ref_count = 1;
  return b;
}

void BlockManager::acquire_cached(int b) {
  Block& blk = blocks_[size_t(b)];
  if (blk.ref_count == 0) evictable_.erase(blk.lru);
  ++blk.ref_count;
}

void BlockManager::release(int b) {
  Block& blk = blocks_[size_t(b)];
  DS_CHECK(blk.ref_count > 0, "releasing unreferenced block " + std::to_string(b));
  if (--blk.ref_count > 0) return;
  if (blk.cached) {
    blk.lru = evictable_.insert(evictable_.end(), b);
  } else {
    free_.push_back(b);
  }
  // A copy into a block nobody holds any more is moot (and the block may be reused this step).
  std::erase_if(pending_copies_, [b](const BlockCopy& c) { return c.second == b; });
}

std::optional<int> BlockManager::allocate(SeqId id, std::span<const int32_t> prompt,
                                          int max_new_tokens) {
  DS_CHECK(!has(id), "sequence " + std::to_string(id) + " already has blocks");
  DS_CHECK(!prompt.empty(), "empty prompt");
  DS_CHECK(max_new_tokens >= 0, "negative max_new_tokens");
  if (!can_allocate(prompt, max_new_tokens)) return std::nullopt;
  SeqBlocks s;
  const std::vector<int> hits = lookup(prompt, &s.chain);
  const int64_t tokens =
      int64_t(prompt.size()) + (cfg_.mode == AllocationMode::Static ? max_new_tokens : 0);
  for (int b : hits) {
    acquire_cached(b);
    s.table.push_back(b);
  }
  while (int64_t(s.table.size()) * cfg_.block_size < tokens) s.table.push_back(take_block());
  const int computed = int(hits.size()) * cfg_.block_size;
  s.len = int(prompt.size());
  s.committed = computed;
  if (cfg_.enable_prefix_cache) {
    query_tokens_ += int64_t(prompt.size());
    hit_tokens_ += computed;
  }
  seqs_.emplace(id, std::move(s));
  return computed;
}

bool BlockManager::can_grow(SeqId id, int n) const {
  DS_CHECK(n >= 0, "negative growth");
  const SeqBlocks& s = seq(id);
  int need = std::max(0, blocks_for(int64_t(s.len) + n) - int(s.table.size()));
  const bool cow = n > 0 && s.len % cfg_.block_size != 0 &&
                   blocks_[size_t(s.table[size_t(s.len / cfg_.block_size)])].ref_count > 1;
  need += cow;
  return need <= num_available_blocks();
}

bool BlockManager::grow(SeqId id, int n) {
  if (!can_grow(id, n)) return false;
  if (n == 0) return true;
  SeqBlocks& s = seq(id);
  if (s.len % cfg_.block_size != 0) {
    int32_t& last = s.table[size_t(s.len / cfg_.block_size)];
    if (blocks_[size_t(last)].ref_count > 1) {  // shared partial block: copy before writing
      const int dst = take_block();
      pending_copies_.emplace_back(last, dst);
      release(last);
      last = dst;
    }
  }
  s.len += n;
  while (int64_t(s.table.size()) * cfg_.block_size < s.len) s.table.push_back(take_block());
  return true;
}

void BlockManager::register_full_block(int b, uint64_t hash, uint64_t parent,
                                       std::span<const int32_t> toks) {
  Block& blk = blocks_[size_t(b)];
  if (blk.cached || cache_.count(hash)) return;  // an identical block is already cached
  blk.cached = true;
  blk.hash = hash;
  blk.parent_hash = parent;
  blk.tokens.assign(toks.begin(), toks.end());
  cache_.emplace(hash, b);
}

void BlockManager::commit(SeqId id, std::span<const int32_t> tokens) {
  SeqBlocks& s = seq(id);
  DS_CHECK(s.committed + int64_t(tokens.size()) <= s.len,
           "sequence " + std::to_string(id) + " commits tokens past its slots");
  const size_t bs = size_t(cfg_.block_size);
  for (int32_t t : tokens) {
    s.partial.push_back(t);
    ++s.committed;
    if (s.partial.size() < bs) continue;
    if (cfg_.enable_prefix_cache) {
      const uint64_t h = hash_block(s.chain, s.partial);
      register_full_block(s.table[size_t(s.committed) / bs - 1], h, s.chain, s.partial);
      s.chain = h;
    }
    s.partial.clear();
  }
}

bool BlockManager::fork(SeqId parent, SeqId child) {
  DS_CHECK(!has(child), "sequence " + std::to_string(child) + " already has blocks");
  const SeqBlocks& p = seq(parent);
  DS_CHECK(p.committed == p.len, "fork of a sequence with uncomputed slots");
  SeqBlocks c = p;
  if (cfg_.mode == AllocationMode::Dynamic) {
    for (int32_t b : c.table) ++blocks_[size_t(b)].ref_count;
  } else {
    // Share the full blocks; the partial block and the rest of the reservation are the child's.
    const size_t full = size_t(p.len / cfg_.block_size);
    if (int(p.table.size() - full) > num_available_blocks()) return false;
    for (size_t i = 0; i < c.table.size(); ++i) {
      if (i < full) {
        ++blocks_[size_t(c.table[i])].ref_count;
        continue;
      }
      c.table[i] = take_block();
      if (i == full && p.len % cfg_.block_size != 0)
        pending_copies_.emplace_back(p.table[i], c.table[i]);
    }
  }
  seqs_.emplace(child, std::move(c));
  return true;
}

void BlockManager::free(SeqId id) {
  auto it = seqs_.find(id);
  DS_CHECK(it != seqs_.end(), "unknown sequence " + std::to_string(id));
  const std::vector<int32_t> table = std::move(it->second.table);
  seqs_.erase(it);
  for (auto b = table.rbegin(); b != table.rend(); ++b) release(*b);
}

std::vector<BlockCopy> BlockManager::take_pending_copies() {
  return std::exchange(pending_copies_, {});
}

const std::vector<int32_t>& BlockManager::block_table(SeqId id) const {
  return seq(id).table;
}
int BlockManager::num_slots(SeqId id) const {
  return seq(id).len;
}
int BlockManager::num_committed(SeqId id) const {
  return seq(id).committed;
}

int64_t BlockManager::slot(SeqId id, int position) const {
  const SeqBlocks& s = seq(id);
  DS_CHECK(position >= 0 && position < s.len, "position " + std::to_string(position) +
                                                  " has no slot in sequence " + std::to_string(id));
  return int64_t(s.table[size_t(position / cfg_.block_size)]) * cfg_.block_size +
         position % cfg_.block_size;
}

int BlockManager::num_exclusive_blocks(SeqId id) const {
  int n = 0;
  for (int32_t b : seq(id).table) n += blocks_[size_t(b)].ref_count == 1;
  return n;
}

BlockManagerStats BlockManager::stats() const {
  BlockManagerStats st;
  st.total_blocks = cfg_.num_blocks;
  st.free_blocks = int(free_.size());
  st.evictable_blocks = int(evictable_.size());
  st.used_blocks = st.total_blocks - st.free_blocks - st.evictable_blocks;
  st.usage = double(st.used_blocks) / st.total_blocks;
  for (const auto& [id, s] : seqs_) {
    st.reserved_slots += int64_t(s.table.size()) * cfg_.block_size;
    st.used_slots += s.len;
  }
  if (st.reserved_slots > 0)
    st.fragmentation = double(st.reserved_slots - st.used_slots) / double(st.reserved_slots);
  st.prefix_query_tokens = query_tokens_;
  st.prefix_hit_tokens = hit_tokens_;
  if (query_tokens_ > 0) st.prefix_hit_rate = double(hit_tokens_) / double(query_tokens_);
  st.evictions = evictions_;
  return st;
}

void BlockManager::check_invariants() const {
  const size_t total = blocks_.size();
  const size_t bs = size_t(cfg_.block_size);
  std::vector<int> refs(total, 0);
  for (const auto& [id, s] : seqs_) {
    const std::string who = "sequence " + std::to_string(id);
    for (int32_t b : s.table) {
      if (b < 0 || size_t(b) >= total) violated(who + " holds block id " + std::to_string(b));
      ++refs[size_t(b)];
    }
    if (s.table.size() * bs < size_t(s.len)) violated(who + " has slots past its blocks");
    if (cfg_.mode == AllocationMode::Dynamic && int(s.table.size()) != blocks_for(s.len))
      violated(who + " holds blocks it does not use (dynamic mode)");
    if (s.committed < 0 || s.committed > s.len) violated(who + " committed past its slots");
    if (s.partial.size() != size_t(s.committed) % bs)
      violated(who + " partial block does not match its committed count");
  }
  enum : uint8_t { kNone, kFree, kEvictable };
  std::vector<uint8_t> where(total, kNone);
  for (int b : free_) {
    if (b < 0 || size_t(b) >= total) violated("free list holds block id " + std::to_string(b));
    if (where[size_t(b)] != kNone) violated("block " + std::to_string(b) + " listed twice");
    where[size_t(b)] = kFree;
    if (blocks_[size_t(b)].cached) violated("free block " + std::to_string(b) + " is cached");
  }
  for (auto it = evictable_.begin(); it != evictable_.end(); ++it) {
    const int b = *it;
    if (b < 0 || size_t(b) >= total) violated("LRU list holds block id " + std::to_string(b));
    if (where[size_t(b)] != kNone) violated("block " + std::to_string(b) + " listed twice");
    where[size_t(b)] = kEvictable;
    if (!blocks_[size_t(b)].cached)
      violated("evictable block " + std::to_string(b) + " is not cached");
    if (blocks_[size_t(b)].lru != it) violated("block " + std::to_string(b) + " LRU link broken");
  }
  size_t used = 0;
  for (size_t b = 0; b < total; ++b) {
    const Block& blk = blocks_[b];
    const std::string name = "block " + std::to_string(b);
    if (blk.ref_count != refs[b])
      violated(name + " has refcount " + std::to_string(blk.ref_count) + " but " +
               std::to_string(refs[b]) + " table entries");
    if (blk.ref_count > 0 && where[b] != kNone) violated(name + " is referenced and pooled");
    if (blk.ref_count == 0 && where[b] == kNone) violated(name + " is leaked");
    used += blk.ref_count > 0;
    if (blk.cached) {
      auto it = cache_.find(blk.hash);
      if (it == cache_.end() || it->second != int(b)) violated(name + " missing from the cache");
      if (blk.tokens.size() != bs) violated(name + " cached with a partial token list");
    }
  }
  for (const auto& [h, b] : cache_)
    if (b < 0 || size_t(b) >= total || !blocks_[size_t(b)].cached || blocks_[size_t(b)].hash != h)
      violated("cache entry points at block " + std::to_string(b) + " of another hash");
  if (used + free_.size() + evictable_.size() != total)
    violated("used + free + evictable != total blocks");
  for (const auto& [src, dst] : pending_copies_)
    if (dst < 0 || size_t(dst) >= total || blocks_[size_t(dst)].ref_count == 0)
      violated("pending copy into unowned block " + std::to_string(dst));
}

}  // namespace ds
