// The OpenAI-compatible API server: routes, authentication and request admission on top of
// the event-driven HTTP transport (http_transport.h). I/O threads only parse, submit to the
// engine and write what its events make (job.h); the engine thread does all the model work.
#pragma once

#include <atomic>
#include <memory>
#include <optional>
#include <string>

#include "engine/engine.h"
#include "model/loader.h"
#include "server/api.h"
#include "server/http_transport.h"
#include "server/job.h"
#include "server/metrics.h"

namespace ds {

struct ServerConfig {
  std::string host = "127.0.0.1";
  int port = 8000;         // 0 = any free port
  std::string api_key;     // empty = no authentication
  std::string model_name;  // the id clients send as "model"
  HttpLimits http;         // sizes, timeouts, open connections
  int io_threads = 2;      // threads running every connection
  // Engine requests submitted but not yet generating, at most; more get 503 + Retry-After.
  int max_waiting_requests = 4096;
};

class ApiServer {
 public:
  ApiServer(Engine& engine, const LoadedModel& model, ServerConfig cfg);
  ~ApiServer();
  ApiServer(const ApiServer&) = delete;
  ApiServer& operator=(const ApiServer&) = delete;

  // Binds the listening socket; returns the port (throws Error when it cannot bind).
  int bind();
  // Serves until shutdown() is called.
  bool run();
  // Stops accepting, waits up to `timeout_s` for in-flight requests, cancels the rest and
  // makes run() return. Safe from any thread.
  void shutdown(double timeout_s);

 private:
  void handle(HttpRequest& req, const std::shared_ptr<HttpExchange>& ex);
  void route(HttpRequest& req, const std::shared_ptr<HttpExchange>& ex);
  void completions(bool chat, const HttpRequest& req, const std::shared_ptr<HttpExchange>& ex);
  bool quiet(double timeout_s);  // waits for no job and no response in flight

  Engine& engine_;
  ServerConfig cfg_;
  ApiLimits limits_;
  std::optional<ChatTemplate> chat_;
  ServerMetrics metrics_;
  JobEnv env_;
  std::atomic<bool> draining_{false};
  std::atomic<uint64_t> next_id_;
  int64_t created_;                   // unix time the server started, for /v1/models
  std::unique_ptr<HttpServer> http_;  // last: its connections go before what they use
};

}  // namespace ds
