// Randomized runs of the scheduler and block manager against a shadow KV cache. Like real K/V,
// what a step writes into a token's slot depends on the whole prefix: a hash of the sequence's
// tokens up to that position. After the plan's block copies and the writes, every scheduled
// sequence must read back its own prefix hashes at every position of its context. That catches
// a slot shared wrongly, a missed copy-on-write and a prefix-cache hit on equal tokens behind a
// different history, on top of check_invariants() (leaks, double ownership, refcounts).
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <optional>
#include <random>
#include <set>

#include "engine/scheduler.h"

namespace ds {
namespace {

struct Totals {
  int64_t steps = 0, preemptions = 0, forks = 0, copies = 0, hits = 0, rejected = 0;
  int64_t cancelled = 0, auto_finished = 0, chunked = 0;
  int64_t capped = 0;   // steps whose lower-class prefill used the whole isolation cap
  int64_t sat_out = 0;  // steps whose top-class decodes sat out for prompts (prefill first)
};

class Simulation {
 public:
  Simulation(uint64_t seed, AllocationMode mode, bool prefix_cache, Totals& totals)
      : rng_(seed), sched_(make_sched(rng_), make_blocks(mode, prefix_cache)), totals_(totals) {
    const BlockManager& bm = sched_.block_manager();
    shadow_.assign(size_t(bm.num_blocks()) * size_t(bm.block_size()), 0);
    for (int i = 0; i < 3; ++i) prefixes_.push_back(random_tokens(uniform(8, 40)));
  }

  void run(int steps) {
    for (int i = 0; i < steps; ++i) {
      step(/*arrivals=*/true);
      if (::testing::Test::HasFatalFailure()) return;
    }
    // Drain: no new work; everything must finish without a stall.
    for (int i = 0; sched_.has_unfinished(); ++i) {
      ASSERT_LT(i, 20000) << "the scheduler stopped making progress";
      step(false);
      if (::testing::Test::HasFatalFailure()) return;
    }
    for (const auto& [id, o] : outcomes_) EXPECT_TRUE(o.done) << "request " << id << " is lost";
    const BlockManagerStats st = sched_.block_manager().stats();
    EXPECT_EQ(sched_.block_manager().num_sequences(), 0);
    EXPECT_EQ(st.used_blocks, 0) << "blocks leaked";
    EXPECT_EQ(st.free_blocks + st.evictable_blocks, st.total_blocks);
    totals_.hits += st.prefix_hit_tokens;
    totals_.preemptions += sched_.stats().preemptions;
  }

 private:
  struct Outcome {
    bool done = false;
    FinishReason reason = FinishReason::Stop;
  };

  static SchedulerConfig make_sched(std::mt19937_64& rng) {
    SchedulerConfig c;
    c.max_num_batched_tokens = std::uniform_int_distribution<int>(6, 48)(rng);
    c.max_num_seqs = std::uniform_int_distribution<int>(3, 10)(rng);
    // Priority isolation: off, pausing (0) or a cap below and above typical chunks.
    c.lower_class_prefill_tokens = std::uniform_int_distribution<int>(-1, 12)(rng);
    // The batch class's own per-step prefill budget: off, or from below a chunk to above.
    c.batch_prefill_tokens = std::uniform_int_distribution<int>(-1, 16)(rng);
    // Prefill first in bursts: off, or decodes sitting out up to 1..4 steps.
    c.prefill_first_steps = std::uniform_int_distribution<int>(0, 4)(rng);
    return c;
  }
  static BlockManagerConfig make_blocks(AllocationMode mode, bool prefix_cache) {
    BlockManagerConfig c;
    c.num_blocks = 24;  // 96 tokens: small enough to force preemptions
    c.block_size = 4;
    c.mode = mode;
    c.enable_prefix_cache = prefix_cache;
    return c;
  }

  int uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  bool chance(double p) { return std::bernoulli_distribution(p)(rng_); }
  // A third of the sequences use a 2-token vocabulary, so equal blocks behind different
  // prefixes are common: only chained hashes keep them apart.
  std::vector<int32_t> random_tokens(int n) {
    const int vocab = chance(0.33) ? 1 : 40;
    std::vector<int32_t> v(static_cast<size_t>(n));
    for (auto& t : v) t = uniform(0, vocab);
    return v;
  }

  SeqId random_live() {
    auto it = live_.begin();
    std::advance(it, uniform(0, int(live_.size()) - 1));
    return *it;
  }

  void done(SeqId id, FinishReason reason) {
    Outcome& o = outcomes_.at(id);
    ASSERT_FALSE(o.done) << "request " << id << " finished twice";
    o.done = true;
    o.reason = reason;
    live_.erase(id);
  }

  void arrive() {
    Request r;
    r.id = next_id_++;
    r.priority = Priority(uniform(0, 2));
    if (chance(0.5)) r.prompt = prefixes_[size_t(uniform(0, 2))];
    const auto tail = random_tokens(uniform(chance(0.03) ? 0 : 1, 30));
    r.prompt.insert(r.prompt.end(), tail.begin(), tail.end());
    r.max_tokens = chance(0.03) ? uniform(80, 200) : uniform(1, 24);  // some never fit
    outcomes_[r.id];
    if (sched_.add(r)) live_.insert(r.id);
  }

  void fork_one() {
    std::vector<SeqId> decoding;  // forks branch off running, decoding sequences
    for (SeqId id : live_)
      if (sched_.can_fork(id)) decoding.push_back(id);
    if (decoding.empty()) return;
    const SeqId parent = decoding[size_t(uniform(0, int(decoding.size()) - 1))];
    const SeqId child = next_id_++;
    if (!sched_.fork(parent, child, uniform(0, 40))) return;
    outcomes_[child];
    live_.insert(child);
    ++totals_.forks;
  }

  void cancel_one() {
    const SeqId id = random_live();
    ASSERT_TRUE(sched_.abort(id));
    done(id, FinishReason::Cancelled);
    ++totals_.cancelled;
  }

  // Stands for the K/V of position `pos`: depends on every token up to it.
  uint64_t prefix_hash(SeqId id, int pos) const {
    const Sequence* s = sched_.find(id);
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i <= pos; ++i)
      h = (h ^ uint64_t(uint32_t(s->tokens[size_t(i)]))) * 1099511628211ull;
    return h;
  }

  // Plays the forward: block copies, then every token's id into its slot.
  void forward(const StepPlan& plan, const StepBatch& batch) {
    const BlockManager& bm = sched_.block_manager();
    const int bs = bm.block_size();
    for (const auto& [src, dst] : plan.block_copies)
      std::copy_n(shadow_.begin() + src * bs, bs, shadow_.begin() + dst * bs);
    std::set<int32_t> written;
    for (int s = 0; s < batch.num_seqs(); ++s) {
      const SeqId id = plan.seqs[size_t(s)].id;
      for (int t = batch.query_start[size_t(s)]; t < batch.query_start[size_t(s) + 1]; ++t) {
        const int32_t slot = batch.slot_mapping[size_t(t)];
        ASSERT_TRUE(written.insert(slot).second) << "two tokens write slot " << slot;
        // No other sequence may see the block being written.
        for (SeqId other : live_) {
          if (other == id || !bm.has(other)) continue;
          const auto& table = bm.block_table(other);
          ASSERT_EQ(std::count(table.begin(), table.end(), slot / bs), 0)
              << "sequence " << id << " writes block " << slot / bs << " shared with " << other;
        }
        shadow_[size_t(slot)] = prefix_hash(id, batch.positions[size_t(t)]);
      }
    }
  }

  // The highest class among sequences live when the plan was made (the scheduler has already
  // dropped those it finished itself).
  std::optional<Priority> top_class(const StepPlan& plan) const {
    std::optional<Priority> top;
    for (SeqId id : live_) {
      const Sequence* s = sched_.find(id);
      if (!s || std::any_of(plan.finished.begin(), plan.finished.end(),
                            [&](const Finished& f) { return f.id == id; }))
        continue;
      if (!top || s->priority < *top) top = s->priority;
    }
    return top;
  }

  // The batch class's prefill stays within its per-step budget in every plan. While the top
  // class has work in the plan, lower classes' prefill chunks stay within the isolation cap
  // and their decodes wait (a plan without top-class work is the fallback that never stalls).
  void verify_isolation(const StepPlan& plan, std::optional<Priority> top) {
    const int batch_cap = sched_.config().batch_prefill_tokens;
    int batch = 0;
    for (const ScheduledSeq& x : plan.seqs) {
      const Sequence* s = sched_.find(x.id);
      if (s->num_uncomputed() > 1 && s->priority == Priority::Batch) batch += int(x.tokens.size());
    }
    if (batch_cap > 0) {
      ASSERT_LE(batch, batch_cap) << "batch-class prefill over its per-step budget";
    }
    const int cap = sched_.config().lower_class_prefill_tokens;
    if (!top || cap < 0) return;
    // Under isolation every lower-class item counts against the cap: a decode would too (a
    // one-token item may also be a prompt's last token, admitted on a prefix-cache hit), so
    // with cap 0 no lower-class work may run at all (Scheduler.LowerClassPrefillIsCapped...
    // checks that decodes wait while prefill goes on).
    int lower = 0;
    for (const ScheduledSeq& x : plan.seqs)
      if (sched_.find(x.id)->priority != *top) lower += int(x.tokens.size());
    if (plan.isolated) {
      ASSERT_LE(lower, cap) << "lower-class work over the isolation cap";
    }
    if (plan.isolated && lower == cap && cap > 0) ++totals_.capped;
  }

  void verify_plan(const StepPlan& plan) {
    ASSERT_LE(plan.num_tokens(), sched_.config().max_num_batched_tokens);
    const BlockManager& bm = sched_.block_manager();
    for (const ScheduledSeq& x : plan.seqs) {
      const Sequence* s = sched_.find(x.id);
      ASSERT_NE(s, nullptr);
      ASSERT_EQ(s->status, SeqStatus::Running);
      ASSERT_EQ(x.start_pos, s->num_computed);
      ASSERT_EQ(int(x.tokens.size()), s->num_scheduled);
      ASSERT_GT(s->num_scheduled, 0);
      ASSERT_TRUE(std::equal(x.tokens.begin(), x.tokens.end(), s->tokens.begin() + x.start_pos));
      ASSERT_EQ(x.needs_logits, x.start_pos + int(x.tokens.size()) == s->num_tokens());
      ASSERT_LE(x.start_pos + int(x.tokens.size()), bm.num_slots(x.id));
      if (!x.needs_logits) ++totals_.chunked;
    }
  }

  // Running sequences with one token to compute (decodes) before the plan was made.
  std::set<SeqId> decoders() const {
    std::set<SeqId> d;
    for (SeqId id : live_) {
      const Sequence* s = sched_.find(id);
      if (s && s->status == SeqStatus::Running && s->num_uncomputed() == 1) d.insert(id);
    }
    return d;
  }

  // Decodes lead the plan (the model splits mixed steps there). A top-class decode that sits
  // out a step with prompts in it does so at most prefill_first_steps steps in a row.
  void verify_decodes(const StepPlan& plan, const std::set<SeqId>& decoding,
                      std::optional<Priority> top) {
    bool prompts = false;
    for (const ScheduledSeq& x : plan.seqs) {
      const bool decode = decoding.count(x.id) > 0;
      ASSERT_FALSE(decode && prompts) << "decode of " << x.id << " after a prompt's chunk";
      prompts |= !decode;
    }
    bool sat_out = false;
    for (SeqId id : decoding) {
      const Sequence* s = sched_.find(id);
      auto in = [&](const auto& v) {
        return std::any_of(v.begin(), v.end(), [&](const auto& x) { return x.id == id; });
      };
      sat_out |= prompts && s && top && s->priority == *top && !in(plan.seqs) &&
                 std::count(plan.preempted.begin(), plan.preempted.end(), id) == 0;
    }
    sat_out_run_ = sat_out ? sat_out_run_ + 1 : 0;
    totals_.sat_out += sat_out;
    ASSERT_LE(sat_out_run_, sched_.config().prefill_first_steps)
        << "decodes sat out more consecutive steps than prefill_first_steps";
  }

  void verify_reads(const StepPlan& plan) {
    const BlockManager& bm = sched_.block_manager();
    for (const ScheduledSeq& x : plan.seqs) {
      const Sequence* s = sched_.find(x.id);
      if (!s) continue;  // cancelled mid-step
      const int ctx = x.start_pos + int(x.tokens.size());
      for (int pos = 0; pos < ctx; ++pos)
        ASSERT_EQ(shadow_[size_t(bm.slot(x.id, pos))], prefix_hash(x.id, pos))
            << "sequence " << x.id << " reads a wrong token at position " << pos;
    }
  }

  void step(bool arrivals) {
    if (arrivals) {
      if (chance(0.25))
        for (int n = uniform(1, 3); n > 0; --n) arrive();
      if (!live_.empty() && chance(0.04)) cancel_one();
      if (!live_.empty() && chance(0.08)) fork_one();
    }
    const bool had_work = sched_.num_running() + sched_.num_waiting() > 0;
    const std::set<SeqId> decoding = decoders();
    const StepPlan plan = sched_.schedule();
    ++totals_.steps;
    verify_isolation(plan, top_class(plan));
    if (::testing::Test::HasFatalFailure()) return;
    verify_decodes(plan, decoding, top_class(plan));
    if (::testing::Test::HasFatalFailure()) return;
    for (const Rejection& r : plan.rejected) {
      ASSERT_FALSE(r.reason.empty());
      done(r.id, FinishReason::Rejected);
      ++totals_.rejected;
    }
    for (const Finished& f : plan.finished) {
      done(f.id, f.reason);
      ++totals_.auto_finished;
    }
    if (had_work && sched_.num_running() + sched_.num_waiting() > 0) {
      ASSERT_FALSE(plan.empty()) << "live requests but an empty plan";
    }
    verify_plan(plan);
    totals_.copies += int64_t(plan.block_copies.size());
    const StepBatch batch = build_step_batch(plan, sched_.block_manager());
    forward(plan, batch);
    if (::testing::Test::HasFatalFailure()) return;
    verify_reads(plan);
    if (arrivals && !live_.empty() && chance(0.02)) cancel_one();  // mid-step
    sched_.block_manager().check_invariants();

    std::vector<SampledToken> sampled;
    for (SeqId id : batch.logit_seqs) sampled.push_back({id, uniform(0, 40)});
    sched_.on_step_done(sampled);
    for (const SampledToken& t : sampled) {
      const Sequence* s = sched_.find(t.id);
      if (!s) continue;
      if (chance(0.06)) {
        sched_.finish(t.id, FinishReason::Stop);
        done(t.id, FinishReason::Stop);
      } else if (s->num_output() >= s->max_tokens && chance(0.7)) {
        sched_.finish(t.id, FinishReason::Length);
        done(t.id, FinishReason::Length);
      }
    }
    sched_.block_manager().check_invariants();
  }

  std::mt19937_64 rng_;
  Scheduler sched_;
  Totals& totals_;
  std::vector<uint64_t> shadow_;                // [num_blocks * block_size] what each slot holds
  std::vector<std::vector<int32_t>> prefixes_;  // shared system prompts
  std::map<SeqId, Outcome> outcomes_;
  std::set<SeqId> live_;
  SeqId next_id_ = 1;
  int sat_out_run_ = 0;  // consecutive steps whose top-class decodes sat out
};

TEST(SchedulerRandom, NoLeaksNoDoubleOwnershipEveryRequestEnds) {
  Totals totals;
  for (uint64_t seed : {1, 2, 3, 4, 5, 6}) {
    for (auto [mode, prefix] :
         {std::pair{AllocationMode::Dynamic, true}, std::pair{AllocationMode::Dynamic, false},
          std::pair{AllocationMode::Static, true}}) {
      SCOPED_TRACE("seed " + std::to_string(seed) +
                   (mode == AllocationMode::Static ? " static" : " dynamic") +
                   (prefix ? " prefix-cache" : ""));
      Simulation sim(seed, mode, prefix, totals);
      sim.run(1000);
      if (HasFatalFailure()) return;
    }
  }
  EXPECT_GE(totals.steps, 18000);
  // The runs must exercise what they claim to test.
  EXPECT_GT(totals.preemptions, 100);
  EXPECT_GT(totals.forks, 100);
  EXPECT_GT(totals.copies, 10);
  EXPECT_GT(totals.hits, 0);
  EXPECT_GT(totals.rejected, 0);
  EXPECT_GT(totals.cancelled, 100);
  EXPECT_GT(totals.auto_finished, 0);
  EXPECT_GT(totals.chunked, 100);
  EXPECT_GT(totals.capped, 100);
  EXPECT_GT(totals.sat_out, 100);
  std::printf(
      "random steps %lld, preemptions %lld, forks %lld, block copies %lld, "
      "prefix-hit tokens %lld, rejected %lld, cancelled %lld, capped steps %lld, "
      "decodes sat out %lld\n",
      (long long)totals.steps, (long long)totals.preemptions, (long long)totals.forks,
      (long long)totals.copies, (long long)totals.hits, (long long)totals.rejected,
      (long long)totals.cancelled, (long long)totals.capped, (long long)totals.sat_out);
}

}  // namespace
}  // namespace ds
