// Continuous batching: each step, which sequences compute which tokens, under a token budget
// and a cap on running sequences, with chunked prefill, recompute preemption and priority
// classes. Plain C++: the engine runs the plan and reports back with on_step_done().
//
// Engine loop, one thread:
//   add() / abort() / finish() as requests arrive, are cancelled or stop;
//   plan = schedule();  perform plan.block_copies;  batch = build_step_batch(plan, blocks);
//   forward;  sample the rows in batch.logit_rows;  on_step_done(sampled);
//   then finish(id, Stop or Length) for sequences whose new token ends them.
#pragma once

#include <optional>
#include <set>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "backend/backend.h"
#include "engine/block_manager.h"
#include "engine/request.h"
#include "engine/sched_policy.h"

namespace ds {

struct SchedulerConfig {
  // Tokens computed per step, prefill chunks and decodes; keep >= max_num_seqs so that every
  // running sequence's decode fits one step.
  int max_num_batched_tokens = 2048;
  int max_num_seqs = 64;  // running sequences at most
  int max_model_len = 0;  // prompt + max_tokens at most; 0 = only the cache limits
  // Priority isolation: while a sequence of a higher class is live (running or waiting), the
  // prefill chunks of all lower classes together take at most this many tokens per step and
  // lower-class decodes wait (they keep their KV blocks), so the higher class's steps stay
  // short and hold only its own work. 0 pauses lower-class prefill too; -1 turns isolation
  // off (every class shares every step). With nothing else to run, lower classes go ahead.
  int lower_class_prefill_tokens = 0;
  // Batch-class prefill tokens per step, always (-1: no cap): a request of a higher class
  // that arrives mid-step waits at most one such step before isolation applies.
  int batch_prefill_tokens = 512;
  // Prefill first in a burst: while waiting prompts (two or more, of the top class, with
  // seats free) hold a whole step of tokens, running decodes sit out up to this many
  // consecutive steps, then join one step. The batch fills sooner, and a closed batch ends one
  // admission phase plus its decode steps after it starts, so the decodes that mixed steps
  // carry early only lengthen that phase (SGLang's default puts new prompts first too).
  // 0: decodes join every step (vLLM's chunked prefill). A lone long prompt never stalls them.
  int prefill_first_steps = 8;
};

// One sequence's share of a step.
struct ScheduledSeq {
  SeqId id = 0;
  std::vector<int32_t> tokens;  // [n] ids to compute: a prefill chunk, or the last sampled token
  int start_pos = 0;            // position of tokens[0]; context after the step = start_pos + n
  bool needs_logits = false;    // the chunk completes the sequence: sample its next token
};

struct Rejection {
  SeqId id = 0;
  std::string reason;
};

struct Finished {
  SeqId id = 0;
  FinishReason reason = FinishReason::Length;
};

struct StepPlan {
  std::vector<ScheduledSeq> seqs;       // decodes first, then prefill chunks
  std::vector<SeqId> preempted;         // lost their blocks; recomputed once readmitted
  std::vector<Rejection> rejected;      // never served: report the reason and forget them
  std::vector<Finished> finished;       // finished by the scheduler (max_tokens reached)
  std::vector<BlockCopy> block_copies;  // (src, dst) K/V block copies, in order, before forward
  // Lower classes were held to the isolation caps (false: isolation is off, no class is
  // above another, or nothing else could run and they went ahead).
  bool isolated = false;
  int num_tokens() const;
  bool empty() const { return seqs.empty(); }
};

struct SampledToken {
  SeqId id = 0;
  int32_t token = 0;
};

struct SchedulerStats {
  int64_t steps = 0;        // non-empty plans
  int64_t preemptions = 0;  // sequences preempted (a sequence may count several times)
  int64_t rejections = 0;
  int waiting = 0;
  int running = 0;
};

class Scheduler {
 public:
  Scheduler(const SchedulerConfig& cfg, const BlockManagerConfig& blocks);

  // Queues a request. False if it can never be served (empty prompt, max_tokens < 1, longer
  // than max_model_len or than the whole cache); the reason is in the next plan's `rejected`.
  // Throws ds::Error if the id is live.
  bool add(Request req);

  // n > 1 sampling: `child` continues `parent` (same tokens, shared blocks); `last_token`
  // replaces the child's last token (sampled, not yet computed). Between steps only, with the
  // parent running and decoding. False if static mode cannot reserve the child's blocks.
  bool fork(SeqId parent, SeqId child, std::optional<int32_t> last_token = std::nullopt);
  // Whether `parent` is in that state: its next step is the decode of its last sampled token.
  bool can_fork(SeqId parent) const;

  // Plans the next step. Call on_step_done() after running a non-empty plan.
  StepPlan schedule();

  // The plan's tokens are computed (committed to the block manager); `sampled` holds a token
  // for each sequence whose chunk needed logits (ids finished meanwhile are ignored).
  void on_step_done(std::span<const SampledToken> sampled);

  // Ends a sequence now (waiting or running) and frees its blocks. False for an unknown id.
  bool finish(SeqId id, FinishReason reason);
  bool abort(SeqId id) { return finish(id, FinishReason::Cancelled); }

  const Sequence* find(SeqId id) const;  // nullptr once finished
  int num_waiting() const { return int(waiting_.size()); }
  int num_running() const { return int(running_.size()); }
  bool has_unfinished() const { return !seqs_.empty() || !pending_rejections_.empty(); }
  const BlockManager& block_manager() const { return blocks_; }
  const SchedulerConfig& config() const { return cfg_; }
  SchedulerStats stats() const;

 private:
  struct WaitingOrder {
    const AdmissionPolicy* policy;
    bool operator()(const Sequence* a, const Sequence* b) const { return policy->before(*a, *b); }
  };

  std::optional<std::string> rejection_reason(const Request& req) const;
  void finish_reached_max_tokens(StepPlan& plan);
  // Gives `s` slots for n more tokens, preempting unscheduled running sequences (possibly `s`
  // itself: then false).
  bool make_room(Sequence& s, int n, StepPlan& plan, TokenBudget& budget);
  bool admit(Sequence& s, StepPlan& plan, TokenBudget& budget);
  // Schedules running sequences' decodes (or prefill chunks) in service order, within the
  // step's isolation caps.
  void schedule_running(bool decodes, StepPlan& plan, TokenBudget& budget);
  // This step's isolation (set by schedule()): prefill tokens `s` may still take beyond the
  // step budget's, and whether its decode waits for a higher class.
  int prefill_cap_left(const Sequence& s) const;
  void take_prefill_cap(const Sequence& s, int n);
  bool decode_waits(const Sequence& s) const;
  // The highest class with a live sequence (nullopt when none is).
  std::optional<Priority> top_class() const;
  // Whether running decodes sit out this step (prefill_first_steps): a burst of prompts waits.
  bool decodes_sit_out() const;
  void preempt(Sequence& s, StepPlan& plan, TokenBudget& budget);
  void add_to_plan(Sequence& s, int n, StepPlan& plan);
  Sequence& live(SeqId id);

  struct StepCaps {
    std::optional<Priority> top;       // the highest live class
    std::optional<TokenBudget> lower;  // lower classes' prefill, while isolation applies
    std::optional<TokenBudget> batch;  // the batch class's prefill, always
  };
  StepCaps caps_;

  SchedulerConfig cfg_;
  BlockManager blocks_;
  AdmissionPolicy admission_;
  PreemptionPolicy preemption_;
  std::unordered_map<SeqId, Sequence> seqs_;  // live sequences; node addresses are stable
  std::set<Sequence*, WaitingOrder> waiting_;
  std::vector<Sequence*> running_;
  std::vector<Rejection> pending_rejections_;
  std::vector<SeqId> in_flight_;  // sequences in the last plan
  uint64_t next_arrival_ = 0;
  int decode_waits_ = 0;  // consecutive steps whose decodes sat out (prefill_first_steps)
  SchedulerStats stats_;
};

// A plan flattened into the per-step metadata of backend.h's AttentionMeta (host vectors;
// a GPU engine uploads them).
struct StepBatch {
  std::vector<int32_t> tokens;        // [num_tokens]
  std::vector<int32_t> positions;     // [num_tokens]
  std::vector<int32_t> query_start;   // [num_seqs + 1]
  std::vector<int32_t> context_lens;  // [num_seqs] incl. this step's tokens
  std::vector<int32_t> block_tables;  // [num_seqs, max_blocks_per_seq], padded with -1
  int max_blocks_per_seq = 0;         // blocks covering the longest context
  std::vector<int32_t> slot_mapping;  // [num_tokens]
  std::vector<int32_t> logit_rows;    // token rows whose next-token logits are sampled
  std::vector<SeqId> logit_seqs;      // [logit_rows.size()] the sequence of each row
  int num_seqs() const { return int(context_lens.size()); }
  // Points into this object: keep it alive and unchanged while the meta is used.
  AttentionMeta meta() const;
};

StepBatch build_step_batch(const StepPlan& plan, const BlockManager& blocks);

}  // namespace ds
