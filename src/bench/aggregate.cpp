#include "bench/aggregate.h"

#include <algorithm>
#include <limits>

namespace ds {
namespace {

// The largest value of one snapshot field, or nullopt when no snapshot has it.
template <class F>
std::optional<double> max_of(const std::vector<TargetSnapshot>& snaps, F field) {
  std::optional<double> m;
  for (const auto& s : snaps)
    if (auto v = field(s)) m = m ? std::max(*m, double(*v)) : double(*v);
  return m;
}

std::optional<double> mean_of(const std::vector<double>& v) {
  if (v.empty()) return std::nullopt;
  double s = 0;
  for (double x : v) s += x;
  return s / double(v.size());
}

// KV, memory, preemptions and the engine's step timing, from the snapshots the scenario took
// (cumulative counters: last minus first).
void snapshot_figures(const std::vector<TargetSnapshot>& snaps, ScenarioResult& out) {
  if (snaps.empty()) return;
  const TargetSnapshot& a = snaps.front();
  const TargetSnapshot& b = snaps.back();
  out.kv_usage_peak = max_of(snaps, [](const TargetSnapshot& s) { return s.kv_usage; });
  if (a.steps && b.steps && a.mean_fragmentation && b.mean_fragmentation && *b.steps > *a.steps) {
    // The engine keeps a running mean over all steps: undo it to get this scenario's steps.
    out.kv_fragmentation =
        (*b.mean_fragmentation * double(*b.steps) - *a.mean_fragmentation * double(*a.steps)) /
        double(*b.steps - *a.steps);
  } else {
    std::vector<double> f;  // sampled while the cache held something
    for (const auto& s : snaps)
      if (s.kv_fragmentation && s.kv_usage && *s.kv_usage > 0) f.push_back(*s.kv_fragmentation);
    out.kv_fragmentation = mean_of(f);
  }
  if (a.prefix_query_tokens && b.prefix_query_tokens && a.prefix_hit_tokens &&
      b.prefix_hit_tokens) {
    const int64_t q = *b.prefix_query_tokens - *a.prefix_query_tokens;
    if (q > 0) out.prefix_cache_hit_rate = double(*b.prefix_hit_tokens - *a.prefix_hit_tokens) / q;
  } else {
    out.prefix_cache_hit_rate = b.prefix_hit_rate;
  }
  if (a.preemptions && b.preemptions) out.preemptions = *b.preemptions - *a.preemptions;
  // Mean over the scenario's steps of a cumulative (sum, count) pair of the engine's.
  auto step_mean_ms = [&](auto sum, auto count) -> std::optional<double> {
    if (!(a.*sum && b.*sum && a.*count && b.*count) || *(b.*count) <= *(a.*count))
      return std::nullopt;
    return (*(b.*sum) - *(a.*sum)) * 1e3 / double(*(b.*count) - *(a.*count));
  };
  out.step_device_ms = step_mean_ms(&TargetSnapshot::device_s, &TargetSnapshot::device_steps);
  out.step_host_gap_ms = step_mean_ms(&TargetSnapshot::host_gap_s, &TargetSnapshot::host_gaps);
  if (auto g = max_of(snaps, [](const TargetSnapshot& s) { return s.gpu_memory_bytes; }))
    out.peak_gpu_memory_gb = *g / 1e9;
  if (auto r = max_of(snaps, [](const TargetSnapshot& s) { return s.rss_peak_bytes; }))
    out.peak_rss_gb = *r / 1e9;
}

void step_figures(const std::vector<BenchResult>& results, const AggregateOptions& opts,
                  const std::vector<double>& itl_ms, ScenarioResult& out) {
  if (!opts.engine_timestamps) {
    // A client sees one chunk per engine step: the spacing of chunks is the step time.
    out.step_time_ms = mean_std(itl_ms);
    if (out.step_time_ms) out.step_time_source = "itl";
    return;
  }
  std::vector<TokenTrace> traces;
  for (const auto& r : results) traces.push_back({r.start_s, r.prompt_tokens, r.token_s});
  const DecodeSteps steps = decode_steps(traces, opts.max_num_seqs);
  if (steps.step_s.empty()) return;
  std::vector<double> ms;
  for (double s : steps.step_s) ms.push_back(s * 1e3);
  out.step_time_ms = mean_std(ms);
  out.step_time_source = steps.mixed ? "engine_token_timestamps_mixed" : "engine_token_timestamps";
  double batch = 0, context = 0, bytes = 0;
  for (size_t k = 0; k < steps.step_s.size(); ++k) {
    batch += steps.batch[k];
    context += double(steps.context[k]) / steps.batch[k];
    if (opts.roofline)
      bytes += opts.roofline->weights.decode_step(steps.batch[k]) +
               double(opts.roofline->kv_bytes_per_token) * double(steps.context[k]);
  }
  const double n = double(steps.step_s.size());
  out.mean_decode_batch = batch / n;
  out.mean_context = context / n;
  if (!opts.roofline) return;
  const double step_s = out.step_time_ms->mean / 1e3;
  out.bytes_per_step_gb = bytes / n / 1e9;
  out.achieved_gbps = *out.bytes_per_step_gb / step_s;
  if (opts.bandwidth_gbps) out.roofline_fraction = *out.achieved_gbps / *opts.bandwidth_gbps;
}

}  // namespace

ScenarioResult aggregate_scenario(const BenchScenario& scenario, std::optional<double> rate,
                                  const std::vector<BenchResult>& results,
                                  const std::vector<TargetSnapshot>& snapshots,
                                  const AggregateOptions& opts) {
  ScenarioResult out;
  out.scenario = scenario;
  out.rate = rate;
  out.bandwidth_gbps = opts.bandwidth_gbps;
  double first = std::numeric_limits<double>::infinity(), last = -first;
  std::vector<double> itl_ms, prompt_rates, decode_rates;
  bool all_usage = true;
  int64_t usage_sum = 0;
  for (const auto& r : results) {
    first = std::min(first, r.start_s);
    last = std::max(last, r.end_s);
    if (!r.ok) {
      ++out.failed;
      if (out.errors.size() < 5 &&
          std::find(out.errors.begin(), out.errors.end(), r.error) == out.errors.end())
        out.errors.push_back(r.error);
      continue;
    }
    ++out.completed;
    ++out.finish_reasons[r.finish_reason.empty() ? "unknown" : r.finish_reason];
    out.prompt_tokens += r.usage_prompt_tokens.value_or(r.prompt_tokens);
    out.client_output_tokens += r.client_output_tokens;
    out.output_tokens += r.usage_output_tokens.value_or(r.client_output_tokens);
    if (r.usage_output_tokens)
      usage_sum += *r.usage_output_tokens;
    else
      all_usage = false;
    out.e2e_samples_ms.push_back((r.end_s - r.start_s) * 1e3);
    if (r.token_s.empty()) continue;
    const double ttft = r.token_s.front() - r.start_s;
    out.ttft_samples_ms.push_back(ttft * 1e3);
    if (ttft > 0) prompt_rates.push_back(r.prompt_tokens / ttft);
    for (size_t j = 1; j < r.token_s.size(); ++j)
      itl_ms.push_back((r.token_s[j] - r.token_s[j - 1]) * 1e3);
    if (r.token_s.size() >= 2) {
      const double decode = r.token_s.back() - r.token_s.front();
      out.tpot_samples_ms.push_back(decode * 1e3 / double(r.token_s.size() - 1));
      if (decode > 0) decode_rates.push_back(double(r.token_s.size() - 1) / decode);
    }
  }
  if (out.completed > 0 && all_usage) out.usage_output_tokens = usage_sum;
  out.duration_s = results.empty() ? 0 : std::max(0.0, last - first);
  if (out.duration_s > 0) {
    out.requests_per_s = out.completed / out.duration_s;
    out.output_tokens_per_s = double(out.output_tokens) / out.duration_s;
    out.total_tokens_per_s = double(out.prompt_tokens + out.output_tokens) / out.duration_s;
  }
  out.prompt_tokens_per_s = mean_of(prompt_rates);
  out.decode_tokens_per_s = mean_of(decode_rates);
  out.ttft_ms = summarize(out.ttft_samples_ms);
  out.tpot_ms = summarize(out.tpot_samples_ms);
  out.itl_ms = summarize(itl_ms);
  out.e2e_ms = summarize(out.e2e_samples_ms);
  std::vector<BenchResult> ok;
  for (const auto& r : results)
    if (r.ok) ok.push_back(r);
  step_figures(ok, opts, itl_ms, out);
  snapshot_figures(snapshots, out);
  if (opts.gpu_hour_price && out.output_tokens_per_s > 0)
    out.usd_per_million_output_tokens =
        *opts.gpu_hour_price / 3600.0 / out.output_tokens_per_s * 1e6;
  return out;
}

ClassResult class_result(const BenchClass& cls, const ScenarioResult& r) {
  ClassResult c;
  c.cls = cls;
  c.completed = r.completed;
  c.failed = r.failed;
  c.duration_s = r.duration_s;
  c.output_tokens_per_s = r.output_tokens_per_s;
  c.ttft_ms = r.ttft_ms;
  c.tpot_ms = r.tpot_ms;
  c.itl_ms = r.itl_ms;
  c.e2e_ms = r.e2e_ms;
  c.ttft_samples_ms = r.ttft_samples_ms;
  c.tpot_samples_ms = r.tpot_samples_ms;
  c.e2e_samples_ms = r.e2e_samples_ms;
  return c;
}

}  // namespace ds
