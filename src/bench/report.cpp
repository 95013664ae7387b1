#include "bench/report.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <ctime>
#include <fstream>
#include <thread>

#include "core/build_info.h"

namespace ds {
namespace {

using Json = nlohmann::json;

// A command's standard output, trimmed; nullopt when it fails or prints nothing.
std::optional<std::string> command_output(const std::string& cmd) {
  FILE* p = popen((cmd + " 2>/dev/null").c_str(), "r");
  if (!p) return std::nullopt;
  std::array<char, 4096> buf{};
  std::string out;
  while (fgets(buf.data(), int(buf.size()), p)) out += buf.data();
  const int rc = pclose(p);
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r' || out.back() == ' '))
    out.pop_back();
  if (rc != 0 || out.empty()) return std::nullopt;
  return out;
}

std::optional<std::string> cpu_model_name() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) != 0) continue;
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string v = line.substr(colon + 1);
    while (!v.empty() && v.front() == ' ') v.erase(v.begin());
    return v;
  }
  return std::nullopt;
}

template <class T>
Json opt(const std::optional<T>& v) {
  return v ? Json(*v) : Json();
}

Json summary_json(const std::optional<Summary>& s) {
  if (!s)
    return {
        {"mean", nullptr}, {"p50", nullptr}, {"p90", nullptr}, {"p99", nullptr}, {"max", nullptr}};
  return {{"mean", s->mean}, {"p50", s->p50}, {"p90", s->p90}, {"p99", s->p99}, {"max", s->max}};
}

std::string cell(const std::optional<double>& v, const char* fmt) {
  if (!v) return "-";
  char buf[64];
  std::snprintf(buf, sizeof buf, fmt, *v);
  return buf;
}

Json timing_rows_json(const std::vector<OpTimingRow>& rows) {
  Json a = Json::array();
  for (const OpTimingRow& r : rows)
    a.push_back({{"label", r.label},
                 {"kind", r.kind},
                 {"calls", r.calls},
                 {"us", r.us},
                 {"share", r.share}});
  return a;
}

Json class_json(const ClassResult& c) {
  const BenchClass& k = c.cls;
  return {{"name", k.name},
          {"priority", k.priority.empty() ? Json() : Json(k.priority)},
          {"input_len", k.input_len},
          {"output_len", k.output_len},
          {"concurrency", k.concurrency},
          {"num_prompts", k.num_prompts},
          {"request_rate", opt(k.rate)},
          {"start_s", k.start_s},
          {"background", k.background},
          {"completed", c.completed},
          {"failed", c.failed},
          {"duration_s", c.duration_s},
          {"output_tokens_per_s", c.output_tokens_per_s},
          {"ttft_ms", summary_json(c.ttft_ms)},
          {"tpot_ms", summary_json(c.tpot_ms)},
          {"itl_ms", summary_json(c.itl_ms)},
          {"e2e_ms", summary_json(c.e2e_ms)},
          {"samples",
           {{"ttft_ms", c.ttft_samples_ms},
            {"tpot_ms", c.tpot_samples_ms},
            {"e2e_ms", c.e2e_samples_ms}}}};
}

std::string p50_p99(const std::optional<Summary>& s, const char* fmt) {
  if (!s) return "-";
  return cell(s->p50, fmt) + "/" + cell(s->p99, fmt);
}

}  // namespace

Json op_profile_json(const OpProfile& p) {
  Json groups = Json::array();
  for (const StepGroupCount& g : p.groups)
    groups.push_back({{"tokens", g.tokens}, {"decode", g.decode}, {"steps", g.steps}});
  Json step;  // null without steps
  if (p.step) {
    const StepProfile& s = *p.step;
    step = {{"tokens", s.tokens},
            {"decode", s.decode},
            {"steps", s.steps},
            {"seqs", s.seqs},
            {"context", s.context},
            {"op_ms", s.op_ms},
            {"wall_ms", s.wall_ms},
            {"ops", timing_rows_json(s.ops)},
            {"kinds", timing_rows_json(s.kinds)}};
  }
  return {{"backend", p.backend}, {"steps", p.steps}, {"groups", groups}, {"step", step}};
}

SystemInfo collect_system_info(const std::string& command, const std::string& version) {
  SystemInfo s;
  if (auto g = command_output("nvidia-smi --query-gpu=name,driver_version --format=csv,noheader")) {
    const std::string first = g->substr(0, g->find('\n'));  // the first GPU
    for (size_t at = 0; at < g->size(); at = g->find('\n', at) + 1) {
      if ((*g)[at] != '\n') ++s.gpu_count;
      if (g->find('\n', at) == std::string::npos) break;
    }
    const size_t comma = first.rfind(',');
    s.gpu = first.substr(0, comma);
    if (comma != std::string::npos) {
      std::string d = first.substr(comma + 1);
      while (!d.empty() && d.front() == ' ') d.erase(d.begin());
      s.driver = d;
    }
  }
  s.cpu = cpu_model_name();
  s.cpu_cores = int(std::thread::hardware_concurrency());
  s.commit = build_commit();
  s.command = command;
  s.version = version;
  const std::time_t now = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  s.time_utc = buf;
  return s;
}

std::optional<double> default_bandwidth_gbps(const std::string& device,
                                             const std::optional<std::string>& gpu_name) {
  if (device == "cuda" && gpu_name && gpu_name->find("H200") != std::string::npos) return 4190;
  return std::nullopt;
}

Json scenario_json(const ScenarioResult& r) {
  const BenchScenario& s = r.scenario;
  Json j = {{"name", s.name},
            {"concurrency", s.concurrency},
            {"input_len", s.input_len},
            {"output_len", s.output_len},
            {"num_prompts", s.num_prompts},
            {"request_rate", opt(r.rate)},
            {"completed", r.completed},
            {"failed", r.failed},
            {"errors", r.errors},
            {"finish_reasons", r.finish_reasons},
            {"duration_s", r.duration_s},
            {"prompt_tokens", r.prompt_tokens},
            {"output_tokens", r.output_tokens},
            {"client_output_tokens", r.client_output_tokens},
            {"usage_output_tokens", opt(r.usage_output_tokens)},
            {"requests_per_s", r.requests_per_s},
            {"output_tokens_per_s", r.output_tokens_per_s},
            {"total_tokens_per_s", r.total_tokens_per_s},
            {"prompt_tokens_per_s", opt(r.prompt_tokens_per_s)},
            {"decode_tokens_per_s", opt(r.decode_tokens_per_s)},
            {"ttft_ms", summary_json(r.ttft_ms)},
            {"tpot_ms", summary_json(r.tpot_ms)},
            {"itl_ms", summary_json(r.itl_ms)},
            {"e2e_ms", summary_json(r.e2e_ms)}};
  j["step_time_ms"] = {{"mean", r.step_time_ms ? Json(r.step_time_ms->mean) : Json()},
                       {"std", r.step_time_ms ? Json(r.step_time_ms->std) : Json()},
                       {"steps", r.step_time_ms ? r.step_time_ms->count : 0},
                       {"device_mean", opt(r.step_device_ms)},
                       {"host_gap_mean", opt(r.step_host_gap_ms)},
                       {"source", r.step_time_source.empty() ? Json() : Json(r.step_time_source)}};
  j["peak_gpu_memory_gb"] = opt(r.peak_gpu_memory_gb);
  j["peak_rss_gb"] = opt(r.peak_rss_gb);
  j["kv_usage_peak"] = opt(r.kv_usage_peak);
  j["kv_fragmentation"] = opt(r.kv_fragmentation);
  j["prefix_cache_hit_rate"] = opt(r.prefix_cache_hit_rate);
  j["preemptions"] = opt(r.preemptions);
  j["roofline_fraction"] = opt(r.roofline_fraction);
  j["roofline"] = {{"bytes_per_step_gb", opt(r.bytes_per_step_gb)},
                   {"achieved_gbps", opt(r.achieved_gbps)},
                   {"bandwidth_gbps", opt(r.bandwidth_gbps)},
                   {"mean_decode_batch", opt(r.mean_decode_batch)},
                   {"mean_context", opt(r.mean_context)}};
  j["usd_per_million_output_tokens"] = opt(r.usd_per_million_output_tokens);
  j["samples"] = {
      {"ttft_ms", r.ttft_samples_ms}, {"tpot_ms", r.tpot_samples_ms}, {"e2e_ms", r.e2e_samples_ms}};
  j["op_profile"] = r.op_profile ? op_profile_json(*r.op_profile) : Json();
  j["classes"] = Json::array();
  for (const ClassResult& c : r.classes) j["classes"].push_back(class_json(c));
  return j;
}

std::string dominant_weight_format(
    const std::map<std::string, std::pair<uint64_t, uint64_t>>& formats) {
  std::string best;
  uint64_t most = 0;
  for (const auto& [name, bp] : formats)
    if ((name != "F32" || formats.size() == 1) && (best.empty() || bp.first > most))
      best = name, most = bp.first;
  if (best == "FP8W") return "fp8";
  std::transform(best.begin(), best.end(), best.begin(),
                 [](unsigned char c) { return char(std::tolower(c)); });
  return best;
}

Json bench_json(const BenchSpec& spec, const BenchRun& run, const SystemInfo& sys,
                const ReportContext& ctx) {
  Json scen = Json::array();
  for (const auto& r : run.scenarios) scen.push_back(scenario_json(r));
  const Json engine = {{"kv_cache_tokens", spec.engine.kv_cache_tokens},
                       {"block_size", spec.engine.block_size},
                       {"kv_mode", spec.engine.kv_mode},
                       {"prefix_cache", spec.engine.prefix_cache},
                       {"max_num_seqs", spec.engine.max_num_seqs},
                       {"max_num_batched_tokens", spec.engine.max_num_batched_tokens},
                       {"lower_class_prefill_tokens", spec.engine.lower_class_prefill_tokens},
                       {"batch_prefill_tokens", spec.engine.batch_prefill_tokens},
                       {"prefill_first_steps", spec.engine.prefill_first_steps},
                       {"defer_wakeups", spec.engine.defer_wakeups},
                       {"warmup_tokens", spec.engine.warmup_tokens}};
  return {{"schema_version", 1},
          {"name", spec.name},
          {"description", spec.description},
          {"mode", ctx.mode},
          {"model", ctx.model},
          {"url", ctx.url.empty() ? Json() : Json(ctx.url)},
          {"system",
           {{"gpu", opt(sys.gpu)},
            {"gpu_count", sys.gpu_count},
            {"driver", opt(sys.driver)},
            {"cpu", opt(sys.cpu)},
            {"cpu_cores", sys.cpu_cores},
            {"commit", opt(sys.commit)},
            {"command", sys.command},
            {"version", sys.version},
            {"time_utc", sys.time_utc}}},
          {"config",
           {{"device", ctx.device.empty() ? Json(spec.device) : Json(ctx.device)},
            {"kv_dtype", spec.kv_dtype.empty() ? Json() : Json(spec.kv_dtype)},
            {"kv_cache_dtype", !spec.kv_dtype.empty() ? Json(spec.kv_dtype)
                               : ctx.device == "cuda" ? Json("bf16")
                               : ctx.device == "cpu"  ? Json("f32")
                                                      : Json()},
            {"load_format", spec.load_format},
            // What the engine ran offline; online, the YAML's word ("none": the checkpoint's).
            {"quantize", !ctx.weight_format.empty() ? ctx.weight_format
                         : spec.quantize == "none"  ? "bf16"
                                                    : spec.quantize},
            {"weights", ctx.weights.empty() ? Json() : Json(ctx.weights)},
            {"kv_cache",
             {{"capacity_tokens", ctx.kv_capacity_tokens ? Json(ctx.kv_capacity_tokens) : Json()},
              {"bytes_per_token", ctx.kv_bytes_per_token ? Json(ctx.kv_bytes_per_token) : Json()},
              {"tokens_that_fit", ctx.kv_tokens_fit ? Json(ctx.kv_tokens_fit) : Json()}}},
            {"gpu_memory_utilization", spec.gpu_memory_utilization},
            {"threads", spec.threads},
            {"tensor_parallel_size", spec.tensor_parallel_size},
            {"expert_parallel_size", spec.expert_parallel ? spec.tensor_parallel_size : 1},
            {"precision", spec.precision},
            {"engine", engine},
            {"request_rate", opt(spec.rate)},
            {"priority", spec.priority.empty() ? Json() : Json(spec.priority)},
            {"ignore_eos", spec.ignore_eos},
            {"temperature", spec.temperature},
            {"warmup", spec.warmup},
            {"prompt", spec.prompt},
            {"seed", spec.seed},
            {"bandwidth_gbps",
             opt(run.scenarios.empty() ? std::nullopt : run.scenarios[0].bandwidth_gbps)},
            {"bandwidth_source", ctx.bandwidth_source},
            {"profile_ops", ctx.profile_ops}}},
          {"warmup_s", run.warmup_s},
          {"scenarios", scen}};
}

void print_table(std::FILE* out, const BenchRun& run) {
  std::fprintf(out, "%-24s %5s %6s %5s %7s %9s %9s %9s %9s %15s %13s %13s %14s %8s %7s\n",
               "scenario", "conc", "in", "out", "req/s", "out tok/s", "tot tok/s", "pp tok/s",
               "tg tok/s", "TTFT p50/p99", "TPOT p50/p99", "E2E p50/p99", "step ms (std)",
               "roofline", "mem GB");
  for (const auto& r : run.scenarios) {
    const std::string step = r.step_time_ms ? cell(r.step_time_ms->mean, "%.2f") + " (" +
                                                  cell(r.step_time_ms->std, "%.2f") + ")"
                                            : "-";
    const auto mem = r.peak_gpu_memory_gb ? r.peak_gpu_memory_gb : r.peak_rss_gb;
    const std::optional<double> roof =
        r.roofline_fraction ? std::optional<double>(*r.roofline_fraction * 100) : std::nullopt;
    std::fprintf(out, "%-24s %5d %6d %5d %7.2f %9.1f %9.1f %9s %9s %15s %13s %13s %14s %8s %7s\n",
                 r.scenario.name.c_str(), r.scenario.concurrency, r.scenario.input_len,
                 r.scenario.output_len, r.requests_per_s, r.output_tokens_per_s,
                 r.total_tokens_per_s, cell(r.prompt_tokens_per_s, "%.1f").c_str(),
                 cell(r.decode_tokens_per_s, "%.1f").c_str(), p50_p99(r.ttft_ms, "%.1f").c_str(),
                 p50_p99(r.tpot_ms, "%.2f").c_str(), p50_p99(r.e2e_ms, "%.0f").c_str(),
                 step.c_str(), cell(roof, "%.1f%%").c_str(), cell(mem, "%.2f").c_str());
    for (const ClassResult& c : r.classes) {  // mixed scenarios: each class's own latencies
      const std::string name =
          "  " + c.cls.name + (c.cls.priority.empty() ? "" : " (" + c.cls.priority + ")");
      std::fprintf(out, "%-24s %5d %6d %5d %7s %9.1f %9s %9s %9s %15s %13s %13s\n", name.c_str(),
                   c.cls.concurrency, c.cls.input_len, c.cls.output_len, "", c.output_tokens_per_s,
                   "", "", "", p50_p99(c.ttft_ms, "%.1f").c_str(),
                   p50_p99(c.tpot_ms, "%.2f").c_str(), p50_p99(c.e2e_ms, "%.0f").c_str());
    }
    if (r.step_device_ms && r.step_host_gap_ms)
      std::fprintf(out,
                   "  engine decode steps: %.3f ms launch to results, %.3f ms host gap before\n",
                   *r.step_device_ms, *r.step_host_gap_ms);
    if (r.failed)
      std::fprintf(out, "  %d request(s) failed: %s\n", r.failed,
                   r.errors.empty() ? "" : r.errors.front().c_str());
  }
  std::fprintf(out,
               "(ms unless noted; pp = prompt tokens / TTFT and tg = 1 / TPOT, per request; "
               "mem = peak GPU memory, else peak RSS)\n");
  bool profiled = false;
  for (const auto& r : run.scenarios) {
    if (!r.op_profile) continue;
    std::fprintf(out, "\n%s ", r.scenario.name.c_str());
    print_op_profile(out, *r.op_profile);
    profiled = true;
  }
  if (profiled)
    std::fprintf(out,
                 "(--profile-ops: eager per-op times without graphs or launch gaps; quote a plain "
                 "run for throughput)\n");
}

}  // namespace ds
