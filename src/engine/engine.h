// The serving engine: one thread owns the batch. Callers submit requests from any thread and
// read each request's events (tokens with text deltas, then a final event with the finish
// reason, usage and timings) from its handle.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "engine/decode_graphs.h"
#include "engine/output.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"
#include "model/model.h"

namespace ds {

struct EngineConfig {
  int64_t kv_cache_tokens = 4096;
  int block_size = 16;
  AllocationMode kv_mode = AllocationMode::Dynamic;
  bool prefix_cache = true;
  int max_num_seqs = 64;
  int max_num_batched_tokens = 2048;
  int lower_class_prefill_tokens = 0;  // SchedulerConfig's priority isolation; -1: off
  int batch_prefill_tokens = 512;      // SchedulerConfig's; -1: no cap
  int prefill_first_steps = 8;         // SchedulerConfig's; 0: decodes join every step
  DType kv_dtype = DType::F32;
  // Decode steps of up to this many sequences replay device graphs (CUDA); 0 disables.
  int graph_max_batch = kMaxDecodeGraphBatch;
  // Contexts up to this many tokens use graphs (every captured launch is sized for it, so a
  // larger value costs empty work in each replay); longer ones run eagerly.
  int64_t graph_max_context = 4096;
  // Readers are woken (condition variable, listener) for a step's events after the next
  // step's forward is launched, while the device runs it, instead of between the two steps:
  // at 256 streams one wakeup per stream is a syscall each, about half of the engine's host
  // time between decode steps (bench/host-overhead-cpu.yaml, perf). Events are queued at once;
  // the wakeups follow at the next launch, or when the engine has nothing to launch.
  // -1: on for device backends (the CPU computes in the launch, so it would only delay
  // delivery); 0: off; 1: on.
  int defer_wakeups = -1;
  // Before serving, one prefill step of this many random prompt tokens (in up to
  // max_num_seqs sequences of ~1,024; at most max_num_batched_tokens and what the cache holds)
  // runs through the model, so the first real batch does not pay one-time costs (library
  // handles, lazily loaded kernels, first-use scratch). 0: none; -1 (the default):
  // max_num_batched_tokens on a GPU, none on the CPU. On the H200 it took the first batch's
  // TTFT of W1 from 463 to 209 ms (bench/results/2026-12-02-h200-1fe840d-*).
  int64_t warmup_tokens = -1;
  // Fault injection for tests: called for each sampled token before its output is made; what
  // it throws fails that request alone (as a detokenizer or stop-string failure would).
  std::function<void(SeqId, int32_t)> fault_hook;
};

struct EngineRequest {
  std::vector<int32_t> prompt;
  int max_tokens = 128;
  SamplingParams sampling;
  std::vector<std::string> stop;
  bool ignore_eos = false;
  Priority priority = Priority::Standard;
  // -1: none; 0..20: each token event carries the sampled token's log-probability and this
  // many top alternatives, from the model's raw logits (before penalties and temperature).
  int logprobs = -1;
};

struct Usage {
  int prompt_tokens = 0;
  int completion_tokens = 0;
  int cached_prompt_tokens = 0;  // served from the prefix cache at admission
};

struct Timings {
  double queue_s = 0;                  // submit -> first scheduled
  double ttft_s = 0;                   // submit -> first token
  double total_s = 0;                  // submit -> finished
  double decode_s = 0;                 // first token -> last token
  double prompt_tokens_per_s() const;  // computed prompt tokens / (ttft - queue)
  double decode_tokens_per_s() const;  // (completion - 1) / decode_s
  int computed_prompt_tokens = 0;
  int completion_tokens = 0;
  int preemptions = 0;
};

struct EngineEvent {
  bool final = false;
  int32_t token = -1;  // the sampled id (token events)
  double time_s = 0;   // token events: when the engine sampled it (steady clock, seconds)
  std::string text;    // newly final text
  float logprob = 0;   // token events of requests with logprobs >= 0: log p(token)
  std::vector<std::pair<int32_t, float>> top_logprobs;  // descending; ties by lower id
  std::string finish_reason;  // final: "stop", "length", "cancelled", "rejected", "error"
  std::string error;          // final, rejected or error: why
  Usage usage;
  Timings timings;
};

// A submitted request's event stream. Thread-safe; one reader.
class RequestHandle {
 public:
  explicit RequestHandle(SeqId id) : id_(id) {}
  SeqId id() const { return id_; }
  // Blocks until the next event; nullopt once the final event has been read.
  std::optional<EngineEvent> next();
  // Like next(), but waits at most `timeout_s`: nullopt also when nothing arrived in time.
  std::optional<EngineEvent> next_for(double timeout_s);
  // Never blocks: the next event if one is queued, else nullopt (also after the final one).
  std::optional<EngineEvent> try_next();
  // Event-driven readers: `fn` runs after each event is queued (on the engine thread, so it
  // must only hand off, e.g. post to an executor), and at once if events are already queued.
  // Once set_listener returns, the previous listener is not running and will not run again.
  void set_listener(std::function<void()> fn);
  // Reads events until the final one; returns it with `text` holding the whole output.
  EngineEvent wait();

 private:
  friend class Engine;
  void enqueue(EngineEvent ev);  // queued, reader not woken yet
  void wake();                   // wakes a blocked reader and runs the listener
  std::optional<EngineEvent> pop_locked();

  SeqId id_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<EngineEvent> events_;
  bool done_ = false;       // final event read
  std::mutex listener_mu_;  // held while the listener runs or is replaced
  std::function<void()> listener_;
};

struct EngineStats {
  int64_t steps = 0;
  int64_t preemptions = 0;
  int64_t prompt_tokens_computed = 0;
  int64_t tokens_generated = 0;
  double mean_fragmentation = 0;  // over steps, of the KV blocks held
  double peak_kv_usage = 0;
  int running = 0;  // sequences the scheduler holds as running after the last step
  int waiting = 0;  // admitted but not yet running (incl. preempted)
  std::vector<ExpertLoad> expert_load;  // MoE models: tokens per expert per layer (<= 0.25 s old)
  BlockManagerStats kv;
  // Where a decode step's time goes (steps without prompt tokens that sample), summed:
  // `device_s` from the launch of its forward to its sampled tokens (or logits) back on the
  // host, `host_gap_s` from the previous step's results to this launch (scheduling, outputs,
  // metadata: time the device sits idle; counted when that step returned results).
  double device_s = 0;
  int64_t device_steps = 0;
  double host_gap_s = 0;
  int64_t host_gaps = 0;
};

class Engine {
 public:
  Engine(Model& model, Backend& backend, const Tokenizer* tokenizer, const EngineConfig& cfg);
  ~Engine();  // cancels what is left and joins the engine thread
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  std::shared_ptr<RequestHandle> submit(EngineRequest req);
  void cancel(SeqId id);
  // While held, submitted requests wait in the inbox: the scheduler sees none of them (steps
  // of sequences already running go on). Releasing admits them together, so a batch that a
  // client submits from several threads starts in one step (the offline bench's closed-loop
  // start) instead of in whichever steps its submissions happen to reach.
  void hold_admission(bool hold);
  EngineStats stats() const;
  int graphs_captured() const { return graphs_ ? graphs_->captured() : 0; }
  int64_t kv_capacity_tokens() const { return cache_.capacity_tokens(); }

 private:
  struct Live {
    EngineRequest req;
    std::shared_ptr<RequestHandle> handle;
    Sampler sampler;
    OutputProcessor out;
    double t_submit = 0, t_scheduled = -1, t_first = -1, t_last = -1;
    int cached = -1;
    int generated = 0;
  };

  void loop();
  void step();
  void warm_up(int64_t tokens);
  void finish(SeqId id, FinishReason reason, const std::string& error = {});
  void finish_all(FinishReason reason, const std::string& error = {});
  // Ends one sequence whose own work failed (`stage`: sampling, output), never the step.
  void fail(SeqId id, const char* stage, const std::string& why);
  void copy_blocks(const std::vector<BlockCopy>& copies);
  ForwardInput place_inputs(const StepBatch& b);

  Model& model_;
  Backend& backend_;
  const Tokenizer* tok_;
  EngineConfig cfg_;
  KvCache cache_;
  Scheduler sched_;
  std::unordered_map<SeqId, std::unique_ptr<Live>> live_;  // engine thread only
  std::unique_ptr<DecodeGraphs> graphs_;                   // null when the backend has none
  std::unique_ptr<Buffer> logits_buf_;  // [max_num_seqs (or graph bucket), vocab], fixed
  std::unique_ptr<Buffer> ids_buf_;     // device sampling: the step's SampleRow params, then ids
  std::unique_ptr<Buffer> meta_buf_;    // step metadata in backend memory (non-CPU backends)
  std::vector<int32_t> staging_;        // host side of meta_buf_'s upload
  std::vector<float> logits_;
  static constexpr double kExpertLoadPeriodS = 0.25;
  double expert_load_read_s_ = -1e9;  // when the model's expert counters were last read
  bool expert_load_stale_ = false;    // steps ran since then
  double t_results_ = -1;       // when the last step's results reached the host; -1: none pending
  bool defer_wakeups_ = false;  // EngineConfig::defer_wakeups resolved
  std::vector<std::shared_ptr<RequestHandle>> wake_;  // handles with events not yet woken for
  // Queues `ev` on `h` and wakes its reader, or with deferred wakeups notes `h` for the next
  // flush_wakeups().
  void deliver(const std::shared_ptr<RequestHandle>& h, EngineEvent ev);
  void flush_wakeups();

  mutable std::mutex mu_;  // guards the inbox, cancels, stats_, held_ and stop_
  std::condition_variable cv_;
  std::vector<std::pair<SeqId, std::unique_ptr<Live>>> inbox_;
  std::vector<SeqId> cancels_;
  EngineStats stats_;
  bool held_ = false;  // hold_admission
  bool stop_ = false;
  SeqId next_id_ = 1;
  std::thread thread_;
};

}  // namespace ds
