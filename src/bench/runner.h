// Drives a target through every scenario of a spec: warm-up, then each scenario's requests
// from `concurrency` client threads (burst or Poisson arrivals), with a progress bar.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "bench/aggregate.h"
#include "bench/prompts.h"
#include "bench/spec.h"
#include "bench/target.h"

namespace ds {

struct BenchRunOptions {
  std::optional<double> bandwidth_gbps;  // resolved: the spec's or the device's default
  std::optional<double> gpu_hour_price;
  bool progress = true;               // a bar (or, off a terminal, a line per scenario) on stderr
  double snapshot_interval_s = 0.05;  // how often memory and KV state are sampled
};

struct BenchRun {
  std::vector<ScenarioResult> scenarios;
  double warmup_s = 0;
};

BenchRun run_bench(const BenchSpec& spec, BenchTarget& target, const PromptMaker& prompts,
                   const BenchRunOptions& opts);

// Arrival offsets (seconds from the start) of n requests: all 0 for a burst, else a Poisson
// process of `rate` per second drawn from `seed`.
std::vector<double> arrival_times(int n, std::optional<double> rate, uint64_t seed);

}  // namespace ds
