// What generate and chat share: options, a backend, a loaded model and its KV cache.
#pragma once

#include <memory>
#include <string>

#include "backend/backend.h"
#include "engine/sampler.h"
#include "model/loader.h"

namespace ds {

struct ModelOptions {
  std::string model;  // path; empty = the embedded default
  int threads = 0;    // 0 = all cores
  int ctx_size = 0;   // KV cache tokens; 0 = min(4096, model context)
  std::string isa = "auto";
  std::string precision = "f32";
  bool verbose = false;
};

struct Session {
  std::unique_ptr<Backend> backend;
  LoadedModel loaded;
  std::unique_ptr<KvCache> cache;
};

// Resolves the model path (default model when empty), loads it with a progress bar and
// sizes the KV cache for at least `min_tokens` tokens.
Session open_session(const ModelOptions& o, int64_t min_tokens);
std::string resolve_model_path(const std::string& model);

}  // namespace ds
