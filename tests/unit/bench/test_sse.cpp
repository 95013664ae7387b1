// Server-sent events split anywhere, OpenAI completion chunks decoded, server URLs split.
#include <gtest/gtest.h>

#include "bench/online.h"
#include "bench/sse.h"
#include "core/error.h"

namespace ds {
namespace {

const std::string kStream =
    ": a comment\r\n"
    "data: {\"choices\":[{\"index\":0,\"text\":\"Hel\",\"finish_reason\":null}]}\r\n\r\n"
    "event: message\n"
    "data: {\"choices\":[{\"index\":0,\"text\":\"lo\",\n"
    "data: \"finish_reason\":\"length\"}]}\n\n"
    "data:{\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2}}\r\r"
    "data: [DONE]\n\n";

TEST(Sse, SplitsAtEveryByteGiveTheSameEvents) {
  const std::vector<std::string> want = {
      "{\"choices\":[{\"index\":0,\"text\":\"Hel\",\"finish_reason\":null}]}",
      "{\"choices\":[{\"index\":0,\"text\":\"lo\",\n\"finish_reason\":\"length\"}]}",
      "{\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2}}",
      "[DONE]",
  };
  for (size_t cut = 0; cut <= kStream.size(); ++cut) {
    SseParser p;
    auto got = p.feed(std::string_view(kStream).substr(0, cut));
    for (auto& e : p.feed(std::string_view(kStream).substr(cut))) got.push_back(e);
    EXPECT_EQ(got, want) << "cut at " << cut;
  }
  SseParser bytewise;
  std::vector<std::string> got;
  for (char c : kStream)
    for (auto& e : bytewise.feed(std::string_view(&c, 1))) got.push_back(e);
  EXPECT_EQ(got, want);
}

TEST(Sse, IncompleteEventIsHeldBack) {
  SseParser p;
  EXPECT_TRUE(p.feed("data: {\"a\":1}\n").empty());
  EXPECT_EQ(p.feed("\n"), std::vector<std::string>{"{\"a\":1}"});
  EXPECT_TRUE(p.feed("\n\n").empty());  // blank lines with no data dispatch nothing
}

TEST(CompletionChunk, Fields) {
  auto c = parse_completion_chunk(
      R"({"choices":[{"index":0,"text":"ab","finish_reason":null,)"
      R"("logprobs":{"tokens":["a","b"],"token_logprobs":[-1,-2]}}],"usage":null})");
  EXPECT_TRUE(c.has_choice);
  EXPECT_EQ(c.text, "ab");
  EXPECT_EQ(c.finish_reason, "");
  EXPECT_EQ(c.logprob_tokens, 2);
  EXPECT_EQ(c.token_ids, -1);  // none sent
  EXPECT_FALSE(c.completion_tokens);

  // Token ids (return_token_ids): counted even when the step added no text.
  c = parse_completion_chunk(R"({"choices":[{"text":"","token_ids":[17]}]})");
  EXPECT_EQ(c.token_ids, 1);
  EXPECT_EQ(parse_completion_chunk(R"({"choices":[{"text":"","token_ids":[]}]})").token_ids, 0);

  c = parse_completion_chunk(R"({"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3}})");
  EXPECT_FALSE(c.has_choice);
  EXPECT_EQ(*c.prompt_tokens, 7);
  EXPECT_EQ(*c.completion_tokens, 3);

  c = parse_completion_chunk(R"({"choices":[{"delta":{"content":"hi"},"finish_reason":"stop"}]})");
  EXPECT_EQ(c.text, "hi");
  EXPECT_EQ(c.finish_reason, "stop");

  c = parse_completion_chunk(R"({"error":{"message":"bad","type":"x"}})");
  EXPECT_EQ(c.error, "bad");
  EXPECT_TRUE(parse_completion_chunk("[DONE]").done);
  EXPECT_THROW(parse_completion_chunk("{not json"), Error);
}

}  // namespace
}  // namespace ds

namespace ds {
namespace {

TEST(ServerUrl, OriginAndPrefix) {
  auto u = parse_server_url("http://127.0.0.1:8000");
  EXPECT_EQ(u.origin, "http://127.0.0.1:8000");
  EXPECT_EQ(u.prefix, "");
  u = parse_server_url("http://host:8000/v1/");
  EXPECT_EQ(u.origin, "http://host:8000");
  EXPECT_EQ(u.prefix, "");
  u = parse_server_url("http://host/proxy/v1");
  EXPECT_EQ(u.origin, "http://host");
  EXPECT_EQ(u.prefix, "/proxy");
  EXPECT_THROW(parse_server_url("https://host"), Error);
  EXPECT_THROW(parse_server_url("host:8000"), Error);
  EXPECT_THROW(parse_server_url("http://"), Error);
}

}  // namespace
}  // namespace ds
