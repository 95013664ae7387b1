// What a benchmark runs against: the in-process engine (offline) or an OpenAI-compatible HTTP
// server (online). Both run one request at a time per calling thread and report what a client
// sees of it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "backend/profiling_backend.h"
#include "model/model.h"

namespace ds {

struct BenchRequest {
  std::vector<int32_t> prompt_ids;  // random prompts (and text prompts, offline)
  std::string prompt_text;          // text prompts, online
  int max_tokens = 0;
  bool ignore_eos = true;
  double temperature = 0;
  uint64_t seed = 0;
  std::string priority;  // "latency-critical", "standard", "batch"; "" = the target's default
};

struct BenchResult {
  bool ok = false;
  std::string error;
  std::string finish_reason;
  double start_s = 0;            // steady clock, seconds: just before the request went out
  double end_s = 0;              // the end of its stream
  std::vector<double> token_s;   // when each generated token arrived (same clock)
  int prompt_tokens = 0;         // prompt length as sent (text prompts: as the server counted)
  int client_output_tokens = 0;  // tokens the client counted in the stream
  std::optional<int> usage_prompt_tokens, usage_output_tokens;  // the server's usage fields
};

// Memory and KV-cache state at one moment; fields a target cannot see stay empty.
struct TargetSnapshot {
  std::optional<double> gpu_memory_bytes;  // in use on the device
  std::optional<double> rss_peak_bytes;    // this process's peak resident set (VmHWM)
  std::optional<double> kv_usage;          // fraction of KV blocks in use now
  std::optional<double> kv_fragmentation;  // now
  // Offline: the engine's cumulative counters, so a scenario can take differences.
  std::optional<int64_t> steps;
  std::optional<double> mean_fragmentation;  // running mean over `steps`
  std::optional<int64_t> prefix_query_tokens, prefix_hit_tokens;
  std::optional<double> prefix_hit_rate;  // online: the server's cumulative figure
  std::optional<int64_t> preemptions;
  // EngineStats' decode-step timing (cumulative): launch to results, and the host gap before.
  std::optional<double> device_s, host_gap_s;
  std::optional<int64_t> device_steps, host_gaps;
};

// The figures a roofline needs (offline only: the model must be loaded here).
struct RooflineModel {
  WeightBytes weights;
  uint64_t kv_bytes_per_token = 0;
};

class BenchTarget {
 public:
  virtual ~BenchTarget() = default;
  virtual std::string mode() const = 0;  // "offline" or "online"
  // Runs one request to its end; safe to call from many threads at once.
  virtual BenchResult run(const BenchRequest& req) = 0;
  virtual TargetSnapshot snapshot() = 0;
  virtual std::optional<RooflineModel> roofline() const = 0;
  // Step times from the engine's own token timestamps (offline) rather than chunk arrival.
  virtual bool engine_timestamps() const = 0;
  // Per-op timing (offline with --profile-ops): forget the steps so far (called while idle,
  // before each scenario), and summarize the steps since then (after it).
  virtual void reset_op_profile() {}
  virtual std::optional<OpProfile> op_profile() { return std::nullopt; }
  // A scenario's closed-loop start (offline): the next n requests run() submits are admitted
  // together, as one batch, once the last of them is in; end_wave() admits what came so far
  // (the runner's safety net when fewer arrive).
  virtual void begin_wave(int n) { (void)n; }
  virtual void end_wave() {}
};

double steady_now_s();  // the clock every BenchResult uses

}  // namespace ds
