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

Session open_session(const ModelOptions& o, int64_t min_tokens) {
  Session s;
  BackendOptions bo;
  bo.threads = o.threads;
  bo.isa = o.isa;
  if (o.precision == "q8")
    bo.precision = ActivationPrecision::Q8;
  else if (o.precision != "f32")
    throw Error("--precision must be f32 or q8, not '" + o.precision + "'");
  s.backend = make_cpu_backend(bo);
  LoadOptions lo;
  lo.threads = std::max(1, o.threads);
  lo.progress = true;
  s.loaded = load_model(resolve_model_path(o.model), *s.backend, lo);
  const auto& cfg = s.loaded.config;
  int64_t tokens = o.ctx_size > 0 ? o.ctx_size : std::max<int64_t>(4096, min_tokens);
  tokens = std::min<int64_t>(tokens, cfg.max_context);
  KvCacheConfig kv;
  kv.block_size = 16;
  kv.num_blocks = int((tokens + kv.block_size - 1) / kv.block_size);
  kv.dtype = DType::F32;
  s.cache = std::make_unique<KvCache>(*s.backend, cfg, kv);
  log_info("backend " + s.backend->name() + ", KV cache " +
           std::to_string(s.cache->capacity_tokens()) + " tokens (" +
           std::to_string(s.cache->bytes() >> 20) + " MiB)");
  return s;
}

}  // namespace ds
