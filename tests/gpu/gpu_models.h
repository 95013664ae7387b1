// A model on the CUDA backend for the GPU tests: loading, a prefill with hand-made metadata
// and greedy continuations through the engine.
#pragma once

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <vector>

#include "../hf_fixtures.h"
#include "backend/cuda/cuda_backend.h"
#include "engine/engine.h"
#include "model/loader.h"

namespace ds::test {

struct OnGpu {
  std::unique_ptr<Backend> backend;
  LoadedModel m;
};

inline OnGpu load_on_gpu(const std::filesystem::path& dir) {
  OnGpu g;
  BackendOptions bo;
  bo.gpu_memory_utilization = 0.05;
  g.backend = make_cuda_backend(bo, 0);
  g.m = load_model(dir, *g.backend, LoadOptions{});
  return g;
}

// One forward step of several sequences over a shared cache, metadata made by hand (device and
// host copies): sequence s owns cache blocks [s * blocks_per_seq, (s + 1) * blocks_per_seq) and
// runs tokens[s] at positions start[s] ... Returns the logits of every token of the step.
struct StepPart {
  std::vector<int32_t> tokens;
  int start = 0;  // position of tokens[0] (the cache holds positions [0, start) already)
};
inline std::vector<float> gpu_step(OnGpu& g, KvCache& cache, const std::vector<StepPart>& parts,
                                   int blocks_per_seq) {
  Backend& be = *g.backend;
  const int S = int(parts.size()), vocab = g.m.config.vocab, bs = cache.block_size();
  std::vector<int32_t> tokens, positions, slots, query_start{0}, context_lens, tables;
  int max_q = 0, max_ctx = 0;
  for (int s = 0; s < S; ++s) {
    const StepPart& p = parts[size_t(s)];
    for (size_t i = 0; i < p.tokens.size(); ++i) {
      const int pos = p.start + int(i);
      tokens.push_back(p.tokens[i]);
      positions.push_back(pos);
      slots.push_back((s * blocks_per_seq + pos / bs) * bs + pos % bs);
    }
    query_start.push_back(int32_t(tokens.size()));
    context_lens.push_back(p.start + int(p.tokens.size()));
    for (int b = 0; b < blocks_per_seq; ++b) tables.push_back(s * blocks_per_seq + b);
    max_q = std::max(max_q, int(p.tokens.size()));
    max_ctx = std::max(max_ctx, context_lens.back());
  }
  const int n = int(tokens.size());
  std::vector<int32_t> host;
  const auto put = [&](const std::vector<int32_t>& v) {
    const size_t at = host.size();
    host.insert(host.end(), v.begin(), v.end());
    return at;
  };
  const size_t o_tok = put(tokens), o_pos = put(positions), o_slot = put(slots),
               o_qs = put(query_start), o_ctx = put(context_lens), o_tab = put(tables);
  auto meta = be.alloc(host.size() * 4);
  be.upload(meta->view(DType::I32, {int64_t(host.size())}), host.data(), host.size() * 4);
  const int32_t* d = static_cast<const int32_t*>(meta->data());
  std::vector<int32_t> rows(size_t(n), 0);
  for (int i = 0; i < n; ++i) rows[size_t(i)] = i;
  ForwardInput in;
  in.tokens = tokens;
  in.device_tokens = d + o_tok;
  const auto fill = [&](AttentionMeta& m, const int32_t* base) {
    m.num_seqs = S;
    m.num_tokens = n;
    m.positions = base + o_pos;
    m.slot_mapping = base + o_slot;
    m.query_start = base + o_qs;
    m.context_lens = base + o_ctx;
    m.block_tables = base + o_tab;
    m.max_blocks_per_seq = blocks_per_seq;
    m.max_query_len = max_q;
    m.max_context_len = max_ctx;
  };
  fill(in.meta, d);
  fill(in.host_meta, host.data());
  in.logit_rows = rows;
  auto buf = be.alloc(size_t(n) * size_t(vocab) * 4);
  TensorView logits = buf->view(DType::F32, {n, vocab});
  g.m.model->forward(in, cache, logits);
  std::vector<float> out(size_t(n) * size_t(vocab));
  be.download(out.data(), logits, out.size() * 4);
  return out;
}

// Prefill logits of one prompt through the model on the GPU, metadata uploaded by hand.
inline std::vector<float> gpu_prefill(OnGpu& g, const std::vector<int32_t>& ids) {
  const int blocks = (int(ids.size()) + 15) / 16;
  KvCacheConfig kvc;
  kvc.num_blocks = blocks;
  kvc.dtype = DType::BF16;
  KvCache cache(*g.backend, g.m.config, kvc);
  return gpu_step(g, cache, {{ids, 0}}, blocks);
}

// Greedy continuations (EOS ignored) through the engine on the GPU (BF16 KV cache, CUDA
// graphs), submitted all at once or one after another, with the model's tokenizer: a padded
// vocabulary's ids past it are outputs without text, which must not end a request.
// max_batched_tokens > 0: the engine's token budget per step (small budgets chunk prompts, so
// concurrent requests decode while others prefill).
inline std::vector<std::vector<int32_t>> gpu_greedy(OnGpu& g,
                                                    const std::vector<std::vector<int32_t>>& ps,
                                                    int max_tokens, bool concurrent,
                                                    int max_batched_tokens = 0) {
  EngineConfig cfg;
  cfg.prefix_cache = false;
  cfg.kv_dtype = DType::BF16;
  cfg.kv_cache_tokens = 2048;
  if (max_batched_tokens > 0) cfg.max_num_batched_tokens = max_batched_tokens;
  Engine engine(*g.m.model, *g.backend, g.m.tokenizer.get(), cfg);
  auto out = greedy_generate(engine, ps, max_tokens, concurrent);
  std::printf("  engine: %d decode graphs captured\n", engine.graphs_captured());
  return out;
}

}  // namespace ds::test
