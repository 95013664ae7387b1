#include "server/server.h"

#include <httplib.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <span>
#include <string_view>

#include "core/error.h"
#include "core/log.h"

namespace ds {
namespace {

// Insertion-ordered, so maps such as completions' top_logprobs keep their descending order.
using Json = nlohmann::ordered_json;

std::string dump(const Json& j) {
  return j.dump(-1, ' ', false, Json::error_handler_t::replace);
}

void send_json(httplib::Response& res, int status, const Json& j) {
  res.status = status;
  res.set_content(dump(j), "application/json");
}

void send_error(httplib::Response& res, const ApiError& e) {
  send_json(res, e.status, error_body(e));
}

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

bool starts_with(const std::string& s, const char* prefix) {
  return s.rfind(prefix, 0) == 0;
}

double mono_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Non-streaming requests that finish within this are answered directly, with a Content-Length
// and the status their outcome calls for; longer ones go out as a chunked body.
constexpr double kDirectWaitS = 0.5;
// How often a response checks that its client is still connected while it waits.
constexpr double kPollS = 0.2;
// With several choices open, how long to wait on one before looking at the others again.
constexpr double kSliceS = 0.02;

// One generated token's log-probabilities, kept until the text it stands for is returned.
struct TokenLp {
  int32_t id = -1;
  float logprob = 0;
  std::vector<std::pair<int32_t, float>> top;
  size_t begin = 0, end = 0;  // its byte range in the choice's text
};

std::string token_text(const Tokenizer* tok, int32_t id) {
  return tok ? tok->token_bytes(id) : std::string();
}

Json byte_values(const std::string& s) {
  Json out = Json::array();
  for (unsigned char c : s) out.push_back(int(c));
  return out;
}

// OpenAI's chat shape: {content: [{token, logprob, bytes, top_logprobs: [...]}]}.
Json chat_logprobs(const Tokenizer* tok, std::span<const TokenLp> lps) {
  Json content = Json::array();
  for (const auto& t : lps) {
    Json top = Json::array();
    for (const auto& [id, lp] : t.top) {
      const std::string s = token_text(tok, id);
      top.push_back({{"token", s}, {"logprob", lp}, {"bytes", byte_values(s)}});
    }
    const std::string s = token_text(tok, t.id);
    content.push_back(
        {{"token", s}, {"logprob", t.logprob}, {"bytes", byte_values(s)}, {"top_logprobs", top}});
  }
  return {{"content", content}};
}

// The legacy completions shape: parallel lists, alternatives as {token: logprob} maps; text
// offsets count from `base` (the echoed prompt's length).
Json completion_logprobs(const Tokenizer* tok, std::span<const TokenLp> lps, size_t base = 0) {
  Json tokens = Json::array(), token_lps = Json::array(), tops = Json::array(),
       offsets = Json::array();
  for (const auto& t : lps) {
    tokens.push_back(token_text(tok, t.id));
    token_lps.push_back(t.logprob);
    Json top = Json::object();
    for (const auto& [id, lp] : t.top) top[token_text(tok, id)] = lp;
    tops.push_back(top);
    offsets.push_back(base + t.begin);
  }
  return {{"tokens", tokens},
          {"token_logprobs", token_lps},
          {"top_logprobs", tops},
          {"text_offset", offsets}};
}

// Echo: the prompt's tokens in the completions shape, without log-probabilities (null).
Json echo_logprobs(const Tokenizer* tok, std::span<const int32_t> prompt) {
  Json j = {{"tokens", Json::array()},
            {"token_logprobs", Json::array()},
            {"top_logprobs", Json::array()},
            {"text_offset", Json::array()}};
  size_t at = 0;
  for (int32_t id : prompt) {
    const std::string s = token_text(tok, id);
    j["tokens"].push_back(s);
    j["token_logprobs"].push_back(nullptr);
    j["top_logprobs"].push_back(nullptr);
    j["text_offset"].push_back(at);
    at += s.size();
  }
  return j;
}

}  // namespace

// One API request: its engine requests and what has been read from them. Destroying it
// cancels whatever is unfinished (a client that went away) and waits for the engine to let go.
struct ApiServer::Job {
  struct Sub {
    std::shared_ptr<RequestHandle> handle;
    Priority priority = Priority::Standard;
    double last_token_s = -1;  // engine time of the previous token
    bool finished = false;
    std::string text;
    EngineEvent fin;
    std::vector<TokenLp> lps;  // requests with logprobs: one per generated token
    size_t lps_sent = 0;       // streamed so far
  };

  ApiServer* srv = nullptr;
  ApiRequest req;
  std::vector<Sub> subs;
  std::string id;
  int64_t created = 0;
  size_t cursor = 0;  // next_any's round-robin position

  ~Job() {
    abandon();
    srv->job_done();
  }

  // The next event of choice `i` (nullopt after its final one, or when `timeout_s` >= 0 passed
  // without one), with metrics recorded.
  std::optional<EngineEvent> next(size_t i, double timeout_s = -1) {
    Sub& s = subs[i];
    if (s.finished) return std::nullopt;
    auto ev = timeout_s < 0 ? s.handle->next() : s.handle->next_for(timeout_s);
    if (!ev) return ev;
    if (ev->token >= 0) {
      // Gaps come from the engine's timestamps, not from when this reader got the event.
      srv->metrics_.token(s.priority, s.last_token_s >= 0 ? ev->time_s - s.last_token_s : -1.0);
      s.last_token_s = ev->time_s;
      if (req.logprobs >= 0) {
        const size_t begin = s.lps.empty() ? 0 : s.lps.back().end;
        const size_t len = token_text(srv->limits_.tokenizer, ev->token).size();
        s.lps.push_back({ev->token, ev->logprob, std::move(ev->top_logprobs), begin, begin + len});
      }
    }
    s.text += ev->text;
    if (ev->final) {
      s.finished = true;
      s.fin = *ev;
      srv->metrics_.request_finished({s.priority, ev->finish_reason, ev->usage.prompt_tokens,
                                      ev->usage.completion_tokens, ev->timings});
      std::lock_guard<std::mutex> lock(srv->mu_);
      srv->live_.erase(s.handle->id());
    }
    return ev;
  }

  // The logprobs of choice `i`'s tokens from `from` on whose text has been returned: tokens
  // whose text was cut (a stop string, an end-of-turn token) are left out, so the token
  // strings always join to the text.
  Json logprobs(size_t i, size_t from) const {
    const Sub& s = subs[i];
    size_t to = from;
    while (to < s.lps.size() && s.lps[to].end <= s.text.size()) ++to;
    const std::span<const TokenLp> part(s.lps.data() + from, to - from);
    return req.chat ? chat_logprobs(srv->limits_.tokenizer, part)
                    : completion_logprobs(srv->limits_.tokenizer, part, echo(i).size());
  }

  // Completions with echo: the prompt text choice `i` begins with ("" without echo).
  const std::string& echo(size_t i) const {
    static const std::string none;
    return req.echo ? req.echo_text[i / size_t(req.n)] : none;
  }
  // Echo with logprobs: the prompt's entries (null log-probabilities), then `generated`'s.
  Json echo_logprobs(size_t i, const Json& generated = nullptr) const {
    Json j = ds::echo_logprobs(srv->limits_.tokenizer, req.prompts[i / size_t(req.n)]);
    if (generated.is_object())
      for (const char* key : {"tokens", "token_logprobs", "top_logprobs", "text_offset"})
        for (const auto& x : generated[key]) j[key].push_back(x);
    return j;
  }

  // For a streamed chunk: the ready tokens not sent yet (null when logprobs are off).
  Json take_logprobs(size_t i) {
    if (req.logprobs < 0) return nullptr;
    Json j = logprobs(i, subs[i].lps_sent);
    subs[i].lps_sent += (req.chat ? j["content"] : j["tokens"]).size();
    return j;
  }

  bool all_finished() const {
    return std::all_of(subs.begin(), subs.end(), [](const Sub& s) { return s.finished; });
  }

  // The next event of any open choice, taking the choices in turn so that their events
  // interleave as the engine generates them; nullopt when `timeout_s` passes without one or
  // all are finished.
  std::optional<std::pair<size_t, EngineEvent>> next_any(double timeout_s) {
    const double until = mono_s() + timeout_s;
    for (;;) {
      size_t open = 0, wait_on = 0;
      for (size_t k = 0; k < subs.size(); ++k) {
        const size_t i = (cursor + k) % subs.size();
        if (subs[i].finished) continue;
        if (open++ == 0) wait_on = i;
        if (auto ev = next(i, 0)) {
          cursor = i + 1;
          return std::pair{i, std::move(*ev)};
        }
      }
      const double left = until - mono_s();
      if (open == 0 || left <= 0) return std::nullopt;
      // One choice open: wait on it; several: wait briefly on one, then look at all again.
      if (auto ev = next(wait_on, open == 1 ? left : std::min(left, kSliceS))) {
        cursor = wait_on + 1;
        return std::pair{wait_on, std::move(*ev)};
      }
    }
  }

  // Reads events until every choice has finished or `timeout_s` passed; true if all finished.
  bool collect(double timeout_s) {
    const double until = mono_s() + timeout_s;
    while (!all_finished()) {
      const double left = until - mono_s();
      if (left <= 0) return false;
      next_any(left);
    }
    return true;
  }

  // The non-streaming answer once all choices have finished: {status, body}.
  std::pair<int, Json> response() const {
    Json choices = Json::array();
    for (size_t i = 0; i < subs.size(); ++i) {
      const auto& s = subs[i];
      if (s.fin.finish_reason == "rejected") {
        const ApiError e(400, s.fin.error, "", "rejected");
        return {e.status, error_body(e)};
      }
      Json lp = req.logprobs >= 0 ? logprobs(i, 0) : Json();
      if (req.echo && req.logprobs >= 0) lp = echo_logprobs(i, lp);
      Json c = {{"index", i}, {"logprobs", lp}, {"finish_reason", s.fin.finish_reason}};
      if (req.chat)
        c["message"] = {{"role", "assistant"}, {"content", s.text}};
      else
        c["text"] = echo(i) + s.text;
      choices.push_back(c);
    }
    return {200,
            {{"id", id},
             {"object", req.chat ? "chat.completion" : "text_completion"},
             {"created", created},
             {"model", srv->cfg_.model_name},
             {"choices", choices},
             {"usage", usage()}}};
  }

  void finish_all() {
    for (size_t i = 0; i < subs.size(); ++i)
      while (next(i)) {
      }
  }

  void abandon() {
    for (auto& s : subs)
      if (!s.finished) srv->engine_.cancel(s.handle->id());
    finish_all();
  }

  Json usage() const {
    int prompt = 0, completion = 0;
    for (size_t i = 0; i < subs.size(); ++i) {
      if (i % size_t(req.n) == 0) prompt += subs[i].fin.usage.prompt_tokens;
      completion += subs[i].fin.usage.completion_tokens;
    }
    return {{"prompt_tokens", prompt},
            {"completion_tokens", completion},
            {"total_tokens", prompt + completion}};
  }

  // A streamed chunk for choice `i`: a text delta and/or the finish reason.
  Json chunk(size_t i, const std::string* text, const std::string* finish, bool role,
             Json lp = nullptr) const {
    Json choice = {{"index", i}, {"logprobs", std::move(lp)}};
    choice["finish_reason"] = finish ? Json(*finish) : Json();
    if (req.chat) {
      Json delta = Json::object();
      if (role) delta["role"] = "assistant";
      if (text) delta["content"] = *text;
      choice["delta"] = delta;
    } else {
      choice["text"] = text ? *text : "";
    }
    Json j = {{"id", id},
              {"object", req.chat ? "chat.completion.chunk" : "text_completion"},
              {"created", created},
              {"model", srv->cfg_.model_name},
              {"choices", Json::array({choice})}};
    if (req.include_usage) j["usage"] = nullptr;
    return j;
  }
};

ApiServer::ApiServer(Engine& engine, const LoadedModel& model, ServerConfig cfg)
    : engine_(engine),
      cfg_(std::move(cfg)),
      metrics_(cfg_.model_name),
      http_(std::make_unique<httplib::Server>()),
      created_(unix_now()) {
  limits_.tokenizer = model.tokenizer.get();
  if (limits_.tokenizer) {
    chat_ = ChatTemplate::detect(model.chat_template, model.config.arch);
    limits_.chat = &*chat_;
    limits_.chat_stops = chat_->stop_strings();
  }
  limits_.vocab = int32_t(model.config.vocab);
  limits_.context = std::min<int64_t>(model.config.max_context, engine.kv_capacity_tokens());
  limits_.model_name = cfg_.model_name;
  next_id_ = std::random_device{}() & 0xffffffu;
  routes();
}

ApiServer::~ApiServer() = default;

int ApiServer::bind() {
  if (cfg_.port == 0) {
    const int port = http_->bind_to_any_port(cfg_.host);
    if (port < 0) throw Error("cannot listen on " + cfg_.host);
    return port;
  }
  if (!http_->bind_to_port(cfg_.host, cfg_.port))
    throw Error("cannot listen on " + cfg_.host + ":" + std::to_string(cfg_.port));
  return cfg_.port;
}

bool ApiServer::run() {
  return http_->listen_after_bind();
}

void ApiServer::shutdown(double timeout_s) {
  draining_ = true;
  http_->stop();  // no new connections; open ones close after their current request
  std::unique_lock<std::mutex> lock(mu_);
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  if (!cv_.wait_until(lock, until, [&] { return in_flight_ == 0; })) {
    log_warn("shutdown: cancelling " + std::to_string(live_.size()) + " unfinished requests");
    for (SeqId id : live_) engine_.cancel(id);
    cv_.wait_for(lock, std::chrono::seconds(5), [&] { return in_flight_ == 0; });
  }
}

void ApiServer::job_done() {
  std::lock_guard<std::mutex> lock(mu_);
  --in_flight_;
  cv_.notify_all();
}

std::shared_ptr<ApiServer::Job> ApiServer::start_job(ApiRequest req) {
  auto job = std::make_shared<Job>();
  job->srv = this;
  job->id = (req.chat ? "chatcmpl-" : "cmpl-") + std::to_string(next_id_++);
  job->created = unix_now();
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++in_flight_;
  }
  for (auto& er : req.engine) {
    Job::Sub s;
    s.priority = er.priority;
    s.handle = engine_.submit(std::move(er));
    {
      std::lock_guard<std::mutex> lock(mu_);
      live_.insert(s.handle->id());
    }
    job->subs.push_back(std::move(s));
  }
  req.engine.clear();
  job->req = std::move(req);
  return job;
}

void ApiServer::completions(bool chat, const std::string& body, void* res_ptr) {
  auto& res = *static_cast<httplib::Response*>(res_ptr);
  if (draining_) throw ApiError(503, "the server is shutting down");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(body);
  } catch (const nlohmann::json::parse_error& e) {
    throw ApiError(400, std::string("the body is not valid JSON: ") + e.what(), "", "invalid_json");
  }
  std::shared_ptr<Job> job = start_job(parse_api_request(j, chat, limits_));

  if (!job->req.stream) {
    if (job->collect(kDirectWaitS)) {
      const auto [status, out] = job->response();
      send_json(res, status, out);
      return;
    }
    // httplib says that a client hung up only to a content provider (sink.is_writable), so a
    // longer request waits inside one; returning false there drops the job, which cancels it.
    // The status line goes out first: a late failure can only be reported in the body.
    res.set_chunked_content_provider("application/json", [job](size_t, httplib::DataSink& sink) {
      double next_check = 0;
      while (!job->all_finished()) {
        job->next_any(kPollS);
        if (mono_s() < next_check) continue;
        if (!sink.is_writable()) return false;
        next_check = mono_s() + kPollS;
      }
      const std::string body = dump(job->response().second);
      if (!sink.write(body.data(), body.size())) return false;
      sink.done();
      return true;
    });
    return;
  }

  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider("text/event-stream", [job](size_t, httplib::DataSink& sink) {
    auto send = [&](const Json& ev) {
      const std::string s = "data: " + dump(ev) + "\n\n";
      return sink.write(s.data(), s.size());
    };
    if (job->req.chat)
      for (size_t i = 0; i < job->subs.size(); ++i)
        if (!send(job->chunk(i, nullptr, nullptr, true))) return false;
    if (job->req.echo)  // the prompt first
      for (size_t i = 0; i < job->subs.size(); ++i)
        if (!send(job->chunk(i, &job->echo(i), nullptr, false,
                             job->req.logprobs >= 0 ? job->echo_logprobs(i) : Json())))
          return false;
    while (!job->all_finished()) {
      auto got = job->next_any(kPollS);
      if (!got) {
        // Nothing new (queued, or a long prefill): a write would notice a hang-up, so look.
        if (!sink.is_writable()) return false;
        continue;
      }
      auto& [i, ev] = *got;
      bool ok = true;
      if (ev.final && ev.finish_reason == "rejected") {
        ok = send(error_body(ApiError(400, ev.error, "", "rejected")));
      } else if (ev.final) {
        ok = send(job->chunk(i, ev.text.empty() ? nullptr : &ev.text, &ev.finish_reason, false,
                             job->take_logprobs(i)));
      } else if (!ev.text.empty()) {
        ok = send(job->chunk(i, &ev.text, nullptr, false, job->take_logprobs(i)));
      }
      if (!ok) return false;  // the client is gone: ~Job cancels the rest
    }
    if (job->req.include_usage) {
      Json u = {{"id", job->id},
                {"object", job->req.chat ? "chat.completion.chunk" : "text_completion"},
                {"created", job->created},
                {"model", job->srv->cfg_.model_name},
                {"choices", Json::array()},
                {"usage", job->usage()}};
      if (!send(u)) return false;
    }
    constexpr std::string_view done = "data: [DONE]\n\n";
    if (!sink.write(done.data(), done.size())) return false;
    sink.done();
    return true;
  });
}

void ApiServer::routes() {
  auto& h = *http_;
  h.new_task_queue = [n = cfg_.http_threads] { return new httplib::ThreadPool(size_t(n)); };
  h.set_payload_max_length(cfg_.max_body_bytes);
  h.set_keep_alive_timeout(5);
  h.set_read_timeout(30);
  h.set_write_timeout(30);

  h.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (cfg_.api_key.empty() || !(starts_with(req.path, "/v1/") || starts_with(req.path, "/api/")))
      return httplib::Server::HandlerResponse::Unhandled;
    if (req.get_header_value("Authorization") == "Bearer " + cfg_.api_key)
      return httplib::Server::HandlerResponse::Unhandled;
    send_error(res, ApiError(401, "missing or wrong API key", "", "invalid_api_key"));
    return httplib::Server::HandlerResponse::Handled;
  });
  // httplib's own failures (unknown route, body over the limit, unreadable request) get
  // OpenAI-style bodies too.
  h.set_error_handler(
      httplib::Server::HandlerWithResponse([](const httplib::Request& req, httplib::Response& res) {
        if (!res.body.empty() || res.content_provider_)
          return httplib::Server::HandlerResponse::Unhandled;
        std::string msg = "request failed";
        if (res.status == 404) msg = "no route for " + req.method + " " + req.path;
        if (res.status == 413) msg = "the request body is larger than the server accepts";
        if (res.status == 400) msg = "malformed HTTP request";
        send_error(res, ApiError(res.status, msg));
        return httplib::Server::HandlerResponse::Handled;
      }));
  h.set_exception_handler(
      [](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
        try {
          std::rethrow_exception(ep);
        } catch (const ApiError& e) {
          send_error(res, e);
        } catch (const std::exception& e) {
          log_warn(std::string("internal error: ") + e.what());
          send_error(res, ApiError(500, std::string("internal error: ") + e.what()));
        } catch (...) {
          send_error(res, ApiError(500, "internal error"));
        }
      });

  h.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
    completions(false, req.body, &res);
  });
  h.Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) {
    completions(true, req.body, &res);
  });
  auto model_card = [this] {
    return Json{{"id", cfg_.model_name},
                {"object", "model"},
                {"created", created_},
                {"owned_by", "deepserve"},
                {"max_model_len", limits_.context}};
  };
  h.Get("/v1/models", [model_card](const httplib::Request&, httplib::Response& res) {
    send_json(res, 200, {{"object", "list"}, {"data", Json::array({model_card()})}});
  });
  // Ids may hold slashes ("org/name"); httplib matches the decoded path.
  h.Get(R"(/v1/models/(.+))", [this, model_card](const httplib::Request& req,
                                                 httplib::Response& res) {
    const std::string id = req.matches[1];
    if (id != cfg_.model_name)
      throw ApiError(404, "the model '" + id + "' does not exist", "model", "model_not_found");
    send_json(res, 200, model_card());
  });
  h.Get("/health", [](const httplib::Request&, httplib::Response& res) {
    send_json(res, 200, {{"status", "ok"}});
  });
  h.Get("/ready", [this](const httplib::Request&, httplib::Response& res) {
    if (draining_)
      send_error(res, ApiError(503, "the server is shutting down"));
    else
      send_json(res, 200, {{"status", "ready"}});
  });
  h.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics_.prometheus(engine_.stats()), "text/plain; version=0.0.4");
  });
  h.Get("/api/v1/metrics", [this](const httplib::Request& req, httplib::Response& res) {
    if (req.has_param("model") && req.get_param_value("model") != cfg_.model_name)
      throw ApiError(404, "the model '" + req.get_param_value("model") + "' does not exist",
                     "model", "model_not_found");
    send_json(res, 200, metrics_.json(engine_.stats()));
  });
}

}  // namespace ds
