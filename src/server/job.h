// One completions request in flight: its engine requests, what has been read from them, and
// the answer it writes. Event-driven: each engine request's handle posts a pump to the
// connection's strand when it has events; the pump reads them without blocking and writes SSE
// chunks (streaming) or, once all choices finished, one JSON answer.
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/engine.h"
#include "server/api.h"
#include "server/http_transport.h"
#include "server/metrics.h"

namespace ds {

// What jobs share with the server: the engine, metrics and the bookkeeping that shutdown and
// the waiting-queue limit read.
struct JobEnv {
  JobEnv(Engine& e, ServerMetrics& m, const ApiLimits& l) : engine(e), metrics(m), limits(l) {}
  Engine& engine;
  ServerMetrics& metrics;
  const ApiLimits& limits;
  std::string model_name;

  std::mutex mu;  // guards live and in_flight
  std::condition_variable cv;
  std::unordered_map<SeqId, std::shared_ptr<RequestHandle>> live;  // engine requests not done
  int in_flight = 0;                                               // jobs not yet destroyed
  // Engine requests submitted that have not produced an event yet (queued or in prefill).
  std::atomic<int> waiting{0};
};

class Job : public std::enable_shared_from_this<Job> {
 public:
  Job(JobEnv& env, ApiRequest req, std::string id, int64_t created,
      std::shared_ptr<HttpExchange> ex);
  ~Job();
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;

  // Submits the engine requests and starts listening (on the connection's strand).
  void start();

 private:
  struct Sub;
  void notify();  // any thread: schedule a pump
  void pump();    // strand: read what is there, write what it makes
  void record(size_t i, EngineEvent& ev);
  void emit(size_t i, const EngineEvent& ev);
  void finish();
  void abandon();  // the client went away: cancel what is unfinished
  bool all_finished() const;
  nlohmann::ordered_json logprobs(size_t i, size_t from) const;
  nlohmann::ordered_json take_logprobs(size_t i);
  const std::string& echo(size_t i) const;
  nlohmann::ordered_json prompt_logprobs(size_t i, const nlohmann::ordered_json& generated) const;
  nlohmann::ordered_json usage() const;
  nlohmann::ordered_json chunk(size_t i, const std::string* text, const std::string* finish,
                               bool role, nlohmann::ordered_json lp,
                               const std::vector<int32_t>* ids) const;
  void reply_whole();
  void send(const nlohmann::ordered_json& j);

  JobEnv& env_;
  ApiRequest req_;
  std::string id_;
  int64_t created_;
  std::shared_ptr<HttpExchange> ex_;
  std::vector<Sub> subs_;
  std::atomic<bool> pump_posted_{false};
  bool gone_ = false;  // the client went away
  bool done_ = false;  // the answer is complete
  size_t cursor_ = 0;  // round-robin position over the choices
};

}  // namespace ds
