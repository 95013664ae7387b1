#include "cli/session.h"

#include <algorithm>

#include "cli/default_model.h"
#include "core/error.h"
#include "core/log.h"

namespace ds {

std::string resolve_model_path(const std::string& model) {
  if (!model.empty()) return model;
  std::vector<std::string> looked;
  auto found = find_default_model(looked);
  if (!found) throw Error(default_model_missing_message(looked));
  return found->string();
}

Session open_session(const ModelOptions& m, const EngineOptions& e) {
  Session s;
  BackendOptions bo;
  bo.threads = m.threads;
  bo.isa = m.isa;
  if (m.precision == "q8")
    bo.precision = ActivationPrecision::Q8;
  else if (m.precision != "f32")
    throw Error("--precision must be f32 or q8, not '" + m.precision + "'");
  s.backend = make_cpu_backend(bo);
  LoadOptions lo;
  lo.threads = std::max(1, m.threads);
  lo.progress = true;
  s.loaded = load_model(resolve_model_path(m.model), *s.backend, lo);
  EngineConfig ec;
  ec.kv_cache_tokens = e.kv_cache_tokens > 0 ? e.kv_cache_tokens
                                             : std::min<int64_t>(4096, s.loaded.config.max_context);
  ec.block_size = e.block_size;
  if (e.kv_mode == "static")
    ec.kv_mode = AllocationMode::Static;
  else if (e.kv_mode != "dynamic")
    throw Error("--kv-mode must be dynamic or static, not '" + e.kv_mode + "'");
  ec.prefix_cache = e.prefix_cache;
  ec.max_num_seqs = e.max_num_seqs;
  ec.max_num_batched_tokens = e.max_num_batched_tokens;
  s.engine = std::make_unique<Engine>(*s.loaded.model, *s.backend, s.loaded.tokenizer.get(), ec);
  log_info("backend " + s.backend->name() + ", KV cache " +
           std::to_string(s.engine->kv_capacity_tokens()) + " tokens");
  return s;
}

}  // namespace ds
