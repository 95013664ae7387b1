// Opens a model path (a .gguf file or a safetensors folder) into config, weights,
// tokenizer and a ready model on a backend.
#pragma once

#include <filesystem>
#include <memory>
#include <string>

#include "model/model.h"
#include "tokenizer/tokenizer.h"

namespace ds {

class GgufFile;

struct LoadOptions {
  int threads = 1;            // for reading the weights in
  bool progress = false;      // draw a progress bar on stderr
  bool mla_expanded = false;  // deepseek_v2: expanded-form attention (a reference path)
};

struct LoadedModel {
  std::string path;
  std::string format;  // "gguf" or "safetensors"
  ModelConfig config;
  std::shared_ptr<const GgufFile> gguf;  // set for GGUF files
  std::unique_ptr<WeightSource> weights;
  std::unique_ptr<Tokenizer> tokenizer;  // null when the checkpoint carries none
  std::string chat_template;             // jinja source from the model, "" if none
  std::unique_ptr<Model> model;
  double load_seconds = 0;
  uint64_t bytes = 0;
};

LoadedModel load_model(const std::filesystem::path& path, Backend& backend,
                       const LoadOptions& opts);

// Just the parts `inspect` needs: no backend, no weights read.
LoadedModel open_model_metadata(const std::filesystem::path& path);

}  // namespace ds
