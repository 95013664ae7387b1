// The benchmark's outputs: the JSON document (schema in docs/BENCH.md) and the table.
#pragma once

#include <cstdio>
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
};

nlohmann::json scenario_json(const ScenarioResult& r);
// The `op_profile` object of a scenario (docs/BENCH.md).
nlohmann::json op_profile_json(const OpProfile& p);
nlohmann::json bench_json(const BenchSpec& spec, const BenchRun& run, const SystemInfo& sys,
                          const ReportContext& ctx);
void print_table(std::FILE* out, const BenchRun& run);

}  // namespace ds
