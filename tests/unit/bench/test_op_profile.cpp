// --profile-ops end to end on the CPU: the engine running the Hugging Face fixtures through a
// ProfilingBackend generates exactly what it does unwrapped, and the profile of its decode
// steps holds each op of the architecture as often as one forward calls it. Then the bench
// runner's per-scenario profile and its JSON (docs/BENCH.md).
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <map>

#include "../../hf_fixtures.h"
#include "backend/profiling_backend.h"
#include "bench/report.h"
#include "bench/runner.h"
#include "model/loader.h"

namespace ds {
namespace {

using test::greedy_generate;
using test::hf_root;

struct Generated {
  std::vector<std::vector<int32_t>> tokens;
  std::optional<OpProfile> profile;
  ModelConfig config;
};

// Two prompts generated concurrently (decode steps of two tokens), optionally profiled.
Generated generate(const std::string& fixture, bool profile) {
  BackendOptions bo;
  bo.threads = 2;
  auto cpu = make_cpu_backend(bo);
  std::unique_ptr<ProfilingBackend> prof;
  if (profile) prof = std::make_unique<ProfilingBackend>(*cpu);
  Backend& be = prof ? static_cast<Backend&>(*prof) : *cpu;
  LoadedModel m = load_model(hf_root() / fixture, be, {});
  EngineConfig ec;
  ec.kv_cache_tokens = 256;
  Generated r;
  r.config = m.config;
  {
    Engine engine(*m.model, be, m.tokenizer.get(), ec);
    r.tokens = greedy_generate(engine, {{5, 17, 33, 2, 9, 41}, {7, 3, 101}}, 6, true);
  }
  if (prof) r.profile = prof->profile();
  return r;
}

std::map<std::string, double> kind_calls(const StepProfile& s) {
  std::map<std::string, double> m;
  for (const auto& k : s.kinds) m[k.label] = k.calls;
  return m;
}

void check_common(const Generated& plain, const Generated& profiled) {
  EXPECT_EQ(plain.tokens, profiled.tokens);
  ASSERT_TRUE(profiled.profile);
  const OpProfile& p = *profiled.profile;
  ASSERT_TRUE(p.step);
  const StepProfile& s = *p.step;
  // Both requests decode together after their prefills: 5 steps of 2 tokens.
  EXPECT_TRUE(s.decode);
  EXPECT_EQ(s.tokens, 2);
  EXPECT_EQ(s.seqs, 2);
  EXPECT_GE(s.steps, 4);
  EXPECT_LE(s.op_ms, s.wall_ms);
  EXPECT_GT(s.op_ms, 0);
  int64_t steps = 0;
  for (const auto& g : p.groups) steps += g.steps;
  EXPECT_EQ(steps, p.steps);
  for (const auto& r : s.ops) {
    EXPECT_GE(r.us, 0) << r.label;
    EXPECT_GT(r.calls, 0) << r.label;
  }
}

TEST(OpProfile, LlamaDecodeStepHasEveryOp) {
  const Generated plain = generate("llama_gqa_f16", false), prof = generate("llama_gqa_f16", true);
  check_common(plain, prof);
  ASSERT_TRUE(prof.profile && prof.profile->step);
  const auto calls = kind_calls(*prof.profile->step);
  const double L = prof.config.layers;
  EXPECT_EQ(calls.at("embed"), 1);
  // The first layer's input norm and the output norm; the residual adds fuse with the next
  // norm (add_rms_norm) except the last layer's.
  EXPECT_EQ(calls.at("rms_norm"), 2);
  EXPECT_EQ(calls.at("add_rms_norm"), 2 * L - 1);
  EXPECT_EQ(calls.at("rope"), 2 * L);
  EXPECT_EQ(calls.at("store_kv"), L);
  EXPECT_EQ(calls.at("attention"), L);
  EXPECT_EQ(calls.at("silu_mul"), L);
  EXPECT_EQ(calls.at("add"), 1);
  EXPECT_GE(calls.at("matmul"), 4 * L + 1);
  EXPECT_EQ(calls.at("copy"), 1);  // the two sequences' rows (consecutive) to the logits input
  EXPECT_EQ(calls.at("download"), 1);
  EXPECT_EQ(calls.count("moe_ffn"), 0u);
  bool attention_label = false;
  for (const auto& r : prof.profile->step->ops)
    attention_label |= r.label.rfind("attention [2,6,16] kv[2,16]", 0) == 0;
  EXPECT_TRUE(attention_label);
}

TEST(OpProfile, DeepseekDecodeStepHasMlaAndMoe) {
  const Generated plain = generate("deepseek_v2_qlora_bf16", false);
  const Generated prof = generate("deepseek_v2_qlora_bf16", true);
  check_common(plain, prof);
  ASSERT_TRUE(prof.profile && prof.profile->step);
  const auto calls = kind_calls(*prof.profile->step);
  const double L = prof.config.layers;
  EXPECT_EQ(calls.at("mla_attention"), L);
  // Each norm runs with the op before it: the FFN norm with o_proj (matmul_add_norm), the next
  // layer's input norm with the dense FFN's down product (matmul_add_norm) or the MoE (moe_ffn
  // "+add_norm"); only the first layer's input norm goes with the product after it
  // (norm_matmul), and the last residual add stays alone.
  EXPECT_EQ(calls.at("norm_matmul"), 1);
  EXPECT_EQ(calls.at("matmul_add_norm"), L + 1);  // the first layer is dense
  EXPECT_EQ(calls.count("add_rms_norm"), 0u);
  EXPECT_EQ(calls.at("add"), 1);
  EXPECT_EQ(calls.at("batched_matmul"), 2 * L);
  EXPECT_EQ(calls.at("moe_ffn"), L - 1);  // the first layer is dense
  // The router's choice is part of the moe_ffn op (Backend::moe_routed_ffn), so a backend can
  // fuse it; its rows say so in their label.
  EXPECT_EQ(calls.count("moe_route"), 0u);
  EXPECT_EQ(calls.count("attention"), 0u);
  int routed_label = 0, add_norm_label = 0;
  for (const auto& r : prof.profile->step->ops) {
    routed_label +=
        r.label.rfind("moe_ffn T=2 ", 0) == 0 && r.label.find(" +route") != std::string::npos;
    add_norm_label += r.label.find(" +add_norm") != std::string::npos;
  }
  EXPECT_EQ(routed_label, L - 1);
  EXPECT_EQ(add_norm_label, L - 2);  // not after the last layer
}

// Hands out a fixed profile and counts the resets the runner asks for.
class ProfiledTarget : public BenchTarget {
 public:
  std::string mode() const override { return "offline"; }
  BenchResult run(const BenchRequest& req) override {
    BenchResult r;
    r.ok = true;
    r.finish_reason = "length";
    r.prompt_tokens = int(req.prompt_ids.size());
    r.start_s = 1;
    for (int k = 0; k < req.max_tokens; ++k) r.token_s.push_back(1.5 + 0.1 * k);
    r.end_s = r.token_s.back();
    r.client_output_tokens = req.max_tokens;
    return r;
  }
  TargetSnapshot snapshot() override { return {}; }
  std::optional<RooflineModel> roofline() const override { return std::nullopt; }
  bool engine_timestamps() const override { return true; }
  void reset_op_profile() override { ++resets; }
  std::optional<OpProfile> op_profile() override {
    OpProfile p;
    p.backend = "fake";
    p.steps = 10 * resets;
    p.groups = {{4, true, 9 * resets}, {12, false, resets}};
    StepProfile s;
    s.tokens = 4;
    s.decode = true;
    s.steps = 9 * resets;
    s.seqs = 4;
    s.context = 100;
    s.op_ms = 2;
    s.wall_ms = 2.5;
    s.ops = {{"matmul [4,8]x[8,8] F32", "matmul", 3, 1500, 0.75},
             {"add [4,8]", "add", 2, 500, 0.25}};
    s.kinds = {{"matmul", "matmul", 3, 1500, 0.75}, {"add", "add", 2, 500, 0.25}};
    p.step = s;
    return p;
  }
  int resets = 0;
};

TEST(OpProfile, RunnerProfilesEachScenarioAndJsonHasIt) {
  BenchSpec spec;
  spec.name = "t";
  spec.concurrency = {1, 2};
  spec.input_len = {4};
  spec.output_len = {3};
  spec.warmup = 1;
  ProfiledTarget target;
  PromptMaker prompts({nullptr, 100, false, false});
  BenchRunOptions ro;
  ro.progress = false;
  const BenchRun run = run_bench(spec, target, prompts, ro);
  ASSERT_EQ(run.scenarios.size(), 2u);
  EXPECT_EQ(target.resets, 2);  // once before each scenario, after the warm-up
  ASSERT_TRUE(run.scenarios[1].op_profile);
  EXPECT_EQ(run.scenarios[1].op_profile->steps, 20);

  const nlohmann::json j = scenario_json(run.scenarios[0]);
  const auto& op = j.at("op_profile");
  EXPECT_EQ(op.at("backend"), "fake");
  EXPECT_EQ(op.at("steps"), 10);
  ASSERT_EQ(op.at("groups").size(), 2u);
  EXPECT_EQ(op.at("groups")[0].at("tokens"), 4);
  EXPECT_EQ(op.at("groups")[0].at("decode"), true);
  EXPECT_EQ(op.at("groups")[1].at("steps"), 1);
  const auto& st = op.at("step");
  for (const char* k : {"tokens", "decode", "steps", "seqs", "context", "op_ms", "wall_ms"})
    EXPECT_TRUE(st.contains(k)) << k;
  EXPECT_EQ(st.at("wall_ms"), 2.5);
  ASSERT_EQ(st.at("ops").size(), 2u);
  EXPECT_EQ(st.at("ops")[0].at("label"), "matmul [4,8]x[8,8] F32");
  EXPECT_EQ(st.at("ops")[0].at("kind"), "matmul");
  EXPECT_EQ(st.at("ops")[0].at("calls"), 3);
  EXPECT_EQ(st.at("ops")[0].at("us"), 1500);
  EXPECT_EQ(st.at("ops")[0].at("share"), 0.75);
  EXPECT_EQ(st.at("kinds")[1].at("label"), "add");

  // A scenario without a profile has a null one.
  ScenarioResult plain = run.scenarios[0];
  plain.op_profile.reset();
  EXPECT_TRUE(scenario_json(plain).at("op_profile").is_null());

  char* buf = nullptr;
  size_t len = 0;
  std::FILE* f = open_memstream(&buf, &len);
  print_table(f, run);
  std::fclose(f);
  const std::string text(buf, len);
  std::free(buf);
  EXPECT_NE(text.find("matmul [4,8]x[8,8] F32"), std::string::npos) << text;
  EXPECT_NE(text.find("--profile-ops"), std::string::npos) << text;
}

}  // namespace
}  // namespace ds
