// What generate and chat share: options, a backend, a loaded model and its engine.
#pragma once

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
};

struct EngineOptions {
  int64_t kv_cache_tokens = 0;  // 0 = min(4096, model context)
  int block_size = 16;
  std::string kv_mode = "dynamic";
  bool prefix_cache = true;
  int max_num_seqs = 64;
  int max_num_batched_tokens = 2048;
};

struct Session {
  std::unique_ptr<Backend> backend;
  LoadedModel loaded;
  std::unique_ptr<Engine> engine;
};

// Resolves the model path (default model when empty), loads it with a progress bar and
// starts an engine over it.
Session open_session(const ModelOptions& m, const EngineOptions& e);
std::string resolve_model_path(const std::string& model);

}  // namespace ds
