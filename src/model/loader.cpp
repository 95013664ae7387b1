#include "model/loader.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>

#include "core/error.h"
#include "core/log.h"
#include "formats/gguf.h"
#include "parallel/parallel_model.h"

namespace ds {
namespace {

// A one-line progress bar on stderr, redrawn when the percentage changes.
class ProgressBar {
 public:
  explicit ProgressBar(double t0) : t0_(t0) {}
  void update(size_t done, size_t total) {
    const int pct = total ? int(100.0 * double(done) / double(total)) : 100;
    if (pct == last_) return;
    last_ = pct;
    const int width = 30, fill = pct * width / 100;
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count() -
        t0_;
    std::fprintf(stderr, "\rloading [%.*s%*s] %3d%% %6.0f/%.0f MB %5.2f GB/s", fill,
                 "##############################", width - fill, "", pct, double(done) / 1e6,
                 double(total) / 1e6, secs > 0 ? double(done) / secs / 1e9 : 0.0);
    if (done >= total) std::fputc('\n', stderr);
    std::fflush(stderr);
  }

 private:
  double t0_;
  int last_ = -1;
};

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

bool load_format_is_dummy(const std::string& load_format) {
  if (load_format.empty() || load_format == "auto") return false;
  if (load_format == "dummy") return true;
  throw Error("--load-format must be auto or dummy, not '" + load_format + "'");
}

std::string describe_weight_formats(const Model& model) {
  std::string out;
  for (const auto& [name, bp] : model.weight_formats()) {
    char buf[128];
    std::snprintf(buf, sizeof buf, "%s%s %.3f GB (%.3f bytes/param)", out.empty() ? "" : ", ",
                  name.c_str(), double(bp.first) / 1e9,
                  bp.second ? double(bp.first) / double(bp.second) : 0.0);
    out += buf;
  }
  return out;
}

LoadedModel open_model_metadata(const std::filesystem::path& path, bool dummy,
                                uint64_t dummy_seed) {
  LoadedModel m;
  m.path = path.string();
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) throw Error(m.path + ": no such file or directory");
  if (dummy) {
    const bool dir = std::filesystem::is_directory(path, ec);
    const auto cfg = dir ? path / "config.json" : path;
    const auto folder = dir ? path : path.parent_path();
    if (!std::filesystem::exists(cfg, ec))
      throw Error(m.path + ": --load-format dummy needs a config.json (or a folder with one)");
    m.format = "dummy";
    m.config = config_from_hf_json(cfg.string());
    m.weights = dummy_weights(m.config, dummy_seed);
    const auto tj = folder / "tokenizer.json";
    if (std::filesystem::exists(tj, ec)) {
      m.tokenizer = Tokenizer::from_hf_json(tj, folder / "tokenizer_config.json");
      m.chat_template = m.tokenizer->chat_template();
    }
  } else if (std::filesystem::is_directory(path, ec)) {
    m.format = "safetensors";
    const auto cfg = path / "config.json";
    if (!std::filesystem::exists(cfg, ec))
      throw Error(m.path + ": a model folder needs config.json (and *.safetensors)");
    m.config = config_from_hf_json(cfg.string());
    m.weights = safetensors_llama_weights(path);
    const auto tj = path / "tokenizer.json";
    if (std::filesystem::exists(tj, ec)) {
      m.tokenizer = Tokenizer::from_hf_json(tj, path / "tokenizer_config.json");
      m.chat_template = m.tokenizer->chat_template();
    } else {
      log_warn(m.path + " has no tokenizer.json: only token-id input will work");
    }
  } else {
    m.format = "gguf";
    auto g = std::make_shared<GgufFile>(GgufFile::open(path));
    m.config = config_from_gguf(*g);
    m.tokenizer = Tokenizer::from_gguf(*g);
    m.chat_template = g->get_string("tokenizer.chat_template").value_or("");
    m.gguf = g;
    m.weights =
        m.config.arch == "deepseek_v2" ? gguf_deepseek2_weights(g, m.config) : gguf_weights(g);
  }
  m.bytes = m.weights->total_bytes();
  return m;
}

LoadedModel load_model(const std::filesystem::path& path, Backend& backend,
                       const LoadOptions& opts) {
  const double t0 = now();
  LoadedModel m = open_model_metadata(path, opts.dummy, opts.dummy_seed);
  // Before reading the weights in: an unsupported model should not cost a full read.
  if (m.config.arch != "llama" && m.config.arch != "deepseek_v2")
    throw UnsupportedError(m.path + ": architecture '" + m.config.arch + "' is not supported");
  const bool bar = opts.progress && isatty(2);
  ProgressBar progress(t0);
  m.weights->prefetch(opts.threads, [&](size_t done, size_t total) {
    if (bar) progress.update(done, total);
  });
  auto make = [&](const ModelConfig& cfg, const WeightSource& w, Backend& be) {
    if (cfg.arch == "deepseek_v2")
      return make_deepseek_v2(cfg, w, be,
                              {.mla_expanded = opts.mla_expanded, .quantize = opts.quantize});
    return make_llama(cfg, w, be, opts.quantize);
  };
  if (opts.expert_parallel && opts.tensor_parallel_size < 2)
    throw Error(
        "--enable-expert-parallel splits experts over the tensor-parallel ranks: it "
        "needs --tensor-parallel-size of 2 or more");
  if (opts.tensor_parallel_size > 1 && m.config.int4)  // shards would slice packed words
    throw UnsupportedError(m.path + ": " + m.config.quant_method +
                           " checkpoints with tensor parallelism are not supported yet");
  if (opts.tensor_parallel_size > 1) {
    ParallelLoad pl;
    pl.parallel.tensor_parallel_size = opts.tensor_parallel_size;
    pl.parallel.expert_parallel = opts.expert_parallel;
    pl.make_model = make;
    pl.make_backend = opts.rank_backend;
    if (!pl.make_backend) {
      if (backend.device().kind != DeviceKind::CPU)
        throw Error("tensor parallelism on " + backend.name() + " needs a backend per rank");
      pl.make_backend = [](int) { return make_cpu_backend(BackendOptions{}); };
    }
    m.model = make_parallel_model(m.config, *m.weights, backend, pl);
  } else {
    m.model = make(m.config, *m.weights, backend);
  }
  if (opts.dummy || opts.quantize != WeightQuant::None) m.bytes = m.model->weight_bytes().total;
  m.load_seconds = now() - t0;
  char speed[64];
  std::snprintf(speed, sizeof speed, "%.2f GB/s", double(m.bytes) / m.load_seconds / 1e9);
  log_info("loaded " + m.path + " (" + m.config.summary() + ") in " +
           std::to_string(m.load_seconds) + " s, " + speed + " on " + backend.name());
  log_info("weights: " + describe_weight_formats(*m.model));
  if (opts.progress)  // the one line a user sees even without a terminal or -v
    std::fprintf(stderr, "loaded %.2f GB in %.2f s (%s) on %s\nweights: %s\n",
                 double(m.bytes) / 1e9, m.load_seconds, speed, backend.name().c_str(),
                 describe_weight_formats(*m.model).c_str());
  return m;
}

}  // namespace ds
