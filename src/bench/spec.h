// A benchmark workload as read from YAML (docs/BENCH.md): the model and engine to run, and a
// matrix of scenarios (concurrency x input length x output length).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace ds {

// Engine options as the YAML's `engine:` section gives them (0 / empty: the CLI's default).
struct BenchEngineSpec {
  int64_t kv_cache_tokens = 0;
  int block_size = 16;
  std::string kv_mode = "dynamic";
  bool prefix_cache = true;
  int max_num_seqs = 64;
  int max_num_batched_tokens = 2048;
  int lower_class_prefill_tokens = 0;  // priority isolation; -1: off
  int batch_prefill_tokens = 512;      // batch-class prefill per step; -1: no cap
  int prefill_first_steps = 8;         // decodes sit out a burst of prompts; 0: never
  int defer_wakeups = -1;              // EngineConfig::defer_wakeups (-1: device backends)
  int64_t warmup_tokens = -1;          // EngineConfig::warmup_tokens
};

// One class of requests of a mixed scenario (`classes:`): its own shape, load and priority.
struct BenchClass {
  std::string name{};
  std::string priority{};  // "latency-critical", "standard", "batch"; "" = the target's default
  int input_len = 0;
  int output_len = 0;
  int concurrency = 1;           // requests of this class in flight at most
  int num_prompts = 0;           // requests (background classes: at most)
  std::optional<double> rate{};  // Poisson arrivals per second; unset: as concurrency allows
  double start_s = 0;            // when its first request may go out, from the scenario's start
  bool background = false;       // issues no new request once the other classes are done
};

// One cell of the matrix, or the one scenario of a spec with classes.
struct BenchScenario {
  std::string name;     // "c4_in512_out128" (+ "_r2.5" with a request rate), or the spec's name
  int concurrency = 1;  // mixed: summed over the classes
  int input_len = 0;    // mixed: 0
  int output_len = 0;   // mixed: 0
  int num_prompts = 0;  // mixed: summed over the foreground classes
  // Each a class of its own; a matrix cell is the one class {"", spec priority, its shape}.
  std::vector<BenchClass> classes;
  bool mixed = false;  // from `classes:` (per-class figures are reported)
};

struct BenchSpec {
  std::string name;
  std::string description;
  std::string model;                 // path after ${VAR} expansion; empty = the embedded default
  std::string load_format = "auto";  // "dummy": random weights from the model's config.json
  std::string quantize = "none";     // load-time weight format: none, w4a16 or fp8

  // Backend.
  std::string device = "auto";  // cpu, cuda, or auto (cuda when built with it and a GPU is seen)
  double gpu_memory_utilization = 0.9;
  int threads = 0;               // 0 = all cores
  int tensor_parallel_size = 1;  // ranks (GPUs) the model is split over
  bool expert_parallel = false;  // routed experts split by id over those ranks
  std::string precision = "f32";
  std::string isa = "auto";
  BenchEngineSpec engine;

  // Matrix and load.
  std::vector<int> concurrency{1};
  std::vector<int> input_len;
  std::vector<int> output_len;
  std::optional<int> num_prompts;   // per scenario; unset = its concurrency
  std::optional<double> rate;       // requests per second (Poisson); unset = burst
  std::string priority;             // every matrix request's class; "" = the target's default
  std::vector<BenchClass> classes;  // instead of the matrix: one scenario of these classes
  bool ignore_eos = true;
  double temperature = 0;
  int warmup = 1;
  std::string prompt = "random";  // "random" token ids or "text"
  uint64_t seed = 0;

  // Derived figures.
  std::optional<double> bandwidth_gbps;  // memory bandwidth for the roofline
  std::string kv_dtype;                  // KV cache dtype; "" = kv_cache_dtype's default
  std::optional<double> gpu_hour_price;  // USD

  // Online mode.
  std::string url;
  std::string served_model_name;        // "" = the first id of GET /v1/models
  std::string api_key;                  // sent as a bearer token when set
  std::string count_tokens = "chunks";  // "chunks" (text chunks) or "logprobs" (exact)
  double request_timeout_s = 600;
  std::optional<int> vocab_size;  // random prompts when the model's metadata is not at hand

  std::vector<BenchScenario> scenarios() const;  // the matrix, concurrency varying fastest
};

// Looks an environment variable up (nullopt when unset); the parser expands ${NAME} with it.
using EnvLookup = std::function<std::optional<std::string>(const std::string&)>;

// Parses and validates YAML text. `source` names it in errors ("w1.yaml:12: ...").
// Throws ds::Error on unknown keys, wrong types and out-of-range values.
BenchSpec parse_bench_spec(const std::string& yaml, const std::string& source,
                           const EnvLookup& env);
BenchSpec load_bench_spec(const std::string& path, const EnvLookup& env);

}  // namespace ds
