// `deepserve bench`: a workload YAML run offline (in-process engine) or online (HTTP), with a
// table, a JSON file and plots.
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "backend/profiling_backend.h"
#include "bench/offline.h"
#include "bench/online.h"
#include "bench/plots.h"
#include "bench/report.h"
#include "cli/commands.h"
#include "core/error.h"
#ifdef DEEPSERVE_HAVE_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

namespace ds {
namespace {

std::optional<std::string> getenv_str(const std::string& name) {
  const char* v = std::getenv(name.c_str());
  return v ? std::optional<std::string>(v) : std::nullopt;
}

// Options the session may or may not have (they arrive with the CUDA work): set them when
// the struct has the field, else refuse settings that would be silently ignored.
template <class M>
void set_device_options(M& m, const BenchSpec& spec) {
  if constexpr (requires { m.device = spec.device; }) {
    m.device = spec.device;
  } else if (spec.device == "cuda") {
    throw Error("device 'cuda' is not available in this build (only cpu)");
  }
  if constexpr (requires { m.gpu_memory_utilization = spec.gpu_memory_utilization; })
    m.gpu_memory_utilization = spec.gpu_memory_utilization;
}

template <class E>
void set_kv_dtype(E& e, const std::string& kv_dtype) {
  if constexpr (requires { e.kv_dtype = kv_dtype; }) e.kv_dtype = kv_dtype;
}

DType kv_dtype_of(const BenchSpec& spec, const std::string& device) {
  return kv_cache_dtype(spec.kv_dtype, device == "cuda" ? DeviceKind::CUDA : DeviceKind::CPU,
                        spec.precision);
}

// The spec's bandwidth, else the device's documented default (docs/BENCH.md).
void resolve_bandwidth(const BenchSpec& spec, const std::string& device, const SystemInfo& sys,
                       BenchRunOptions& ro, ReportContext& ctx) {
  ro.bandwidth_gbps = spec.bandwidth_gbps;
  ctx.bandwidth_source = "config";
  if (ro.bandwidth_gbps) return;
  ro.bandwidth_gbps = default_bandwidth_gbps(device, sys.gpu);
  ctx.bandwidth_source = ro.bandwidth_gbps ? "default for " + sys.gpu.value_or("?") : "none";
}

BenchRun run_offline(const BenchSpec& spec, const SystemInfo& sys, BenchRunOptions ro,
                     ReportContext& ctx, bool profile_ops, int profile_step_tokens) {
  ModelOptions m;
  m.model = spec.model;
  m.threads = spec.threads;
  m.isa = spec.isa;
  m.precision = spec.precision;
  m.load_format = spec.load_format;
  m.quantize = spec.quantize;
  m.tensor_parallel_size = spec.tensor_parallel_size;
  m.expert_parallel = spec.expert_parallel;
  set_device_options(m, spec);
  ProfilingBackend* profiler = nullptr;  // owned by the session
  if (profile_ops)
    m.wrap_backend = [&profiler](Backend& inner) {
      auto p = std::make_unique<ProfilingBackend>(inner);
      profiler = p.get();
      return std::unique_ptr<Backend>(std::move(p));
    };
  EngineOptions e;
  e.kv_cache_tokens = spec.engine.kv_cache_tokens;
  e.block_size = spec.engine.block_size;
  e.kv_mode = spec.engine.kv_mode;
  e.prefix_cache = spec.engine.prefix_cache;
  e.max_num_seqs = spec.engine.max_num_seqs;
  e.max_num_batched_tokens = spec.engine.max_num_batched_tokens;
  e.lower_class_prefill_tokens = spec.engine.lower_class_prefill_tokens;
  e.batch_prefill_tokens = spec.engine.batch_prefill_tokens;
  e.prefill_first_steps = spec.engine.prefill_first_steps;
  e.defer_wakeups = spec.engine.defer_wakeups;
  e.warmup_tokens = spec.engine.warmup_tokens;
  set_kv_dtype(e, spec.kv_dtype);
  Session s = open_session(m, e);
  const std::string device = s.backend->device().kind == DeviceKind::CUDA ? "cuda" : "cpu";
  ctx.mode = "offline";
  ctx.model = s.loaded.path;
  ctx.device = device;
  ctx.weight_format = dominant_weight_format(s.loaded.model->weight_formats());
  ctx.weights = describe_weight_formats(*s.loaded.model);
  ctx.kv_capacity_tokens = s.engine->kv_capacity_tokens();
  ctx.kv_bytes_per_token = s.kv_bytes_per_token;
  ctx.kv_tokens_fit = s.kv_tokens_fit;
  resolve_bandwidth(spec, device, sys, ro, ctx);
  PromptMaker prompts({s.loaded.tokenizer.get(), s.loaded.config.vocab, spec.prompt == "text",
                       /*send_text=*/false});
  OfflineTargetConfig tc{device, kv_dtype_of(spec, device), {}, profiler, profile_step_tokens};
#ifdef DEEPSERVE_HAVE_CUDA
  // The pool reserves most of the GPU up front: what its live buffers hold is the real use.
  if (device == "cuda")
    tc.device_memory_used = [&b = *s.backend] { return double(cuda_pool_info(b).used_bytes); };
#endif
  OfflineTarget target(*s.engine, *s.loaded.model, tc);
  return run_bench(spec, target, prompts, ro);
}

BenchRun run_online(const BenchSpec& spec, BenchRunOptions ro, ReportContext& ctx) {
  // The model's metadata (no weights) gives the tokenizer random prompts are drawn from.
  LoadedModel meta;
  try {
    meta =
        open_model_metadata(resolve_model_path(spec.model), load_format_is_dummy(spec.load_format));
  } catch (const std::exception& e) {
    if (!spec.vocab_size || spec.prompt == "text")
      throw Error(std::string("online mode draws prompts from the model's vocabulary: ") +
                  e.what() + "\n(set `model:` to the served checkpoint, or `vocab_size:`)");
  }
  OnlineTargetConfig oc;
  oc.url = spec.url;
  oc.model_name = spec.served_model_name;
  oc.api_key = spec.api_key;
  oc.count_logprobs = spec.count_tokens == "logprobs";
  oc.request_timeout_s = spec.request_timeout_s;
  OnlineTarget target(oc);
  ctx.mode = "online";
  ctx.model = target.model_name();
  ctx.url = spec.url;
  ctx.bandwidth_source = "none";  // the client does not load the model: no roofline
  ro.snapshot_interval_s = 0.25;  // each sample is an HTTP request
  const int vocab = meta.tokenizer ? meta.tokenizer->vocab_size()
                                   : spec.vocab_size.value_or(int(meta.config.vocab));
  PromptMaker prompts({meta.tokenizer.get(), vocab, spec.prompt == "text", /*send_text=*/true});
  return run_bench(spec, target, prompts, ro);
}

}  // namespace

int run_benchmark(const BenchOptions& o) {
  BenchSpec spec = load_bench_spec(o.config, getenv_str);
  if (!o.url.empty()) spec.url = o.url;
  if (o.gpu_hour_price) spec.gpu_hour_price = o.gpu_hour_price;
  if (o.lower_class_prefill_tokens)
    spec.engine.lower_class_prefill_tokens = *o.lower_class_prefill_tokens;
  if (o.prefill_first_steps) spec.engine.prefill_first_steps = *o.prefill_first_steps;
  if (o.max_num_batched_tokens) spec.engine.max_num_batched_tokens = *o.max_num_batched_tokens;
  if (o.defer_wakeups) spec.engine.defer_wakeups = *o.defer_wakeups;
  if (o.tensor_parallel_size) spec.tensor_parallel_size = *o.tensor_parallel_size;
  if (o.expert_parallel) spec.expert_parallel = true;
  if (o.profile_ops && !spec.url.empty())
    throw Error(
        "--profile-ops times the ops of an in-process engine: offline mode only "
        "(drop --url and the YAML's url)");
  if (o.profile_step_tokens > 0 && !o.profile_ops)
    throw Error("--profile-step-tokens chooses the steps --profile-ops reports: add --profile-ops");
  const SystemInfo sys = collect_system_info(o.command, DEEPSERVE_VERSION);

  ReportContext ctx;
  ctx.profile_ops = o.profile_ops;
  BenchRunOptions ro;
  ro.gpu_hour_price = spec.gpu_hour_price;
  const BenchRun run = spec.url.empty()
                           ? run_offline(spec, sys, ro, ctx, o.profile_ops, o.profile_step_tokens)
                           : run_online(spec, ro, ctx);
  const nlohmann::json doc = bench_json(spec, run, sys, ctx);

  std::printf("%s (%s%s, %s)\n", spec.name.c_str(), ctx.mode.c_str(),
              ctx.device.empty() ? "" : (" on " + ctx.device).c_str(), ctx.model.c_str());
  print_table(stdout, run);
  std::fflush(stdout);

  std::string json_path = o.output;
  if (json_path.empty() && !o.plots.empty()) {
    std::filesystem::create_directories(o.plots);
    json_path = (std::filesystem::path(o.plots) / "bench.json").string();
  }
  if (!json_path.empty()) {
    std::ofstream out(json_path);
    if (!out) throw Error(json_path + ": cannot write the JSON result");
    out << doc.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    if (!out) throw Error(json_path + ": write failed");
    std::fprintf(stderr, "bench: wrote %s\n", json_path.c_str());
  }
  if (!o.plots.empty()) {
    std::filesystem::create_directories(o.plots);
    const std::string files =
        draw_plots({json_path, o.plots, getenv_str("VIRTUAL_ENV").value_or("")});
    std::fprintf(stderr, "bench: plots:\n%s", files.c_str());
  }
  int failed = 0;
  for (const auto& s : run.scenarios) failed += s.failed;
  return failed ? 2 : 0;
}

}  // namespace ds
