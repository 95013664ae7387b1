#include "server/metrics.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>

namespace ds {
namespace {

double wall_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Seconds: fine steps below 100 ms (inter-token gaps), coarse ones up to long requests.
constexpr double kLatencyBounds[] = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                                     0.75,  1.0,   2.5,  5.0,  7.5,  10,   20,   40,  80};

std::vector<double> latency_bounds() {
  return {std::begin(kLatencyBounds), std::end(kLatencyBounds)};
}

std::string fmt(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

void header(std::string& out, const std::string& name, const char* type, const char* help) {
  out += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
}

void sample(std::string& out, const std::string& name, const std::string& labels, double v) {
  out += name;
  if (!labels.empty()) out += "{" + labels + "}";
  out += " " + fmt(v) + "\n";
}

nlohmann::json histogram_json(const Histogram& h) {
  nlohmann::json buckets = nlohmann::json::array();
  uint64_t cum = 0;
  for (size_t i = 0; i < h.counts().size(); ++i) {
    cum += h.counts()[i];
    const double le = i < h.bounds().size() ? h.bounds()[i] : INFINITY;
    buckets.push_back({{"le", fmt(le)}, {"count", cum}});
  }
  return {{"count", h.count()},
          {"sum", h.sum()},
          {"mean", h.count() ? h.sum() / double(h.count()) : 0.0},
          {"buckets", buckets}};
}

// Routed tokens per expert and per layer: nothing for dense models.
void moe_prometheus(std::string& out, const std::string& m, const std::vector<ExpertLoad>& load) {
  if (load.empty()) return;
  header(out, "deepserve:moe_expert_tokens", "counter", "Tokens routed to each MoE expert.");
  for (const auto& l : load)
    for (size_t e = 0; e < l.tokens.size(); ++e)
      sample(out, "deepserve:moe_expert_tokens_total",
             m + ",layer=\"" + std::to_string(l.layer) + "\",expert=\"" + std::to_string(e) + "\"",
             double(l.tokens[e]));
  header(out, "deepserve:moe_expert_utilization_variance", "gauge",
         "Variance over a layer's experts of their share of its routed tokens.");
  for (const auto& l : load)
    sample(out, "deepserve:moe_expert_utilization_variance",
           m + ",layer=\"" + std::to_string(l.layer) + "\"", expert_utilization_variance(l.tokens));
}

nlohmann::json moe_json(const std::vector<ExpertLoad>& load) {
  nlohmann::json layers = nlohmann::json::array();
  double sum = 0;
  for (const auto& l : load) {
    const double v = expert_utilization_variance(l.tokens);
    sum += v;
    layers.push_back({{"layer", l.layer}, {"tokens", l.tokens}, {"utilization_variance", v}});
  }
  return {{"layers", layers}, {"mean_utilization_variance", sum / double(load.size())}};
}

}  // namespace

double expert_utilization_variance(const std::vector<int64_t>& tokens) {
  double total = 0;
  for (int64_t t : tokens) total += double(t);
  if (tokens.empty() || total <= 0) return 0;
  const double mean = 1.0 / double(tokens.size());  // the shares sum to 1
  double var = 0;
  for (int64_t t : tokens) {
    const double d = double(t) / total - mean;
    var += d * d;
  }
  return var / double(tokens.size());
}

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double v) {
  const size_t i = size_t(std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin());
  ++counts_[i];
  ++count_;
  sum_ += v;
}

ServerMetrics::PerPriority::PerPriority()
    : ttft(latency_bounds()),
      itl(latency_bounds()),
      e2e(latency_bounds()),
      queue(latency_bounds()) {}

ServerMetrics::ServerMetrics(std::string model_name)
    : model_(std::move(model_name)), start_s_(wall_s()) {
  window_head_s_ = int64_t(start_s_);
}

void ServerMetrics::advance_window_locked(int64_t now_s) const {
  // Slots for seconds that passed without tokens are cleared as the head moves forward.
  const int64_t steps = std::min<int64_t>(now_s - window_head_s_, kWindowS);
  for (int64_t i = 1; i <= steps; ++i) window_[size_t((window_head_s_ + i) % kWindowS)] = 0;
  window_head_s_ = std::max(window_head_s_, now_s);
}

void ServerMetrics::token(Priority priority, double gap_s) {
  std::lock_guard<std::mutex> lock(mu_);
  if (gap_s >= 0) per_priority_[size_t(priority)].itl.observe(gap_s);
  const int64_t now = int64_t(wall_s());
  advance_window_locked(now);
  ++window_[size_t(now % kWindowS)];
}

void ServerMetrics::request_finished(const RequestRecord& r) {
  std::lock_guard<std::mutex> lock(mu_);
  prompt_tokens_ += r.prompt_tokens;
  generation_tokens_ += r.completion_tokens;
  ++requests_[r.finish_reason];
  if (r.finish_reason == "rejected") return;  // never scheduled: no latencies to report
  auto& pp = per_priority_[size_t(r.priority)];
  pp.e2e.observe(r.timings.total_s);
  pp.queue.observe(r.timings.queue_s);
  if (r.completion_tokens > 0) pp.ttft.observe(r.timings.ttft_s);
}

double ServerMetrics::tokens_per_second_locked() const {
  const double now = wall_s();
  advance_window_locked(int64_t(now));
  int64_t total = 0;
  for (int64_t v : window_) total += v;
  // Before a minute has passed, average over the time the server has been up.
  const double span = std::clamp(now - start_s_, 1.0, double(kWindowS));
  return double(total) / span;
}

void ServerMetrics::set_open_connections(int64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  open_connections_ = n;
}

std::string ServerMetrics::prometheus(const EngineStats& st) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  const std::string m = "model_name=\"" + model_ + "\"";
  header(out, "deepserve:prompt_tokens", "counter", "Prompt tokens of finished requests.");
  sample(out, "deepserve:prompt_tokens_total", m, double(prompt_tokens_));
  header(out, "deepserve:generation_tokens", "counter", "Generated tokens of finished requests.");
  sample(out, "deepserve:generation_tokens_total", m, double(generation_tokens_));
  header(out, "deepserve:requests", "counter", "Finished requests by finish reason.");
  for (const char* reason : {"stop", "length", "cancelled", "rejected", "error"}) {
    auto it = requests_.find(reason);
    sample(out, "deepserve:requests_total", m + ",finish_reason=\"" + reason + "\"",
           it == requests_.end() ? 0.0 : double(it->second));
  }
  header(out, "deepserve:preemptions", "counter", "Sequences preempted by the scheduler.");
  sample(out, "deepserve:preemptions_total", m, double(st.preemptions));

  struct Gauge {
    const char* name;
    const char* help;
    double v;
  };
  const Gauge gauges[] = {
      {"deepserve:num_requests_running", "Requests the scheduler is running.", double(st.running)},
      {"deepserve:num_requests_waiting", "Requests waiting to be scheduled (incl. preempted).",
       double(st.waiting)},
      {"deepserve:kv_cache_usage", "Fraction of KV blocks in use (0..1).", st.kv.usage},
      {"deepserve:kv_fragmentation", "Reserved but unused KV slots over reserved slots.",
       st.kv.fragmentation},
      {"deepserve:prefix_cache_hit_rate", "Prompt tokens served from the prefix cache.",
       st.kv.prefix_hit_rate},
      {"deepserve:tokens_per_second_1m_avg", "Generated tokens per second, last minute.",
       tokens_per_second_locked()},
      {"deepserve:http_connections_open", "Open HTTP connections.", double(open_connections_)},
  };
  for (const auto& g : gauges) {
    header(out, g.name, "gauge", g.help);
    sample(out, g.name, m, g.v);
  }

  moe_prometheus(out, m, st.expert_load);

  struct Hist {
    const char* name;
    const char* help;
    const Histogram PerPriority::*h;
  };
  const Hist hists[] = {
      {"deepserve:time_to_first_token_seconds", "Submit to first token.", &PerPriority::ttft},
      {"deepserve:inter_token_latency_seconds", "Between consecutive tokens.", &PerPriority::itl},
      {"deepserve:e2e_request_latency_seconds", "Submit to finish.", &PerPriority::e2e},
      {"deepserve:queue_time_seconds", "Submit to first scheduled.", &PerPriority::queue},
  };
  for (const auto& hd : hists) {
    const std::string name = hd.name;
    header(out, name, "histogram", hd.help);
    for (int p = 0; p < kPriorities; ++p) {
      const Histogram& h = per_priority_[size_t(p)].*hd.h;
      const std::string labels =
          m + ",priority=\"" + std::string(priority_name(Priority(p))) + "\"";
      uint64_t cum = 0;
      for (size_t i = 0; i < h.counts().size(); ++i) {
        cum += h.counts()[i];
        const double le = i < h.bounds().size() ? h.bounds()[i] : INFINITY;
        sample(out, name + "_bucket", labels + ",le=\"" + fmt(le) + "\"", double(cum));
      }
      sample(out, name + "_sum", labels, h.sum());
      sample(out, name + "_count", labels, double(h.count()));
    }
  }
  return out;
}

nlohmann::json ServerMetrics::json(const EngineStats& st) const {
  std::lock_guard<std::mutex> lock(mu_);
  nlohmann::json reqs = nlohmann::json::object();
  for (const char* reason : {"stop", "length", "cancelled", "rejected", "error"}) reqs[reason] = 0;
  for (const auto& [k, v] : requests_) reqs[k] = v;
  nlohmann::json lat = nlohmann::json::object();
  for (int p = 0; p < kPriorities; ++p) {
    const auto& pp = per_priority_[size_t(p)];
    lat[std::string(priority_name(Priority(p)))] = {
        {"time_to_first_token_seconds", histogram_json(pp.ttft)},
        {"inter_token_latency_seconds", histogram_json(pp.itl)},
        {"e2e_request_latency_seconds", histogram_json(pp.e2e)},
        {"queue_time_seconds", histogram_json(pp.queue)}};
  }
  nlohmann::json j = {{"model", model_},
                      {"prompt_tokens_total", prompt_tokens_},
                      {"generation_tokens_total", generation_tokens_},
                      {"requests_total", reqs},
                      {"num_requests_running", st.running},
                      {"num_requests_waiting", st.waiting},
                      {"kv_cache_usage", st.kv.usage},
                      {"kv_fragmentation", st.kv.fragmentation},
                      {"prefix_cache_hit_rate", st.kv.prefix_hit_rate},
                      {"preemptions_total", st.preemptions},
                      {"tokens_per_second_1m_avg", tokens_per_second_locked()},
                      {"http_connections_open", open_connections_},
                      {"latency", lat}};
  if (!st.expert_load.empty()) j["moe"] = moe_json(st.expert_load);
  return j;
}

}  // namespace ds
