// Server-side metric bookkeeping: counters, latency histograms per priority, a one-minute
// token-rate average, rendered as Prometheus text or JSON together with the engine's own
// figures (scheduler queues, KV cache, MoE expert load). Thread-safe.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/request.h"

namespace ds {

class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double v);
  const std::vector<double>& bounds() const { return bounds_; }
  const std::vector<uint64_t>& counts() const { return counts_; }  // per bucket, not cumulative
  uint64_t count() const { return count_; }
  double sum() const { return sum_; }

 private:
  std::vector<double> bounds_;    // upper bounds, ascending; +Inf is implicit
  std::vector<uint64_t> counts_;  // bounds_.size() + 1 buckets
  uint64_t count_ = 0;
  double sum_ = 0;
};

// Variance over experts of each one's share of the routed tokens (tokens_e / sum): 0 for a
// perfectly even load, and when nothing was routed yet.
double expert_utilization_variance(const std::vector<int64_t>& tokens);

// What a finished request reports.
struct RequestRecord {
  Priority priority = Priority::Standard;
  std::string finish_reason;
  int prompt_tokens = 0;
  int completion_tokens = 0;
  Timings timings;
};

class ServerMetrics {
 public:
  explicit ServerMetrics(std::string model_name);

  // One generated token arrived. gap_s: engine time since the request's previous token (< 0
  // for the first).
  void token(Priority priority, double gap_s);
  void request_finished(const RequestRecord& r);
  // The HTTP layer's open connections (a gauge, set before each rendering).
  void set_open_connections(int64_t n);

  std::string prometheus(const EngineStats& st) const;
  nlohmann::json json(const EngineStats& st) const;

 private:
  static constexpr int kPriorities = 3;
  static constexpr int kWindowS = 60;
  struct PerPriority {
    Histogram ttft, itl, e2e, queue;
    PerPriority();
  };
  double tokens_per_second_locked() const;
  void advance_window_locked(int64_t now_s) const;

  std::string model_;
  double start_s_;
  mutable std::mutex mu_;
  int64_t prompt_tokens_ = 0;
  int64_t generation_tokens_ = 0;
  int64_t open_connections_ = 0;
  std::map<std::string, int64_t> requests_;  // by finish reason
  std::array<PerPriority, kPriorities> per_priority_;
  // Tokens per wall-clock second over the last minute: a ring indexed by second.
  mutable std::array<int64_t, kWindowS> window_{};
  mutable int64_t window_head_s_ = 0;  // the second the ring's newest slot stands for
};

}  // namespace ds
