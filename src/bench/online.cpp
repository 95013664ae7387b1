#include "bench/online.h"

#include <nlohmann/json.hpp>

#include "bench/http_client.h"
#include "bench/sse.h"
#include "core/error.h"

namespace ds {
namespace {

HttpCall make_call(const ParsedUrl& u, const OnlineTargetConfig& c, std::string target) {
  HttpCall call;
  call.origin = u.origin;
  call.target = u.prefix + target;
  call.read_timeout_s = c.request_timeout_s;
  if (!c.api_key.empty()) call.headers.push_back({"Authorization", "Bearer " + c.api_key});
  return call;
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
  const HttpReply res = http_call(make_call(url_, cfg_, "/v1/models"));
  if (!res.error.empty()) throw Error(res.error);
  if (res.status != 200)
    throw Error(cfg_.url + "/v1/models: HTTP " + std::to_string(res.status) + ": " + res.body);
  try {
    const auto j = nlohmann::json::parse(res.body);
    cfg_.model_name = j.at("data").at(0).at("id").get<std::string>();
  } catch (const std::exception& e) {
    throw Error(cfg_.url + "/v1/models: no model id in the answer: " + e.what());
  }
}

BenchResult OnlineTarget::run(const BenchRequest& req) {
  // return_token_ids: each chunk carries its tokens' ids (deepserve, vLLM), so tokens are
  // counted exactly and timed as they arrive, with or without a tokenizer on the server.
  nlohmann::json body = {{"model", cfg_.model_name},
                         {"max_tokens", req.max_tokens},
                         {"stream", true},
                         {"stream_options", {{"include_usage", true}}},
                         {"ignore_eos", req.ignore_eos},
                         {"temperature", req.temperature},
                         {"seed", req.seed},
                         {"return_token_ids", true}};
  if (req.prompt_text.empty())
    body["prompt"] = req.prompt_ids;
  else
    body["prompt"] = req.prompt_text;
  if (cfg_.count_logprobs) body["logprobs"] = 0;
  if (!req.priority.empty()) body["priority"] = req.priority;  // deepserve's extension field

  BenchResult r;
  r.prompt_tokens = int(req.prompt_ids.size());
  SseParser sse;
  bool done = false;
  HttpCall call = make_call(url_, cfg_, "/v1/completions");
  call.method = "POST";
  call.body = body.dump();
  call.headers.push_back({"Content-Type", "application/json"});
  call.headers.push_back({"Accept", "text/event-stream"});
  call.on_body = [&](std::string_view data) {
    const double t = steady_now_s();
    try {
      for (const std::string& ev : sse.feed(data)) {
        const CompletionChunk c = parse_completion_chunk(ev);
        if (c.done) {
          done = true;
          continue;
        }
        if (!c.error.empty()) {
          r.error = c.error;
          continue;
        }
        const int tokens = c.token_ids >= 0      ? c.token_ids
                           : cfg_.count_logprobs ? c.logprob_tokens
                                                 : (c.text.empty() ? 0 : 1);
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

  r.start_s = steady_now_s();
  const HttpReply res = http_call(call);
  r.end_s = steady_now_s();
  if (res.status != 200 && res.status != 0) {
    r.error = "HTTP " + std::to_string(res.status) + ": " + res.body.substr(0, 500);
  } else if (!res.error.empty()) {
    if (r.error.empty()) r.error = res.error;
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
  HttpCall call = make_call(url_, cfg_, "/api/v1/metrics?model=" + url_encode(cfg_.model_name));
  call.read_timeout_s = 5;
  const HttpReply res = http_call(call);
  if (res.status == 0) return s;  // busy or gone: try again at the next sample
  if (res.status == 404) {
    metrics_missing_ = true;  // not our server: no JSON metrics
    return s;
  }
  if (res.status != 200) return s;
  try {
    const auto j = nlohmann::json::parse(res.body);
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
