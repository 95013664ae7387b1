// Scenario figures from synthetic request timelines (worked out by hand), and the JSON
// document holding every field docs/BENCH.md promises.
#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <mutex>

#include "bench/aggregate.h"
#include "bench/report.h"
#include "bench/runner.h"

namespace ds {
namespace {

// Request i starts at 10 * i seconds: first token 0.5 s later, then one every 0.1 s; the
// server reports usage. Snapshots count steps and fragmentation like the engine does.
class FakeTarget : public BenchTarget {
 public:
  std::string mode() const override { return "offline"; }
  BenchResult run(const BenchRequest& req) override {
    const int i = calls_++;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++priorities[req.priority];
    }
    BenchResult r;
    r.ok = true;
    r.finish_reason = "length";
    r.prompt_tokens = int(req.prompt_ids.size());
    r.start_s = 10.0 * i;
    for (int k = 0; k < req.max_tokens; ++k) r.token_s.push_back(r.start_s + 0.5 + 0.1 * k);
    r.end_s = r.token_s.back() + 0.05;
    r.client_output_tokens = req.max_tokens;
    r.usage_prompt_tokens = r.prompt_tokens;
    r.usage_output_tokens = req.max_tokens;
    return r;
  }
  TargetSnapshot snapshot() override {
    TargetSnapshot s;
    s.rss_peak_bytes = 2e9;
    s.kv_usage = 0.25;
    // 10 earlier steps at fragmentation 0.1, then 10 more between snapshots at 0.5 each.
    s.steps = 10 + 10 * snaps_;
    s.mean_fragmentation = (10 * 0.1 + 10 * 0.5 * snaps_) / double(*s.steps);
    s.prefix_query_tokens = 100 * snaps_;
    s.prefix_hit_tokens = 25 * snaps_;
    s.preemptions = snaps_;
    // Before the scenario 5 steps of 9 ms and 4 gaps of 3 ms; then per snapshot 10 steps of
    // 20 ms and 10 gaps of 0.5 ms.
    s.device_s = 0.045 + 0.2 * snaps_;
    s.device_steps = 5 + 10 * snaps_;
    s.host_gap_s = 0.012 + 0.005 * snaps_;
    s.host_gaps = 4 + 10 * snaps_;
    ++snaps_;
    return s;
  }
  std::optional<RooflineModel> roofline() const override {
    RooflineModel m;
    m.weights.dense = 1'000'000'000;
    m.kv_bytes_per_token = 1000;
    return m;
  }
  bool engine_timestamps() const override { return true; }

  std::mutex mu_;
  std::map<std::string, int> priorities;  // requests seen per priority

 private:
  std::atomic<int> calls_{0};
  int snaps_ = 0;
};

TEST(BenchAggregate, FiguresOfOneRequest) {
  FakeTarget t;
  BenchRequest req;
  req.prompt_ids.assign(100, 1);
  req.max_tokens = 5;
  const BenchResult r = t.run(req);
  BenchScenario sc{"s", 1, 100, 5, 1, {}, false};
  AggregateOptions o;
  o.roofline = t.roofline();
  o.bandwidth_gbps = 100;
  o.gpu_hour_price = 3.6;
  o.engine_timestamps = true;
  const ScenarioResult a = aggregate_scenario(sc, std::nullopt, {r}, {}, o);
  // start 0, tokens at 0.5 .. 0.9, end 0.95.
  EXPECT_NEAR(a.duration_s, 0.95, 1e-12);
  EXPECT_EQ(a.output_tokens, 5);
  EXPECT_NEAR(a.output_tokens_per_s, 5 / 0.95, 1e-9);
  EXPECT_NEAR(a.total_tokens_per_s, 105 / 0.95, 1e-9);
  EXPECT_NEAR(a.requests_per_s, 1 / 0.95, 1e-9);
  EXPECT_NEAR(a.ttft_ms->p50, 500, 1e-9);
  EXPECT_NEAR(a.tpot_ms->mean, 100, 1e-9);
  EXPECT_NEAR(a.itl_ms->max, 100, 1e-9);
  EXPECT_NEAR(a.e2e_ms->max, 950, 1e-9);
  EXPECT_NEAR(*a.prompt_tokens_per_s, 200, 1e-9);
  EXPECT_NEAR(*a.decode_tokens_per_s, 10, 1e-9);
  // Four decode steps of 100 ms at batch 1, contexts 101..104 (mean 102.5):
  // (1e9 + 1000 * 102.5) bytes / 0.1 s = 10.001025 GB/s, a tenth of 100 GB/s.
  EXPECT_EQ(a.step_time_ms->count, 4u);
  EXPECT_NEAR(a.step_time_ms->mean, 100, 1e-9);
  EXPECT_NEAR(a.step_time_ms->std, 0, 1e-9);
  EXPECT_NEAR(*a.mean_context, 102.5, 1e-12);
  EXPECT_NEAR(*a.achieved_gbps, 10.001025, 1e-9);
  EXPECT_NEAR(*a.roofline_fraction, 0.10001025, 1e-11);
  // 3.6 USD/h = 0.001 USD/s over 5/0.95 tok/s.
  EXPECT_NEAR(*a.usd_per_million_output_tokens, 0.001 / (5 / 0.95) * 1e6, 1e-6);
}

TEST(BenchAggregate, FailuresAndKvDifferences) {
  BenchResult bad;
  bad.error = "boom";
  bad.start_s = 0;
  bad.end_s = 1;
  FakeTarget t;
  std::vector<TargetSnapshot> snaps;
  for (int i = 0; i < 3; ++i) snaps.push_back(t.snapshot());
  const ScenarioResult a =
      aggregate_scenario(BenchScenario{"s", 1, 1, 1, 1, {}, false}, 2.0, {bad, bad}, snaps, {});
  EXPECT_EQ(a.failed, 2);
  EXPECT_EQ(a.completed, 0);
  EXPECT_EQ(a.errors, std::vector<std::string>{"boom"});
  EXPECT_FALSE(a.ttft_ms);
  // Steps 0 -> 20, each with fragmentation 0.5; prefix 50 hits of 200 lookups; 2 preemptions.
  EXPECT_NEAR(*a.kv_fragmentation, 0.5, 1e-12);
  EXPECT_NEAR(*a.prefix_cache_hit_rate, 0.25, 1e-12);
  EXPECT_EQ(*a.preemptions, 2);
  EXPECT_NEAR(*a.step_device_ms, 20.0, 1e-9);  // the scenario's steps, not the earlier ones
  EXPECT_NEAR(*a.step_host_gap_ms, 0.5, 1e-9);
  EXPECT_NEAR(*a.peak_rss_gb, 2.0, 1e-12);
  EXPECT_FALSE(a.peak_gpu_memory_gb);
}

TEST(BenchArrivals, BurstAndPoisson) {
  EXPECT_EQ(arrival_times(3, std::nullopt, 1), (std::vector<double>{0, 0, 0}));
  const auto t = arrival_times(20000, 4.0, 7);
  EXPECT_EQ(t.front(), 0);
  for (size_t i = 1; i < t.size(); ++i) ASSERT_GE(t[i], t[i - 1]);
  // Mean gap of a rate-4 Poisson process is 0.25 s (20000 gaps: within ~3 standard errors).
  EXPECT_NEAR(t.back() / double(t.size() - 1), 0.25, 0.25 * 3 / std::sqrt(20000.0));
}

TEST(BenchReport, JsonHasEverySchemaField) {
  BenchSpec spec;
  spec.name = "fake";
  spec.concurrency = {1, 2};
  spec.input_len = {8};
  spec.output_len = {4};
  spec.warmup = 1;
  FakeTarget target;
  PromptMaker prompts({nullptr, 1000, false, false});
  BenchRunOptions ro;
  ro.progress = false;
  ro.bandwidth_gbps = 50;
  ro.gpu_hour_price = 2;
  ro.snapshot_interval_s = 0.001;
  const BenchRun run = run_bench(spec, target, prompts, ro);
  ASSERT_EQ(run.scenarios.size(), 2u);
  const SystemInfo sys = collect_system_info("deepserve bench --config x", "0.0");
  ReportContext ctx;
  ctx.mode = "offline";
  ctx.model = "m";
  ctx.device = "cpu";
  ctx.bandwidth_source = "config";
  ctx.weight_format = "q4_1";
  ctx.weights = "Q4_1 0.066 GB (0.625 bytes/param)";
  ctx.kv_capacity_tokens = 16384;
  ctx.kv_bytes_per_token = 69120;
  const auto j = bench_json(spec, run, sys, ctx);
  EXPECT_EQ(j["config"]["kv_cache"]["capacity_tokens"], 16384);
  EXPECT_EQ(j["config"]["kv_cache"]["bytes_per_token"], 69120);
  EXPECT_TRUE(
      j["config"]["kv_cache"]["tokens_that_fit"].is_null());  // CPU: memory does not size it
  EXPECT_EQ(j["config"]["quantize"], "q4_1");  // what was bound, not the YAML's "none"
  EXPECT_EQ(j["config"]["weights"], "Q4_1 0.066 GB (0.625 bytes/param)");

  for (const char* k : {"gpu", "driver", "cpu", "commit", "command"})
    EXPECT_TRUE(j["system"].contains(k)) << k;
  EXPECT_EQ(j["system"]["command"], "deepserve bench --config x");
  ASSERT_EQ(j["scenarios"].size(), 2u);
  for (const auto& s : j["scenarios"]) {
    for (const char* k :
         {"name", "concurrency", "input_len", "output_len", "output_tokens_per_s",
          "total_tokens_per_s", "requests_per_s", "peak_gpu_memory_gb", "peak_rss_gb",
          "kv_fragmentation", "roofline_fraction", "usd_per_million_output_tokens",
          "prefix_cache_hit_rate", "kv_usage_peak"})
      EXPECT_TRUE(s.contains(k)) << k;
    for (const char* k : {"ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"})
      for (const char* q : {"mean", "p50", "p90", "p99", "max"})
        EXPECT_TRUE(s[k][q].is_number()) << k << "." << q;
    EXPECT_TRUE(s["step_time_ms"]["mean"].is_number());
    EXPECT_TRUE(s["step_time_ms"]["std"].is_number());
    EXPECT_TRUE(s["step_time_ms"]["device_mean"].is_number());
    EXPECT_TRUE(s["step_time_ms"]["host_gap_mean"].is_number());
    EXPECT_TRUE(s["roofline_fraction"].is_number());
    EXPECT_TRUE(s["usd_per_million_output_tokens"].is_number());
    EXPECT_TRUE(s["peak_gpu_memory_gb"].is_null());
    EXPECT_EQ(s["samples"]["ttft_ms"].size(), s["num_prompts"].get<size_t>());
    EXPECT_EQ(s["output_tokens"], 4 * s["num_prompts"].get<int>());
    EXPECT_TRUE(s["classes"].is_array() && s["classes"].empty());  // mixed scenarios only
  }
  EXPECT_EQ(j["scenarios"][1]["concurrency"], 2);
  EXPECT_EQ(j["scenarios"][1]["name"], "c2_in8_out4");
}

TEST(BenchReport, DominantWeightFormatNamesWhatHoldsMostBytes) {
  using F = std::map<std::string, std::pair<uint64_t, uint64_t>>;
  // SmolLM2's Q4_1 file: Q4_1 66 MB, Q8_0 30 MB, F32 norms.
  EXPECT_EQ(dominant_weight_format(F{{"F32", {1, 1}}, {"Q4_1", {66, 1}}, {"Q8_0", {30, 1}}}),
            "q4_1");
  EXPECT_EQ(dominant_weight_format(F{{"BF16", {4, 2}}, {"F32", {1, 1}}, {"W4A16", {120, 2}}}),
            "w4a16");
  EXPECT_EQ(dominant_weight_format(F{{"BF16", {1, 2}}, {"FP8W", {15, 2}}}), "fp8");
  // F32 counts only when it is all there is (an F32 checkpoint), even if it holds more.
  EXPECT_EQ(dominant_weight_format(F{{"F32", {100, 1}}, {"BF16", {31, 1}}}), "bf16");
  EXPECT_EQ(dominant_weight_format(F{{"F32", {100, 1}}}), "f32");
}

TEST(BenchReport, MixedScenarioReportsEachClass) {
  BenchSpec spec;
  spec.name = "mix";
  spec.warmup = 0;
  const BenchClass bulk{.name = "bulk",
                        .priority = "batch",
                        .input_len = 16,
                        .output_len = 2,
                        .concurrency = 2,
                        .num_prompts = 100000,
                        .background = true};
  const BenchClass probe{.name = "probe",
                         .priority = "latency-critical",
                         .input_len = 8,
                         .output_len = 4,
                         .num_prompts = 3,
                         .start_s = 0.01};
  spec.classes = {bulk, probe};
  FakeTarget target;
  PromptMaker prompts({nullptr, 1000, false, false});
  BenchRunOptions ro;
  ro.progress = false;
  ro.snapshot_interval_s = 0.001;
  const BenchRun run = run_bench(spec, target, prompts, ro);
  ASSERT_EQ(run.scenarios.size(), 1u);
  const ScenarioResult& r = run.scenarios[0];
  ASSERT_EQ(r.classes.size(), 2u);
  EXPECT_EQ(r.classes[1].completed, 3);
  // The background class ran until the probes were done, not through all its prompts.
  EXPECT_GT(r.classes[0].completed, 0);
  EXPECT_LT(r.classes[0].completed, 100000);
  EXPECT_EQ(r.completed, r.classes[0].completed + 3);
  EXPECT_EQ(target.priorities["latency-critical"], 3);
  EXPECT_EQ(target.priorities["batch"], r.classes[0].completed);

  ReportContext ctx;
  ctx.mode = "offline";
  ctx.model = "m";
  ctx.device = "cpu";
  ctx.bandwidth_source = "none";
  const auto j = bench_json(spec, run, collect_system_info("x", "0.0"), ctx);
  const auto& c = j["scenarios"][0]["classes"];
  ASSERT_EQ(c.size(), 2u);
  EXPECT_EQ(c[1]["name"], "probe");
  EXPECT_EQ(c[1]["priority"], "latency-critical");
  EXPECT_EQ(c[1]["completed"], 3);
  EXPECT_EQ(c[1]["samples"]["ttft_ms"].size(), 3u);
  EXPECT_DOUBLE_EQ(c[1]["ttft_ms"]["p50"].get<double>(), 500);  // FakeTarget: 0.5 s
  EXPECT_TRUE(c[0]["background"].get<bool>());
  for (const char* k : {"ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"})
    for (const char* q : {"mean", "p50", "p90", "p99", "max"})
      EXPECT_TRUE(c[0][k][q].is_number()) << k << "." << q;
}

}  // namespace
}  // namespace ds
