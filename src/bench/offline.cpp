#include "bench/offline.h"

#include <chrono>
#include <fstream>
#include <sstream>

#ifdef DEEPSERVE_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace ds {

double steady_now_s() {
  // The engine stamps its token events with this same clock.
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::optional<double> peak_rss_bytes() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("VmHWM:", 0) != 0) continue;
    std::istringstream ss(line.substr(6));
    double kb = 0;
    if (ss >> kb) return kb * 1024.0;
  }
  return std::nullopt;
}

std::optional<double> gpu_memory_used_bytes() {
#ifdef DEEPSERVE_HAVE_CUDA
  size_t free = 0, total = 0;
  if (cudaMemGetInfo(&free, &total) == cudaSuccess) return double(total - free);
#endif
  return std::nullopt;
}

OfflineTarget::OfflineTarget(Engine& engine, Model& model, OfflineTargetConfig cfg)
    : engine_(engine), model_(model), cfg_(std::move(cfg)) {}

BenchResult OfflineTarget::run(const BenchRequest& req) {
  EngineRequest er;
  er.prompt = req.prompt_ids;
  er.max_tokens = req.max_tokens;
  er.ignore_eos = req.ignore_eos;
  er.sampling.temperature = float(req.temperature);
  er.sampling.top_k = 0;
  er.sampling.top_p = 1;
  er.sampling.min_p = 0;
  er.sampling.seed = req.seed;
  BenchResult r;
  if (!req.priority.empty()) {
    const auto p = parse_priority(req.priority);
    if (!p) {
      r.error = "unknown priority '" + req.priority + "'";
      return r;
    }
    er.priority = *p;
  }
  r.prompt_tokens = int(req.prompt_ids.size());
  r.start_s = steady_now_s();
  std::shared_ptr<RequestHandle> h;
  try {
    h = engine_.submit(std::move(er));
  } catch (const std::exception& e) {
    submitted();
    r.end_s = steady_now_s();
    r.error = e.what();
    return r;
  }
  submitted();
  while (auto ev = h->next()) {
    if (ev->token >= 0) {
      r.token_s.push_back(ev->time_s);
      ++r.client_output_tokens;
    }
    if (ev->final) {
      r.end_s = steady_now_s();
      r.finish_reason = ev->finish_reason;
      r.error = ev->error;
      r.usage_prompt_tokens = ev->usage.prompt_tokens;
      r.usage_output_tokens = ev->usage.completion_tokens;
    }
  }
  r.ok = r.finish_reason == "stop" || r.finish_reason == "length";
  if (!r.ok && r.error.empty()) r.error = "finished with '" + r.finish_reason + "'";
  return r;
}

void OfflineTarget::begin_wave(int n) {
  if (n <= 1) return;  // one request starts alone anyway
  wave_left_ = n;
  engine_.hold_admission(true);
}

void OfflineTarget::end_wave() {
  if (wave_left_.exchange(0) > 0) engine_.hold_admission(false);
}

void OfflineTarget::submitted() {
  // The wave's last submission releases the hold (later ones count below zero, harmlessly).
  if (wave_left_.fetch_sub(1) == 1) engine_.hold_admission(false);
}

TargetSnapshot OfflineTarget::snapshot() {
  const EngineStats st = engine_.stats();
  TargetSnapshot s;
  if (cfg_.device_memory_used)
    s.gpu_memory_bytes = cfg_.device_memory_used();
  else if (cfg_.device != "cpu")
    s.gpu_memory_bytes = gpu_memory_used_bytes();
  s.rss_peak_bytes = peak_rss_bytes();
  s.kv_usage = st.kv.usage;
  s.kv_fragmentation = st.kv.fragmentation;
  s.steps = st.steps;
  s.mean_fragmentation = st.mean_fragmentation;
  s.prefix_query_tokens = st.kv.prefix_query_tokens;
  s.prefix_hit_tokens = st.kv.prefix_hit_tokens;
  s.preemptions = st.preemptions;
  s.device_s = st.device_s;
  s.device_steps = st.device_steps;
  s.host_gap_s = st.host_gap_s;
  s.host_gaps = st.host_gaps;
  return s;
}

void OfflineTarget::reset_op_profile() {
  if (cfg_.profiler) cfg_.profiler->reset();
}

std::optional<OpProfile> OfflineTarget::op_profile() {
  if (!cfg_.profiler) return std::nullopt;
  if (cfg_.profile_step_tokens > 0) return cfg_.profiler->profile(cfg_.profile_step_tokens);
  return cfg_.profiler->profile();
}

std::optional<RooflineModel> OfflineTarget::roofline() const {
  RooflineModel m;
  m.weights = model_.weight_bytes();
  m.kv_bytes_per_token = model_.kv_bytes_per_token(cfg_.kv_dtype);
  return m;
}

}  // namespace ds
