#include "bench/runner.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <random>
#include <thread>

#include "core/error.h"

namespace ds {
namespace {

void draw_bar(size_t index, size_t count, const BenchScenario& s, int done, double elapsed) {
  constexpr int kWidth = 30;
  const int n = s.num_prompts;
  const int fill = n > 0 ? done * kWidth / n : kWidth;
  std::string bar(size_t(fill), '#');
  bar.resize(kWidth, '.');
  std::fprintf(stderr, "\r[%zu/%zu] %-24s [%s] %d/%d requests %6.1f s", index + 1, count,
               s.name.c_str(), bar.c_str(), done, n, elapsed);
  std::fflush(stderr);
}

BenchRequest request_for(const BenchSpec& spec, const PromptMaker& prompts, int input_len,
                         int output_len, uint64_t seed) {
  BenchRequest r = prompts.make(input_len, seed);
  r.max_tokens = output_len;
  r.ignore_eos = spec.ignore_eos;
  r.temperature = spec.temperature;
  return r;
}

}  // namespace

std::vector<double> arrival_times(int n, std::optional<double> rate, uint64_t seed) {
  std::vector<double> t(size_t(std::max(n, 0)), 0.0);
  if (!rate) return t;
  std::mt19937_64 rng(seed);
  std::exponential_distribution<double> gap(*rate);
  double now = 0;
  for (auto& x : t) {
    x = now;
    now += gap(rng);
  }
  return t;
}

BenchRun run_bench(const BenchSpec& spec, BenchTarget& target, const PromptMaker& prompts,
                   const BenchRunOptions& opts) {
  const std::vector<BenchScenario> scenarios = spec.scenarios();
  const bool tty = opts.progress && isatty(2);
  BenchRun run;

  if (spec.warmup > 0 && !scenarios.empty()) {
    const BenchScenario& s = scenarios.front();
    if (opts.progress) std::fprintf(stderr, "bench: %d warm-up request(s)\n", spec.warmup);
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < spec.warmup; ++i) {
      // Scenario index ~0: warm-up prompts never share a prefix with measured ones.
      const auto req = request_for(spec, prompts, s.input_len, s.output_len,
                                   request_seed(spec.seed, ~uint64_t(0), uint64_t(i)));
      const BenchResult r = target.run(req);
      if (!r.ok) throw Error("warm-up request failed: " + r.error);
    }
    run.warmup_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  const AggregateOptions agg{target.roofline(), opts.bandwidth_gbps, opts.gpu_hour_price,
                             target.engine_timestamps(), spec.engine.max_num_seqs};
  for (size_t si = 0; si < scenarios.size(); ++si) {
    const BenchScenario& s = scenarios[si];
    const int n = s.num_prompts;
    std::vector<BenchRequest> reqs;
    for (int i = 0; i < n; ++i)
      reqs.push_back(request_for(spec, prompts, s.input_len, s.output_len,
                                 request_seed(spec.seed, si, uint64_t(i))));
    const std::vector<double> arrivals =
        arrival_times(n, spec.rate, request_seed(spec.seed, si, ~0ull));
    std::vector<BenchResult> results(static_cast<size_t>(n));
    std::atomic<int> next{0}, done{0};

    target.reset_op_profile();  // the engine is idle: earlier steps stay out of this scenario
    std::vector<TargetSnapshot> snaps{target.snapshot()};
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> workers;
    const int threads = std::min(s.concurrency, n);
    for (int w = 0; w < threads; ++w)
      workers.emplace_back([&] {
        for (int i; (i = next.fetch_add(1)) < n;) {
          std::this_thread::sleep_until(t0 +
                                        std::chrono::duration_cast<std::chrono::nanoseconds>(
                                            std::chrono::duration<double>(arrivals[size_t(i)])));
          try {
            results[size_t(i)] = target.run(reqs[size_t(i)]);
          } catch (const std::exception& e) {
            results[size_t(i)].error = e.what();
          }
          done.fetch_add(1);
        }
      });
    while (done.load() < n) {
      std::this_thread::sleep_for(std::chrono::duration<double>(opts.snapshot_interval_s));
      snaps.push_back(target.snapshot());
      if (tty)
        draw_bar(si, scenarios.size(), s, done.load(),
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    for (auto& w : workers) w.join();
    snaps.push_back(target.snapshot());
    ScenarioResult res = aggregate_scenario(s, spec.rate, results, snaps, agg);
    res.op_profile = target.op_profile();
    if (tty) {
      draw_bar(si, scenarios.size(), s, n, res.duration_s);
      std::fprintf(stderr, "\n");
    }
    if (opts.progress)
      std::fprintf(stderr, "bench: [%zu/%zu] %s: %d/%d requests in %.2f s, %.1f output tok/s%s\n",
                   si + 1, scenarios.size(), s.name.c_str(), res.completed, n, res.duration_s,
                   res.output_tokens_per_s,
                   res.failed ? (", " + std::to_string(res.failed) + " failed").c_str() : "");
    run.scenarios.push_back(std::move(res));
  }
  return run;
}

}  // namespace ds
