#include <gtest/gtest.h>

#include "sched_test_util.h"

#include <algorithm>
#include <numeric>

#include "core/error.h"
#include "engine/scheduler.h"

namespace ds {
namespace {

SchedulerConfig sched(int budget, int max_seqs = 16, int max_model_len = 0) {
  SchedulerConfig c;
  c.max_num_batched_tokens = budget;
  c.max_num_seqs = max_seqs;
  c.max_model_len = max_model_len;
  return c;
}

BlockManagerConfig blocks(int num_blocks, int block_size = 4, bool prefix = true) {
  BlockManagerConfig c;
  c.num_blocks = num_blocks;
  c.block_size = block_size;
  c.enable_prefix_cache = prefix;
  return c;
}

using test::iota_tokens;

Request req(SeqId id, int prompt_len, int max_tokens, Priority p = Priority::Standard) {
  return Request{id, iota_tokens(prompt_len, int32_t(id) * 1000), max_tokens, p};
}

std::vector<SeqId> ids(const StepPlan& plan) {
  std::vector<SeqId> v;
  for (const auto& s : plan.seqs) v.push_back(s.id);
  return v;
}

// Plays the engine: samples token 5000, 5001, ... for every row that needs logits.
class Driver {
 public:
  explicit Driver(Scheduler& s) : s_(s) {}
  StepPlan step() {
    StepPlan plan = s_.schedule();
    std::vector<SampledToken> out;
    for (const auto& x : plan.seqs)
      if (x.needs_logits) out.push_back({x.id, next_++});
    s_.on_step_done(out);
    return plan;
  }

 private:
  Scheduler& s_;
  int32_t next_ = 5000;
};

TEST(Scheduler, PrefillThenDecodeUntilTheEngineFinishes) {
  Scheduler s(sched(64), blocks(64));
  Driver d(s);
  ASSERT_TRUE(s.add(req(1, 10, 3)));
  StepPlan p = d.step();
  ASSERT_EQ(p.seqs.size(), 1u);
  EXPECT_EQ(p.seqs[0].tokens, iota_tokens(10, 1000));
  EXPECT_EQ(p.seqs[0].start_pos, 0);
  EXPECT_TRUE(p.seqs[0].needs_logits);
  p = d.step();
  ASSERT_EQ(p.seqs.size(), 1u);
  EXPECT_EQ(p.seqs[0].tokens, std::vector<int32_t>{5000});
  EXPECT_EQ(p.seqs[0].start_pos, 10);
  d.step();
  const Sequence* seq = s.find(1);
  ASSERT_NE(seq, nullptr);
  EXPECT_EQ(seq->num_output(), 3);
  EXPECT_EQ(std::vector<int32_t>(seq->output().begin(), seq->output().end()),
            (std::vector<int32_t>{5000, 5001, 5002}));
  EXPECT_TRUE(s.finish(1, FinishReason::Length));
  EXPECT_EQ(s.find(1), nullptr);
  EXPECT_FALSE(s.block_manager().has(1));
  EXPECT_FALSE(s.has_unfinished());

  // Left alone at max_tokens, the scheduler finishes the sequence itself.
  ASSERT_TRUE(s.add(req(2, 5, 1)));
  d.step();
  p = d.step();
  EXPECT_TRUE(p.seqs.empty());
  ASSERT_EQ(p.finished.size(), 1u);
  EXPECT_EQ(p.finished[0].id, 2);
  EXPECT_EQ(p.finished[0].reason, FinishReason::Length);
  EXPECT_FALSE(s.has_unfinished());
}

TEST(Scheduler, ChunkedPrefillSplitsALongPrompt) {
  Scheduler s(sched(8), blocks(64));
  Driver d(s);
  ASSERT_TRUE(s.add(req(1, 30, 4)));
  const auto prompt = iota_tokens(30, 1000);
  for (int start : {0, 8, 16, 24}) {
    const StepPlan p = d.step();
    ASSERT_EQ(p.seqs.size(), 1u);
    const int n = std::min(8, 30 - start);
    EXPECT_EQ(p.seqs[0].start_pos, start);
    EXPECT_EQ(p.seqs[0].tokens,
              std::vector<int32_t>(prompt.begin() + start, prompt.begin() + start + n));
    EXPECT_EQ(p.seqs[0].needs_logits, start == 24);
  }
  const StepPlan p = d.step();
  ASSERT_EQ(p.seqs.size(), 1u);
  EXPECT_EQ(p.seqs[0].start_pos, 30);
  EXPECT_EQ(p.seqs[0].tokens.size(), 1u);
}

TEST(Scheduler, DecodesComeFirstAndPrefillChunksFillTheBudget) {
  Scheduler s(sched(8), blocks(64));
  Driver d(s);
  ASSERT_TRUE(s.add(req(1, 4, 10)));
  d.step();
  ASSERT_TRUE(s.add(req(2, 20, 10)));
  for (int chunk : {7, 7, 6}) {
    const StepPlan p = d.step();
    ASSERT_EQ(ids(p), (std::vector<SeqId>{1, 2}));
    EXPECT_EQ(p.seqs[0].tokens.size(), 1u);
    EXPECT_TRUE(p.seqs[0].needs_logits);
    EXPECT_EQ(int(p.seqs[1].tokens.size()), chunk);
    EXPECT_EQ(p.seqs[1].needs_logits, chunk == 6);
    EXPECT_EQ(p.num_tokens(), 1 + chunk);
  }
  EXPECT_EQ(d.step().num_tokens(), 2);  // two decodes
}

TEST(Scheduler, DecodesSitOutABurstOfPromptsForAtMostTheCap) {
  SchedulerConfig c = sched(16, 8);
  c.prefill_first_steps = 2;
  Scheduler s(c, blocks(64));
  Driver d(s);
  ASSERT_TRUE(s.add(req(1, 4, 20)));
  d.step();
  EXPECT_EQ(ids(d.step()), (std::vector<SeqId>{1}));  // decoding alone
  for (SeqId id : {2, 3, 4, 5, 6, 7, 8}) ASSERT_TRUE(s.add(req(id, 8, 20)));
  // 56 prompt tokens wait, more than a step: prompts alone for two steps.
  EXPECT_EQ(ids(d.step()), (std::vector<SeqId>{2, 3}));
  EXPECT_EQ(ids(d.step()), (std::vector<SeqId>{4, 5}));
  // The cap: the five decodes join, ahead of the prompts.
  StepPlan p = d.step();
  EXPECT_EQ(ids(p), (std::vector<SeqId>{1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(p.num_tokens(), 16);
  // One prompt waits now (7's last chunk is running): no burst.
  EXPECT_EQ(ids(d.step()), (std::vector<SeqId>{1, 2, 3, 4, 5, 6, 7, 8}));

  // 0 turns it off: every step carries the decodes.
  c.prefill_first_steps = 0;
  Scheduler t(c, blocks(64));
  Driver e(t);
  t.add(req(1, 4, 20));
  e.step();
  for (SeqId id : {2, 3, 4}) t.add(req(id, 8, 20));
  EXPECT_EQ(ids(e.step()), (std::vector<SeqId>{1, 2, 3}));
}

TEST(Scheduler, DecodesRunWhenTheBurstCannotFillTheStep) {
  SchedulerConfig c = sched(16, 8);
  Scheduler s(c, blocks(64));
  Driver d(s);
  s.add(req(1, 4, 20));
  d.step();
  // Prompts of the batch class keep to their own budget: no burst.
  s.add(req(2, 12, 4, Priority::Batch));
  s.add(req(3, 12, 4, Priority::Batch));
  EXPECT_EQ(ids(d.step()), (std::vector<SeqId>{1}));  // a higher class is live: batch waits
  // Two prompts that do not fill the step ride along with the decode.
  SchedulerConfig c2 = sched(64, 8);
  Scheduler t(c2, blocks(64));
  Driver e(t);
  t.add(req(1, 4, 20));
  e.step();
  t.add(req(2, 12, 4));
  t.add(req(3, 12, 4));
  EXPECT_EQ(ids(e.step()), (std::vector<SeqId>{1, 2, 3}));
  // A burst that the cache cannot take: the decode goes on instead of an empty step.
  Scheduler u(sched(16, 8), blocks(8, 4));
  Driver f(u);
  u.add(req(1, 12, 4));  // 4 of the 8 blocks once it decodes; each prompt needs 5
  f.step();
  f.step();
  u.add(req(2, 20, 4));
  u.add(req(3, 20, 4));
  EXPECT_EQ(ids(f.step()), (std::vector<SeqId>{1}));
  // The same with more decodes than the step holds: some run, never an empty step.
  Scheduler w(sched(2, 8), blocks(8, 4));
  Driver g(w);
  for (SeqId id : {1, 2, 3, 4}) w.add(req(id, 1, 3));  // a block each
  EXPECT_EQ(ids(g.step()), (std::vector<SeqId>{1, 2}));
  EXPECT_EQ(ids(g.step()), (std::vector<SeqId>{3, 4}));  // the decodes sat out
  EXPECT_EQ(ids(g.step()), (std::vector<SeqId>{1, 2}));
  w.add(req(5, 20, 3));  // 5 blocks each, 4 free
  w.add(req(6, 20, 3));
  EXPECT_EQ(ids(g.step()), (std::vector<SeqId>{1, 2}));
}

TEST(Scheduler, CapsRunningSequences) {
  Scheduler s(sched(64, 2), blocks(64));
  Driver d(s);
  for (SeqId id : {1, 2, 3}) ASSERT_TRUE(s.add(req(id, 4, 10)));
  EXPECT_EQ(ids(d.step()), (std::vector<SeqId>{1, 2}));
  EXPECT_EQ(s.num_running(), 2);
  EXPECT_EQ(s.num_waiting(), 1);
  s.finish(1, FinishReason::Stop);
  EXPECT_EQ(ids(d.step()), (std::vector<SeqId>{2, 3}));
}

TEST(Scheduler, AdmitsHigherClassesFirstFifoWithinAClass) {
  Scheduler s(sched(64, 1), blocks(64));
  Driver d(s);
  s.add(req(1, 4, 10, Priority::Batch));
  s.add(req(2, 4, 10, Priority::Standard));
  s.add(req(3, 4, 10, Priority::LatencyCritical));
  s.add(req(4, 4, 10, Priority::Standard));
  s.add(req(5, 4, 10, Priority::LatencyCritical));
  std::vector<SeqId> order;
  for (int i = 0; i < 5; ++i) {
    const StepPlan p = d.step();
    ASSERT_EQ(p.seqs.size(), 1u);
    order.push_back(p.seqs[0].id);
    s.abort(p.seqs[0].id);
  }
  EXPECT_EQ(order, (std::vector<SeqId>{3, 5, 2, 4, 1}));
}

TEST(Scheduler, PreemptsLowerClassesFirstThenTheMostRecent) {
  // 4 blocks of 4 tokens; four 4-token prompts fill the cache; each first decode needs a block.
  // Isolation off: every class shares the steps, so the cache runs short.
  SchedulerConfig c = sched(64);
  c.lower_class_prefill_tokens = -1;
  Scheduler s(c, blocks(4, 4, /*prefix=*/false));
  Driver d(s);
  s.add(req(1, 4, 8, Priority::Batch));
  s.add(req(2, 4, 8, Priority::Standard));
  s.add(req(3, 4, 8, Priority::LatencyCritical));
  s.add(req(4, 4, 8, Priority::Standard));
  EXPECT_EQ(ids(d.step()), (std::vector<SeqId>{3, 2, 4, 1}));
  const StepPlan p = d.step();
  EXPECT_EQ(ids(p), (std::vector<SeqId>{3, 2}));
  EXPECT_EQ(p.preempted, (std::vector<SeqId>{1, 4}));
  EXPECT_EQ(s.find(4)->status, SeqStatus::Waiting);
  EXPECT_EQ(s.find(4)->num_computed, 0);
  EXPECT_EQ(s.find(4)->num_output(), 1);  // generated tokens are kept
  EXPECT_EQ(s.stats().preemptions, 2);
  s.block_manager().check_invariants();

  // Once room is back, the Standard one returns first and recomputes prompt + output.
  s.abort(3);
  s.abort(2);
  const StepPlan q = d.step();
  ASSERT_EQ(ids(q), (std::vector<SeqId>{4, 1}));
  auto expect = iota_tokens(4, 4000);
  expect.push_back(s.find(4)->tokens[4]);
  EXPECT_EQ(q.seqs[0].tokens, expect);
  EXPECT_EQ(q.seqs[0].start_pos, 0);
  EXPECT_TRUE(q.seqs[0].needs_logits);
}

TEST(Scheduler, LatencyCriticalDisplacesBatchButNotItsOwnClass) {
  Scheduler s(sched(64), blocks(4, 4));
  Driver d(s);
  s.add(req(1, 14, 2, Priority::Batch));  // the whole cache
  d.step();
  s.add(req(2, 3, 1, Priority::LatencyCritical));
  StepPlan p = d.step();
  EXPECT_EQ(ids(p), (std::vector<SeqId>{2}));  // the Batch decode was taken out again
  EXPECT_EQ(p.preempted, (std::vector<SeqId>{1}));
  EXPECT_EQ(s.find(1)->status, SeqStatus::Waiting);

  Scheduler t(sched(64), blocks(4, 4));
  Driver e(t);
  t.add(req(1, 14, 2, Priority::Standard));
  e.step();
  t.add(req(2, 3, 1, Priority::Standard));  // same class: no displacement
  p = e.step();
  EXPECT_EQ(ids(p), (std::vector<SeqId>{1}));  // waits its turn
  EXPECT_TRUE(p.preempted.empty());
  EXPECT_EQ(t.find(2)->status, SeqStatus::Waiting);
}

TEST(Scheduler, LowerClassPrefillIsCappedWhileAHigherClassIsLive) {
  SchedulerConfig c = sched(64);
  c.lower_class_prefill_tokens = 8;
  Scheduler s(c, blocks(256));
  Driver d(s);
  s.add(req(1, 200, 4, Priority::Batch));
  s.add(req(2, 40, 8, Priority::Standard));
  StepPlan p = d.step();  // Standard is the top class: only Batch is capped
  ASSERT_EQ(ids(p), (std::vector<SeqId>{2, 1}));
  EXPECT_EQ(p.seqs[0].tokens.size(), 40u);
  EXPECT_EQ(p.seqs[1].tokens.size(), 8u);

  s.add(req(3, 30, 8, Priority::LatencyCritical));
  p = d.step();  // Standard's decode waits; Batch's chunk stays capped; the newcomer's prompt
  ASSERT_EQ(ids(p), (std::vector<SeqId>{1, 3}));
  EXPECT_EQ(p.seqs[0].tokens.size(), 8u);
  EXPECT_EQ(p.seqs[1].tokens.size(), 30u);
  p = d.step();  // its decode and the capped chunk; the rest of the budget stays unused
  ASSERT_EQ(ids(p), (std::vector<SeqId>{3, 1}));
  EXPECT_EQ(p.num_tokens(), 1 + 8);

  s.abort(3);  // Standard is the top class again: Batch is still capped
  EXPECT_EQ(d.step().num_tokens(), 1 + 8);
  s.abort(2);  // no higher class left: the whole budget
  EXPECT_EQ(d.step().num_tokens(), 64);

  // -1 turns the cap off: the Batch prompt takes what the newcomer leaves.
  SchedulerConfig off = c;
  off.lower_class_prefill_tokens = -1;
  Scheduler t(off, blocks(256));
  Driver e(t);
  t.add(req(1, 200, 4, Priority::Batch));
  t.add(req(2, 30, 3, Priority::LatencyCritical));
  EXPECT_EQ(e.step().num_tokens(), 64);
}

TEST(Scheduler, ZeroCapPausesLowerClassPrefill) {
  SchedulerConfig c = sched(64, 2);
  c.lower_class_prefill_tokens = 0;
  Scheduler s(c, blocks(256));
  Driver d(s);
  s.add(req(1, 30, 4, Priority::LatencyCritical));
  s.add(req(2, 30, 4, Priority::Batch));
  EXPECT_EQ(ids(d.step()), (std::vector<SeqId>{1}));  // a seat is free, the budget too
  EXPECT_EQ(ids(d.step()), (std::vector<SeqId>{1}));
  s.abort(1);
  EXPECT_EQ(ids(d.step()), (std::vector<SeqId>{2}));  // the only class left: uncapped
}

// The batch class's prefill has a per-step budget even when no other class is live, so a
// request of a higher class that arrives mid-step waits for a short step at most.
TEST(Scheduler, BatchPrefillHasAPerStepBudget) {
  SchedulerConfig c = sched(64);
  c.batch_prefill_tokens = 16;
  c.lower_class_prefill_tokens = 0;
  Scheduler s(c, blocks(256));
  Driver d(s);
  s.add(req(1, 40, 4, Priority::Batch));
  s.add(req(2, 40, 4, Priority::Batch));
  StepPlan p = d.step();  // two batch prompts share the 16 tokens
  EXPECT_EQ(p.num_tokens(), 16);
  s.add(req(3, 40, 4, Priority::Standard));
  p = d.step();                   // the standard prompt is not held to the batch budget
  EXPECT_EQ(p.num_tokens(), 40);  // and the batch class is below the top now: paused
  c.batch_prefill_tokens = -1;
  Scheduler t(c, blocks(256));
  Driver e(t);
  t.add(req(1, 100, 4, Priority::Batch));
  EXPECT_EQ(e.step().num_tokens(), 64);  // no budget: the whole step
}

TEST(Scheduler, RejectsImpossibleRequestsWithAReason) {
  Scheduler s(sched(64, 16, 12), blocks(4, 4));
  EXPECT_FALSE(s.add(req(1, 10, 7)));  // 17 tokens: longer than the context
  EXPECT_FALSE(s.add(Request{2, {}, 4, Priority::Standard}));
  EXPECT_FALSE(s.add(req(3, 4, 0)));
  EXPECT_TRUE(s.add(req(4, 4, 8)));
  EXPECT_TRUE(s.has_unfinished());
  const StepPlan p = s.schedule();
  ASSERT_EQ(p.rejected.size(), 3u);
  EXPECT_EQ(p.rejected[0].id, 1);
  EXPECT_NE(p.rejected[0].reason.find("context of 12"), std::string::npos);
  EXPECT_NE(p.rejected[1].reason.find("empty"), std::string::npos);
  EXPECT_NE(p.rejected[2].reason.find("max_tokens"), std::string::npos);
  EXPECT_EQ(s.stats().rejections, 3);

  Scheduler t(sched(64), blocks(4, 4));
  EXPECT_FALSE(t.add(req(1, 10, 7)));
  const StepPlan q = t.schedule();
  ASSERT_EQ(q.rejected.size(), 1u);
  EXPECT_NE(q.rejected[0].reason.find("5 KV blocks of 4 tokens; the whole cache has 4"),
            std::string::npos)
      << q.rejected[0].reason;
  EXPECT_FALSE(t.has_unfinished());
  EXPECT_TRUE(t.add(req(1, 10, 6)));  // exactly fits
}

TEST(Scheduler, AbortFreesBlocksAtOnce) {
  Scheduler s(sched(64), blocks(16, 4));
  Driver d(s);
  s.add(req(1, 20, 4));
  s.add(req(2, 4, 4));
  s.schedule();  // mid-step abort: the step's results for it are dropped
  EXPECT_TRUE(s.abort(1));
  EXPECT_FALSE(s.block_manager().has(1));
  s.on_step_done(std::vector<SampledToken>{{1, 7}, {2, 8}});
  EXPECT_EQ(s.find(2)->num_output(), 1);
  s.add(req(3, 4, 4));
  EXPECT_TRUE(s.abort(3));  // waiting
  EXPECT_FALSE(s.abort(3));
  EXPECT_TRUE(s.abort(2));
  EXPECT_EQ(s.block_manager().num_available_blocks(), 16);
  EXPECT_FALSE(s.has_unfinished());
  s.block_manager().check_invariants();
}

TEST(Scheduler, SharedSystemPromptIsComputedOnce) {
  Scheduler s(sched(512), blocks(128, 16));
  Driver d(s);
  const auto system = iota_tokens(400, 7);
  auto with_suffix = [&](SeqId id, int32_t first) {
    Request r{id, system, 2, Priority::Standard};
    for (int i = 0; i < 9; ++i) r.prompt.push_back(first + i);
    return r;
  };
  s.add(with_suffix(1, 100000));
  EXPECT_EQ(d.step().num_tokens(), 409);
  s.add(with_suffix(2, 200000));
  const StepPlan p = d.step();
  ASSERT_EQ(ids(p), (std::vector<SeqId>{1, 2}));
  EXPECT_EQ(p.seqs[1].start_pos, 400);
  EXPECT_EQ(p.seqs[1].tokens.size(), 9u);
  EXPECT_EQ(s.find(2)->num_cached_prompt, 400);
  EXPECT_EQ(s.find(1)->num_cached_prompt, 0);
  const auto st = s.block_manager().stats();
  EXPECT_EQ(st.prefix_hit_tokens, 400);
  EXPECT_EQ(st.prefix_query_tokens, 818);
}

TEST(Scheduler, ForkSharesTheSequenceAndCopiesItsPartialBlock) {
  Scheduler s(sched(64), blocks(16, 4));
  Driver d(s);
  s.add(req(1, 6, 4));
  EXPECT_FALSE(s.can_fork(1));  // waiting
  d.step();
  ASSERT_TRUE(s.can_fork(1));
  ASSERT_TRUE(s.fork(1, 2, 777));
  EXPECT_EQ(s.num_running(), 2);
  const StepPlan p = d.step();
  ASSERT_EQ(ids(p), (std::vector<SeqId>{1, 2}));
  EXPECT_EQ(p.seqs[0].tokens, std::vector<int32_t>{5000});
  EXPECT_EQ(p.seqs[1].tokens, std::vector<int32_t>{777});
  EXPECT_EQ(p.seqs[1].start_pos, 6);
  // The first writer of the shared partial block (the parent) takes a copy; the child keeps it.
  ASSERT_EQ(p.block_copies.size(), 1u);
  const auto& t1 = s.block_manager().block_table(1);
  const auto& t2 = s.block_manager().block_table(2);
  EXPECT_EQ(t1[0], t2[0]);
  EXPECT_EQ(p.block_copies[0], BlockCopy(t2[1], t1[1]));
  s.block_manager().check_invariants();
  EXPECT_THROW(s.fork(1, 2), Error);  // id live
}

TEST(Scheduler, StepBatchFlattensThePlan) {
  BlockManager bm(blocks(8, 4));
  ASSERT_EQ(bm.allocate(1, iota_tokens(5, 0), 4), 0);
  ASSERT_EQ(bm.allocate(2, iota_tokens(3, 100), 4), 0);
  bm.commit(1, iota_tokens(4, 0));
  StepPlan plan;
  plan.seqs.push_back({1, {4}, 4, true});
  plan.seqs.push_back({2, {100, 101, 102}, 0, false});
  const StepBatch b = build_step_batch(plan, bm);
  const auto& t1 = bm.block_table(1);
  const auto& t2 = bm.block_table(2);
  EXPECT_EQ(b.tokens, (std::vector<int32_t>{4, 100, 101, 102}));
  EXPECT_EQ(b.positions, (std::vector<int32_t>{4, 0, 1, 2}));
  EXPECT_EQ(b.query_start, (std::vector<int32_t>{0, 1, 4}));
  EXPECT_EQ(b.context_lens, (std::vector<int32_t>{5, 3}));
  EXPECT_EQ(b.max_blocks_per_seq, 2);
  EXPECT_EQ(b.block_tables, (std::vector<int32_t>{t1[0], t1[1], t2[0], -1}));
  EXPECT_EQ(b.slot_mapping,
            (std::vector<int32_t>{t1[1] * 4, t2[0] * 4, t2[0] * 4 + 1, t2[0] * 4 + 2}));
  EXPECT_EQ(b.logit_rows, std::vector<int32_t>{0});
  EXPECT_EQ(b.logit_seqs, std::vector<SeqId>{1});
  const AttentionMeta m = b.meta();
  EXPECT_EQ(m.num_seqs, 2);
  EXPECT_EQ(m.num_tokens, 4);
  EXPECT_EQ(m.max_blocks_per_seq, 2);
  EXPECT_EQ(m.slot_mapping, b.slot_mapping.data());
  EXPECT_EQ(m.context_lens[1], 3);
}

TEST(Scheduler, CatchesEngineMistakes) {
  Scheduler s(sched(64), blocks(16, 4));
  s.add(req(1, 4, 4));
  s.schedule();
  EXPECT_THROW(s.schedule(), Error);  // no on_step_done
  s.on_step_done({});                 // but no token sampled for the logits row
  EXPECT_THROW(s.schedule(), Error);
  EXPECT_THROW(s.add(req(1, 4, 4)), Error);
  EXPECT_THROW(s.on_step_done(std::vector<SampledToken>{{1, 3}, {1, 4}}), Error);
  EXPECT_EQ(parse_priority("latency-critical"), Priority::LatencyCritical);
  EXPECT_EQ(priority_name(Priority::Batch), "batch");
  EXPECT_FALSE(parse_priority("urgent").has_value());
}

}  // namespace
}  // namespace ds
