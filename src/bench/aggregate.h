// One scenario's figures, computed from what the client saw of each request and from
// snapshots of the target's memory and KV cache taken while it ran.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "bench/spec.h"
#include "bench/stats.h"
#include "bench/target.h"

namespace ds {

// One class of a mixed scenario: the figures of its own requests.
struct ClassResult {
  BenchClass cls;
  int completed = 0;
  int failed = 0;
  double duration_s = 0;  // its first request out -> its last stream end
  double output_tokens_per_s = 0;
  std::optional<Summary> ttft_ms, tpot_ms, itl_ms, e2e_ms;
  std::vector<double> ttft_samples_ms, tpot_samples_ms, e2e_samples_ms;  // per request
};

struct ScenarioResult {
  BenchScenario scenario;
  std::optional<double> rate;  // requests per second; unset = burst
  int completed = 0;
  int failed = 0;
  std::vector<std::string> errors;  // the first few distinct ones
  std::map<std::string, int> finish_reasons;
  double duration_s = 0;  // first request out -> last stream end
  int64_t prompt_tokens = 0;
  int64_t output_tokens = 0;         // the server's usage where reported, else the client's count
  int64_t client_output_tokens = 0;  // counted in the stream
  std::optional<int64_t> usage_output_tokens;  // summed usage (when every request had it)
  double requests_per_s = 0;
  double output_tokens_per_s = 0;
  double total_tokens_per_s = 0;
  std::optional<double> prompt_tokens_per_s;  // mean over requests of prompt / TTFT
  std::optional<double> decode_tokens_per_s;  // mean over requests of 1 / TPOT
  std::optional<Summary> ttft_ms, tpot_ms, itl_ms, e2e_ms;
  std::optional<MeanStd> step_time_ms;
  std::string step_time_source;  // engine_token_timestamps[_mixed] or itl
  // Offline: the scenario's mean per decode step from launch to results on the host
  // (device_ms), and from the previous step's results to its launch (host_gap_ms: the device
  // idles).
  std::optional<double> step_device_ms, step_host_gap_ms;
  std::optional<double> peak_gpu_memory_gb, peak_rss_gb;
  std::optional<double> kv_usage_peak, kv_fragmentation, prefix_cache_hit_rate;
  std::optional<int64_t> preemptions;
  std::optional<double> roofline_fraction;
  std::optional<double> bytes_per_step_gb, achieved_gbps, bandwidth_gbps;
  std::optional<double> mean_decode_batch, mean_context;
  std::optional<double> usd_per_million_output_tokens;
  std::vector<double> ttft_samples_ms, tpot_samples_ms, e2e_samples_ms;  // per request
  std::optional<OpProfile> op_profile;  // --profile-ops: per-op times of the scenario's steps
  std::vector<ClassResult> classes;     // mixed scenarios: one per class, in spec order
};

struct AggregateOptions {
  std::optional<RooflineModel> roofline;
  std::optional<double> bandwidth_gbps;
  std::optional<double> gpu_hour_price;
  bool engine_timestamps = false;  // token times are the engine's step ends (offline)
  int max_num_seqs = 1 << 30;
};

// `snapshots`: at least one before the first request and one after the last.
ScenarioResult aggregate_scenario(const BenchScenario& scenario, std::optional<double> rate,
                                  const std::vector<BenchResult>& results,
                                  const std::vector<TargetSnapshot>& snapshots,
                                  const AggregateOptions& opts);

// A class's figures out of aggregate_scenario() over its requests alone.
ClassResult class_result(const BenchClass& cls, const ScenarioResult& r);

}  // namespace ds
