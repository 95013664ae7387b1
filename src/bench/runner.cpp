#include "bench/runner.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
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

BenchRequest request_for(const BenchSpec& spec, const PromptMaker& prompts, const BenchClass& c,
                         uint64_t seed) {
  BenchRequest r = prompts.make(c.input_len, seed);
  r.max_tokens = c.output_len;
  r.ignore_eos = spec.ignore_eos;
  r.temperature = spec.temperature;
  r.priority = c.priority;
  return r;
}

// One class's requests in a scenario run: what each is, when it may go out, what came back.
struct ClassRun {
  const BenchClass* cls = nullptr;
  uint64_t key = 0;              // its requests' seeds derive from it
  std::vector<double> arrivals;  // [num_prompts] seconds from the scenario's start
  std::vector<BenchResult> results;
  std::vector<char> ran;  // background classes stop early: requests never sent are left out
  std::atomic<int> next{0};

  std::vector<BenchResult> sent() const {
    std::vector<BenchResult> out;
    for (size_t i = 0; i < results.size(); ++i)
      if (ran[i]) out.push_back(results[i]);
    return out;
  }
};

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
      const auto req = request_for(spec, prompts, s.classes.front(),
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
    std::vector<std::unique_ptr<ClassRun>> classes;
    for (size_t ci = 0; ci < s.classes.size(); ++ci) {
      auto cr = std::make_unique<ClassRun>();
      const BenchClass& c = s.classes[ci];
      cr->cls = &c;
      cr->key = si + (uint64_t(ci) << 32);  // a matrix cell's one class: si, as before
      cr->arrivals = arrival_times(c.num_prompts, c.rate, request_seed(spec.seed, cr->key, ~0ull));
      for (double& t : cr->arrivals) t += c.start_s;
      cr->results.resize(size_t(c.num_prompts));
      cr->ran.assign(size_t(c.num_prompts), 0);
      classes.push_back(std::move(cr));
    }
    const int n = s.num_prompts;  // foreground requests: the scenario ends with them
    std::atomic<int> done{0};
    std::atomic<bool> foreground_done{false};

    target.reset_op_profile();  // the engine is idle: earlier steps stay out of this scenario
    std::vector<TargetSnapshot> snaps{target.snapshot()};
    // Closed-loop classes send their first requests together (one per worker, at t = 0): the
    // target admits them as one batch, as a client's batch of `concurrency` requests would
    // arrive, rather than in whichever engine steps the worker threads happen to reach.
    int wave = 0;
    for (const auto& cr : classes)
      if (!cr->cls->rate && cr->cls->start_s <= 0)
        wave += std::min(cr->cls->concurrency, cr->cls->num_prompts);
    target.begin_wave(wave);
    bool wave_open = wave > 1;
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> workers;
    for (auto& cr : classes) {
      const int threads = std::min(cr->cls->concurrency, cr->cls->num_prompts);
      for (int w = 0; w < threads; ++w)
        workers.emplace_back([&, c = cr.get()] {
          const int count = int(c->arrivals.size());
          for (int i; (i = c->next.fetch_add(1)) < count;) {
            const auto at = t0 + std::chrono::duration_cast<std::chrono::nanoseconds>(
                                     std::chrono::duration<double>(c->arrivals[size_t(i)]));
            // In slices, so a background class waiting for its next arrival sees the end.
            while (std::chrono::steady_clock::now() < at && !foreground_done.load())
              std::this_thread::sleep_until(
                  std::min(at, std::chrono::steady_clock::now() + std::chrono::milliseconds(50)));
            if (c->cls->background && foreground_done.load()) break;
            c->ran[size_t(i)] = 1;
            try {
              // Made when sent: a background class may hold many more prompts than it sends.
              const BenchRequest req =
                  request_for(spec, prompts, *c->cls, request_seed(spec.seed, c->key, uint64_t(i)));
              c->results[size_t(i)] = target.run(req);
            } catch (const std::exception& e) {
              c->results[size_t(i)].error = e.what();
            }
            if (!c->cls->background && done.fetch_add(1) + 1 == n) foreground_done = true;
          }
        });
    }
    while (done.load() < n) {
      std::this_thread::sleep_for(std::chrono::duration<double>(opts.snapshot_interval_s));
      if (wave_open &&  // a worker that never submitted must not hold the others back
          std::chrono::steady_clock::now() - t0 > std::chrono::milliseconds(500)) {
        target.end_wave();
        wave_open = false;
      }
      snaps.push_back(target.snapshot());
      if (tty)
        draw_bar(si, scenarios.size(), s, done.load(),
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    target.end_wave();
    for (auto& w : workers) w.join();  // background requests in flight run to their end
    snaps.push_back(target.snapshot());
    std::vector<BenchResult> results;
    for (const auto& cr : classes)
      for (auto& r : cr->sent()) results.push_back(std::move(r));
    const std::optional<double> rate = s.mixed ? std::nullopt : spec.rate;
    ScenarioResult res = aggregate_scenario(s, rate, results, snaps, agg);
    if (s.mixed)
      for (const auto& cr : classes)
        res.classes.push_back(
            class_result(*cr->cls, aggregate_scenario(s, cr->cls->rate, cr->sent(), {}, agg)));
    res.op_profile = target.op_profile();
    if (tty) {
      draw_bar(si, scenarios.size(), s, n, res.duration_s);
      std::fprintf(stderr, "\n");
    }
    if (opts.progress)
      std::fprintf(stderr, "bench: [%zu/%zu] %s: %d/%d requests in %.2f s, %.1f output tok/s%s\n",
                   si + 1, scenarios.size(), s.name.c_str(), res.completed, int(results.size()),
                   res.duration_s, res.output_tokens_per_s,
                   res.failed ? (", " + std::to_string(res.failed) + " failed").c_str() : "");
    run.scenarios.push_back(std::move(res));
  }
  return run;
}

}  // namespace ds
