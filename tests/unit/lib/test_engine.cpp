// The engine on the real SmolLM2 model: batched equals alone (also with tiny prefill chunks
// and a cache small enough to force preemptions), prefix caching, cancellation, rejection,
// and a latency-critical request's TTFT under a saturating batch load.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>
#include <unordered_map>

#include "../../hf_fixtures.h"
#include "../tokenizer/tokenizer_test_util.h"
#include "engine/engine.h"
#include "model/loader.h"
#include "tokenizer/unicode.h"

namespace ds {
namespace {

struct Fixture {
  std::unique_ptr<Backend> backend;
  LoadedModel m;
  std::vector<std::vector<int32_t>> prompts;  // 32 prompts of varied lengths
};

Fixture* fixture() {
  static Fixture* f = [] {
    const char* path = std::getenv("DS_SMOLLM2_GGUF");
    if (!path) return static_cast<Fixture*>(nullptr);
    auto* f = new Fixture;
    BackendOptions bo;
    bo.threads = 2;
    f->backend = make_cpu_backend(bo);
    f->m = load_model(path, *f->backend, {});
    std::ifstream in(std::string(DS_FIXTURES_DIR) + "/llamacpp/smollm2_q4_1.json");
    const auto j = nlohmann::json::parse(in);
    for (const auto& p : j["prompts"]) f->prompts.push_back(p["ids"].get<std::vector<int32_t>>());
    // Twelve more: prefixes of the long paragraph, 3 to 250 tokens.
    const auto longest = *std::max_element(f->prompts.begin(), f->prompts.end(),
                                           [](auto& a, auto& b) { return a.size() < b.size(); });
    for (size_t n : {3, 5, 9, 17, 31, 48, 64, 80, 111, 150, 200, 250})
      f->prompts.emplace_back(longest.begin(), longest.begin() + long(n));
    return f;
  }();
  return f;
}

#define NEED_MODEL()      \
  Fixture* f = fixture(); \
  if (!f) GTEST_SKIP() << "DS_SMOLLM2_GGUF is not set (scripts/test.sh sets it)"

std::vector<std::vector<int32_t>> run_all(Fixture* f, const EngineConfig& cfg,
                                          const std::vector<std::vector<int32_t>>& prompts,
                                          int max_tokens, bool concurrent,
                                          EngineStats* stats = nullptr) {
  Engine engine(*f->m.model, *f->backend, f->m.tokenizer.get(), cfg);
  auto out = test::greedy_generate(engine, prompts, max_tokens, concurrent);
  if (stats) *stats = engine.stats();
  return out;
}

// The engine's step timing: each decode step is timed from launch to results, with the host
// gap before it; prefill steps are not.
TEST(Engine, StepTimingCountsDecodeStepsAndTheirHostGaps) {
  NEED_MODEL();
  Engine engine(*f->m.model, *f->backend, f->m.tokenizer.get(), EngineConfig{});
  const std::vector<std::vector<int32_t>> two = {f->prompts[0], f->prompts[1]};
  test::greedy_generate(engine, two, 6, true);  // one prefill step, five decode steps
  const EngineStats st = engine.stats();
  EXPECT_EQ(st.device_steps, 5);
  EXPECT_EQ(st.host_gaps, 5);  // the first after the prefill step too
  EXPECT_GT(st.device_s, 0);
  EXPECT_GT(st.host_gap_s, 0);
  EXPECT_LT(st.host_gap_s, st.device_s);  // bookkeeping, next to five forwards of a real model
}

TEST(Engine, BatchedEqualsAlone) {
  NEED_MODEL();
  ASSERT_EQ(f->prompts.size(), 32u);
  EngineConfig alone_cfg;
  alone_cfg.prefix_cache = false;
  const auto alone = run_all(f, alone_cfg, f->prompts, 12, false);

  EngineConfig batched = alone_cfg;
  EngineStats st;
  EXPECT_EQ(run_all(f, batched, f->prompts, 12, true, &st), alone) << "plain batching";
  EXPECT_GT(double(st.tokens_generated) / double(st.steps), 4.0) << "requests did share steps";

  EngineConfig chunked = alone_cfg;
  chunked.max_num_seqs = 8;
  chunked.max_num_batched_tokens = 13;  // prompts split into many small chunks
  EXPECT_EQ(run_all(f, chunked, f->prompts, 12, true), alone) << "tiny prefill chunks";

  EngineConfig tight = alone_cfg;
  tight.kv_cache_tokens = 16 * 40;  // 40 blocks: far less than 32 prompts need at once
  EXPECT_EQ(run_all(f, tight, f->prompts, 12, true, &st), alone) << "with preemptions";
  EXPECT_GT(st.preemptions, 0);
}

// The start-up warm-up prefills random tokens into cache blocks the block manager still holds
// as free (here 2 x 320 tokens: capped to a 40-block cache). Nothing of it may show: no steps
// or KV use in the stats, and the same tokens afterwards as an engine without it, batched,
// with the prefix cache and with preemptions.
TEST(Engine, WarmUpLeavesNoTrace) {
  NEED_MODEL();
  EngineConfig plain;
  plain.kv_cache_tokens = 16 * 40;
  plain.warmup_tokens = 0;
  EngineConfig warm = plain;
  warm.warmup_tokens = 2048;
  {
    Engine engine(*f->m.model, *f->backend, f->m.tokenizer.get(), warm);
    const EngineStats st = engine.stats();
    EXPECT_EQ(st.steps, 0);
    EXPECT_EQ(st.prompt_tokens_computed, 0);
    EXPECT_EQ(st.kv.used_blocks, 0);
  }
  const auto want = run_all(f, plain, f->prompts, 8, true);
  EngineStats st;
  EXPECT_EQ(run_all(f, warm, f->prompts, 8, true, &st), want);
  EXPECT_GT(st.preemptions, 0);
}

// hold_admission: requests submitted while held do not run (a cancelled one still finishes);
// released, they start together: one prefill step for all four, then their decode steps.
TEST(Engine, HeldAdmissionStartsTheBatchInOneStep) {
  NEED_MODEL();
  EngineConfig cfg;
  cfg.prefix_cache = false;
  Engine engine(*f->m.model, *f->backend, f->m.tokenizer.get(), cfg);
  engine.hold_admission(true);
  std::vector<std::shared_ptr<RequestHandle>> hs;
  for (int i = 0; i < 4; ++i) {
    EngineRequest r;
    r.prompt = f->prompts[size_t(i)];
    r.max_tokens = 3;
    r.ignore_eos = true;
    hs.push_back(engine.submit(std::move(r)));
  }
  EngineRequest rc;
  rc.prompt = f->prompts[5];
  rc.max_tokens = 3;
  auto hc = engine.submit(std::move(rc));
  engine.cancel(hc->id());
  const auto cancelled = hc->next_for(10.0);
  ASSERT_TRUE(cancelled.has_value());
  EXPECT_TRUE(cancelled->final);
  EXPECT_EQ(cancelled->finish_reason, "cancelled");
  EXPECT_FALSE(hs[0]->next_for(0.3).has_value()) << "a held request ran";
  for (auto& h : hs) EXPECT_FALSE(h->try_next().has_value()) << "a held request ran";
  EXPECT_EQ(engine.stats().steps, 0);

  engine.hold_admission(false);
  for (auto& h : hs) {
    int tokens = 0;
    while (auto ev = h->next()) {
      if (ev->token >= 0) ++tokens;
      if (ev->final) break;
    }
    EXPECT_EQ(tokens, 3);
  }
  EXPECT_EQ(engine.stats().steps, 3) << "not one prefill step for the four, then two decodes";
}

TEST(Engine, PrefixCacheComputesASharedSystemPromptOnce) {
  NEED_MODEL();
  // A 400-token shared prefix (the long paragraph, repeated) plus a different question each.
  std::vector<int32_t> system;
  while (system.size() < 400)
    system.insert(system.end(), f->prompts[16].begin(), f->prompts[16].end());
  system.resize(400);
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 6; ++i) {
    auto p = system;
    p.insert(p.end(), f->prompts[size_t(i)].begin(), f->prompts[size_t(i)].end());
    prompts.push_back(p);
  }
  EngineConfig off;
  off.prefix_cache = false;
  EngineStats st_off, st_on;
  const auto without = run_all(f, off, prompts, 8, false, &st_off);
  EngineConfig on;
  const auto with = run_all(f, on, prompts, 8, false, &st_on);
  EXPECT_EQ(with, without);
  // Requests after the first reuse the 400-token prefix: 25 full blocks of 16 each.
  EXPECT_EQ(st_on.kv.prefix_hit_tokens, 5 * 400);
  EXPECT_EQ(st_off.prompt_tokens_computed - st_on.prompt_tokens_computed, 5 * 400);
}

TEST(Engine, CancelFreesBlocksAndImpossibleRequestsAreRejected) {
  NEED_MODEL();
  EngineConfig cfg;
  cfg.kv_cache_tokens = 256;
  Engine engine(*f->m.model, *f->backend, f->m.tokenizer.get(), cfg);
  EngineRequest r;
  r.prompt = f->prompts[0];
  r.max_tokens = 100000;
  r.ignore_eos = true;
  auto too_long = engine.submit(r);
  const EngineEvent rej = too_long->wait();
  EXPECT_EQ(rej.finish_reason, "rejected");
  EXPECT_FALSE(rej.error.empty());

  r.max_tokens = 200;
  auto h = engine.submit(r);
  ASSERT_TRUE(h->next().has_value());  // first token arrived: it holds blocks now
  engine.cancel(h->id());
  const EngineEvent fin = h->wait();
  EXPECT_EQ(fin.finish_reason, "cancelled");
  EXPECT_LT(fin.usage.completion_tokens, 200);
  EXPECT_EQ(engine.stats().kv.used_blocks, 0);
}

// One request whose output cannot be made (as a failing detokenizer or stop-string check
// would) ends alone, with reason "error"; the others in the same steps finish whole and
// unchanged, and every block comes back.
TEST(Engine, OneRequestsFailureEndsOnlyThatRequest) {
  NEED_MODEL();
  const std::vector<std::vector<int32_t>> prompts(f->prompts.begin(), f->prompts.begin() + 6);
  EngineConfig cfg;
  const auto alone = run_all(f, cfg, prompts, 10, false);

  SeqId victim = 0;  // written before the victim is submitted; read on the engine thread
  std::unordered_map<SeqId, int> seen;  // engine thread only
  cfg.fault_hook = [&](SeqId id, int32_t) {
    if (++seen[id] == 4 && id == victim) throw Error("injected output failure");
  };
  Engine engine(*f->m.model, *f->backend, f->m.tokenizer.get(), cfg);
  std::vector<std::shared_ptr<RequestHandle>> hs;
  for (size_t i = 0; i < prompts.size(); ++i) {
    if (i == 2) victim = 3;  // ids are handed out from 1 in submission order
    hs.push_back(engine.submit(test::greedy_request(prompts[i], 10)));
  }
  ASSERT_EQ(hs[2]->id(), victim);
  for (size_t i = 0; i < hs.size(); ++i) {
    std::vector<int32_t> toks;
    EngineEvent fin;
    while (auto ev = hs[i]->next()) {
      if (ev->final)
        fin = *ev;
      else
        toks.push_back(ev->token);
    }
    if (i == 2) {
      EXPECT_EQ(fin.finish_reason, "error");
      EXPECT_NE(fin.error.find("injected output failure"), std::string::npos) << fin.error;
      EXPECT_EQ(toks, std::vector<int32_t>(alone[i].begin(), alone[i].begin() + 3));
      EXPECT_EQ(fin.usage.completion_tokens, 4);  // the fourth was generated, not shown
    } else {
      EXPECT_EQ(fin.finish_reason, "length") << fin.error;
      EXPECT_EQ(toks, alone[i]) << "request " << i;
    }
  }
  EXPECT_EQ(engine.stats().kv.used_blocks, 0);
}

// A tokenizer smaller than the model's vocabulary (a padded vocabulary): ids it lacks are
// ordinary outputs with no text. Here only the 256 byte tokens are known to the tokenizer,
// so nearly every id SmolLM2 produces is past it.
TEST(Engine, IdsPastTheTokenizerAreOutputsWithoutText) {
  NEED_MODEL();
  const std::vector<std::vector<int32_t>> prompts(f->prompts.begin(), f->prompts.begin() + 4);
  EngineConfig cfg;
  const auto full = run_all(f, cfg, prompts, 16, false);
  const auto bytes_only = Tokenizer::create(test::TinyVocab().spec);
  ASSERT_EQ(bytes_only->vocab_size(), 256);
  Engine engine(*f->m.model, *f->backend, bytes_only.get(), cfg);
  std::vector<std::shared_ptr<RequestHandle>> hs;
  for (const auto& p : prompts) {
    EngineRequest r = test::greedy_request(p, 16);
    r.logprobs = 2;
    hs.push_back(engine.submit(r));
  }
  int past = 0;
  for (size_t i = 0; i < hs.size(); ++i) {
    std::vector<int32_t> toks;
    std::string text;
    EngineEvent fin;
    while (auto ev = hs[i]->next()) {
      text += ev->text;
      if (ev->final) {
        fin = *ev;
      } else {
        toks.push_back(ev->token);
        EXPECT_LE(ev->logprob, 0.0f);
        EXPECT_EQ(ev->top_logprobs.size(), 2u);
      }
    }
    EXPECT_EQ(fin.finish_reason, "length") << fin.error;
    EXPECT_EQ(fin.usage.completion_tokens, 16);
    EXPECT_EQ(toks, full[i]);
    EXPECT_EQ(text, utf8_sanitize(bytes_only->decode(toks)));
    for (int32_t t : toks) past += t >= 256;
  }
  EXPECT_GT(past, 32) << "the test needs ids the tokenizer lacks";
}

// The event-driven reading the HTTP server does: a listener wakes the reader, which takes
// events with try_next() and never blocks; no event is missed, even ones queued before the
// listener was set.
// Both ways of waking readers: at once (the CPU default) and deferred to the next launch or
// idle (EngineConfig::defer_wakeups, the device default).
TEST(Engine, ListenerWakesANonBlockingReader) {
  NEED_MODEL();
  for (int defer : {0, 1}) {
    SCOPED_TRACE("defer_wakeups " + std::to_string(defer));
    EngineConfig cfg;
    cfg.defer_wakeups = defer;
    Engine engine(*f->m.model, *f->backend, f->m.tokenizer.get(), cfg);
    auto h = engine.submit(test::greedy_request(f->prompts[0], 6));
    std::mutex mu;
    std::condition_variable cv;
    int wakeups = 0;
    h->set_listener([&] {
      std::lock_guard<std::mutex> lock(mu);
      ++wakeups;
      cv.notify_all();
    });
    std::vector<EngineEvent> got;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while ((got.empty() || !got.back().final) && std::chrono::steady_clock::now() < deadline) {
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait_until(lock, deadline, [&] { return wakeups > 0; });
        wakeups = 0;
      }
      while (auto ev = h->try_next()) got.push_back(std::move(*ev));
    }
    ASSERT_EQ(got.size(), 7u);  // six tokens, then the final event
    EXPECT_EQ(got.back().finish_reason, "length");
    EXPECT_FALSE(h->try_next().has_value());
    h->set_listener(nullptr);
  }
}

// Deferred wakeups (the device default) forced on the CPU: concurrent streams of different
// lengths, one cancelled midway, all get every token and their final event, the same tokens
// as with wakeups at once.
TEST(Engine, DeferredWakeupsDeliverEveryEvent) {
  NEED_MODEL();
  auto run = [&](int defer) {
    EngineConfig cfg;
    cfg.defer_wakeups = defer;
    Engine engine(*f->m.model, *f->backend, f->m.tokenizer.get(), cfg);
    std::vector<std::shared_ptr<RequestHandle>> hs;
    engine.hold_admission(true);
    for (int i = 0; i < 8; ++i) {
      EngineRequest r = test::greedy_request(f->prompts[size_t(i)], 4 + 3 * i);
      hs.push_back(engine.submit(r));
    }
    engine.hold_admission(false);
    std::vector<std::vector<int32_t>> toks(hs.size());
    std::vector<std::string> reasons(hs.size());
    for (size_t i = 0; i < hs.size(); ++i) {
      for (;;) {
        auto ev = hs[i]->next();
        if (!ev) break;
        if (ev->final) {
          reasons[i] = ev->finish_reason;
          break;
        }
        toks[i].push_back(ev->token);
        if (i == 7 && toks[i].size() == 5) engine.cancel(hs[i]->id());
      }
    }
    return std::pair(toks, reasons);
  };
  const auto [at_once, at_once_reasons] = run(0);
  const auto [deferred, deferred_reasons] = run(1);
  for (size_t i = 0; i < 7; ++i) {
    EXPECT_EQ(deferred[i], at_once[i]) << i;
    EXPECT_EQ(deferred[i].size(), 4 + 3 * i) << i;
    EXPECT_EQ(deferred_reasons[i], "length") << i;
  }
  EXPECT_EQ(deferred_reasons[7], "cancelled");
  EXPECT_GE(deferred[7].size(), 5u);
  EXPECT_LT(deferred[7].size(), 4 + 3 * 7u);
}

// Priority isolation (SchedulerConfig::lower_class_prefill_tokens): while batch requests keep
// every step full of prefill chunks, a latency-critical request's time to first token stays
// within 3x of its time on the idle engine, and its decode steps stay short. Batch prompts
// span four full steps and a batch prompt's chunk takes the whole step, so without isolation
// a probe waits for one to finish before its prompt shares a full step, and each of its
// decodes shares one too (measured on 2 busy cores: TTFT 6.5x idle, TPOT 11x). With it, it
// waits out the step in flight and then runs in a step of its own prompt, a few decodes and
// 8 batch tokens (TTFT about 2x, TPOT 2x). Idle probes run before and after the load and the
// figures are medians, so a busy machine slows both sides alike.
TEST(Engine, LatencyCriticalTtftUnderBatchLoadStaysNearIdle) {
  NEED_MODEL();
  constexpr int kProbeLen = 128, kStep = kProbeLen, kBatchLen = 4 * kStep, kBatchRequests = 24;
  EngineConfig cfg;
  cfg.max_num_seqs = 6;
  cfg.max_num_batched_tokens = kStep;
  cfg.lower_class_prefill_tokens = 8;
  cfg.kv_cache_tokens = 6 * (kBatchLen + 16) + 2 * (kProbeLen + 16);
  Engine engine(*f->m.model, *f->backend, f->m.tokenizer.get(), cfg);
  std::mt19937 rng(7);
  auto request = [&](int len, int max_tokens, Priority p) {
    EngineRequest r;
    std::uniform_int_distribution<int32_t> id(1000, 20000);  // distinct: no prefix-cache hits
    for (int i = 0; i < len; ++i) r.prompt.push_back(id(rng));
    r.max_tokens = max_tokens;
    r.ignore_eos = true;
    r.sampling.temperature = 0;
    r.priority = p;
    return r;
  };
  std::vector<double> idle_ttft, idle_tpot, loaded_ttft, loaded_tpot;
  // Loaded probes go out at random points of the step in flight (a full step takes about one
  // idle probe's time): right after the last probe ends would always be a step's start.
  double max_gap_s = 0.05;
  auto probe = [&](std::vector<double>& ttft, std::vector<double>& tpot) {
    std::this_thread::sleep_for(
        std::chrono::duration<double>(std::uniform_real_distribution<>(0, max_gap_s)(rng)));
    const Timings t =
        engine.submit(request(kProbeLen, 8, Priority::LatencyCritical))->wait().timings;
    ttft.push_back(t.ttft_s);
    tpot.push_back(t.decode_s / 7);
  };
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };

  for (int i = 0; i < 3; ++i) probe(idle_ttft, idle_tpot);
  max_gap_s = 2 * median(idle_ttft);
  std::vector<std::shared_ptr<RequestHandle>> batch;
  for (int i = 0; i < kBatchRequests; ++i)
    batch.push_back(engine.submit(request(kBatchLen, 4, Priority::Batch)));
  while (engine.stats().running < 2)  // the load is on: every step is full from now on
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  for (int i = 0; i < 7; ++i) {
    EXPECT_GT(engine.stats().waiting, 0) << "the batch load ran out before probe " << i;
    probe(loaded_ttft, loaded_tpot);
  }
  for (const auto& h : batch) engine.cancel(h->id());
  for (const auto& h : batch) h->wait();
  max_gap_s = 0.05;
  for (int i = 0; i < 4; ++i) probe(idle_ttft, idle_tpot);

  const double idle = median(idle_ttft), loaded = median(loaded_ttft);
  std::printf(
      "latency-critical TTFT: idle %.0f ms, under batch load %.0f ms (%.2fx); TPOT: idle %.1f "
      "ms, under load %.1f ms\n",
      idle * 1e3, loaded * 1e3, loaded / idle, median(idle_tpot) * 1e3, median(loaded_tpot) * 1e3);
  EXPECT_LE(loaded, 3 * idle);
  EXPECT_LE(median(loaded_tpot), 6 * median(idle_tpot));
}

}  // namespace
}  // namespace ds
