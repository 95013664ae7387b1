#include "engine/decode_graphs.h"

#include <algorithm>

#include "core/error.h"
#include "core/log.h"

namespace ds {

DecodeGraphs::DecodeGraphs(Backend& backend, Model& model, KvCache& cache,
                           const DecodeGraphConfig& cfg)
    : be_(backend), model_(model), cache_(cache), cfg_(cfg) {
  DS_CHECK(cfg.max_blocks_per_seq > 0, "decode graphs need a block-table width");
}

bool DecodeGraphs::eligible(const StepBatch& b) {
  const int n = b.num_seqs();
  return n > 0 && int(b.tokens.size()) == n && int(b.logit_rows.size()) == n;
}

int DecodeGraphs::bucket_for(int n) const {
  for (int B : {1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 320, 384, 448, 512})
    if (B >= n) return B <= cfg_.max_batch ? B : 0;
  return 0;
}

DecodeGraphs::Bucket& DecodeGraphs::bucket(int B) {
  auto it = buckets_.find(B);
  if (it != buckets_.end()) return it->second;
  Bucket& k = buckets_[B];
  const int W = cfg_.max_blocks_per_seq;
  // tokens[B] positions[B] query_start[B+1] context_lens[B] block_tables[B*W] slots[B]
  k.host.assign(size_t(B) * (5 + size_t(W)) + 1, 0);
  k.meta = be_.alloc(k.host.size() * 4);
  k.logit_rows.resize(size_t(B));
  for (int i = 0; i < B; ++i) k.logit_rows[size_t(i)] = i;
  const int32_t* base = static_cast<const int32_t*>(k.meta->data());
  int32_t* hb = k.host.data();
  AttentionMeta& m = k.input.meta;
  AttentionMeta& h = k.input.host_meta;
  m.num_seqs = h.num_seqs = B;
  m.num_tokens = h.num_tokens = B;
  m.max_blocks_per_seq = h.max_blocks_per_seq = W;
  m.max_query_len = h.max_query_len = 1;
  m.max_context_len = h.max_context_len = W * cache_.block_size();
  const size_t tok = 0, pos = size_t(B), qs = 2 * size_t(B), ctx = 3 * size_t(B) + 1,
               bt = 4 * size_t(B) + 1, sm = bt + size_t(B) * size_t(W);
  k.input.device_tokens = base + tok;
  k.input.tokens = std::span<const int32_t>(hb + tok, size_t(B));
  m.positions = base + pos;
  h.positions = hb + pos;
  m.query_start = base + qs;
  h.query_start = hb + qs;
  m.context_lens = base + ctx;
  h.context_lens = hb + ctx;
  m.block_tables = base + bt;
  h.block_tables = hb + bt;
  m.slot_mapping = base + sm;
  h.slot_mapping = hb + sm;
  k.input.logit_rows = k.logit_rows;
  return k;
}

// Copies the step into the bucket's host image; sequences past the batch are padding: token 0
// at position 0 with a one-token context in block 0 (read, never written: slot -1).
void DecodeGraphs::fill(Bucket& k, int B, const StepBatch* b) {
  const int n = b ? b->num_seqs() : 0, W = cfg_.max_blocks_per_seq;
  AttentionMeta& h = k.input.host_meta;
  int32_t* tokens = const_cast<int32_t*>(k.input.tokens.data());
  int32_t* positions = const_cast<int32_t*>(h.positions);
  int32_t* qs = const_cast<int32_t*>(h.query_start);
  int32_t* ctx = const_cast<int32_t*>(h.context_lens);
  int32_t* bt = const_cast<int32_t*>(h.block_tables);
  int32_t* sm = const_cast<int32_t*>(h.slot_mapping);
  for (int i = 0; i <= B; ++i) qs[i] = i;
  std::fill(bt, bt + size_t(B) * size_t(W), 0);
  for (int i = 0; i < B; ++i) {
    if (i < n) {
      tokens[i] = b->tokens[size_t(i)];
      positions[i] = b->positions[size_t(i)];
      ctx[i] = b->context_lens[size_t(i)];
      sm[i] = b->slot_mapping[size_t(i)];
      const int w = b->max_blocks_per_seq;
      for (int j = 0; j < std::min(w, W); ++j) {
        const int32_t blk = b->block_tables[size_t(i) * size_t(w) + size_t(j)];
        bt[size_t(i) * size_t(W) + size_t(j)] = blk < 0 ? 0 : blk;
      }
    } else {
      tokens[i] = 0;
      positions[i] = 0;
      ctx[i] = 1;
      sm[i] = -1;
    }
  }
  be_.upload(k.meta->view(DType::I32, {int64_t(k.host.size())}), k.host.data(), k.host.size() * 4);
}

bool DecodeGraphs::run(const StepBatch& b, const TensorView& logits) {
  if (disabled_ || !be_.supports_graphs() || !eligible(b)) return false;
  if (b.max_blocks_per_seq > cfg_.max_blocks_per_seq) return false;
  const int n = b.num_seqs(), B = bucket_for(n);
  if (B == 0 || logits.shape[0] < B) return false;
  Bucket& k = bucket(B);
  const TensorView out = logits.slice_rows(0, B);
  if (be_.alloc_epoch() != epoch_) {
    // Something was (re)allocated since the graphs were captured: they may point at memory
    // that moved. Run once eagerly at this size (growing any scratch it needs), recapture.
    be_.reset_graphs();
    graphs_.clear();
    fill(k, B, &b);
    model_.forward(k.input, cache_, out);
    epoch_ = be_.alloc_epoch();
    return true;
  }
  fill(k, B, &b);
  auto g = graphs_.find(B);
  if (g == graphs_.end()) {
    int id = -1;
    be_.begin_capture();
    try {
      model_.forward(k.input, cache_, out);
      id = be_.end_capture();
    } catch (const std::exception& e) {
      try {
        be_.end_capture();
      } catch (...) {
      }
      log_warn(std::string("decode graph capture failed, running eagerly from now on: ") +
               e.what());
      disabled_ = true;
      model_.forward(k.input, cache_, out);
      return true;
    }
    if (be_.alloc_epoch() != epoch_) {  // the capture itself allocated: not replayable
      be_.reset_graphs();
      graphs_.clear();
      epoch_ = be_.alloc_epoch();
      model_.forward(k.input, cache_, out);
      return true;
    }
    g = graphs_.emplace(B, id).first;
    const int pieces = be_.graph_pieces(id);
    log_info("captured a decode graph for batch " + std::to_string(B) +
             (pieces > 1 ? " (" + std::to_string(pieces) + " pieces)" : ""));
  }
  be_.replay(g->second);
  return true;
}

}  // namespace ds
