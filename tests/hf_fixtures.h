// Where the Hugging Face golden fixtures live (tests/fixtures/hf, made by
// tools/make_hf_fixtures.py), shared by the CPU golden tests and the GPU model tests.
#pragma once

#include <algorithm>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "backend/backend.h"
#include "engine/engine.h"
#include "model/loader.h"
#include "model/model.h"
#include "request_tokens.h"

namespace ds::test {

inline std::filesystem::path hf_root() {
  return std::filesystem::path(DS_FIXTURES_DIR) / "hf";
}

// Folder names of the fixtures that have a reference.json, sorted.
inline std::vector<std::string> hf_fixture_names() {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(hf_root(), ec))
    if (std::filesystem::exists(e.path() / "reference.json"))
      names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// A model on a 2-thread CPU backend with a one-sequence KV cache of kHarnessBlocks blocks
// (16 slots each), for forwards outside the engine.
constexpr int kHarnessBlocks = 16;  // 256 slots: a fixture prompt (<= 120) + 32 generated
struct CpuModel {
  std::unique_ptr<Backend> backend;
  LoadedModel m;
  std::unique_ptr<KvCache> cache;
};

// The cache is sized by the model's own config (rank 0's under tensor parallelism).
inline CpuModel load_cpu_model(const std::filesystem::path& path, const LoadOptions& lo,
                               int threads = 2) {
  CpuModel l;
  BackendOptions bo;
  bo.threads = threads;
  l.backend = make_cpu_backend(bo);
  l.m = load_model(path, *l.backend, lo);
  KvCacheConfig kvc;
  kvc.num_blocks = kHarnessBlocks;
  l.cache = std::make_unique<KvCache>(*l.backend, l.m.model->config(), kvc);
  return l;
}

inline CpuModel load_cpu_model(const std::filesystem::path& path, bool mla_expanded = false) {
  LoadOptions lo;
  lo.mla_expanded = mla_expanded;
  return load_cpu_model(path, lo);
}

// Forwards ids[start, start + count) of one sequence whose earlier tokens are in the cache
// (slot = position), returning the logits of each of those rows: [count, vocab].
inline std::vector<float> forward_rows(CpuModel& l, const std::vector<int32_t>& ids, int start,
                                       int count) {
  const int vocab = l.m.config.vocab;
  std::vector<int32_t> pos(static_cast<size_t>(count)), rows(static_cast<size_t>(count)),
      table(kHarnessBlocks);
  for (int i = 0; i < count; ++i) {
    pos[size_t(i)] = start + i;
    rows[size_t(i)] = i;
  }
  for (int b = 0; b < kHarnessBlocks; ++b) table[size_t(b)] = b;
  const int32_t qs[2] = {0, count}, ctx[1] = {start + count};
  ForwardInput in;
  in.tokens = std::span(ids).subspan(size_t(start), size_t(count));
  in.meta.num_seqs = 1;
  in.meta.num_tokens = count;
  in.meta.query_start = qs;
  in.meta.context_lens = ctx;
  in.meta.block_tables = table.data();
  in.meta.max_blocks_per_seq = kHarnessBlocks;
  in.meta.slot_mapping = pos.data();
  in.meta.positions = pos.data();
  in.meta.max_query_len = count;
  in.meta.max_context_len = start + count;
  in.logit_rows = rows;
  auto buf = l.backend->alloc(size_t(count) * size_t(vocab) * sizeof(float));
  TensorView logits = buf->view(DType::F32, {count, vocab});
  l.m.model->forward(in, *l.cache, logits);
  l.backend->synchronize();
  std::vector<float> out(size_t(count) * size_t(vocab));
  l.backend->download(out.data(), logits, out.size() * sizeof(float));
  return out;
}

// One forward of a whole prompt from an empty cache: [n, vocab].
inline std::vector<float> prefill_rows(CpuModel& l, const std::vector<int32_t>& ids) {
  return forward_rows(l, ids, 0, int(ids.size()));
}

// A greedy request for `max_tokens` tokens that ignores EOS.
inline EngineRequest greedy_request(const std::vector<int32_t>& prompt, int max_tokens) {
  EngineRequest r;
  r.prompt = prompt;
  r.max_tokens = max_tokens;
  r.sampling.temperature = 0;
  r.ignore_eos = true;
  return r;
}

// Greedy continuations (EOS ignored) of `prompts` on `engine`: submitted all at once
// (concurrent) or one after another.
inline std::vector<std::vector<int32_t>> greedy_generate(
    Engine& engine, const std::vector<std::vector<int32_t>>& prompts, int max_tokens,
    bool concurrent) {
  auto request = [&](const std::vector<int32_t>& p) { return greedy_request(p, max_tokens); };
  std::vector<std::vector<int32_t>> out(prompts.size());
  if (concurrent) {
    // Held admission: the requests start in one step, whatever the engine thread's timing.
    std::vector<std::shared_ptr<RequestHandle>> hs;
    engine.hold_admission(true);
    for (const auto& p : prompts) hs.push_back(engine.submit(request(p)));
    engine.hold_admission(false);
    for (size_t i = 0; i < hs.size(); ++i) out[i] = collect_tokens(*hs[i]);
  } else {
    for (size_t i = 0; i < prompts.size(); ++i)
      out[i] = collect_tokens(*engine.submit(request(prompts[i])));
  }
  return out;
}

}  // namespace ds::test
