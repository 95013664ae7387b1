#include "parallel/parallel_model.h"

#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>

#include "core/error.h"
#include "core/log.h"
#ifdef DEEPSERVE_HAVE_CUDA
#include "backend/cuda/cuda_backend.h"
#endif
#ifdef DEEPSERVE_HAVE_NCCL
#include "parallel/nccl/nccl_comm.h"
#endif

namespace ds {
namespace {

struct Rank {
  std::unique_ptr<Backend> own_backend;  // null for rank 0
  Backend* backend = nullptr;
  std::unique_ptr<WeightSource> weights;  // the rank's slices; outlives its model
  std::unique_ptr<Model> model;
  std::unique_ptr<KvCache> cache;     // ranks >= 1
  std::unique_ptr<Buffer> meta;       // ranks >= 1 on a device: the step's int32 arrays
  std::unique_ptr<Buffer> no_logits;  // a [0, vocab] view's storage
  std::exception_ptr error;
};

void bind_thread(const Backend& be) {
#ifdef DEEPSERVE_HAVE_CUDA
  if (be.device().kind == DeviceKind::CUDA) cuda_bind_thread(be);
#else
  (void)be;
#endif
}

class ParallelModel final : public Model {
 public:
  ParallelModel(std::vector<Rank> ranks, std::vector<std::unique_ptr<Communicator>> comms)
      : ranks_(std::move(ranks)), comms_(std::move(comms)) {
    formats_ = ranks_[0].model->weight_formats();
    for (size_t r = 1; r < ranks_.size(); ++r) workers_.emplace_back([this, r] { work(r); });
  }
  ~ParallelModel() override {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }

  const ModelConfig& config() const override { return ranks_[0].model->config(); }
  WeightBytes weight_bytes() const override { return ranks_[0].model->weight_bytes(); }
  uint64_t kv_bytes_per_token(DType kv_dtype) const override {
    return ranks_[0].model->kv_bytes_per_token(kv_dtype);
  }
  std::vector<ExpertLoad> expert_load() override { return ranks_[0].model->expert_load(); }
  void set_debug_hook(DebugHook hook) override { ranks_[0].model->set_debug_hook(std::move(hook)); }
  int ranks() const override { return int(ranks_.size()); }

  void mirror_block_copy(int src, int dst) override {
    for (size_t r = 1; r < ranks_.size(); ++r) {
      Rank& k = ranks_[r];
      if (!k.cache) continue;  // made at the first forward, before any copy can matter
      for (int l = 0; l < config().layers; ++l) {
        const PagedKv& kv = k.cache->layer(l);
        const int64_t row = int64_t(kv.block_size) * kv.slot_stride();
        for (void* base : {kv.k, kv.v}) {
          if (!base) continue;
          TensorView all =
              TensorView::contiguous(base, kv.dtype, {kv.num_blocks, row}, k.backend->device());
          k.backend->copy(all.slice_rows(src, src + 1), all.slice_rows(dst, dst + 1));
        }
      }
    }
  }

  void forward(const ForwardInput& in, KvCache& cache, TensorView logits) override {
    for (size_t r = 1; r < ranks_.size(); ++r) {
      Rank& k = ranks_[r];
      if (!k.cache || k.cache->num_blocks() != cache.num_blocks()) {
        KvCacheConfig kc;
        kc.num_blocks = cache.num_blocks();
        kc.block_size = cache.block_size();
        kc.dtype = cache.layer(0).dtype;
        k.cache = std::make_unique<KvCache>(*k.backend, k.model->config(), kc);
      }
    }
    {
      std::lock_guard lock(mu_);
      in_ = &in;
      ++step_;
      done_ = 0;
    }
    cv_.notify_all();
    std::exception_ptr first;
    try {
      ranks_[0].model->forward(in, cache, logits);
    } catch (...) {
      first = std::current_exception();
      comms_[0]->abort();
    }
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return done_ == int(ranks_.size()) - 1; });
    }
    for (size_t r = 1; r < ranks_.size() && !first; ++r) first = ranks_[r].error;
    if (first) {
      comms_[0]->reset();  // every rank is idle now
      std::rethrow_exception(first);
    }
  }

 private:
  void work(size_t r) {
    Rank& k = ranks_[r];
    bind_thread(*k.backend);
    uint64_t seen = 0;
    for (;;) {
      const ForwardInput* in = nullptr;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stop_ || step_ != seen; });
        if (stop_) return;
        seen = step_;
        in = in_;
      }
      k.error = nullptr;
      try {
        run_rank(k, *in);
      } catch (...) {
        k.error = std::current_exception();
        comms_[r]->abort();
      }
      {
        std::lock_guard lock(mu_);
        ++done_;
      }
      cv_.notify_all();
    }
  }

  // A rank >= 1's forward: its own copy of the step arrays on a device, no logit rows.
  void run_rank(Rank& k, const ForwardInput& in) {
    ForwardInput mine = in;
    mine.logit_rows = {};
    if (k.backend->device().kind != DeviceKind::CPU) place_meta(k, in, mine);
    if (!k.no_logits) k.no_logits = k.backend->alloc(4);
    const TensorView none = TensorView::contiguous(k.no_logits->data(), DType::F32,
                                                   {0, config().vocab}, k.backend->device());
    k.model->forward(mine, *k.cache, none);
    k.backend->synchronize();
  }

  static void place_meta(Rank& k, const ForwardInput& in, ForwardInput& mine) {
    const AttentionMeta& h = in.host_meta;
    DS_CHECK(h.query_start != nullptr, "a device rank needs the step's host metadata");
    const int S = h.num_seqs, T = h.num_tokens;
    std::vector<int32_t> staging;
    auto put = [&](const int32_t* p, int64_t n) {
      const size_t at = staging.size();
      staging.insert(staging.end(), p, p + n);
      return at;
    };
    const size_t tok = put(in.tokens.data(), T), pos = put(h.positions, T),
                 qs = put(h.query_start, S + 1), ctx = put(h.context_lens, S),
                 bt = put(h.block_tables, int64_t(S) * h.max_blocks_per_seq),
                 sm = put(h.slot_mapping, T);
    const size_t bytes = std::max<size_t>(staging.size(), 1) * 4;
    if (!k.meta || k.meta->size() < bytes) k.meta = k.backend->alloc(bytes * 2);
    k.backend->upload(k.meta->view(DType::I32, {int64_t(staging.size())}), staging.data(),
                      staging.size() * 4);
    const auto* base = static_cast<const int32_t*>(k.meta->data());
    mine.device_tokens = base + tok;
    mine.meta.positions = base + pos;
    mine.meta.query_start = base + qs;
    mine.meta.context_lens = base + ctx;
    mine.meta.block_tables = base + bt;
    mine.meta.slot_mapping = base + sm;
  }

  std::vector<Rank> ranks_;
  std::vector<std::unique_ptr<Communicator>> comms_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_;
  const ForwardInput* in_ = nullptr;
  uint64_t step_ = 0;
  int done_ = 0;
  bool stop_ = false;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_communicators(const std::vector<Backend*>& ranks) {
  bool cpu = true, cuda = true;
  for (const Backend* b : ranks) {
    cpu = cpu && b->device().kind == DeviceKind::CPU;
    cuda = cuda && b->device().kind == DeviceKind::CUDA;
  }
  if (cpu) return make_local_communicators(int(ranks.size()));
#ifdef DEEPSERVE_HAVE_NCCL
  if (cuda) return make_nccl_communicators(ranks);
#endif
  throw UnsupportedError(cuda ? "tensor parallelism on CUDA needs NCCL (not found at build time)"
                              : "tensor parallel ranks must all be CPU or all CUDA backends");
}

std::unique_ptr<Model> make_parallel_model(const ModelConfig& cfg, const WeightSource& weights,
                                           Backend& rank0, const ParallelLoad& load) {
  const int n = load.parallel.tensor_parallel_size;
  DS_CHECK(n >= 2, "make_parallel_model: fewer than two ranks");
  std::vector<ModelConfig> shards;
  for (int r = 0; r < n; ++r) shards.push_back(shard_config(cfg, load.parallel, r));  // may throw
  std::vector<Rank> ranks(static_cast<size_t>(n));
  std::vector<Backend*> backends;
  for (int r = 0; r < n; ++r) {
    Rank& k = ranks[size_t(r)];
    if (r > 0) k.own_backend = load.make_backend(r);
    k.backend = r == 0 ? &rank0 : k.own_backend.get();
    backends.push_back(k.backend);
  }
  auto comms = make_communicators(backends);
  for (int r = 0; r < n; ++r) {
    Rank& k = ranks[size_t(r)];
    bind_thread(*k.backend);
    k.weights = sharded_weights(weights, load.parallel, r);
    k.model = load.make_model(shards[size_t(r)], *k.weights, *k.backend);
    k.model->set_communicator(comms[size_t(r)].get());
  }
  bind_thread(rank0);
  log_info("tensor parallel: " + std::to_string(n) + " ranks (" + comms[0]->name() +
           "), expert parallel " + std::to_string(load.parallel.expert_parallel_size()));
  return std::make_unique<ParallelModel>(std::move(ranks), std::move(comms));
}

}  // namespace ds
