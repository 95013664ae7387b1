// Request validation and metric rendering of the HTTP server, without sockets or a model.
#include <gtest/gtest.h>

#include "server/api.h"
#include "server/metrics.h"

namespace ds {
namespace {

using Json = nlohmann::json;

ApiLimits limits() {
  ApiLimits l;
  l.vocab = 100;
  l.context = 32;
  l.model_name = "m";
  return l;
}

int status_of(const Json& body, bool chat = false) {
  try {
    parse_api_request(body, chat, limits());
  } catch (const ApiError& e) {
    return e.status;
  }
  return 200;
}

TEST(ServerApi, TokenPromptsAndChoices) {
  auto r = parse_api_request(Json{{"model", "m"},
                                  {"prompt", {{1, 2}, {3}}},
                                  {"n", 2},
                                  {"max_tokens", 5},
                                  {"stop", "x"},
                                  {"priority", "batch"},
                                  {"seed", 3}},
                             false, limits());
  ASSERT_EQ(r.prompts.size(), 2u);
  ASSERT_EQ(r.engine.size(), 4u);  // prompt-major, n per prompt
  EXPECT_EQ(r.engine[1].prompt, (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(r.engine[2].prompt, (std::vector<int32_t>{3}));
  EXPECT_EQ(r.engine[0].max_tokens, 5);
  EXPECT_EQ(r.engine[0].stop, (std::vector<std::string>{"x"}));
  EXPECT_EQ(r.engine[0].priority, Priority::Batch);
  EXPECT_NE(r.engine[0].sampling.seed, r.engine[1].sampling.seed);
}

TEST(ServerApi, MaxTokensDefaultsAndClampsToContext) {
  auto r = parse_api_request(Json{{"prompt", {1, 2, 3}}}, false, limits());
  EXPECT_EQ(r.engine[0].max_tokens, 16);
  r = parse_api_request(Json{{"prompt", {1, 2, 3}}, {"max_tokens", 1000}}, false, limits());
  EXPECT_EQ(r.engine[0].max_tokens, 29);
  r = parse_api_request(Json{{"prompt", {1}}, {"max_completion_tokens", 2}}, false, limits());
  EXPECT_EQ(r.engine[0].max_tokens, 2);
}

TEST(ServerApi, RejectsBadRequests) {
  EXPECT_EQ(status_of(Json::array()), 400);
  EXPECT_EQ(status_of(Json{{"prompt", {1}}, {"model", "other"}}), 404);
  EXPECT_EQ(status_of(Json{{"prompt", {1}}, {"max_tokens", 0}}), 400);
  EXPECT_EQ(status_of(Json{{"prompt", {1}}, {"max_tokens", -1}}), 400);
  EXPECT_EQ(status_of(Json{{"prompt", {1}}, {"max_tokens", "3"}}), 400);
  EXPECT_EQ(status_of(Json{{"prompt", {1}}, {"temperature", 5}}), 400);
  EXPECT_EQ(status_of(Json{{"prompt", {1}}, {"n", 0}}), 400);
  EXPECT_EQ(status_of(Json{{"prompt", {1}}, {"stream", 1}}), 400);
  EXPECT_EQ(status_of(Json{{"prompt", {1}}, {"priority", "urgent"}}), 400);
  EXPECT_EQ(status_of(Json{{"prompt", {1}}, {"stop", {1}}}), 400);
  EXPECT_EQ(status_of(Json{{"prompt", {1}}, {"logprobs", true}}), 400);
  EXPECT_EQ(status_of(Json{{"prompt", {100}}}), 400);                    // outside the vocabulary
  EXPECT_EQ(status_of(Json{{"prompt", std::vector<int>(32, 1)}}), 400);  // no room to generate
  EXPECT_EQ(status_of(Json{{"prompt", "text"}}), 400);                   // no tokenizer
  EXPECT_EQ(status_of(Json{{"messages", {{{"role", "user"}, {"content", "hi"}}}}}, true), 400);
  EXPECT_EQ(status_of(Json::object()), 400);
}

TEST(ServerApi, ErrorBodyHasOpenAiFields) {
  const Json j = error_body(ApiError(401, "nope", "", "invalid_api_key"));
  EXPECT_EQ(j["error"]["message"], "nope");
  EXPECT_EQ(j["error"]["type"], "authentication_error");
  EXPECT_TRUE(j["error"]["param"].is_null());
  EXPECT_EQ(j["error"]["code"], "invalid_api_key");
}

TEST(ServerMetrics, CountsAndRenders) {
  Histogram h({0.1, 1.0});
  h.observe(0.05);
  h.observe(0.1);
  h.observe(5);
  EXPECT_EQ(h.counts(), (std::vector<uint64_t>{2, 0, 1}));
  EXPECT_DOUBLE_EQ(h.sum(), 5.15);

  ServerMetrics m("m");
  m.request_started();
  m.token(true);
  m.token(false);
  RequestRecord r;
  r.priority = Priority::LatencyCritical;
  r.finish_reason = "length";
  r.prompt_tokens = 3;
  r.completion_tokens = 2;
  r.timings.total_s = 0.5;
  r.timings.decode_s = 0.2;
  m.request_finished(r, true);
  const Json j = m.json(EngineStats{});
  EXPECT_EQ(j["prompt_tokens_total"], 3);
  EXPECT_EQ(j["generation_tokens_total"], 2);
  EXPECT_EQ(j["requests_total"]["length"], 1);
  EXPECT_EQ(j["num_requests_running"], 0);
  EXPECT_EQ(j["num_requests_waiting"], 0);
  EXPECT_GT(j["tokens_per_second_1m_avg"].get<double>(), 0);
  EXPECT_EQ(j["latency"]["latency-critical"]["inter_token_latency_seconds"]["count"], 1);
  const std::string text = m.prometheus(EngineStats{});
  EXPECT_NE(text.find("deepserve:requests_total{model_name=\"m\",finish_reason=\"length\"} 1\n"),
            std::string::npos);
  EXPECT_NE(text.find("deepserve:e2e_request_latency_seconds_count{model_name=\"m\","
                      "priority=\"latency-critical\"} 1\n"),
            std::string::npos);
}

}  // namespace
}  // namespace ds
