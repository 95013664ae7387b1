// The engine's device sampling path (one Backend::sample per step) exercised on the CPU: a
// backend that forwards every op to the CPU backend but reports a CUDA device, so the engine
// uploads step inputs and samples through the op as it does on a GPU. Seeded requests draw the
// same tokens alone and batched; top_k = 1 rows equal the host greedy path; rows that need the
// host (penalties, logprobs) take the host sampler.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "../../request_tokens.h"
#include "engine/engine.h"
#include "model/loader.h"

namespace ds {
namespace {

// The CPU backend under a CUDA device id; counts the sample calls.
class DeviceLike final : public Backend {
 public:
  explicit DeviceLike(Backend& inner) : in_(inner) {}
  Device device() const override { return {DeviceKind::CUDA, 0}; }
  std::string name() const override { return "device-like " + in_.name(); }
  bool supports(Op op, DType t) const override { return in_.supports(op, t); }
  std::unique_ptr<Buffer> alloc(size_t bytes) override { return in_.alloc(bytes); }
  void upload(const TensorView& dst, const void* host, size_t bytes) override {
    in_.upload(dst, host, bytes);
  }
  void download(void* host, const TensorView& src, size_t bytes) override {
    in_.download(host, src, bytes);
  }
  void synchronize() override { in_.synchronize(); }
  void embed(const TensorView& table, const int32_t* ids, int n, TensorView out) override {
    in_.embed(table, ids, n, out);
  }
  void rms_norm(const TensorView& x, const TensorView& w, float eps, TensorView out) override {
    in_.rms_norm(x, w, eps, out);
  }
  void matmul(const TensorView& x, const TensorView& w, TensorView out) override {
    in_.matmul(x, w, out);
  }
  void rope(TensorView x, const int32_t* positions, const RopeParams& p) override {
    in_.rope(x, positions, p);
  }
  void store_kv(const TensorView& k, const TensorView& v, const PagedKv& kv,
                const AttentionMeta& meta) override {
    in_.store_kv(k, v, kv, meta);
  }
  void attention(const AttentionParams& p, const AttentionMeta& meta) override {
    in_.attention(p, meta);
  }
  void silu_mul(const TensorView& gate_up, TensorView out) override { in_.silu_mul(gate_up, out); }
  void add(TensorView x, const TensorView& y) override { in_.add(x, y); }
  void batched_matmul(const TensorView& x, const TensorView& w, TensorView out) override {
    in_.batched_matmul(x, w, out);
  }
  void mla_attention(const MlaAttentionParams& p, const AttentionMeta& meta) override {
    in_.mla_attention(p, meta);
  }
  void moe_route(const TensorView& logits, const MoeRouteParams& p, TensorView ids,
                 TensorView weights) override {
    in_.moe_route(logits, p, ids, weights);
  }
  void moe_ffn(const MoeFfnParams& p) override { in_.moe_ffn(p); }
  void argmax(const TensorView& logits, TensorView ids) override { in_.argmax(logits, ids); }
  void sample(const TensorView& logits, const SampleRow* rows, TensorView ids) override {
    ++sample_calls;
    seen.insert(seen.end(), rows, rows + logits.rows());  // host memory underneath
    in_.sample(logits, rows, ids);
  }
  void copy(const TensorView& src, TensorView dst) override { in_.copy(src, dst); }

  std::atomic<int> sample_calls{0};
  std::vector<SampleRow> seen;  // every row sampled, in order (engine thread; read when idle)

 private:
  Backend& in_;
};

struct Fixture {
  std::unique_ptr<Backend> cpu;
  std::unique_ptr<DeviceLike> device;
  LoadedModel host_model, device_model;
  std::vector<std::vector<int32_t>> prompts;
};

Fixture* fixture() {
  static Fixture* f = [] {
    const char* path = std::getenv("DS_SMOLLM2_GGUF");
    if (!path) return static_cast<Fixture*>(nullptr);
    auto* f = new Fixture;
    BackendOptions bo;
    bo.threads = 2;
    f->cpu = make_cpu_backend(bo);
    f->device = std::make_unique<DeviceLike>(*f->cpu);
    f->host_model = load_model(path, *f->cpu, {});
    f->device_model = load_model(path, *f->device, {});
    std::ifstream in(std::string(DS_FIXTURES_DIR) + "/llamacpp/smollm2_q4_1.json");
    const auto j = nlohmann::json::parse(in);
    for (const auto& p : j["prompts"]) f->prompts.push_back(p["ids"].get<std::vector<int32_t>>());
    f->prompts.resize(std::min<size_t>(f->prompts.size(), 8));
    return f;
  }();
  return f;
}

#define NEED_MODEL()      \
  Fixture* f = fixture(); \
  if (!f) GTEST_SKIP() << "DS_SMOLLM2_GGUF is not set (scripts/test.sh sets it)"

using MakeRequest = std::function<EngineRequest(size_t i)>;

// Every request's tokens, submitted together (one batch) or one after another.
std::vector<std::vector<int32_t>> run(Backend& backend, LoadedModel& m, size_t n,
                                      const MakeRequest& make, bool together) {
  EngineConfig cfg;
  cfg.prefix_cache = false;
  Engine engine(*m.model, backend, m.tokenizer.get(), cfg);
  std::vector<std::vector<int32_t>> out(n);
  if (together) {
    std::vector<std::shared_ptr<RequestHandle>> hs;
    for (size_t i = 0; i < n; ++i) hs.push_back(engine.submit(make(i)));
    for (size_t i = 0; i < n; ++i) out[i] = test::collect_tokens(*hs[i]);
  } else {
    for (size_t i = 0; i < n; ++i) out[i] = test::collect_tokens(*engine.submit(make(i)));
  }
  return out;
}

EngineRequest request(const std::vector<int32_t>& prompt, const SamplingParams& s) {
  EngineRequest r;
  r.prompt = prompt;
  r.max_tokens = 10;
  r.ignore_eos = true;
  r.sampling = s;
  return r;
}

TEST(EngineDeviceSample, SeededRequestsDrawTheSameAloneAndBatched) {
  NEED_MODEL();
  auto make = [&](size_t i) {
    SamplingParams s;  // temperature 0.8, top-k 40, top-p 0.95, min-p 0.05
    s.temperature = 1.2f;
    s.seed = 1000 + i;
    return request(f->prompts[i], s);
  };
  const size_t n = f->prompts.size();
  f->device->sample_calls = 0;
  f->device->seen.clear();
  const auto alone = run(*f->device, f->device_model, n, make, false);
  EXPECT_EQ(f->device->sample_calls, int(n * 10)) << "every step sampled on the device";
  // One request at a time: request i's rows carry its seed, counters 0..9, its filters.
  ASSERT_EQ(f->device->seen.size(), n * 10);
  for (size_t i = 0; i < n; ++i)
    for (size_t t = 0; t < 10; ++t) {
      const SampleRow& r = f->device->seen[i * 10 + t];
      EXPECT_EQ(r.seed, 1000 + i);
      EXPECT_EQ(r.counter, t);
      EXPECT_EQ(r.temperature, 1.2f);
      EXPECT_EQ(r.top_k, 40);
      EXPECT_EQ(r.top_p, 0.95f);
      EXPECT_EQ(r.min_p, 0.05f);
    }
  EXPECT_EQ(run(*f->device, f->device_model, n, make, true), alone);
  // The draws differ from greedy somewhere (the temperature is high), yet stay seeded.
  auto greedy = [&](size_t i) {
    SamplingParams s;
    s.temperature = 0;
    return request(f->prompts[i], s);
  };
  EXPECT_NE(run(*f->device, f->device_model, n, greedy, true), alone);
}

// top_k = 1 and temperature 0 through the op equal the host path's greedy picks, row for row
// in a mixed batch.
TEST(EngineDeviceSample, GreedyRowsEqualTheHostPath) {
  NEED_MODEL();
  auto make = [&](size_t i) {
    SamplingParams s;
    s.temperature = i % 2 ? 0.0f : 0.9f;
    s.top_k = 1;
    s.seed = i;
    return request(f->prompts[i], s);
  };
  const size_t n = f->prompts.size();
  f->device->sample_calls = 0;
  const auto device = run(*f->device, f->device_model, n, make, true);
  EXPECT_GT(f->device->sample_calls, 0);
  EXPECT_EQ(device, run(*f->cpu, f->host_model, n, make, true));
}

TEST(EngineDeviceSample, PenaltiesAndLogprobsUseTheHostSampler) {
  NEED_MODEL();
  auto penalized = [&](size_t i) {
    SamplingParams s;
    s.repetition_penalty = 1.3f;
    s.seed = i;
    return request(f->prompts[i], s);
  };
  auto logprobs = [&](size_t i) {
    SamplingParams s;
    s.seed = i;
    EngineRequest r = request(f->prompts[i], s);
    r.logprobs = 2;
    return r;
  };
  f->device->sample_calls = 0;
  const auto a = run(*f->device, f->device_model, 2, penalized, true);
  const auto b = run(*f->device, f->device_model, 2, logprobs, true);
  EXPECT_EQ(f->device->sample_calls, 0);
  // The host sampler with the same seed gives the same tokens on the plain CPU backend.
  EXPECT_EQ(a, run(*f->cpu, f->host_model, 2, penalized, true));
  EXPECT_EQ(b, run(*f->cpu, f->host_model, 2, logprobs, true));
}

}  // namespace
}  // namespace ds
