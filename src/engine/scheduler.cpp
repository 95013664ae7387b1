#include "engine/scheduler.h"

#include <algorithm>
#include <climits>

#include "core/error.h"

namespace ds {

int StepPlan::num_tokens() const {
  int n = 0;
  for (const auto& s : seqs) n += int(s.tokens.size());
  return n;
}

Scheduler::Scheduler(const SchedulerConfig& cfg, const BlockManagerConfig& blocks)
    : cfg_(cfg), blocks_(blocks), waiting_(WaitingOrder{&admission_}) {
  DS_CHECK(cfg.max_num_batched_tokens > 0, "max_num_batched_tokens must be positive");
  DS_CHECK(cfg.max_num_seqs > 0, "max_num_seqs must be positive");
  DS_CHECK(cfg.max_model_len >= 0, "max_model_len must be >= 0");
}

Sequence& Scheduler::live(SeqId id) {
  auto it = seqs_.find(id);
  DS_CHECK(it != seqs_.end(), "unknown sequence " + std::to_string(id));
  return it->second;
}

const Sequence* Scheduler::find(SeqId id) const {
  auto it = seqs_.find(id);
  return it == seqs_.end() ? nullptr : &it->second;
}

SchedulerStats Scheduler::stats() const {
  SchedulerStats st = stats_;
  st.waiting = num_waiting();
  st.running = num_running();
  return st;
}

std::optional<std::string> Scheduler::rejection_reason(const Request& req) const {
  if (req.prompt.empty()) return "the prompt is empty";
  if (req.max_tokens < 1) return "max_tokens must be at least 1";
  const int64_t total = int64_t(req.prompt.size()) + req.max_tokens;
  const std::string what = "prompt (" + std::to_string(req.prompt.size()) +
                           " tokens) plus max_tokens (" + std::to_string(req.max_tokens) + ")";
  if (cfg_.max_model_len > 0 && total > cfg_.max_model_len)
    return what + " exceeds the model's context of " + std::to_string(cfg_.max_model_len) +
           " tokens";
  if (blocks_.blocks_for(total) > blocks_.num_blocks())
    return what + " needs " + std::to_string(blocks_.blocks_for(total)) + " KV blocks of " +
           std::to_string(blocks_.block_size()) + " tokens; the whole cache has " +
           std::to_string(blocks_.num_blocks());
  return std::nullopt;
}

bool Scheduler::add(Request req) {
  DS_CHECK(!seqs_.count(req.id), "sequence " + std::to_string(req.id) + " is already live");
  if (auto reason = rejection_reason(req)) {
    pending_rejections_.push_back({req.id, std::move(*reason)});
    ++stats_.rejections;
    return false;
  }
  Sequence s;
  s.id = req.id;
  s.priority = req.priority;
  s.arrival = next_arrival_++;
  s.num_prompt_tokens = int(req.prompt.size());
  s.tokens = std::move(req.prompt);
  s.max_tokens = req.max_tokens;
  Sequence& ref = seqs_.emplace(s.id, std::move(s)).first->second;
  waiting_.insert(&ref);
  return true;
}

bool Scheduler::can_fork(SeqId parent) const {
  const Sequence* p = find(parent);
  // A recompute chunk can also stop one token short; only a decode has no uncomputed slots.
  return in_flight_.empty() && p && p->status == SeqStatus::Running && p->num_uncomputed() == 1 &&
         p->num_output() > 0 && blocks_.num_slots(parent) == p->num_computed;
}

bool Scheduler::fork(SeqId parent, SeqId child, std::optional<int32_t> last_token) {
  DS_CHECK(!seqs_.count(child), "sequence " + std::to_string(child) + " is already live");
  DS_CHECK(can_fork(parent), "fork() needs a running, decoding parent, between steps");
  Sequence& p = live(parent);
  if (!blocks_.fork(parent, child)) return false;
  Sequence c = p;
  c.id = child;
  c.num_preemptions = 0;
  if (last_token) c.tokens.back() = *last_token;
  running_.push_back(&seqs_.emplace(child, std::move(c)).first->second);
  return true;
}

bool Scheduler::finish(SeqId id, FinishReason reason) {
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return false;
  Sequence& s = it->second;
  if (s.status == SeqStatus::Running) {
    blocks_.free(id);
    std::erase(running_, &s);
  } else {
    waiting_.erase(&s);
  }
  seqs_.erase(it);
  return true;
}

void Scheduler::preempt(Sequence& s, StepPlan& plan, TokenBudget& budget) {
  if (s.num_scheduled > 0) {  // already in this step's plan: take it out again
    budget.give_back(s.num_scheduled);
    std::erase_if(plan.seqs, [&](const ScheduledSeq& x) { return x.id == s.id; });
    s.num_scheduled = 0;
  }
  blocks_.free(s.id);
  std::erase(running_, &s);
  s.status = SeqStatus::Waiting;
  s.num_computed = 0;  // recomputed from scratch: prompt and generated tokens alike
  ++s.num_preemptions;
  waiting_.insert(&s);
  plan.preempted.push_back(s.id);
  ++stats_.preemptions;
}

void Scheduler::add_to_plan(Sequence& s, int n, StepPlan& plan) {
  ScheduledSeq x;
  x.id = s.id;
  x.start_pos = s.num_computed;
  x.tokens.assign(s.tokens.begin() + s.num_computed, s.tokens.begin() + s.num_computed + n);
  x.needs_logits = s.num_computed + n == s.num_tokens();
  s.num_scheduled = n;
  plan.seqs.push_back(std::move(x));
}

bool Scheduler::make_room(Sequence& s, int n, StepPlan& plan, TokenBudget& budget) {
  const int grow = s.num_computed + n - blocks_.num_slots(s.id);
  if (grow <= 0) return true;
  while (!blocks_.can_grow(s.id, grow)) {
    std::vector<Sequence*> candidates;
    for (Sequence* r : running_)
      if (r->num_scheduled == 0) candidates.push_back(r);
    Sequence* victim = preemption_.pick(candidates);  // `s` itself is a candidate
    preempt(*victim, plan, budget);
    if (victim == &s) return false;
  }
  DS_CHECK(blocks_.grow(s.id, grow), "grow failed after can_grow");
  return true;
}

bool Scheduler::admit(Sequence& s, StepPlan& plan, TokenBudget& budget) {
  if (prefill_cap_left(s) == 0) return false;        // checked before anyone is displaced
  const std::span<const int32_t> tokens = s.tokens;  // recompute includes generated tokens
  const int max_new = s.max_tokens - s.num_output();
  const int need = blocks_.blocks_needed(tokens, max_new);
  const bool need_seat = num_running() >= cfg_.max_num_seqs;
  if (need_seat || need > blocks_.num_available_blocks()) {
    // Displace lower classes only if that surely makes room, so none is preempted in vain.
    std::vector<Sequence*> candidates;
    int reclaimable = blocks_.num_available_blocks();
    for (Sequence* r : running_)
      if (admission_.may_displace(s, *r)) {
        candidates.push_back(r);
        reclaimable += blocks_.num_exclusive_blocks(r->id);
      }
    if (candidates.empty() || reclaimable < need) return false;
    while (num_running() >= cfg_.max_num_seqs || !blocks_.can_allocate(tokens, max_new)) {
      Sequence* victim = preemption_.pick(candidates);
      if (!victim) return false;
      preempt(*victim, plan, budget);
      std::erase(candidates, victim);
    }
  }
  const std::optional<int> computed = blocks_.allocate(s.id, tokens, max_new);
  DS_CHECK(computed.has_value(), "allocate failed after can_allocate");
  waiting_.erase(&s);
  s.status = SeqStatus::Running;
  s.num_computed = *computed;
  if (s.num_cached_prompt < 0) s.num_cached_prompt = *computed;
  running_.push_back(&s);
  const int n = std::min({s.num_uncomputed(), budget.left(), prefill_cap_left(s)});
  take_prefill_cap(s, n);
  add_to_plan(s, budget.take(n), plan);
  return true;
}

int Scheduler::prefill_cap_left(const Sequence& s) const {
  int left = INT_MAX;
  if (caps_.lower && s.priority > *caps_.top) left = std::min(left, caps_.lower->left());
  if (caps_.batch && s.priority == Priority::Batch) left = std::min(left, caps_.batch->left());
  return left;
}

void Scheduler::take_prefill_cap(const Sequence& s, int n) {
  if (caps_.lower && s.priority > *caps_.top) caps_.lower->take(n);
  if (caps_.batch && s.priority == Priority::Batch) caps_.batch->take(n);
}

bool Scheduler::decode_waits(const Sequence& s) const {
  return caps_.lower && s.priority > *caps_.top;
}

std::optional<Priority> Scheduler::top_class() const {
  std::optional<Priority> top;
  if (!waiting_.empty()) top = (*waiting_.begin())->priority;  // the waiting set is class-ordered
  for (const Sequence* s : running_)
    if (!top || s->priority < *top) top = s->priority;
  return top;
}

bool Scheduler::decodes_sit_out() const {
  if (cfg_.prefill_first_steps <= 0 || decode_waits_ >= cfg_.prefill_first_steps) return false;
  if (waiting_.size() < 2 || num_running() >= cfg_.max_num_seqs) return false;
  const Sequence& head = **waiting_.begin();
  // A higher class live (isolation decides) or the batch class's own prefill cap: no burst.
  if (head.priority != *caps_.top) return false;
  if (head.priority == Priority::Batch && cfg_.batch_prefill_tokens > 0) return false;
  int64_t tokens = 0;
  bool decoding = false;
  for (const Sequence* s : running_) {
    const int left = s->num_uncomputed();
    decoding |= left == 1;
    if (left > 1) tokens += left;  // a prompt's remaining chunks
  }
  int seats = cfg_.max_num_seqs - num_running(), prompts = 0;
  for (const Sequence* w : waiting_) {
    if (seats == 0 || w->priority != head.priority) break;
    tokens += w->num_uncomputed();
    --seats;
    ++prompts;
  }
  return decoding && prompts >= 2 && tokens >= cfg_.max_num_batched_tokens;
}

void Scheduler::schedule_running(bool decodes, StepPlan& plan, TokenBudget& budget) {
  std::vector<Sequence*> order = running_;  // in service order
  std::sort(order.begin(), order.end(),
            [&](const Sequence* a, const Sequence* b) { return admission_.before(*a, *b); });
  for (Sequence* s : order) {
    if (budget.left() == 0) break;
    if (s->status != SeqStatus::Running || s->num_scheduled > 0) continue;  // preempted
    if ((s->num_uncomputed() == 1) != decodes) continue;
    if (decodes && decode_waits(*s)) continue;
    const int n =
        std::min({s->num_uncomputed(), budget.left(), decodes ? INT_MAX : prefill_cap_left(*s)});
    if (n == 0 || !make_room(*s, n, plan, budget)) continue;
    if (!decodes) take_prefill_cap(*s, n);
    add_to_plan(*s, budget.take(n), plan);
  }
}

void Scheduler::finish_reached_max_tokens(StepPlan& plan) {
  std::vector<SeqId> done;
  for (Sequence* s : running_) {
    DS_CHECK(s->num_uncomputed() > 0, "sequence " + std::to_string(s->id) +
                                          " needs a sampled token (missing in on_step_done)");
    if (s->num_output() >= s->max_tokens) done.push_back(s->id);
  }
  for (SeqId id : done) {
    finish(id, FinishReason::Length);
    plan.finished.push_back({id, FinishReason::Length});
  }
}

StepPlan Scheduler::schedule() {
  DS_CHECK(in_flight_.empty(), "schedule() called before on_step_done() of the last plan");
  StepPlan plan;
  finish_reached_max_tokens(plan);
  plan.rejected = std::exchange(pending_rejections_, {});
  TokenBudget budget(cfg_.max_num_batched_tokens);
  // Priority isolation: lower classes' prefill chunks share a small budget of their own and
  // their decodes wait; the batch class's prefill has a per-step budget at all times.
  caps_ = {};
  caps_.top = top_class();
  bool sat_out = false;
  auto fill = [&](bool isolate) {
    sat_out = false;
    caps_.lower.reset();
    if (isolate) caps_.lower.emplace(cfg_.lower_class_prefill_tokens);
    caps_.batch.reset();
    if (cfg_.batch_prefill_tokens > 0) caps_.batch.emplace(cfg_.batch_prefill_tokens);
    // Running sequences first: decodes, then unfinished prefills (chunks); in a burst the
    // decodes sit out unless the prompts leave room for all of them.
    const bool sit_out = decodes_sit_out();
    if (!sit_out) schedule_running(true, plan, budget);
    schedule_running(false, plan, budget);
    // Admissions, unless memory was short this step (readmitting now would thrash).
    if (plan.preempted.empty()) {
      while (budget.left() > 0 && !waiting_.empty()) {
        Sequence& head = **waiting_.begin();
        // Head-of-line blocking keeps class and FIFO order; one displaced this step waits.
        if (std::find(plan.preempted.begin(), plan.preempted.end(), head.id) !=
            plan.preempted.end())
          break;
        if (!admit(head, plan, budget)) break;
      }
    }
    if (sit_out) {
      int decodes = 0;
      for (const Sequence* s : running_)
        decodes += s->num_scheduled == 0 && s->num_uncomputed() == 1 && !decode_waits(*s);
      sat_out = !plan.seqs.empty() && budget.left() < decodes;
      if (!sat_out) {  // they fit after all: run them, ahead of the prompts as always
        const size_t prompts = plan.seqs.size();
        schedule_running(true, plan, budget);
        std::rotate(plan.seqs.begin(), plan.seqs.begin() + long(prompts), plan.seqs.end());
      }
    }
  };
  if (caps_.top) {
    const bool isolate = cfg_.lower_class_prefill_tokens >= 0;
    fill(isolate);
    plan.isolated = isolate;
    // Isolation never stalls the engine: with nothing else to run, lower classes go ahead.
    if (plan.seqs.empty() && isolate) {
      fill(false);
      plan.isolated = false;
    }
  }
  caps_ = {};
  decode_waits_ = sat_out ? decode_waits_ + 1 : 0;

  plan.block_copies = blocks_.take_pending_copies();
  for (const auto& x : plan.seqs) in_flight_.push_back(x.id);
  if (!plan.seqs.empty()) ++stats_.steps;
  return plan;
}

void Scheduler::on_step_done(std::span<const SampledToken> sampled) {
  for (SeqId id : in_flight_) {
    auto it = seqs_.find(id);
    if (it == seqs_.end()) continue;  // finished during the step
    Sequence& s = it->second;
    if (s.num_scheduled == 0) continue;
    blocks_.commit(id,
                   std::span(s.tokens).subspan(size_t(s.num_computed), size_t(s.num_scheduled)));
    s.num_computed += s.num_scheduled;
    s.num_scheduled = 0;
  }
  in_flight_.clear();
  for (const SampledToken& t : sampled) {
    auto it = seqs_.find(t.id);
    if (it == seqs_.end()) continue;
    Sequence& s = it->second;
    DS_CHECK(s.status == SeqStatus::Running && s.num_uncomputed() == 0,
             "sampled token for sequence " + std::to_string(t.id) + ", which needs none");
    s.tokens.push_back(t.token);
  }
}

AttentionMeta StepBatch::meta() const {
  AttentionMeta m;
  m.num_seqs = num_seqs();
  m.num_tokens = int(tokens.size());
  m.query_start = query_start.data();
  m.context_lens = context_lens.data();
  m.block_tables = block_tables.data();
  m.max_blocks_per_seq = max_blocks_per_seq;
  m.slot_mapping = slot_mapping.data();
  m.positions = positions.data();
  for (int i = 0; i < m.num_seqs; ++i) {
    m.max_query_len =
        std::max(m.max_query_len, query_start[size_t(i) + 1] - query_start[size_t(i)]);
    m.max_context_len = std::max(m.max_context_len, context_lens[size_t(i)]);
  }
  return m;
}

StepBatch build_step_batch(const StepPlan& plan, const BlockManager& blocks) {
  StepBatch b;
  const int bs = blocks.block_size();
  const int n_tokens = plan.num_tokens();
  b.tokens.reserve(size_t(n_tokens));
  b.positions.reserve(size_t(n_tokens));
  b.slot_mapping.reserve(size_t(n_tokens));
  b.query_start.push_back(0);
  for (const auto& s : plan.seqs) {
    const int ctx = s.start_pos + int(s.tokens.size());
    b.context_lens.push_back(ctx);
    b.max_blocks_per_seq = std::max(b.max_blocks_per_seq, blocks.blocks_for(ctx));
  }
  b.block_tables.assign(plan.seqs.size() * size_t(b.max_blocks_per_seq), -1);
  for (size_t i = 0; i < plan.seqs.size(); ++i) {
    const ScheduledSeq& s = plan.seqs[i];
    const std::vector<int32_t>& table = blocks.block_table(s.id);
    const int used = blocks.blocks_for(b.context_lens[i]);
    DS_CHECK(int(table.size()) >= used, "sequence " + std::to_string(s.id) + " lacks blocks");
    std::copy_n(table.begin(), used, b.block_tables.begin() + long(i) * b.max_blocks_per_seq);
    for (size_t t = 0; t < s.tokens.size(); ++t) {
      const int pos = s.start_pos + int(t);
      b.tokens.push_back(s.tokens[t]);
      b.positions.push_back(pos);
      b.slot_mapping.push_back(table[size_t(pos / bs)] * bs + pos % bs);
    }
    b.query_start.push_back(int32_t(b.tokens.size()));
    if (s.needs_logits) {
      b.logit_rows.push_back(int32_t(b.tokens.size()) - 1);
      b.logit_seqs.push_back(s.id);
    }
  }
  return b;
}

}  // namespace ds
