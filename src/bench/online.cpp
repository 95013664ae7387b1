#include "bench/online.h"

#include <httplib.h>

#include <nlohmann/json.hpp>

#include "bench/sse.h"
#include "core/error.h"

namespace ds {
namespace {

std::unique_ptr<httplib::Client> make_client(const ParsedUrl& u, const OnlineTargetConfig& c) {
  auto cli = std::make_unique<httplib::Client>(u.origin);
  cli->set_connection_timeout(10);
  const auto timeout = std::chrono::duration<double>(c.request_timeout_s);
  cli->set_read_timeout(std::chrono::duration_cast<std::chrono::microseconds>(timeout));
  if (!c.api_key.empty()) cli->set_bearer_token_auth(c.api_key);
  return cli;
}

}  // namespace

ParsedUrl parse_server_url(const std::string& url) {
  const size_t scheme = url.find("://");
  if (scheme == std::string::npos || url.substr(0, scheme) != "http")
    throw Error("--url must start with http:// (got '" + url + "')");
  const size_t slash = url.find('/', scheme + 3);
  ParsedUrl p;
  p.origin = url.substr(0, slash);
  if (p.origin.size() == scheme + 3) throw Error("--url has no host: '" + url + "'");
  p.prefix = slash == std::string::npos ? "" : url.substr(slash);
  while (!p.prefix.empty() && p.prefix.back() == '/') p.prefix.pop_back();
  if (p.prefix.size() >= 3 && p.prefix.compare(p.prefix.size() - 3, 3, "/v1") == 0)
    p.prefix.resize(p.prefix.size() - 3);
  return p;
}

OnlineTarget::OnlineTarget(OnlineTargetConfig cfg)
    : cfg_(std::move(cfg)), url_(parse_server_url(cfg_.url)) {
  if (!cfg_.model_name.empty()) return;
  auto cli = make_client(url_, cfg_);
  auto res = cli->Get(url_.prefix + "/v1/models");
  if (!res) throw Error(cfg_.url + ": " + httplib::to_string(res.error()));
  if (res->status != 200)
    throw Error(cfg_.url + "/v1/models: HTTP " + std::to_string(res->status) + ": " + res->body);
  try {
    const auto j = nlohmann::json::parse(res->body);
    cfg_.model_name = j.at("data").at(0).at("id").get<std::string>();
  } catch (const std::exception& e) {
    throw Error(cfg_.url + "/v1/models: no model id in the answer: " + e.what());
  }
}

BenchResult OnlineTarget::run(const BenchRequest& req) {
  nlohmann::json body = {{"model", cfg_.model_name},
                         {"max_tokens", req.max_tokens},
                         {"stream", true},
                         {"stream_options", {{"include_usage", true}}},
                         {"ignore_eos", req.ignore_eos},
                         {"temperature", req.temperature},
                         {"seed", req.seed}};
  if (req.prompt_text.empty())
    body["prompt"] = req.prompt_ids;
  else
    body["prompt"] = req.prompt_text;
  if (cfg_.count_logprobs) body["logprobs"] = 0;
  if (!req.priority.empty()) body["priority"] = req.priority;  // deepserve's extension field

  BenchResult r;
  r.prompt_tokens = int(req.prompt_ids.size());
  SseParser sse;
  int status = 0;
  std::string error_body;
  bool done = false;
  httplib::Request hr;
  hr.method = "POST";
  hr.path = url_.prefix + "/v1/completions";
  hr.body = body.dump();
  hr.set_header("Content-Type", "application/json");
  hr.set_header("Accept", "text/event-stream");
  hr.response_handler = [&](const httplib::Response& res) {
    status = res.status;
    return true;
  };
  hr.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    const double t = steady_now_s();
    if (status != 200) {
      error_body.append(data, n);
      return true;
    }
    try {
      for (const std::string& ev : sse.feed(std::string_view(data, n))) {
        const CompletionChunk c = parse_completion_chunk(ev);
        if (c.done) {
          done = true;
          continue;
        }
        if (!c.error.empty()) {
          r.error = c.error;
          continue;
        }
        const int tokens = cfg_.count_logprobs ? c.logprob_tokens : (c.text.empty() ? 0 : 1);
        for (int i = 0; i < tokens; ++i) r.token_s.push_back(t);
        r.client_output_tokens += tokens;
        if (!c.finish_reason.empty()) r.finish_reason = c.finish_reason;
        if (c.prompt_tokens) r.usage_prompt_tokens = c.prompt_tokens;
        if (c.completion_tokens) r.usage_output_tokens = c.completion_tokens;
      }
    } catch (const std::exception& e) {
      r.error = e.what();
      return false;
    }
    return true;
  };

  auto cli = make_client(url_, cfg_);
  r.start_s = steady_now_s();
  auto res = cli->send(hr);
  r.end_s = steady_now_s();
  if (!res) {
    if (r.error.empty()) r.error = cfg_.url + ": " + httplib::to_string(res.error());
  } else if (status != 200) {
    r.error = "HTTP " + std::to_string(status) + ": " + error_body.substr(0, 500);
  } else if (!done && r.error.empty()) {
    r.error = "the stream ended without [DONE]";
  }
  if (!req.prompt_text.empty() && r.usage_prompt_tokens) r.prompt_tokens = *r.usage_prompt_tokens;
  r.ok = r.error.empty();
  return r;
}

TargetSnapshot OnlineTarget::snapshot() {
  TargetSnapshot s;
  if (metrics_missing_) return s;
  auto cli = make_client(url_, cfg_);
  cli->set_read_timeout(5);
  auto res = cli->Get(url_.prefix + "/api/v1/metrics?model=" +
                      httplib::detail::encode_query_param(cfg_.model_name));
  if (!res) return s;  // busy or gone: try again at the next sample
  if (res->status == 404) {
    metrics_missing_ = true;  // not our server: no JSON metrics
    return s;
  }
  if (res->status != 200) return s;
  try {
    const auto j = nlohmann::json::parse(res->body);
    auto num = [&](const char* k) -> std::optional<double> {
      auto it = j.find(k);
      if (it == j.end() || !it->is_number()) return std::nullopt;
      return it->get<double>();
    };
    s.kv_usage = num("kv_cache_usage");
    s.kv_fragmentation = num("kv_fragmentation");
    s.prefix_hit_rate = num("prefix_cache_hit_rate");
    if (auto p = num("preemptions_total")) s.preemptions = int64_t(*p);
  } catch (const std::exception&) {
    metrics_missing_ = true;
  }
  return s;
}

}  // namespace ds
