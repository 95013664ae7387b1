// Opens a model path (a .gguf file or a safetensors folder) into config, weights,
// tokenizer and a ready model on a backend.
#pragma once

#include <filesystem>
#include <functional>
#include <map>
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
  // --load-format dummy: `path` is a config.json (or a folder holding one) and the weights are
  // generated (dummy_weights) on the backend, seeded by dummy_seed.
  bool dummy = false;
  uint64_t dummy_seed = 0;
  WeightQuant quantize = WeightQuant::None;  // --quantize
  // --tensor-parallel-size / --enable-expert-parallel (src/parallel): with N > 1 the model is
  // a ParallelModel whose rank 0 runs on the given backend and ranks 1..N-1 on rank_backend(r)
  // (unset on the CPU: a default CPU backend each).
  int tensor_parallel_size = 1;
  bool expert_parallel = false;
  std::function<std::unique_ptr<Backend>(int rank)> rank_backend;
};

struct LoadedModel {
  std::string path;
  std::string format;  // "gguf", "safetensors" or "dummy"
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

// Just the parts `inspect` needs: no backend, no weights read. With dummy, path is a
// config.json or a folder with one, and the weights are dummy_weights(config, dummy_seed).
LoadedModel open_model_metadata(const std::filesystem::path& path, bool dummy = false,
                                uint64_t dummy_seed = 0);
// "auto" (false) or "dummy" (true); throws for anything else.
bool load_format_is_dummy(const std::string& load_format);
// The formats a model's weights would be bound in with `opts` (dummy, quantize), found by
// binding it on a backend that holds no memory: (bytes, parameters) per format. A real
// checkpoint with --quantize is read and quantized on the host to find out.
std::map<std::string, std::pair<uint64_t, uint64_t>> plan_weight_formats(
    const std::filesystem::path& path, const LoadOptions& opts);
// One line per weight format of a loaded model: "W4A16 1.23 GB, 0.516 bytes/param".
std::string describe_weight_formats(const Model& model);

}  // namespace ds
