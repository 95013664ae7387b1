// The benchmark's outputs: the JSON document (schema in docs/BENCH.md) and the table.
#pragma once

#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "bench/runner.h"
#include "bench/spec.h"

namespace ds {

struct SystemInfo {
  std::optional<std::string> gpu, driver;  // from nvidia-smi when there is one
  int gpu_count = 0;                       // GPUs nvidia-smi lists
  std::optional<std::string> cpu;          // /proc/cpuinfo's model name
  int cpu_cores = 0;
  std::optional<std::string> commit;  // build_commit() of this binary
  std::string command;
  std::string version;
  std::string time_utc;  // ISO 8601
};

// Looks the machine up (runs nvidia-smi and git when they exist).
SystemInfo collect_system_info(const std::string& command, const std::string& version);

// The default memory bandwidth for a device, GB/s (docs/BENCH.md): 4190 for an H200, else none.
std::optional<double> default_bandwidth_gbps(const std::string& device,
                                             const std::optional<std::string>& gpu_name);

struct ReportContext {
  std::string mode;   // offline | online
  std::string model;  // path (offline) or served name (online)
  std::string url;
  std::string device;            // offline: the device the engine ran on
  std::string bandwidth_source;  // "config", "default for <gpu>" or "none"
  bool profile_ops = false;      // ops ran eagerly between timing marks (--profile-ops)
  // Offline: the format holding most of the weight bytes ("bf16", "w4a16", "fp8", a GGUF type
  // such as "q4_1"), and every format with its bytes (the start-up log's line).
  std::string weight_format, weights;
  // Offline: the engine's KV cache (capacity, bytes per token over all layers) and, on CUDA,
  // the tokens the GPU could hold after the weights (the automatic capacity); 0 = unknown.
  int64_t kv_capacity_tokens = 0, kv_tokens_fit = 0;
  uint64_t kv_bytes_per_token = 0;
};

// The format holding most bytes among formats -> (bytes, params), F32 left out unless it is
// all there is, named as --quantize does (FP8W "fp8") or in lower case ("bf16", "q4_k").
std::string dominant_weight_format(const std::map<std::string, std::pair<uint64_t, uint64_t>>& f);

nlohmann::json scenario_json(const ScenarioResult& r);
// The `op_profile` object of a scenario (docs/BENCH.md).
nlohmann::json op_profile_json(const OpProfile& p);
nlohmann::json bench_json(const BenchSpec& spec, const BenchRun& run, const SystemInfo& sys,
                          const ReportContext& ctx);
void print_table(std::FILE* out, const BenchRun& run);

}  // namespace ds
