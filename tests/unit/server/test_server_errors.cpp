// Failures that are the server's fault reach clients as 5xx (or an error event in a stream),
// never as 400, and end only the request they hit: the real API server on the SmolLM2 model,
// with a fault injected into one request's output (EngineConfig::fault_hook).
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <string>
#include <thread>

#include "core/error.h"
#include "loopback.h"
#include "server/server.h"

namespace ds {
namespace {

// One HTTP/1.1 request on a fresh connection; the whole answer (the server closes it).
std::string post(int port, const std::string& path, const std::string& body) {
  const int fd = test::connect_to(port, 60);
  const std::string req = "POST " + path +
                          " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                          "Content-Type: application/json\r\nContent-Length: " +
                          std::to_string(body.size()) + "\r\n\r\n" + body;
  EXPECT_EQ(send(fd, req.data(), req.size(), MSG_NOSIGNAL), ssize_t(req.size()));
  std::string out;
  char buf[65536];
  for (ssize_t n; (n = recv(fd, buf, sizeof buf, 0)) > 0;) out.append(buf, size_t(n));
  close(fd);
  return out;
}

TEST(ServerErrors, AnEngineFailureIs500AndEndsOnlyItsRequest) {
  const char* path = std::getenv("DS_SMOLLM2_GGUF");
  if (!path) GTEST_SKIP() << "DS_SMOLLM2_GGUF is not set (scripts/test.sh sets it)";
  BackendOptions bo;
  bo.threads = 2;
  auto backend = make_cpu_backend(bo);
  LoadedModel m = load_model(path, *backend, {});
  std::atomic<SeqId> victim_lo{1}, victim_hi{2};  // the first two requests fail
  EngineConfig ec;
  ec.fault_hook = [&](SeqId id, int32_t) {
    if (id >= victim_lo && id <= victim_hi) throw Error("injected detokenizer failure");
  };
  Engine engine(*m.model, *backend, m.tokenizer.get(), ec);
  ServerConfig sc;
  sc.port = 0;
  sc.model_name = "m";
  ApiServer server(engine, m, sc);
  const int port = server.bind();
  std::thread runner([&] { server.run(); });

  const std::string body =
      R"({"model": "m", "prompt": "Hello", "max_tokens": 4, "ignore_eos": true)";
  const std::string plain = post(port, "/v1/completions", body + "}");
  EXPECT_EQ(plain.rfind("HTTP/1.1 500", 0), 0u) << plain;
  EXPECT_NE(plain.find("internal_error"), std::string::npos) << plain;
  EXPECT_NE(plain.find("injected detokenizer failure"), std::string::npos) << plain;

  const std::string streamed = post(port, "/v1/completions", body + R"(, "stream": true})");
  EXPECT_EQ(streamed.rfind("HTTP/1.1 200", 0), 0u) << streamed;  // the stream had begun
  EXPECT_NE(streamed.find("\"error\""), std::string::npos) << streamed;
  EXPECT_NE(streamed.find("injected detokenizer failure"), std::string::npos) << streamed;

  const std::string fine = post(port, "/v1/completions", body + "}");  // request 3
  EXPECT_EQ(fine.rfind("HTTP/1.1 200", 0), 0u) << fine;
  EXPECT_NE(fine.find("\"completion_tokens\":4"), std::string::npos) << fine;
  EXPECT_NE(fine.find("\"finish_reason\":\"length\""), std::string::npos) << fine;

  server.shutdown(5);
  runner.join();
}

}  // namespace
}  // namespace ds
