#include "server/server.h"

#include <algorithm>
#include <chrono>
#include <random>
#include <thread>

#include "core/error.h"
#include "core/log.h"

namespace ds {
namespace {

using Json = nlohmann::ordered_json;

void send_json(HttpExchange& ex, int status, const Json& j, const HttpHeaders& extra = {}) {
  ex.reply(status, "application/json", dump_json(j), extra);
}

void send_error(HttpExchange& ex, const ApiError& e) {
  // A full queue or a draining server: the client may come back.
  const HttpHeaders retry = {{"Retry-After", "1"}};
  send_json(ex, e.status, error_body(e), e.status == 503 ? retry : HttpHeaders{});
}

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

bool starts_with(const std::string& s, const char* prefix) {
  return s.rfind(prefix, 0) == 0;
}

}  // namespace

ApiServer::ApiServer(Engine& engine, const LoadedModel& model, ServerConfig cfg)
    : engine_(engine),
      cfg_(std::move(cfg)),
      metrics_(cfg_.model_name),
      env_(engine, metrics_, limits_),
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
  env_.model_name = cfg_.model_name;
  next_id_ = std::random_device{}() & 0xffffffu;
  http_ = std::make_unique<HttpServer>(
      cfg_.http, [this](HttpRequest& req, const auto& ex) { handle(req, ex); },
      [](int status, const std::string& message) {
        return dump_json(error_body(ApiError(status, message)));
      });
}

ApiServer::~ApiServer() {
  http_->stop();
  // Engine events must not reach connections that are going away. (Outside the lock: a
  // listener may hold the last reference to its job, whose destructor takes the lock.)
  std::vector<std::shared_ptr<RequestHandle>> live;
  {
    std::lock_guard<std::mutex> lock(env_.mu);
    for (auto& [id, handle] : env_.live) live.push_back(handle);
  }
  for (auto& handle : live) handle->set_listener(nullptr);
  // (http_ is destroyed first among the members, closing what is still open.)
}

int ApiServer::bind() {
  return http_->bind(cfg_.host, cfg_.port);
}

bool ApiServer::run() {
  http_->run(std::max(cfg_.io_threads, 1));
  return true;
}

bool ApiServer::quiet(double timeout_s) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(env_.mu);
      if (env_.in_flight == 0 && http_->busy() == 0) return true;
    }
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

void ApiServer::shutdown(double timeout_s) {
  draining_ = true;
  http_->stop_accepting();  // no new connections; open ones close after their current request
  if (!quiet(timeout_s)) {
    {
      std::lock_guard<std::mutex> lock(env_.mu);
      log_warn("shutdown: cancelling " + std::to_string(env_.live.size()) + " unfinished requests");
      for (const auto& [id, handle] : env_.live) engine_.cancel(id);
    }
    quiet(5);
  }
  http_->stop();
}

void ApiServer::handle(HttpRequest& req, const std::shared_ptr<HttpExchange>& ex) {
  try {
    route(req, ex);
  } catch (const ApiError& e) {
    send_error(*ex, e);
  } catch (const std::exception& e) {
    log_warn(std::string("internal error: ") + e.what());
    send_error(*ex, ApiError(500, std::string("internal error: ") + e.what()));
  }
}

void ApiServer::route(HttpRequest& req, const std::shared_ptr<HttpExchange>& ex) {
  const std::string& path = req.path;
  if (!cfg_.api_key.empty() && (starts_with(path, "/v1/") || starts_with(path, "/api/")) &&
      req.header("authorization") != "Bearer " + cfg_.api_key)
    throw ApiError(401, "missing or wrong API key", "", "invalid_api_key");

  auto model_card = [this] {
    return Json{{"id", cfg_.model_name},
                {"object", "model"},
                {"created", created_},
                {"owned_by", "deepserve"},
                {"max_model_len", limits_.context}};
  };
  if (req.method == "POST" && (path == "/v1/completions" || path == "/v1/chat/completions"))
    return completions(path == "/v1/chat/completions", req, ex);
  if (req.method == "GET" && path == "/v1/models")
    return send_json(*ex, 200, {{"object", "list"}, {"data", Json::array({model_card()})}});
  // Ids may hold slashes ("org/name"); the path is matched decoded.
  if (req.method == "GET" && starts_with(path, "/v1/models/") && path.size() > 11) {
    const std::string id = path.substr(11);
    if (id != cfg_.model_name)
      throw ApiError(404, "the model '" + id + "' does not exist", "model", "model_not_found");
    return send_json(*ex, 200, model_card());
  }
  if (req.method == "GET" && path == "/health") return send_json(*ex, 200, {{"status", "ok"}});
  if (req.method == "GET" && path == "/ready") {
    if (draining_) throw ApiError(503, "the server is shutting down");
    return send_json(*ex, 200, {{"status", "ready"}});
  }
  if (req.method == "GET" && path == "/metrics") {
    metrics_.set_open_connections(http_->open_connections());
    return ex->reply(200, "text/plain; version=0.0.4", metrics_.prometheus(engine_.stats()));
  }
  if (req.method == "GET" && path == "/api/v1/metrics") {
    if (auto it = req.query.find("model"); it != req.query.end() && it->second != cfg_.model_name)
      throw ApiError(404, "the model '" + it->second + "' does not exist", "model",
                     "model_not_found");
    metrics_.set_open_connections(http_->open_connections());
    return send_json(*ex, 200, metrics_.json(engine_.stats()));
  }
  throw ApiError(404, "no route for " + req.method + " " + path);
}

void ApiServer::completions(bool chat, const HttpRequest& req,
                            const std::shared_ptr<HttpExchange>& ex) {
  if (draining_) throw ApiError(503, "the server is shutting down");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(req.body);
  } catch (const nlohmann::json::parse_error& e) {
    throw ApiError(400, std::string("the body is not valid JSON: ") + e.what(), "", "invalid_json");
  }
  ApiRequest api = parse_api_request(j, chat, limits_);
  const int waiting = env_.waiting.load();
  if (waiting > 0 && waiting + int(api.engine.size()) > cfg_.max_waiting_requests)
    throw ApiError(503,
                   "too many requests waiting (" + std::to_string(waiting) + "); try again later",
                   "", "queue_full");
  std::string id = (chat ? "chatcmpl-" : "cmpl-") + std::to_string(next_id_++);
  auto job = std::make_shared<Job>(env_, std::move(api), std::move(id), unix_now(), ex);
  job->start();
}

}  // namespace ds
