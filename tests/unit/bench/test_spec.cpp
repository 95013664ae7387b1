// Bench YAML: every setting read, the matrix expanded, and each kind of mistake rejected with
// a message that names the key and the line.
#include <gtest/gtest.h>

#include <map>

#include "bench/spec.h"
#include "core/error.h"

namespace ds {
namespace {

EnvLookup env_of(std::map<std::string, std::string> vars) {
  return [vars](const std::string& k) -> std::optional<std::string> {
    auto it = vars.find(k);
    return it == vars.end() ? std::nullopt : std::optional<std::string>(it->second);
  };
}

BenchSpec parse(const std::string& y, std::map<std::string, std::string> vars = {}) {
  return parse_bench_spec(y, "t.yaml", env_of(std::move(vars)));
}

// The error message of parsing `y`, or "" when it parses.
std::string error_of(const std::string& y) {
  try {
    parse(y);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(BenchSpec, ReadsEverySetting) {
  const BenchSpec s = parse(R"(
name: w9
description: all of it
model: ${CKPT}/model
device: cuda
gpu_memory_utilization: 0.5
threads: 3
precision: q8
isa: avx2
engine:
  kv_cache_tokens: 8192
  block_size: 32
  kv_mode: static
  prefix_cache: false
  max_num_seqs: 8
  max_num_batched_tokens: 4096
  lower_class_prefill_tokens: -1
  prefill_first_steps: 3
  defer_wakeups: 0
batch_sizes: [1, 4, 16]
seq_lengths: [512, 2048]
output_len: 64
num_prompts: 32
rate: 2.5
priority: batch
ignore_eos: false
temperature: 0.7
warmup: 3
prompt: text
seed: 42
bandwidth_gbps: 19.4
kv_dtype: bf16
gpu_hour_price: 3.5
url: http://127.0.0.1:8000
served_model_name: m
api_key: ${KEY}
count_tokens: logprobs
request_timeout_s: 30
vocab_size: 1000
)",
                            {{"CKPT", "/ckpt"}, {"KEY", "secret"}});
  EXPECT_EQ(s.name, "w9");
  EXPECT_EQ(s.model, "/ckpt/model");
  EXPECT_EQ(s.device, "cuda");
  EXPECT_DOUBLE_EQ(s.gpu_memory_utilization, 0.5);
  EXPECT_EQ(s.threads, 3);
  EXPECT_EQ(s.precision, "q8");
  EXPECT_EQ(s.isa, "avx2");
  EXPECT_EQ(s.engine.kv_cache_tokens, 8192);
  EXPECT_EQ(s.engine.block_size, 32);
  EXPECT_EQ(s.engine.kv_mode, "static");
  EXPECT_FALSE(s.engine.prefix_cache);
  EXPECT_EQ(s.engine.max_num_seqs, 8);
  EXPECT_EQ(s.engine.max_num_batched_tokens, 4096);
  EXPECT_EQ(s.engine.lower_class_prefill_tokens, -1);
  EXPECT_EQ(s.engine.prefill_first_steps, 3);
  EXPECT_EQ(s.engine.defer_wakeups, 0);
  EXPECT_EQ(s.concurrency, (std::vector<int>{1, 4, 16}));
  EXPECT_EQ(s.input_len, (std::vector<int>{512, 2048}));
  EXPECT_EQ(s.output_len, (std::vector<int>{64}));
  EXPECT_EQ(s.num_prompts, 32);
  EXPECT_DOUBLE_EQ(*s.rate, 2.5);
  EXPECT_FALSE(s.ignore_eos);
  EXPECT_DOUBLE_EQ(s.temperature, 0.7);
  EXPECT_EQ(s.warmup, 3);
  EXPECT_EQ(s.prompt, "text");
  EXPECT_EQ(s.seed, 42u);
  EXPECT_DOUBLE_EQ(*s.bandwidth_gbps, 19.4);
  EXPECT_EQ(s.kv_dtype, "bf16");
  EXPECT_DOUBLE_EQ(*s.gpu_hour_price, 3.5);
  EXPECT_EQ(s.url, "http://127.0.0.1:8000");
  EXPECT_EQ(s.api_key, "secret");
  EXPECT_EQ(s.count_tokens, "logprobs");
  EXPECT_EQ(*s.vocab_size, 1000);

  const auto sc = s.scenarios();
  ASSERT_EQ(sc.size(), 6u);  // concurrency varies fastest
  EXPECT_EQ(sc[0].name, "c1_in512_out64_r2.5");
  EXPECT_EQ(sc[1].concurrency, 4);
  EXPECT_EQ(sc[3].input_len, 2048);
  EXPECT_EQ(sc[5].num_prompts, 32);
  ASSERT_EQ(sc[3].classes.size(), 1u);  // a matrix cell is one class of its shape
  EXPECT_FALSE(sc[3].mixed);
  EXPECT_EQ(sc[3].classes[0].priority, "batch");
  EXPECT_EQ(sc[3].classes[0].input_len, 2048);
  EXPECT_EQ(sc[3].classes[0].concurrency, 1);
  EXPECT_EQ(sc[3].classes[0].num_prompts, 32);
  EXPECT_DOUBLE_EQ(*sc[3].classes[0].rate, 2.5);
}

TEST(BenchSpec, ClassesMakeOneMixedScenario) {
  const BenchSpec s = parse(R"(
name: mix
classes:
  - name: bulk
    priority: batch
    input_len: 1024
    output_len: 256
    concurrency: 64
    num_prompts: 1000
    background: true
  - priority: latency-critical
    input_len: 512
    output_len: 64
    rate: 0.5
    num_prompts: 8
    start_s: 5
)");
  const auto sc = s.scenarios();
  ASSERT_EQ(sc.size(), 1u);
  EXPECT_TRUE(sc[0].mixed);
  EXPECT_EQ(sc[0].name, "mix");
  EXPECT_EQ(sc[0].concurrency, 65);
  EXPECT_EQ(sc[0].num_prompts, 8);  // the foreground class ends the scenario
  ASSERT_EQ(sc[0].classes.size(), 2u);
  const BenchClass& bulk = sc[0].classes[0];
  EXPECT_EQ(bulk.name, "bulk");
  EXPECT_EQ(bulk.priority, "batch");
  EXPECT_EQ(bulk.input_len, 1024);
  EXPECT_EQ(bulk.concurrency, 64);
  EXPECT_EQ(bulk.num_prompts, 1000);
  EXPECT_TRUE(bulk.background);
  EXPECT_FALSE(bulk.rate);
  const BenchClass& probe = sc[0].classes[1];
  EXPECT_EQ(probe.name, "class1");
  EXPECT_EQ(probe.priority, "latency-critical");
  EXPECT_EQ(probe.concurrency, 1);
  EXPECT_DOUBLE_EQ(*probe.rate, 0.5);
  EXPECT_DOUBLE_EQ(probe.start_s, 5);
  EXPECT_FALSE(probe.background);

  const std::string one = "classes:\n  - input_len: 4\n    output_len: 2\n";
  EXPECT_EQ(error_of(one), "");
  EXPECT_NE(error_of(one + "input_len: 8\n").find("'input_len' is set per class"),
            std::string::npos);
  EXPECT_NE(error_of(one + "    priority: urgent\n").find("'classes[0].priority' must be one of"),
            std::string::npos);
  EXPECT_NE(error_of(one + "    prio: batch\n").find("unknown key 'classes[0].prio'"),
            std::string::npos);
  EXPECT_NE(error_of("classes:\n  - input_len: 4\n").find("are required"), std::string::npos);
  EXPECT_NE(error_of(one + "    background: true\n").find("not 'background'"), std::string::npos);
  const std::string a = "  - name: a\n    input_len: 4\n    output_len: 2\n";
  EXPECT_NE(error_of("classes:\n" + a + a).find("two classes are named 'a'"), std::string::npos);
  EXPECT_NE(error_of("classes: []\n").find("non-empty list"), std::string::npos);
}

TEST(BenchSpec, DefaultsAndScalars) {
  const BenchSpec s = parse("input_len: 16\noutput_len: 8\nmodel: default\nrate: burst\n");
  EXPECT_EQ(s.name, "t");  // the file's stem
  EXPECT_TRUE(s.model.empty());
  EXPECT_FALSE(s.rate);
  EXPECT_TRUE(s.ignore_eos);
  EXPECT_EQ(s.prompt, "random");
  EXPECT_EQ(s.device, "auto");
  const auto sc = s.scenarios();
  ASSERT_EQ(sc.size(), 1u);
  EXPECT_EQ(sc[0].name, "c1_in16_out8");
  EXPECT_EQ(sc[0].num_prompts, 1);  // defaults to the concurrency
}

TEST(BenchSpec, UnknownKeysAreErrors) {
  std::string e = error_of("input_len: 1\noutput_len: 1\nconcurency: [1]\n");
  EXPECT_NE(e.find("t.yaml:3"), std::string::npos) << e;
  EXPECT_NE(e.find("unknown key 'concurency'"), std::string::npos) << e;
  EXPECT_NE(e.find("concurrency"), std::string::npos) << e;  // the known keys are listed
  e = error_of("input_len: 1\noutput_len: 1\nengine:\n  max_seqs: 4\n");
  EXPECT_NE(e.find("t.yaml:4"), std::string::npos) << e;
  EXPECT_NE(e.find("'engine.max_seqs'"), std::string::npos) << e;
}

TEST(BenchSpec, WrongTypesAreErrors) {
  struct Case {
    std::string yaml, want;
  };
  const std::vector<Case> cases = {
      {"input_len: 1\noutput_len: 1\nthreads: two\n", "t.yaml:3: 'threads' must be an integer"},
      {"input_len: 1\noutput_len: 1\nthreads: 1.5\n", "'threads' must be an integer"},
      {"input_len: [16, x]\noutput_len: 1\n", "t.yaml:1: 'input_len' must be an integer"},
      {"input_len: 0\noutput_len: 1\n", "'input_len' must be an integer between 1"},
      {"input_len: []\noutput_len: 1\n", "must not be an empty list"},
      {"input_len: {a: 1}\noutput_len: 1\n", "'input_len' must be an integer"},
      {"input_len: 1\noutput_len: 1\nignore_eos: maybe\n", "'ignore_eos' must be true or false"},
      {"input_len: 1\noutput_len: 1\nrate: fast\n", "'rate' must be a number"},
      {"input_len: 1\noutput_len: 1\nrate: -1\n", "'rate' must be a number"},
      {"input_len: 1\noutput_len: 1\ndevice: tpu\n", "'device' must be one of auto, cpu, cuda"},
      {"input_len: 1\noutput_len: 1\nengine: 5\n", "'engine' must be a mapping"},
      {"input_len: 1\noutput_len: 1\nengine:\n  prefix_cache: 3\n",
       "'engine.prefix_cache' must be true or false"},
      {"input_len: 1\noutput_len: 1\nmodel: [a]\n", "'model' must be a string"},
      {"input_len: 1\n", "'output_len' is required"},
      {"output_len: 1\n", "'input_len' (or 'seq_lengths') is required"},
      {"input_len: 1\noutput_len: 1\nconcurrency: 1\nbatch_sizes: [2]\n", "the same setting"},
      {"- a\n- b\n", "must be a YAML mapping"},
      {"input_len: [1\n", "YAML syntax"},
  };
  for (const auto& c : cases) {
    const std::string e = error_of(c.yaml);
    EXPECT_NE(e.find(c.want), std::string::npos) << c.yaml << "\n-> " << e;
  }
}

TEST(BenchSpec, EnvironmentVariables) {
  EXPECT_EQ(parse("model: ${A}\ninput_len: 1\noutput_len: 1\n", {{"A", "/m.gguf"}}).model,
            "/m.gguf");
  const std::string e = error_of("model: ${DS_NOT_SET}\ninput_len: 1\noutput_len: 1\n");
  EXPECT_NE(e.find("environment variable DS_NOT_SET, which is not set"), std::string::npos) << e;
  EXPECT_NE(error_of("model: ${OPEN\ninput_len: 1\noutput_len: 1\n").find("unterminated"),
            std::string::npos);
}

TEST(BenchSpec, ReadsLoadFormatAndQuantize) {
  const BenchSpec s =
      parse("model: m\nload_format: dummy\nquantize: w4a16\ninput_len: 1\noutput_len: 1\n");
  EXPECT_EQ(s.load_format, "dummy");
  EXPECT_EQ(s.quantize, "w4a16");
  const BenchSpec d = parse("input_len: 1\noutput_len: 1\n");
  EXPECT_EQ(d.load_format, "auto");
  EXPECT_EQ(d.quantize, "none");
  EXPECT_NE(error_of("quantize: int3\ninput_len: 1\noutput_len: 1\n").find("quantize"),
            std::string::npos);
}

TEST(BenchSpec, ReadsFp8KvCacheAndW1kv8) {
  EXPECT_EQ(parse("kv_dtype: fp8\ninput_len: 1\noutput_len: 1\n").kv_dtype, "fp8");
  EXPECT_EQ(parse("kv_cache_dtype: fp8\ninput_len: 1\noutput_len: 1\n").kv_dtype, "fp8");
  EXPECT_NE(error_of("kv_dtype: int8\ninput_len: 1\noutput_len: 1\n").find("kv_dtype"),
            std::string::npos);
  const BenchSpec w = load_bench_spec(std::string(DS_FIXTURES_DIR) + "/../../bench/w1kv8.yaml",
                                      env_of({{"DEEPSERVE_V2_LITE", "/models/v2-lite"}}));
  EXPECT_EQ(w.name, "w1kv8");
  EXPECT_EQ(w.kv_dtype, "fp8");
  EXPECT_EQ(w.device, "cuda");
}

}  // namespace
}  // namespace ds
