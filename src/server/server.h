// The OpenAI-compatible HTTP server (cpp-httplib). HTTP worker threads only parse, submit to
// the engine and stream its events back; the engine thread does all the model work.
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>

#include "engine/engine.h"
#include "model/loader.h"
#include "server/api.h"
#include "server/metrics.h"

namespace httplib {
class Server;
}

namespace ds {

struct ServerConfig {
  std::string host = "127.0.0.1";
  int port = 8000;         // 0 = any free port
  std::string api_key;     // empty = no authentication
  std::string model_name;  // the id clients send as "model"
  size_t max_body_bytes = 8u << 20;
  int http_threads = 64;  // each open connection holds one while it is served
};

class ApiServer {
 public:
  ApiServer(Engine& engine, const LoadedModel& model, ServerConfig cfg);
  ~ApiServer();
  ApiServer(const ApiServer&) = delete;
  ApiServer& operator=(const ApiServer&) = delete;

  // Binds the listening socket; returns the port (throws Error when it cannot bind).
  int bind();
  // Serves until shutdown() is called; false if the listener failed.
  bool run();
  // Stops accepting, waits up to `timeout_s` for in-flight requests, cancels the rest and
  // makes run() return. Safe from any thread.
  void shutdown(double timeout_s);

 private:
  struct Job;
  void routes();
  void completions(bool chat, const std::string& body, void* res);
  std::shared_ptr<Job> start_job(ApiRequest req);
  void job_done();

  Engine& engine_;
  ServerConfig cfg_;
  ApiLimits limits_;
  std::optional<ChatTemplate> chat_;
  ServerMetrics metrics_;
  std::unique_ptr<httplib::Server> http_;
  std::atomic<bool> draining_{false};
  std::atomic<uint64_t> next_id_;
  int64_t created_;  // unix time the server started, for /v1/models

  std::mutex mu_;  // guards in_flight_ and live_
  std::condition_variable cv_;
  int in_flight_ = 0;     // jobs not yet finished
  std::set<SeqId> live_;  // engine requests not yet finished
};

}  // namespace ds
