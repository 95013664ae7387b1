// Online mode: an HTTP client for any OpenAI-compatible server. Requests are streamed
// `/v1/completions` calls with token-id prompts; times are when the client read each chunk.
#pragma once

#include <atomic>
#include <string>

#include "bench/target.h"

namespace ds {

struct OnlineTargetConfig {
  std::string url;              // http://host:port, optionally with a path prefix or /v1
  std::string model_name;       // "" = the first id from GET /v1/models
  std::string api_key;          // bearer token when set
  bool count_logprobs = false;  // count tokens by logprobs entries (exact) instead of chunks
  double request_timeout_s = 600;
};

// "http://h:p/x/v1/" -> {"http://h:p", "/x"}; throws ds::Error for what it cannot use.
struct ParsedUrl {
  std::string origin;
  std::string prefix;
};
ParsedUrl parse_server_url(const std::string& url);

class OnlineTarget : public BenchTarget {
 public:
  // Asks the server for its model name when none is given.
  explicit OnlineTarget(OnlineTargetConfig cfg);
  std::string mode() const override { return "online"; }
  BenchResult run(const BenchRequest& req) override;
  // Reads GET /api/v1/metrics?model=NAME when the server has it (ours does).
  TargetSnapshot snapshot() override;
  std::optional<RooflineModel> roofline() const override { return std::nullopt; }
  bool engine_timestamps() const override { return false; }
  const std::string& model_name() const { return cfg_.model_name; }

 private:
  OnlineTargetConfig cfg_;
  ParsedUrl url_;
  std::atomic<bool> metrics_missing_{false};
};

}  // namespace ds
