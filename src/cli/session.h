// What generate and chat share: options, a backend, a loaded model and its engine.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "backend/backend.h"
#include "engine/engine.h"
#include "model/loader.h"

namespace ds {

struct ModelOptions {
  std::string model;  // path; empty = the embedded default
  int threads = 0;    // 0 = all cores
  std::string isa = "auto";
  std::string precision = "f32";
  bool verbose = false;
  std::string
      device;  // "cpu", "cuda", or ""/"auto": cuda when built with CUDA and a GPU is present
  double gpu_memory_utilization = 0.9;  // CUDA: fraction of free GPU memory the backend reserves
  std::string load_format = "auto";     // "auto" (read the checkpoint) or "dummy" (config only)
  std::string quantize = "none";        // load-time weight format: none, w4a16 or fp8
  // Ranks the model is split over (src/parallel): GPUs 0..N-1 on CUDA, N in-process ranks
  // sharing the threads on the CPU; expert_parallel splits routed experts by id (EP = N).
  int tensor_parallel_size = 1;
  bool expert_parallel = false;
  // Wraps the device backend (e.g. in a ProfilingBackend); the model and engine run on the
  // wrapper. Unset: no wrapper.
  std::function<std::unique_ptr<Backend>(Backend&)> wrap_backend;
};

struct EngineOptions {
  // 0 = min(4096, model context) on the CPU; on CUDA what fits in 90% of the memory pool left
  // after loading the weights (the rest stays for activations and scratch).
  int64_t kv_cache_tokens = 0;
  int block_size = 16;
  std::string kv_mode = "dynamic";
  bool prefix_cache = true;
  int max_num_seqs = 64;
  int max_num_batched_tokens = 2048;
  int lower_class_prefill_tokens = 0;  // priority isolation (docs/ARCHITECTURE.md); -1: off
  int batch_prefill_tokens = 512;      // batch-class prefill tokens per step; -1: no cap
  int prefill_first_steps = 8;         // decodes sit out a burst of prompts; 0: never
  int defer_wakeups = -1;              // EngineConfig::defer_wakeups (-1: device backends)
  std::string kv_dtype;                // "f32", "f16", "bf16", "fp8"; "" = the default
  int64_t warmup_tokens = -1;          // EngineConfig::warmup_tokens
};

struct Session {
  std::unique_ptr<Backend> backend;  // destroyed last: the model and engine hold its memory
  std::unique_ptr<Backend> wrapper;  // ModelOptions::wrap_backend's, over `backend`; or null
  LoadedModel loaded;
  std::unique_ptr<Engine> engine;
  uint64_t kv_bytes_per_token = 0;  // at the engine's KV dtype, all layers
  int64_t kv_tokens_fit = 0;        // CUDA: KV tokens the pool could hold after the weights
  // What the model and engine run on.
  Backend& ops() { return wrapper ? *wrapper : *backend; }
};

// Resolves the model path (default model when empty), picks the device, loads the model with
// a progress bar and starts an engine over it.
Session open_session(const ModelOptions& m, const EngineOptions& e);
// The backend --device and --gpu-memory-utilization (and the CPU options) ask for; throws a
// clear error for cuda without a GPU or in a build without CUDA. Logs the choice.
// device_index: the GPU of a tensor-parallel rank (its CPU backend gets its share of threads).
std::unique_ptr<Backend> make_session_backend(const ModelOptions& m, int device_index = 0);
std::string resolve_model_path(const std::string& model);
// The KV cache dtype a name ("f32", "f16", "bf16") asks for; "" = the default: BF16 on CUDA;
// on the CPU F32 with --precision f32 (which stays exact) and F16 with q8 (llama.cpp's cache
// type, half the bytes).
DType kv_cache_dtype(const std::string& name, DeviceKind device, const std::string& precision);

}  // namespace ds
