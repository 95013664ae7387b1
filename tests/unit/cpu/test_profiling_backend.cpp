// ProfilingBackend over the CPU backend: every op is forwarded (results bit-identical to the
// unwrapped backend), labels carry the op's shapes, ops group into steps at each embed, and
// the times are consistent (non-negative, summing to at most the step's wall time).
#include "backend/profiling_backend.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <thread>

namespace ds {
namespace {

constexpr int kVocab = 50, kHidden = 32, kHeads = 4, kKvHeads = 2, kHeadDim = 8, kFfn = 48;
constexpr int kBlock = 4, kExperts = 4, kTopK = 2, kExpertFfn = 6, kLatent = 8, kRopeDim = 4;

std::unique_ptr<Backend> cpu(int threads = 1) {
  BackendOptions o;
  o.threads = threads;
  return make_cpu_backend(o);
}

// Every input and output of one model-like step of `seqs` sequences with `q` new tokens each,
// all in host memory (the CPU backend's memory). Equal seeds give equal contents.
struct StepData {
  int seqs, q, T;
  std::map<std::string, std::vector<float>> f;  // F32 tensors by name
  std::vector<uint16_t> w_up_f16;               // an F16 weight [2 * kFfn, kHidden]
  std::vector<int32_t> ids, positions, query_start, context_lens, block_tables, slots;
  std::vector<int32_t> route_ids, argmax_ids, downloaded;
  AttentionMeta meta;
  PagedKv kv, latent;
  std::vector<ExpertWeights> experts;

  StepData(int num_seqs, int tokens_per_seq, uint32_t seed)
      : seqs(num_seqs), q(tokens_per_seq), T(num_seqs * tokens_per_seq) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 0.5f);
    auto randn = [&](const std::string& name, size_t n) {
      auto& v = f[name];
      v.resize(n);
      for (auto& x : v) x = nd(rng);
    };
    auto zeros = [&](const std::string& name, size_t n) { f[name].assign(n, 0.0f); };
    // Sequence s already holds 2 * s + 3 tokens; its q new ones follow.
    int max_ctx = 0;
    for (int s = 0; s < seqs; ++s) max_ctx = std::max(max_ctx, 2 * s + 3 + q);
    const int max_blocks = (max_ctx + kBlock - 1) / kBlock, num_blocks = seqs * max_blocks;
    query_start.push_back(0);
    for (int s = 0; s < seqs; ++s) {
      const int cached = 2 * s + 3;
      for (int j = 0; j < max_blocks; ++j) block_tables.push_back(s * max_blocks + j);
      for (int i = 0; i < q; ++i) {
        const int pos = cached + i;
        positions.push_back(pos);
        slots.push_back((s * max_blocks + pos / kBlock) * kBlock + pos % kBlock);
      }
      query_start.push_back(query_start.back() + q);
      context_lens.push_back(cached + q);
    }
    std::uniform_int_distribution<int> tok(0, kVocab - 1);
    for (int t = 0; t < T; ++t) ids.push_back(tok(rng));
    meta.num_seqs = seqs;
    meta.num_tokens = T;
    meta.query_start = query_start.data();
    meta.context_lens = context_lens.data();
    meta.block_tables = block_tables.data();
    meta.max_blocks_per_seq = max_blocks;
    meta.slot_mapping = slots.data();
    meta.positions = positions.data();
    meta.max_query_len = q;
    meta.max_context_len = max_ctx;

    const size_t S = size_t(num_blocks) * kBlock;  // cache slots
    randn("table", size_t(kVocab) * kHidden);
    randn("norm_w", kHidden);
    randn("wq", size_t(kHeads) * kHeadDim * kHidden);
    randn("wk", size_t(kKvHeads) * kHeadDim * kHidden);
    randn("wv", size_t(kKvHeads) * kHeadDim * kHidden);
    randn("wo", size_t(kHidden) * kHeads * kHeadDim);
    randn("w_down", size_t(kHidden) * kFfn);
    randn("k_cache", S * kKvHeads * kHeadDim);  // earlier tokens' keys and values
    randn("v_cache", S * kKvHeads * kHeadDim);
    randn("lat_cache", S * (kLatent + kRopeDim));
    randn("bmm_w", size_t(kHeads) * 5 * kHeadDim);
    randn("q_rope", size_t(T) * kHeads * kRopeDim);
    randn("router", size_t(kExperts) * kHidden);
    randn("experts", size_t(kExperts) * 3 * kExpertFfn * kHidden);
    for (int i = 0; i < 2 * kFfn * kHidden; ++i) w_up_f16.push_back(f32_to_fp16(nd(rng)));
    for (const char* out : {"x", "xn", "y", "moe_out", "copy"}) zeros(out, size_t(T) * kHidden);
    zeros("q", size_t(T) * kHeads * kHeadDim);
    zeros("k", size_t(T) * kKvHeads * kHeadDim);
    zeros("v", size_t(T) * kKvHeads * kHeadDim);
    zeros("attn", size_t(T) * kHeads * kHeadDim);
    zeros("gate_up", size_t(T) * 2 * kFfn);
    zeros("act", size_t(T) * kFfn);
    zeros("bmm_out", size_t(kHeads) * T * 5);
    zeros("lat_row", size_t(T) * (kLatent + kRopeDim));
    zeros("mla_out", size_t(T) * kHeads * kLatent);
    zeros("route_logits", size_t(T) * kExperts);
    zeros("route_w", size_t(T) * kTopK);
    zeros("logits", size_t(T) * kVocab);
    route_ids.assign(size_t(T) * kTopK, 0);
    argmax_ids.assign(size_t(T), 0);
    downloaded.assign(size_t(T), -1);

    kv = {f["k_cache"].data(),
          f["v_cache"].data(),
          DType::F32,
          num_blocks,
          kBlock,
          kKvHeads,
          kHeadDim};
    latent = {f["lat_cache"].data(), nullptr, DType::F32, num_blocks, kBlock, 1,
              kLatent + kRopeDim};
    float* e = f["experts"].data();
    const size_t per = size_t(kExpertFfn) * kHidden;
    for (int x = 0; x < kExperts; ++x, e += 3 * per)
      experts.push_back({view(e, {kExpertFfn, kHidden}), view(e + per, {kExpertFfn, kHidden}),
                         view(e + 2 * per, {kHidden, kExpertFfn})});
  }
  StepData(const StepData&) = delete;  // views point into this object

  static TensorView view(float* p, std::initializer_list<int64_t> d) {
    return TensorView::contiguous(p, DType::F32, d);
  }
  TensorView t(const std::string& name, std::initializer_list<int64_t> d) {
    return view(f.at(name).data(), d);
  }

  // The ops of a llama layer, then DeepSeek's, then the engine's sampling, in one step.
  void run(Backend& b) {
    const int64_t n = T;
    TensorView x = t("x", {n, kHidden}), xn = t("xn", {n, kHidden}), y = t("y", {n, kHidden});
    b.embed(t("table", {kVocab, kHidden}), ids.data(), T, x);
    b.rms_norm(x, t("norm_w", {kHidden}), 1e-5f, xn);
    b.matmul(xn, t("wq", {kHeads * kHeadDim, kHidden}), t("q", {n, kHeads * kHeadDim}));
    b.matmul(xn, t("wk", {kKvHeads * kHeadDim, kHidden}), t("k", {n, kKvHeads * kHeadDim}));
    b.matmul(xn, t("wv", {kKvHeads * kHeadDim, kHidden}), t("v", {n, kKvHeads * kHeadDim}));
    RopeParams rp;
    rp.rotary_dim = kHeadDim;
    b.rope(t("q", {n, kHeads, kHeadDim}), meta.positions, rp);
    b.rope(t("k", {n, kKvHeads, kHeadDim}), meta.positions, rp);
    b.store_kv(t("k", {n, kKvHeads, kHeadDim}), t("v", {n, kKvHeads, kHeadDim}), kv, meta);
    AttentionParams ap;
    ap.q = t("q", {n, kHeads, kHeadDim});
    ap.out = t("attn", {n, kHeads, kHeadDim});
    ap.kv = kv;
    ap.scale = 0.35f;
    b.attention(ap, meta);
    b.matmul(t("attn", {n, kHeads * kHeadDim}), t("wo", {kHidden, kHeads * kHeadDim}), y);
    b.add(x, y);
    b.matmul(xn, TensorView::contiguous(w_up_f16.data(), DType::F16, {2 * kFfn, kHidden}),
             t("gate_up", {n, 2 * kFfn}));
    b.silu_mul(t("gate_up", {n, 2 * kFfn}), t("act", {n, kFfn}));
    b.matmul(t("act", {n, kFfn}), t("w_down", {kHidden, kFfn}), y);
    b.add(x, y);
    // [H, T, d] views of the [T, H, d] query: heads as batches.
    TensorView qh = t("q", {kHeads, n, kHeadDim});
    qh.stride = {kHeadDim * 4, kHeads * kHeadDim * 4, 4, 0};
    b.batched_matmul(qh, t("bmm_w", {kHeads, 5, kHeadDim}), t("bmm_out", {kHeads, n, 5}));
    b.store_kv(t("lat_row", {n, 1, kLatent + kRopeDim}), TensorView{}, latent, meta);
    MlaAttentionParams mp;
    mp.q_latent = t("attn", {n, kHeads, kLatent});
    mp.q_rope = t("q_rope", {n, kHeads, kRopeDim});
    mp.out = t("mla_out", {n, kHeads, kLatent});
    mp.cache = latent;
    mp.kv_lora_rank = kLatent;
    mp.scale = 0.3f;
    b.mla_attention(mp, meta);
    b.matmul(xn, t("router", {kExperts, kHidden}), t("route_logits", {n, kExperts}));
    MoeRouteParams rt;
    rt.top_k = kTopK;
    TensorView rids = TensorView::contiguous(route_ids.data(), DType::I32, {n, kTopK});
    b.moe_route(t("route_logits", {n, kExperts}), rt, rids, t("route_w", {n, kTopK}));
    MoeFfnParams fp;
    fp.x = xn;
    fp.ids = rids;
    fp.weights = t("route_w", {n, kTopK});
    fp.experts = experts;
    fp.out = t("moe_out", {n, kHidden});
    b.moe_ffn(fp);
    b.copy(fp.out, t("copy", {n, kHidden}));
    b.matmul(x, t("table", {kVocab, kHidden}), t("logits", {n, kVocab}));
    TensorView am = TensorView::contiguous(argmax_ids.data(), DType::I32, {n});
    b.argmax(t("logits", {n, kVocab}), am);
    b.download(downloaded.data(), am, size_t(T) * 4);
  }
};

TEST(ProfilingBackend, ForwardsEveryOpWithIdenticalResults) {
  auto be = cpu();
  StepData plain(3, 1, 7), wrapped(3, 1, 7);
  plain.run(*be);
  ProfilingBackend prof(*be);
  EXPECT_EQ(prof.name(), be->name());
  EXPECT_EQ(prof.device(), be->device());
  EXPECT_FALSE(prof.supports_graphs());
  EXPECT_EQ(prof.supports(Op::MatMul, DType::Q4_1), be->supports(Op::MatMul, DType::Q4_1));
  wrapped.run(prof);
  for (const auto& [name, v] : plain.f) {
    const auto& w = wrapped.f.at(name);
    ASSERT_EQ(v.size(), w.size());
    EXPECT_EQ(std::memcmp(v.data(), w.data(), v.size() * 4), 0) << name;
  }
  EXPECT_EQ(plain.route_ids, wrapped.route_ids);
  EXPECT_EQ(plain.argmax_ids, wrapped.argmax_ids);
  EXPECT_EQ(plain.downloaded, wrapped.downloaded);
  EXPECT_EQ(wrapped.downloaded, wrapped.argmax_ids);
  // The step did real work: not every output stayed zero.
  for (const char* name : {"x", "attn", "mla_out", "moe_out", "copy", "bmm_out", "logits"})
    EXPECT_TRUE(std::any_of(wrapped.f[name].begin(), wrapped.f[name].end(), [](float a) {
      return a != 0.0f;
    })) << name;
}

std::map<std::string, OpTimingRow> by_label(const std::vector<OpTimingRow>& rows) {
  std::map<std::string, OpTimingRow> m;
  for (const auto& r : rows) m[r.label] = r;
  return m;
}

TEST(ProfilingBackend, LabelsShapesAndCountsCallsPerStep) {
  auto be = cpu();
  ProfilingBackend prof(*be);
  StepData d(3, 1, 11);
  d.run(prof);
  const OpProfile p = prof.profile();
  ASSERT_TRUE(p.step);
  EXPECT_EQ(p.backend, be->name());
  EXPECT_EQ(p.steps, 1);
  const StepProfile& s = *p.step;
  EXPECT_EQ(s.tokens, 3);
  EXPECT_TRUE(s.decode);
  EXPECT_EQ(s.seqs, 3);
  EXPECT_EQ(s.context, 3 + 2 * 2 + 1);  // the longest sequence: 7 cached + 1 new
  const auto ops = by_label(s.ops);
  const std::map<std::string, double> want = {
      {"embed T=3 [50,32] F32", 1},
      {"rms_norm [3,32]", 1},
      {"matmul [3,32]x[32,32] F32", 2},  // wq and wo (the attention output is [3,32] too)
      {"matmul [3,32]x[16,32] F32", 2},
      {"matmul [3,32]x[96,32] F16", 1},
      {"matmul [3,48]x[32,48] F32", 1},
      {"matmul [3,32]x[4,32] F32", 1},
      {"matmul [3,32]x[50,32] F32", 1},
      {"rope [3,4,8]", 1},
      {"rope [3,2,8]", 1},
      {"store_kv [3,2,8] F32", 1},
      {"store_kv [3,1,12] F32", 1},
      {"attention [3,4,8] kv[2,8] F32", 1},
      {"silu_mul [3,48]", 1},
      {"add [3,32]", 2},
      {"batched_matmul [4,3,8]x[4,5,8] F32", 1},
      {"mla_attention [3,4,8] rope 4 F32", 1},
      {"moe_route [3,4] k=2", 1},
      {"moe_ffn T=3 E=4 k=2 [6,32] F32", 1},
      {"copy [3,32] F32", 1},
      {"argmax [3,50]", 1},
      {"download", 1},
  };
  for (const auto& [label, calls] : want) {
    auto it = ops.find(label);
    ASSERT_NE(it, ops.end()) << label;
    EXPECT_EQ(it->second.calls, calls) << label;
  }
  EXPECT_EQ(ops.size(), want.size());
  EXPECT_EQ(ops.at("moe_ffn T=3 E=4 k=2 [6,32] F32").kind, "moe_ffn");
  // Kinds add their labels up.
  const auto kinds = by_label(s.kinds);
  EXPECT_EQ(kinds.at("matmul").calls, 8);
  EXPECT_EQ(kinds.at("store_kv").calls, 2);
  EXPECT_EQ(kinds.at("embed").calls, 1);
  double share = 0, us = 0;
  for (const auto& r : s.kinds) {
    share += r.share;
    us += r.us;
  }
  EXPECT_NEAR(share, 1.0, 1e-9);
  EXPECT_NEAR(us, s.op_ms * 1e3, 1e-6);
}

TEST(ProfilingBackend, GroupsStepsAtEachEmbedByTokensAndKind) {
  auto be = cpu();
  ProfilingBackend prof(*be);
  StepData decode(3, 1, 1), prefill(1, 5, 2), warm(2, 1, 3);
  // Ops before the first embed belong to no step; reset() drops what came before.
  prof.add(decode.t("x", {3, kHidden}), decode.t("y", {3, kHidden}));
  warm.run(prof);
  prof.reset();
  decode.run(prof);
  prefill.run(prof);
  decode.run(prof);
  decode.run(prof);
  const OpProfile p = prof.profile();
  EXPECT_EQ(p.steps, 4);
  ASSERT_EQ(p.groups.size(), 2u);
  EXPECT_EQ(p.groups[0].tokens, 3);
  EXPECT_TRUE(p.groups[0].decode);
  EXPECT_EQ(p.groups[0].steps, 3);
  EXPECT_EQ(p.groups[1].tokens, 5);
  EXPECT_FALSE(p.groups[1].decode);
  EXPECT_EQ(p.groups[1].steps, 1);
  ASSERT_TRUE(p.step);
  EXPECT_EQ(p.step->tokens, 3);
  EXPECT_EQ(p.step->steps, 3);
  // Per step, not summed over steps.
  EXPECT_EQ(by_label(p.step->ops).at("add [3,32]").calls, 2);
  // Picking the prefill group by its token count.
  const OpProfile pp = prof.profile(5);
  ASSERT_TRUE(pp.step);
  EXPECT_FALSE(pp.step->decode);
  EXPECT_EQ(pp.step->seqs, 1);
  EXPECT_EQ(by_label(pp.step->ops).count("embed T=5 [50,32] F32"), 1u);
  // After profile() closed the last step, ops until the next embed are not recorded.
  prof.add(decode.t("x", {3, kHidden}), decode.t("y", {3, kHidden}));
  EXPECT_EQ(prof.profile().steps, 4);
  prof.reset();
  const OpProfile empty = prof.profile();
  EXPECT_EQ(empty.steps, 0);
  EXPECT_FALSE(empty.step);
}

TEST(ProfilingBackend, TimesAreNonNegativeAndFitTheWallTime) {
  auto be = cpu();
  ProfilingBackend prof(*be);
  StepData d(3, 1, 5);
  for (int i = 0; i < 3; ++i) d.run(prof);
  const OpProfile p = prof.profile();
  ASSERT_TRUE(p.step);
  const StepProfile& s = *p.step;
  EXPECT_GT(s.op_ms, 0);
  EXPECT_LE(s.op_ms, s.wall_ms);
  for (const auto& r : s.ops) {
    EXPECT_GE(r.us, 0) << r.label;
    EXPECT_GE(r.share, 0) << r.label;
  }
  // Sorted by time, most first.
  for (size_t i = 1; i < s.ops.size(); ++i) EXPECT_GE(s.ops[i - 1].us, s.ops[i].us);
  // Host marks: the base Backend's clock, relative to the first mark.
  auto host = cpu();
  host->clear_marks();
  EXPECT_EQ(host->mark(), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(3));
  EXPECT_EQ(host->mark(), 1);
  const std::vector<double> t = host->mark_times_ms();
  ASSERT_EQ(t.size(), 2u);
  EXPECT_EQ(t[0], 0);
  EXPECT_GE(t[1], 3.0);
  host->clear_marks();
  EXPECT_TRUE(host->mark_times_ms().empty());
}

TEST(ProfilingBackend, TableListsTheTopLabels) {
  auto be = cpu();
  ProfilingBackend prof(*be);
  StepData d(3, 1, 9);
  d.run(prof);
  const OpProfile p = prof.profile();
  char* buf = nullptr;
  size_t len = 0;
  std::FILE* f = open_memstream(&buf, &len);
  print_op_profile(f, p, 3);
  std::fclose(f);
  const std::string all(buf, len);
  std::free(buf);
  const std::string text = all.substr(0, all.find("by kind"));  // the table rows
  EXPECT_NE(text.find("1 decode step(s) of 3 tokens"), std::string::npos) << text;
  EXPECT_NE(text.find(p.step->ops[0].label), std::string::npos) << text;
  EXPECT_EQ(text.find(p.step->ops[3].label + " "), std::string::npos) << text;
  EXPECT_NE(text.find("more labels"), std::string::npos) << text;
  EXPECT_NE(all.find("by kind: "), std::string::npos) << all;
}

}  // namespace
}  // namespace ds
