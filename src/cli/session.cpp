#include "cli/session.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "cli/default_model.h"
#include "core/error.h"
#include "core/log.h"
#ifdef DEEPSERVE_HAVE_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

namespace ds {
namespace {

// Share of the pool left after loading the weights that the automatic KV cache takes; the
// rest is for activations, logits and kernel scratch, allocated on the first steps.
[[maybe_unused]] constexpr double kKvShareOfFreePool = 0.9;

[[maybe_unused]] std::string gib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", bytes / double(int64_t(1) << 30));
  return buf;
}

}  // namespace

DType kv_cache_dtype(const std::string& name, DeviceKind device, const std::string& precision) {
  if (name.empty())
    return device == DeviceKind::CUDA ? DType::BF16 : precision == "f32" ? DType::F32 : DType::F16;
  if (name == "f32") return DType::F32;
  if (name == "f16") return DType::F16;
  if (name == "bf16") return DType::BF16;
  if (name == "fp8") return DType::F8_E4M3;
  throw Error("KV cache dtype must be f32, f16, bf16 or fp8, not '" + name + "'");
}

namespace {

// On CUDA, the KV tokens that fit in the pool after the weights (what the automatic capacity
// takes); 0 on the CPU, where memory does not size the cache. Logs when `log` is set.
int64_t kv_tokens_that_fit(const Session& s, DType kv_dtype, int block_size, bool log) {
#ifdef DEEPSERVE_HAVE_CUDA
  if (s.backend->device().kind == DeviceKind::CUDA) {
    const CudaPoolInfo pool = cuda_pool_info(*s.backend);
    const uint64_t per_token = s.loaded.model->kv_bytes_per_token(kv_dtype);
    DS_CHECK(per_token > 0, "model reports 0 KV bytes per token");
    const double budget = double(pool.free_bytes) * kKvShareOfFreePool;
    // Whole blocks, and slots addressable with 32-bit indices.
    int64_t tokens = int64_t(budget / double(per_token)) / block_size * block_size;
    tokens = std::min<int64_t>(tokens, (int64_t(1) << 31) - int64_t(block_size));
    if (tokens < block_size)
      throw Error("no GPU memory left for the KV cache: " + gib(double(pool.free_bytes)) +
                  " of the " + gib(double(pool.capacity_bytes)) +
                  " pool is free after loading the weights, one block of " +
                  std::to_string(block_size) + " tokens needs " +
                  gib(double(per_token) * block_size) +
                  "; raise --gpu-memory-utilization or use a smaller model");
    if (log)
      log_info("KV cache sized from GPU memory: " + std::to_string(tokens) + " tokens x " +
               std::to_string(per_token) + " bytes (" + gib(double(tokens) * double(per_token)) +
               " of " + gib(double(pool.free_bytes)) + " free in the pool)");
    return tokens;
  }
#else
  (void)s;
  (void)kv_dtype;
  (void)block_size;
  (void)log;
#endif
  return 0;
}

}  // namespace

std::string resolve_model_path(const std::string& model) {
  if (!model.empty()) return model;
  std::vector<std::string> looked;
  auto found = find_default_model(looked);
  if (!found) throw Error(default_model_missing_message(looked));
  return found->string();
}

namespace {
// The CPU threads one rank gets: tensor-parallel ranks split the machine's (or --threads).
int rank_threads(const ModelOptions& m) {
  if (m.tensor_parallel_size <= 1) return m.threads;
  const int all = m.threads > 0 ? m.threads : int(std::thread::hardware_concurrency());
  return std::max(1, all / m.tensor_parallel_size);
}
}  // namespace

std::unique_ptr<Backend> make_session_backend(const ModelOptions& m, int device_index) {
  BackendOptions bo;
  bo.threads = rank_threads(m);
  bo.isa = m.isa;
  bo.gpu_memory_utilization = m.gpu_memory_utilization;
  if (m.precision == "q8")
    bo.precision = ActivationPrecision::Q8;
  else if (m.precision != "f32")
    throw Error("--precision must be f32 or q8, not '" + m.precision + "'");
  const bool auto_device = m.device.empty() || m.device == "auto";
  if (!auto_device && m.device != "cpu" && m.device != "cuda")
    throw Error("--device must be cpu, cuda or auto, not '" + m.device + "'");
#ifdef DEEPSERVE_HAVE_CUDA
  if (m.device != "cpu") {
    const int gpus = cuda_device_count();
    if (gpus > 0) {
      if (!(m.gpu_memory_utilization > 0.0 && m.gpu_memory_utilization <= 1.0))
        throw Error("--gpu-memory-utilization must be in (0, 1], not " +
                    std::to_string(m.gpu_memory_utilization));
      if (m.tensor_parallel_size > gpus)
        throw Error("--tensor-parallel-size " + std::to_string(m.tensor_parallel_size) +
                    " needs as many CUDA devices; " + std::to_string(gpus) + " visible");
      if (device_index == 0)
        log_info(std::string("device cuda") + (auto_device ? " (auto: " : " (") +
                 std::to_string(gpus) + " CUDA device(s) found, using " +
                 std::to_string(std::max(1, m.tensor_parallel_size)) + ")");
      return make_cuda_backend(bo, device_index);
    }
    if (!auto_device)
      throw Error(
          "--device cuda: no CUDA device is visible (check the driver, "
          "CUDA_VISIBLE_DEVICES, or use --device cpu)");
    log_info("device cpu (auto: no CUDA device found)");
  } else {
    log_info("device cpu");
  }
#else
  (void)device_index;
  if (m.device == "cuda")
    throw Error(
        "--device cuda: this deepserve was built without the CUDA backend "
        "(configure with nvcc on the PATH or -DDEEPSERVE_CUDA=ON)");
  log_info(auto_device ? "device cpu (auto: built without CUDA)" : "device cpu");
#endif
  return make_cpu_backend(bo);
}

Session open_session(const ModelOptions& m, const EngineOptions& e) {
  Session s;
  s.backend = make_session_backend(m);
  if (m.wrap_backend) s.wrapper = m.wrap_backend(*s.backend);
  const DeviceKind device = s.backend->device().kind;
  const DType kv_dtype = kv_cache_dtype(e.kv_dtype, device, m.precision);
  LoadOptions lo;
  lo.threads = std::max(1, m.threads);
  lo.progress = true;
  lo.dummy = load_format_is_dummy(m.load_format);
  lo.quantize = weight_quant_from_name(m.quantize);
  lo.tensor_parallel_size = m.tensor_parallel_size;
  lo.expert_parallel = m.expert_parallel;
  lo.rank_backend = [&m](int rank) { return make_session_backend(m, rank); };
  s.loaded = load_model(resolve_model_path(m.model), s.ops(), lo);
  EngineConfig ec;
  s.kv_tokens_fit = kv_tokens_that_fit(s, kv_dtype, e.block_size, e.kv_cache_tokens <= 0);
  s.kv_bytes_per_token = s.loaded.model->kv_bytes_per_token(kv_dtype);
  // No capacity given: on CUDA what fits after the weights, on the CPU 4096 (or the context).
  ec.kv_cache_tokens = e.kv_cache_tokens > 0 ? e.kv_cache_tokens
                       : s.kv_tokens_fit > 0 ? s.kv_tokens_fit
                                             : std::min<int64_t>(4096, s.loaded.config.max_context);
  ec.kv_dtype = kv_dtype;
  ec.block_size = e.block_size;
  if (e.kv_mode == "static")
    ec.kv_mode = AllocationMode::Static;
  else if (e.kv_mode != "dynamic")
    throw Error("--kv-mode must be dynamic or static, not '" + e.kv_mode + "'");
  ec.prefix_cache = e.prefix_cache;
  ec.max_num_seqs = e.max_num_seqs;
  ec.max_num_batched_tokens = e.max_num_batched_tokens;
  ec.lower_class_prefill_tokens = e.lower_class_prefill_tokens;
  ec.batch_prefill_tokens = e.batch_prefill_tokens;
  ec.prefill_first_steps = e.prefill_first_steps;
  ec.defer_wakeups = e.defer_wakeups;
  ec.warmup_tokens = e.warmup_tokens;
  // DEEPSERVE_WARMUP_TOKENS stands in for an unset option (A/B runs of the bench YAMLs).
  if (const char* w = std::getenv("DEEPSERVE_WARMUP_TOKENS"); w && ec.warmup_tokens == -1)
    ec.warmup_tokens = std::clamp<int64_t>(std::atoll(w), -1, int64_t(1) << 24);
  s.engine = std::make_unique<Engine>(*s.loaded.model, s.ops(), s.loaded.tokenizer.get(), ec);
  log_info("backend " + s.backend->name() + ", KV cache " +
           std::to_string(s.engine->kv_capacity_tokens()) + " tokens (" +
           std::string(dtype_name(kv_dtype)) + ")");
  return s;
}

}  // namespace ds
