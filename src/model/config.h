// Hyperparameters of a model, read once from GGUF metadata or config.json.
#pragma once

#include <cstdint>
#include <string>

#include "backend/backend.h"

namespace ds {

class GgufFile;

struct ModelConfig {
  std::string arch;  // "llama"
  std::string name;
  int hidden = 0;  // d_model
  int layers = 0;
  int heads = 0;     // query heads
  int kv_heads = 0;  // grouped-query kv heads
  int head_dim = 0;
  int intermediate = 0;  // MLP inner size
  int vocab = 0;
  int64_t max_context = 0;
  float rms_eps = 1e-5f;
  RopeParams rope;
  bool tied_embeddings = false;
  int bos_id = -1;
  int eos_id = -1;

  std::string summary() const;  // one line for logs
};

// llama-family hyperparameters from GGUF metadata ("<arch>.block_count", ...).
ModelConfig config_from_gguf(const GgufFile& f);
// llama-family hyperparameters from a Hugging Face config.json.
ModelConfig config_from_hf_json(const std::string& path);

}  // namespace ds
