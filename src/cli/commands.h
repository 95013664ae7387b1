// The CLI's subcommands.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "cli/session.h"
#include "server/http_transport.h"

namespace ds {

struct GenerateOptions {
  ModelOptions model;
  EngineOptions engine;
  std::string priority = "standard";
  bool stats = false;  // engine statistics as JSON on stderr at the end
  std::vector<std::string> prompts;
  std::string prompts_file;     // one prompt per line
  std::string prompt_ids_file;  // whitespace-separated token ids: one prompt
  int max_tokens = 128;
  SamplingParams sampling;
  std::vector<std::string> stop;
  bool chat = false;
  std::string system;
  bool ignore_eos = false;
  bool json = false;
};

struct ChatOptions {
  ModelOptions model;
  EngineOptions engine;
  SamplingParams sampling;
  int max_tokens = 512;
  std::string system;
};

struct ServeOptions {
  ModelOptions model;
  EngineOptions engine;
  std::string host = "127.0.0.1";
  int port = 8000;
  std::string api_key;
  std::string served_model_name;  // default: the model file's name without extension
  double drain_timeout_s = 30;
  HttpLimits http;
  int io_threads = 2;
  int max_waiting_requests = 4096;
};

struct BenchOptions {
  std::string config;  // the workload YAML (docs/BENCH.md)
  std::string output;  // JSON result file; "" = none (or DIR/bench.json with --plots)
  std::string url;     // online mode against this server; "" = the YAML's url, else offline
  std::optional<double> gpu_hour_price;  // USD per GPU-hour, for the cost per token
  std::string plots;                     // folder for PNG plots; "" = none
  bool verbose = false;
  bool profile_ops = false;  // offline: time every op of each step (eager, ProfilingBackend)
  // With profile_ops: report the steps of this many tokens (0: the most common decode step).
  int profile_step_tokens = 0;
  std::optional<int> lower_class_prefill_tokens;  // overrides the YAML's engine setting
  std::optional<int> prefill_first_steps;         // overrides the YAML's engine setting
  std::optional<int> max_num_batched_tokens;      // overrides the YAML's engine setting
  std::optional<int> defer_wakeups;               // overrides the YAML's engine setting
  std::optional<int> tensor_parallel_size;        // overrides the YAML's
  bool expert_parallel = false;                   // sets the YAML's enable_expert_parallel
  std::string command;                            // the command line, recorded in the JSON
};

struct InspectOptions {
  std::string path;
  std::string load_format = "auto";  // dummy: path is a config.json (or its folder)
  std::string quantize = "none";     // report the formats a load with --quantize would bind
  bool json = false;
  bool all_metadata = false;
};

// `deepserve accuracy` (hidden): a model as stored vs the same model in other formats.
struct AccuracyOptions {
  ModelOptions model;                 // the reference (its --quantize, usually none)
  std::string kv_dtype;               // the reference's KV cache dtype ("" = default)
  std::vector<std::string> variants;  // "quantize=fp8", "quantize=w4a16,kv=fp8", "kv=fp8"
  std::vector<std::string> prompts;   // text; none: built-in prompts (or ids without tokenizer)
  int gen_tokens = 32;
  std::string output;  // JSON file; "" = stdout only
};

int run_generate(const GenerateOptions& o);
int run_accuracy(const AccuracyOptions& o);
int run_chat(const ChatOptions& o);
int run_inspect(const InspectOptions& o);
int run_serve(const ServeOptions& o);
int run_benchmark(const BenchOptions& o);

}  // namespace ds
