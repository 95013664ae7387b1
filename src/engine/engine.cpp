#include "engine/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>

#include "core/error.h"
#include "core/log.h"

namespace ds {
namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

KvCacheConfig kv_config(const EngineConfig& c) {
  KvCacheConfig kv;
  kv.block_size = c.block_size;
  kv.num_blocks = int((c.kv_cache_tokens + c.block_size - 1) / c.block_size);
  kv.dtype = c.kv_dtype;
  return kv;
}

SchedulerConfig sched_config(const EngineConfig& c, const ModelConfig& m) {
  SchedulerConfig s;
  s.max_num_seqs = c.max_num_seqs;
  s.max_num_batched_tokens = c.max_num_batched_tokens;
  s.lower_class_prefill_tokens = c.lower_class_prefill_tokens;
  s.batch_prefill_tokens = c.batch_prefill_tokens;
  s.prefill_first_steps = c.prefill_first_steps;
  s.max_model_len = int(m.max_context);
  return s;
}

BlockManagerConfig block_config(const EngineConfig& c) {
  BlockManagerConfig b;
  b.num_blocks = kv_config(c).num_blocks;
  b.block_size = c.block_size;
  b.mode = c.kv_mode;
  b.enable_prefix_cache = c.prefix_cache;
  return b;
}

// Log-softmax of one logits row, read at `token` and at the `top` most likely ids. The
// normaliser is summed in double: a float sum over a large vocabulary loses the tail.
struct TokenLogprobs {
  float logprob = 0;
  std::vector<std::pair<int32_t, float>> top;
};

TokenLogprobs token_logprobs(std::span<const float> row, int32_t token, int top) {
  double mx = -INFINITY;
  for (float x : row) mx = std::max(mx, double(x));
  double sum = 0;
  for (float x : row) sum += std::exp(double(x) - mx);
  const double log_z = mx + std::log(sum);
  TokenLogprobs r;
  r.logprob = float(double(row[size_t(token)]) - log_z);
  const size_t k = std::min(size_t(std::max(top, 0)), row.size());
  if (k == 0) return r;
  std::vector<int32_t> ids(row.size());
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t(i);
  auto better = [&](int32_t a, int32_t b) {
    return row[size_t(a)] != row[size_t(b)] ? row[size_t(a)] > row[size_t(b)] : a < b;
  };
  std::partial_sort(ids.begin(), ids.begin() + std::ptrdiff_t(k), ids.end(), better);
  r.top.reserve(k);
  for (size_t i = 0; i < k; ++i)
    r.top.emplace_back(ids[i], float(double(row[size_t(ids[i])]) - log_z));
  return r;
}

}  // namespace

double Timings::prompt_tokens_per_s() const {
  const double t = ttft_s - queue_s;
  return t > 0 ? computed_prompt_tokens / t : 0;
}

double Timings::decode_tokens_per_s() const {
  return decode_s > 0 && completion_tokens > 1 ? (completion_tokens - 1) / decode_s : 0;
}

std::optional<EngineEvent> RequestHandle::pop_locked() {
  EngineEvent ev = std::move(events_.front());
  events_.pop_front();
  if (ev.final) done_ = true;
  return ev;
}

std::optional<EngineEvent> RequestHandle::next() {
  std::unique_lock<std::mutex> lock(mu_);
  if (done_) return std::nullopt;
  cv_.wait(lock, [&] { return !events_.empty(); });
  return pop_locked();
}

std::optional<EngineEvent> RequestHandle::next_for(double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  if (done_) return std::nullopt;
  if (!cv_.wait_for(lock, std::chrono::duration<double>(std::max(timeout_s, 0.0)),
                    [&] { return !events_.empty(); }))
    return std::nullopt;
  return pop_locked();
}

std::optional<EngineEvent> RequestHandle::try_next() {
  std::lock_guard<std::mutex> lock(mu_);
  if (done_ || events_.empty()) return std::nullopt;
  return pop_locked();
}

void RequestHandle::set_listener(std::function<void()> fn) {
  std::function<void()> old;  // destroyed outside the lock: it may own what set it
  {
    std::lock_guard<std::mutex> lock(listener_mu_);
    old = std::exchange(listener_, std::move(fn));
    bool queued;
    {
      std::lock_guard<std::mutex> events_lock(mu_);
      queued = !events_.empty();
    }
    if (queued && listener_) listener_();
  }
}

EngineEvent RequestHandle::wait() {
  std::string text;
  for (;;) {
    auto ev = next();
    if (!ev) throw Error("request " + std::to_string(id_) + ": events already consumed");
    text += ev->text;
    if (ev->final) {
      ev->text = std::move(text);
      return *ev;
    }
  }
}

void RequestHandle::enqueue(EngineEvent ev) {
  std::lock_guard<std::mutex> lock(mu_);
  events_.push_back(std::move(ev));
}

void RequestHandle::wake() {
  cv_.notify_one();
  std::lock_guard<std::mutex> lock(listener_mu_);
  if (listener_) listener_();
}

Engine::Engine(Model& model, Backend& backend, const Tokenizer* tokenizer, const EngineConfig& cfg)
    : model_(model),
      backend_(backend),
      tok_(tokenizer),
      cfg_(cfg),
      cache_(backend, model.config(), kv_config(cfg)),
      sched_(sched_config(cfg, model.config()), block_config(cfg)) {
  DS_CHECK(cfg.max_num_batched_tokens >= cfg.max_num_seqs,
           "max_num_batched_tokens must be >= max_num_seqs");
  // Logits live at one address for the engine's lifetime (captured graphs write there).
  // Graph buckets may pad a batch past max_num_seqs; without graphs a step has at most one
  // logit row per running sequence.
  // Several ranks: the graphs would hold rank 0's launches only (per-rank capture: not yet).
  const bool graphs = backend.supports_graphs() && cfg.graph_max_batch > 0 && model.ranks() == 1;
  const int64_t logit_rows =
      graphs ? std::max(cfg.max_num_seqs, cfg.graph_max_batch) : int64_t(cfg.max_num_seqs);
  logits_buf_ =
      backend.alloc(size_t(std::max<int64_t>(logit_rows, 1)) * size_t(model.config().vocab) * 4);
  // Backend::sample's per-row parameters, then its ids, for as many rows as the logits hold.
  ids_buf_ = backend.alloc(size_t(std::max<int64_t>(logit_rows, 1)) * (sizeof(SampleRow) + 4));
  if (graphs) {
    DecodeGraphConfig gc;
    gc.max_batch = cfg.graph_max_batch;
    const int64_t len = std::min(cfg.graph_max_context, cache_.capacity_tokens());
    gc.max_blocks_per_seq = int((len + cfg.block_size - 1) / cfg.block_size);
    graphs_ = std::make_unique<DecodeGraphs>(backend, model, cache_, gc);
  }
  const bool cpu = backend.device().kind == DeviceKind::CPU;
  defer_wakeups_ = cfg.defer_wakeups < 0 ? !cpu : cfg.defer_wakeups > 0;
  warm_up(cfg.warmup_tokens >= 0 ? cfg.warmup_tokens : cpu ? 0 : cfg.max_num_batched_tokens);
  thread_ = std::thread([this] { loop(); });
}

// A prefill step of random tokens written into the first blocks of the cache (which the block
// manager still holds as free: their contents mean nothing to it), so shapes and routing look
// like a real batch's; nothing of it reaches the scheduler, the stats or the prefix cache.
void Engine::warm_up(int64_t tokens) {
  const int bs = cfg_.block_size;
  const int64_t blocks = cache_.capacity_tokens() / bs;
  tokens = std::min<int64_t>(tokens, cfg_.max_num_batched_tokens);
  const int S = int(std::clamp<int64_t>((tokens + 1023) / 1024, 1, cfg_.max_num_seqs));
  int64_t L = tokens / S;
  const auto width = [&](int64_t len) { return (len + bs - 1) / bs; };
  while (L > 0 && S * width(L) > blocks) L = (blocks / S) * bs;
  if (L <= 0) return;
  const int W = int(width(L));
  const int vocab = model_.config().vocab;
  std::mt19937 rng(20261202);
  std::uniform_int_distribution<int32_t> pick(0, vocab - 1);
  StepBatch b;
  b.max_blocks_per_seq = W;
  b.query_start.push_back(0);
  for (int s = 0; s < S; ++s) {
    for (int64_t i = 0; i < L; ++i) {
      b.tokens.push_back(pick(rng));
      b.positions.push_back(int32_t(i));
      b.slot_mapping.push_back(int32_t(int64_t(s) * W * bs + i));
    }
    b.query_start.push_back(int32_t((s + 1) * L));
    b.context_lens.push_back(int32_t(L));
    for (int j = 0; j < W; ++j) b.block_tables.push_back(s * W + j);
    b.logit_rows.push_back(int32_t((s + 1) * L - 1));
    b.logit_seqs.push_back(SeqId(0));
  }
  const double t0 = now_s();
  const ForwardInput in = place_inputs(b);
  model_.forward(in, cache_, logits_buf_->view(DType::F32, {int64_t(S), vocab}));
  backend_.synchronize();
  log_info("engine warm-up: one prefill step of " + std::to_string(S) + " x " + std::to_string(L) +
           " tokens in " + std::to_string(int((now_s() - t0) * 1e3)) + " ms");
}

Engine::~Engine() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

std::shared_ptr<RequestHandle> Engine::submit(EngineRequest req) {
  for (int32_t id : req.prompt)
    if (id < 0 || id >= model_.config().vocab)
      throw Error("prompt token id " + std::to_string(id) + " is outside the vocabulary of " +
                  std::to_string(model_.config().vocab));
  if (req.logprobs < -1 || req.logprobs > 20)
    throw Error("logprobs must be between -1 and 20, got " + std::to_string(req.logprobs));
  std::unique_lock<std::mutex> lock(mu_);
  const SeqId id = next_id_++;
  auto handle = std::make_shared<RequestHandle>(id);
  auto live = std::make_unique<Live>(
      Live{req, handle, Sampler(req.sampling),
           OutputProcessor(tok_, req.stop, req.ignore_eos, model_.config().eos_id), now_s()});
  inbox_.emplace_back(id, std::move(live));
  lock.unlock();
  cv_.notify_all();
  return handle;
}

void Engine::hold_admission(bool hold) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    held_ = hold;
  }
  cv_.notify_all();
}

void Engine::cancel(SeqId id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    cancels_.push_back(id);
  }
  cv_.notify_all();
}

EngineStats Engine::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void Engine::loop() {
  for (;;) {
    std::vector<std::pair<SeqId, std::unique_ptr<Live>>> arrived;
    std::vector<SeqId> cancels;
    if (!sched_.has_unfinished()) flush_wakeups();  // nothing to launch: wake readers now
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] {
        return stop_ || (!held_ && !inbox_.empty()) || !cancels_.empty() || sched_.has_unfinished();
      });
      if (stop_) break;
      cancels.swap(cancels_);
      if (!held_) {
        arrived.swap(inbox_);
      } else {
        // Held: only the cancelled ones leave the inbox (admitted, then finished below).
        auto cancelled = [&](const auto& a) {
          return std::find(cancels.begin(), cancels.end(), a.first) != cancels.end();
        };
        for (auto& a : inbox_)
          if (cancelled(a)) arrived.push_back(std::move(a));
        std::erase_if(inbox_, [](const auto& a) { return a.second == nullptr; });
      }
    }
    for (auto& [id, live] : arrived) {
      Request r;
      r.id = id;
      r.prompt = live->req.prompt;
      r.max_tokens = live->req.max_tokens;
      r.priority = live->req.priority;
      live_.emplace(id, std::move(live));
      sched_.add(std::move(r));  // a rejection arrives with the next plan
    }
    for (SeqId id : cancels)
      if (live_.count(id)) finish(id, FinishReason::Cancelled);
    try {
      step();
    } catch (const std::exception& e) {
      // A failed forward fails the requests in it rather than the process. Failures of one
      // sequence's own work are caught in step() and end that sequence alone.
      log_error(std::string("engine step failed: ") + e.what());
      finish_all(FinishReason::Error, e.what());
    }
    if (expert_load_stale_ && !sched_.has_unfinished()) {
      std::vector<ExpertLoad> load = model_.expert_load();
      expert_load_stale_ = false;
      std::lock_guard<std::mutex> lock(mu_);
      stats_.expert_load = std::move(load);
    }
  }
  finish_all(FinishReason::Cancelled);
  flush_wakeups();
}

void Engine::deliver(const std::shared_ptr<RequestHandle>& h, EngineEvent ev) {
  h->enqueue(std::move(ev));
  if (!defer_wakeups_)
    h->wake();
  else if (wake_.empty() || wake_.back() != h)  // a stream's events are adjacent
    wake_.push_back(h);
}

void Engine::flush_wakeups() {
  for (const auto& h : wake_) h->wake();
  wake_.clear();
}

void Engine::finish_all(FinishReason reason, const std::string& error) {
  std::vector<SeqId> ids;  // finish() erases from live_
  for (const auto& [id, l] : live_) ids.push_back(id);
  for (SeqId id : ids) finish(id, reason, error);
}

void Engine::finish(SeqId id, FinishReason reason, const std::string& error) {
  auto it = live_.find(id);
  if (it == live_.end()) return;
  Live& l = *it->second;
  sched_.finish(id, reason);
  {
    // Before the final event, so a caller that reads the stats after it sees the blocks freed.
    std::lock_guard<std::mutex> lock(mu_);
    stats_.kv = sched_.block_manager().stats();
    stats_.running = sched_.num_running();
    stats_.waiting = sched_.num_waiting();
  }
  EngineEvent ev;
  ev.final = true;
  if (reason != FinishReason::Rejected && reason != FinishReason::Error)
    ev.text = std::string(l.out.close());
  ev.finish_reason = std::string(finish_reason_name(reason));
  ev.error = error;
  ev.usage.prompt_tokens = int(l.req.prompt.size());
  ev.usage.completion_tokens = l.generated;
  ev.usage.cached_prompt_tokens = std::max(l.cached, 0);
  const double t = now_s();
  Timings& tm = ev.timings;
  tm.queue_s = l.t_scheduled >= 0 ? l.t_scheduled - l.t_submit : t - l.t_submit;
  tm.ttft_s = l.t_first >= 0 ? l.t_first - l.t_submit : 0;
  tm.total_s = t - l.t_submit;
  tm.decode_s = l.t_first >= 0 ? l.t_last - l.t_first : 0;
  tm.computed_prompt_tokens = ev.usage.prompt_tokens - ev.usage.cached_prompt_tokens;
  tm.completion_tokens = l.generated;
  deliver(l.handle, std::move(ev));
  live_.erase(it);
}

void Engine::copy_blocks(const std::vector<BlockCopy>& copies) {
  for (const auto& [src, dst] : copies)
    for (int l = 0; l < model_.config().layers; ++l) {
      const PagedKv& kv = cache_.layer(l);
      const int64_t row = int64_t(kv.block_size) * kv.slot_stride();
      for (void* base : {kv.k, kv.v}) {
        if (!base) continue;  // latent caches have no separate V
        TensorView all =
            TensorView::contiguous(base, kv.dtype, {kv.num_blocks, row}, backend_.device());
        backend_.copy(all.slice_rows(src, src + 1), all.slice_rows(dst, dst + 1));
      }
      // An FP8 cache's scales are paged like its codes.
      const int64_t k_parts = kv.k_scale_parts(), v_parts = kv.kv_heads;
      for (const auto& [scales, parts] : {std::pair{kv.k_scale, k_parts}, {kv.v_scale, v_parts}}) {
        if (!scales) continue;
        TensorView all = TensorView::contiguous(
            scales, DType::F32, {kv.num_blocks, int64_t(kv.block_size) * parts}, backend_.device());
        backend_.copy(all.slice_rows(src, src + 1), all.slice_rows(dst, dst + 1));
      }
    }
  for (const auto& [src, dst] : copies) model_.mirror_block_copy(int(src), int(dst));
}

ForwardInput Engine::place_inputs(const StepBatch& b) {
  ForwardInput in;
  in.tokens = b.tokens;
  in.host_meta = b.meta();
  in.meta = in.host_meta;
  in.logit_rows = b.logit_rows;
  if (backend_.device().kind == DeviceKind::CPU) return in;
  // One upload per step of every int32 array the kernels read.
  staging_.clear();
  auto put = [&](const std::vector<int32_t>& v) {
    const size_t at = staging_.size();
    staging_.insert(staging_.end(), v.begin(), v.end());
    return at;
  };
  const size_t tok = put(b.tokens), pos = put(b.positions), qs = put(b.query_start),
               ctx = put(b.context_lens), bt = put(b.block_tables), sm = put(b.slot_mapping);
  const size_t bytes = std::max<size_t>(staging_.size(), 1) * 4;
  if (!meta_buf_ || meta_buf_->size() < bytes) meta_buf_ = backend_.alloc(bytes * 2);
  backend_.upload(meta_buf_->view(DType::I32, {int64_t(staging_.size())}), staging_.data(),
                  staging_.size() * 4);
  const int32_t* base = static_cast<const int32_t*>(meta_buf_->data());
  in.device_tokens = base + tok;
  in.meta.positions = base + pos;
  in.meta.query_start = base + qs;
  in.meta.context_lens = base + ctx;
  in.meta.block_tables = base + bt;
  in.meta.slot_mapping = base + sm;
  return in;
}

void Engine::step() {
  StepPlan plan = sched_.schedule();
  for (const auto& r : plan.rejected) finish(r.id, FinishReason::Rejected, r.reason);
  for (const auto& f : plan.finished) finish(f.id, f.reason);
  if (plan.empty()) {
    flush_wakeups();
    return;
  }
  copy_blocks(plan.block_copies);
  const double t_step = now_s();
  int64_t prompt_tokens = 0;  // prefill (and recompute) tokens, as opposed to decodes
  for (const auto& s : plan.seqs) {
    Live& l = *live_.at(s.id);
    const bool decode = l.generated > 0 && s.tokens.size() == 1 && s.needs_logits;
    if (!decode) prompt_tokens += int64_t(s.tokens.size());
    if (l.t_scheduled < 0) l.t_scheduled = t_step;
    if (l.cached < 0)
      if (const Sequence* seq = sched_.find(s.id)) l.cached = seq->num_cached_prompt;
  }

  const StepBatch batch = build_step_batch(plan, sched_.block_manager());
  const int vocab = model_.config().vocab;
  const size_t rows = batch.logit_rows.size();
  DS_CHECK(logits_buf_->size() >= rows * size_t(vocab) * 4, "more logit rows than sequences");
  TensorView logits = logits_buf_->view(DType::F32, {int64_t(rows), vocab});
  const int64_t cap_rows = int64_t(logits_buf_->size() / (size_t(vocab) * 4));
  const double t_launch = now_s();
  double gap_s = -1;  // host time since the last step's results, when it ran right before
  if (t_results_ >= 0) gap_s = t_launch - t_results_;
  t_results_ = -1;
  if (!graphs_ || !graphs_->run(batch, logits_buf_->view(DType::F32, {cap_rows, vocab}))) {
    const ForwardInput in = place_inputs(batch);
    model_.forward(in, cache_, logits);
  }
  if (defer_wakeups_) flush_wakeups();  // the last step's readers, while the device works

  std::vector<SampledToken> sampled;
  sampled.reserve(rows);
  std::vector<TokenLogprobs> lps;  // by index in `sampled`; sized only when a request asked
  std::vector<std::pair<SeqId, std::string>> failed;  // per-sequence failures of this step
  // On a device, a batch whose rows need nothing but their logits (no penalties, no logprobs)
  // is sampled there in one op: R ids come back instead of R x vocab logits.
  bool on_device = backend_.device().kind != DeviceKind::CPU && rows > 0;
  for (size_t i = 0; i < rows && on_device; ++i) {
    const Live& l = *live_.at(batch.logit_seqs[i]);
    on_device = l.sampler.device_sampleable() && l.req.logprobs < 0;
  }
  if (on_device) {
    std::vector<SampleRow> params(rows);
    for (size_t i = 0; i < rows; ++i) {
      const Live& l = *live_.at(batch.logit_seqs[i]);
      params[i] = l.sampler.sample_row(uint64_t(l.generated));
    }
    const Device dev = backend_.device();
    auto* base = static_cast<uint8_t*>(ids_buf_->data());
    const size_t param_bytes = rows * sizeof(SampleRow);
    backend_.upload(TensorView::contiguous(base, DType::U8, {int64_t(param_bytes)}, dev),
                    params.data(), param_bytes);
    const TensorView ids = TensorView::contiguous(base + size_t(cap_rows) * sizeof(SampleRow),
                                                  DType::I32, {int64_t(rows)}, dev);
    backend_.sample(logits, reinterpret_cast<const SampleRow*>(base), ids);
    std::vector<int32_t> host(rows);
    backend_.download(host.data(), ids, rows * 4);
    t_results_ = now_s();
    for (size_t i = 0; i < rows; ++i) sampled.push_back({batch.logit_seqs[i], host[i]});
  } else {
    logits_.resize(rows * size_t(vocab));
    if (rows) {
      backend_.download(logits_.data(), logits, logits_.size() * 4);
      t_results_ = now_s();
    }
    for (size_t i = 0; i < rows; ++i) {
      const SeqId id = batch.logit_seqs[i];
      try {
        const Sequence* seq = sched_.find(id);
        Live& l = *live_.at(id);
        const std::span<const float> row(logits_.data() + i * size_t(vocab), size_t(vocab));
        const int32_t tok = l.sampler.sample(row, seq->tokens);
        if (l.req.logprobs >= 0) {
          lps.resize(rows);
          lps[sampled.size()] = token_logprobs(row, tok, l.req.logprobs);
        }
        sampled.push_back({id, tok});
      } catch (const std::exception& e) {
        failed.emplace_back(id, e.what());
      }
    }
  }
  // A sequence that failed gets no token: finished first, the scheduler forgets its step.
  for (const auto& [id, why] : failed) fail(id, "sampling", why);
  sched_.on_step_done(sampled);

  // Statistics first, so a caller woken by a final event below already sees this step.
  // Expert counters live on the device: read them back a few times a second, not every step
  // (and once more when the engine goes idle, in loop()).
  std::optional<std::vector<ExpertLoad>> expert_load;
  expert_load_stale_ = true;
  if (const double t = now_s(); t - expert_load_read_s_ >= kExpertLoadPeriodS) {
    expert_load = model_.expert_load();
    expert_load_read_s_ = t;
    expert_load_stale_ = false;
  }
  const BlockManagerStats kv = sched_.block_manager().stats();
  const SchedulerStats ss = sched_.stats();
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.steps += 1;
    stats_.preemptions = ss.preemptions;
    stats_.prompt_tokens_computed += prompt_tokens;
    stats_.tokens_generated += int64_t(sampled.size());
    stats_.mean_fragmentation +=
        (kv.fragmentation - stats_.mean_fragmentation) / double(stats_.steps);
    stats_.peak_kv_usage = std::max(stats_.peak_kv_usage, kv.usage);
    stats_.running = sched_.num_running();
    stats_.waiting = sched_.num_waiting();
    if (expert_load) stats_.expert_load = std::move(*expert_load);
    stats_.kv = kv;
    // Decode steps only (no prompt tokens), the steady state; a step without logits has
    // nothing to wait for.
    if (t_results_ >= 0 && prompt_tokens == 0) {
      stats_.device_s += t_results_ - t_launch;
      ++stats_.device_steps;
      if (gap_s >= 0) {
        stats_.host_gap_s += gap_s;
        ++stats_.host_gaps;
      }
    }
  }

  const double t = now_s();
  for (size_t i = 0; i < sampled.size(); ++i) {
    const SampledToken& st = sampled[i];
    Live& l = *live_.at(st.id);
    ++l.generated;
    if (l.t_first < 0) l.t_first = t;
    l.t_last = t;
    OutputProcessor::Delta d;
    try {
      if (cfg_.fault_hook) cfg_.fault_hook(st.id, st.token);
      d = l.out.push(st.token);
    } catch (const std::exception& e) {
      // The token was generated (and is counted), but its output could not be made.
      fail(st.id, "output", e.what());
      continue;
    }
    EngineEvent ev;
    ev.token = st.token;
    ev.time_s = t;
    ev.text = std::string(d.text);
    if (l.req.logprobs >= 0) {
      ev.logprob = lps[i].logprob;
      ev.top_logprobs = std::move(lps[i].top);
    }
    deliver(l.handle, std::move(ev));
    if (d.finished)
      finish(st.id, FinishReason::Stop);
    else if (l.generated >= l.req.max_tokens)
      finish(st.id, FinishReason::Length);
  }
}

void Engine::fail(SeqId id, const char* stage, const std::string& why) {
  log_error("request " + std::to_string(id) + " failed in " + stage + ": " + why);
  finish(id, FinishReason::Error, std::string(stage) + ": " + why);
}

}  // namespace ds
