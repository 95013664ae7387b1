#include "model/accuracy.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace ds {

std::vector<float> prefill_logits(Model& model, Backend& be, const ModelConfig& cfg,
                                  const std::vector<int32_t>& ids, DType kv_dtype) {
  const int n = int(ids.size()), vocab = cfg.vocab, blocks = (n + 15) / 16;
  DS_CHECK(n > 0, "prefill_logits: no tokens");
  KvCacheConfig kvc;
  kvc.num_blocks = blocks;
  kvc.dtype = kv_dtype;
  KvCache cache(be, cfg, kvc);
  // tokens[n] positions[n] query_start[2] context_lens[1] block_table[blocks], uploaded so
  // the same metadata serves a device backend.
  std::vector<int32_t> host(ids.begin(), ids.end());
  for (int i = 0; i < n; ++i) host.push_back(i);
  host.insert(host.end(), {0, n, n});
  for (int b = 0; b < blocks; ++b) host.push_back(b);
  auto meta = be.alloc(host.size() * 4);
  be.upload(meta->view(DType::I32, {int64_t(host.size())}), host.data(), host.size() * 4);
  std::vector<int32_t> rows(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) rows[size_t(i)] = i;
  auto fill = [&](AttentionMeta& m, const int32_t* d) {
    m.num_seqs = 1;
    m.num_tokens = n;
    m.positions = d + n;
    m.slot_mapping = d + n;  // slot = position
    m.query_start = d + 2 * n;
    m.context_lens = d + 2 * n + 2;
    m.block_tables = d + 2 * n + 3;
    m.max_blocks_per_seq = blocks;
    m.max_query_len = n;
    m.max_context_len = n;
  };
  ForwardInput in;
  in.tokens = ids;
  in.device_tokens = static_cast<const int32_t*>(meta->data());
  fill(in.meta, static_cast<const int32_t*>(meta->data()));
  fill(in.host_meta, host.data());
  in.logit_rows = rows;
  auto buf = be.alloc(size_t(n) * size_t(vocab) * 4);
  TensorView logits = buf->view(DType::F32, {n, vocab});
  model.forward(in, cache, logits);
  be.synchronize();
  std::vector<float> out(size_t(n) * size_t(vocab));
  be.download(out.data(), logits, out.size() * 4);
  return out;
}

std::vector<int32_t> greedy_sequence(Model& model, Backend& be, const ModelConfig& cfg,
                                     std::vector<int32_t> prompt, int n, DType kv_dtype) {
  for (int i = 0; i < n; ++i) {
    const auto l = prefill_logits(model, be, cfg, prompt, kv_dtype);
    const auto last = l.end() - cfg.vocab;
    prompt.push_back(int32_t(std::max_element(last, l.end()) - last));
  }
  return prompt;
}

void compare_logits(const std::vector<float>& ref, const std::vector<float>& var, int vocab,
                    AccuracyStats& s) {
  DS_CHECK(ref.size() == var.size() && ref.size() % size_t(vocab) == 0,
           "compare_logits: shapes differ");
  for (size_t r = 0; r < ref.size() / size_t(vocab); ++r) {
    const float* a = ref.data() + r * size_t(vocab);
    const float* b = var.data() + r * size_t(vocab);
    const auto [lo, hi] = std::minmax_element(a, a + vocab);
    double diff = 0;
    for (int v = 0; v < vocab; ++v) diff = std::max(diff, std::fabs(double(b[v]) - a[v]));
    s.max_abs_diff = std::max(s.max_abs_diff, diff);
    if (*hi > *lo) s.max_rel_diff = std::max(s.max_rel_diff, diff / (double(*hi) - *lo));
    s.agree += (std::max_element(a, a + vocab) - a) == (std::max_element(b, b + vocab) - b);
    ++s.positions;
  }
}

}  // namespace ds
