#include "server/job.h"

#include <algorithm>
#include <span>

namespace ds {
namespace {

// Insertion-ordered, so maps such as completions' top_logprobs keep their descending order.
using Json = nlohmann::ordered_json;

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

// How a choice's final event reaches the client when it is a failure (nullopt otherwise):
// "rejected" (the prompt can never fit the KV cache) is the client's, "error" the server's.
std::optional<ApiError> failure(const EngineEvent& fin) {
  if (fin.finish_reason == "rejected") return ApiError(400, fin.error, "", "rejected");
  if (fin.finish_reason == "error")
    return ApiError(500, fin.error.empty() ? "internal error" : fin.error, "", "internal_error");
  return std::nullopt;
}

}  // namespace

struct Job::Sub {
  std::shared_ptr<RequestHandle> handle;
  Priority priority = Priority::Standard;
  double last_token_s = -1;  // engine time of the previous token
  bool any_event = false;    // counted out of JobEnv::waiting
  bool finished = false;
  std::string text;
  std::vector<int32_t> ids;  // generated ids (requests that return them)
  EngineEvent fin;
  std::vector<TokenLp> lps;  // requests with logprobs: one per generated token
  size_t lps_sent = 0;       // streamed so far
};

Job::Job(JobEnv& env, ApiRequest req, std::string id, int64_t created,
         std::shared_ptr<HttpExchange> ex)
    : env_(env), req_(std::move(req)), id_(std::move(id)), created_(created), ex_(std::move(ex)) {
  std::lock_guard<std::mutex> lock(env_.mu);
  ++env_.in_flight;
}

Job::~Job() {
  // Only when the server is torn down with requests unfinished; normally all have finished.
  for (auto& s : subs_) {
    if (!s.any_event) --env_.waiting;
    if (s.handle && !s.finished) env_.engine.cancel(s.handle->id());
  }
  std::lock_guard<std::mutex> lock(env_.mu);
  --env_.in_flight;
  env_.cv.notify_all();
}

void Job::start() {
  std::weak_ptr<Job> weak = weak_from_this();
  ex_->on_hangup([weak] {
    if (auto job = weak.lock()) job->abandon();
  });
  if (req_.stream) {
    ex_->begin_stream(200, "text/event-stream", {{"Cache-Control", "no-cache"}});
    if (req_.chat)
      for (size_t i = 0; i < req_.engine.size(); ++i)
        send(chunk(i, nullptr, nullptr, true, nullptr, nullptr));
    if (req_.echo)  // the prompt first
      for (size_t i = 0; i < req_.engine.size(); ++i)
        send(chunk(i, &echo(i), nullptr, false,
                   req_.logprobs >= 0 ? prompt_logprobs(i, nullptr) : Json(), nullptr));
  }
  subs_.resize(req_.engine.size());
  env_.waiting += int(subs_.size());
  for (size_t i = 0; i < subs_.size(); ++i) {
    Sub& s = subs_[i];
    s.priority = req_.engine[i].priority;
    s.handle = env_.engine.submit(std::move(req_.engine[i]));
    {
      std::lock_guard<std::mutex> lock(env_.mu);
      env_.live[s.handle->id()] = s.handle;
    }
    // The handle holds the job until its final event is read (pump clears it then).
    s.handle->set_listener([self = shared_from_this()] { self->notify(); });
  }
  req_.engine.clear();
}

void Job::notify() {
  if (pump_posted_.exchange(true)) return;
  ex_->post([self = shared_from_this()] { self->pump(); });
}

void Job::pump() {
  pump_posted_ = false;
  // One event per open choice per pass, so that choices interleave as they were generated.
  for (bool progressed = true; progressed;) {
    progressed = false;
    for (size_t k = 0; k < subs_.size(); ++k) {
      const size_t i = (cursor_ + k) % subs_.size();
      if (subs_[i].finished) continue;
      auto ev = subs_[i].handle->try_next();
      if (!ev) continue;
      record(i, *ev);
      if (req_.stream) emit(i, *ev);
      progressed = true;
    }
    cursor_ = (cursor_ + 1) % std::max<size_t>(subs_.size(), 1);
  }
  if (all_finished() && !done_) finish();
}

void Job::record(size_t i, EngineEvent& ev) {
  Sub& s = subs_[i];
  if (!s.any_event) {
    s.any_event = true;
    --env_.waiting;
  }
  if (ev.token >= 0) {
    // Gaps come from the engine's timestamps, not from when this reader got the event.
    env_.metrics.token(s.priority, s.last_token_s >= 0 ? ev.time_s - s.last_token_s : -1.0);
    s.last_token_s = ev.time_s;
    if (req_.return_token_ids) s.ids.push_back(ev.token);
    if (req_.logprobs >= 0) {
      const size_t begin = s.lps.empty() ? 0 : s.lps.back().end;
      const size_t len = token_text(env_.limits.tokenizer, ev.token).size();
      s.lps.push_back({ev.token, ev.logprob, std::move(ev.top_logprobs), begin, begin + len});
    }
  }
  s.text += ev.text;
  if (!ev.final) return;
  s.finished = true;
  s.fin = ev;
  env_.metrics.request_finished({s.priority, ev.finish_reason, ev.usage.prompt_tokens,
                                 ev.usage.completion_tokens, ev.timings});
  {
    std::lock_guard<std::mutex> lock(env_.mu);
    env_.live.erase(s.handle->id());
  }
  s.handle->set_listener(nullptr);  // the pump's caller still holds this job
}

// Streaming: one SSE event per engine step of each choice (per token when ids are returned,
// else when it adds text), the final one with the finish reason.
void Job::emit(size_t i, const EngineEvent& ev) {
  if (ev.final) {
    if (auto err = failure(ev)) return send(error_body(*err));
    const std::vector<int32_t> none;
    send(chunk(i, ev.text.empty() ? nullptr : &ev.text, &ev.finish_reason, false, take_logprobs(i),
               req_.return_token_ids ? &none : nullptr));
    return;
  }
  if (ev.text.empty() && !req_.return_token_ids) return;
  const std::vector<int32_t> ids = {ev.token};
  send(
      chunk(i, &ev.text, nullptr, false, take_logprobs(i), req_.return_token_ids ? &ids : nullptr));
}

void Job::finish() {
  done_ = true;
  if (!req_.stream) return reply_whole();
  if (req_.include_usage)
    send({{"id", id_},
          {"object", req_.chat ? "chat.completion.chunk" : "text_completion"},
          {"created", created_},
          {"model", env_.model_name},
          {"choices", Json::array()},
          {"usage", usage()}});
  ex_->write("data: [DONE]\n\n");
  ex_->end_stream();
}

void Job::abandon() {
  gone_ = true;
  for (auto& s : subs_)
    if (!s.finished) env_.engine.cancel(s.handle->id());
}

bool Job::all_finished() const {
  return std::all_of(subs_.begin(), subs_.end(), [](const Sub& s) { return s.finished; });
}

void Job::send(const Json& j) {
  if (!gone_) ex_->write("data: " + dump_json(j) + "\n\n");
}

// The logprobs of choice `i`'s tokens from `from` on whose text has been returned: tokens whose
// text was cut (a stop string, an end-of-turn token) are left out, so the token strings always
// join to the text.
Json Job::logprobs(size_t i, size_t from) const {
  const Sub& s = subs_[i];
  size_t to = from;
  while (to < s.lps.size() && s.lps[to].end <= s.text.size()) ++to;
  const std::span<const TokenLp> part(s.lps.data() + from, to - from);
  return req_.chat ? chat_logprobs(env_.limits.tokenizer, part)
                   : completion_logprobs(env_.limits.tokenizer, part, echo(i).size());
}

// Completions with echo: the prompt text choice `i` begins with ("" without echo).
const std::string& Job::echo(size_t i) const {
  static const std::string none;
  return req_.echo ? req_.echo_text[i / size_t(req_.n)] : none;
}

// Echo with logprobs: the prompt's entries (null log-probabilities), then `generated`'s.
Json Job::prompt_logprobs(size_t i, const Json& generated) const {
  Json j = echo_logprobs(env_.limits.tokenizer, req_.prompts[i / size_t(req_.n)]);
  if (generated.is_object())
    for (const char* key : {"tokens", "token_logprobs", "top_logprobs", "text_offset"})
      for (const auto& x : generated[key]) j[key].push_back(x);
  return j;
}

// For a streamed chunk: the ready tokens not sent yet (null when logprobs are off).
Json Job::take_logprobs(size_t i) {
  if (req_.logprobs < 0) return nullptr;
  Json j = logprobs(i, subs_[i].lps_sent);
  subs_[i].lps_sent += (req_.chat ? j["content"] : j["tokens"]).size();
  return j;
}

Json Job::usage() const {
  int prompt = 0, completion = 0;
  for (size_t i = 0; i < subs_.size(); ++i) {
    if (i % size_t(req_.n) == 0) prompt += subs_[i].fin.usage.prompt_tokens;
    completion += subs_[i].fin.usage.completion_tokens;
  }
  return {{"prompt_tokens", prompt},
          {"completion_tokens", completion},
          {"total_tokens", prompt + completion}};
}

// A streamed chunk for choice `i`: a text delta and/or the finish reason, and the step's token
// ids when the request returns them.
Json Job::chunk(size_t i, const std::string* text, const std::string* finish, bool role, Json lp,
                const std::vector<int32_t>* ids) const {
  Json choice = {{"index", i}, {"logprobs", std::move(lp)}};
  choice["finish_reason"] = finish ? Json(*finish) : Json();
  if (req_.chat) {
    Json delta = Json::object();
    if (role) delta["role"] = "assistant";
    if (text) delta["content"] = *text;
    choice["delta"] = delta;
  } else {
    choice["text"] = text ? *text : "";
  }
  if (ids) choice["token_ids"] = *ids;
  Json j = {{"id", id_},
            {"object", req_.chat ? "chat.completion.chunk" : "text_completion"},
            {"created", created_},
            {"model", env_.model_name},
            {"choices", Json::array({choice})}};
  if (req_.include_usage) j["usage"] = nullptr;
  return j;
}

// The non-streaming answer once all choices have finished.
void Job::reply_whole() {
  if (gone_) return;
  Json choices = Json::array();
  for (size_t i = 0; i < subs_.size(); ++i) {
    const auto& s = subs_[i];
    if (auto err = failure(s.fin))
      return ex_->reply(err->status, "application/json", dump_json(error_body(*err)));
    Json lp = req_.logprobs >= 0 ? logprobs(i, 0) : Json();
    if (req_.echo && req_.logprobs >= 0) lp = prompt_logprobs(i, lp);
    Json c = {{"index", i}, {"logprobs", lp}, {"finish_reason", s.fin.finish_reason}};
    if (req_.chat)
      c["message"] = {{"role", "assistant"}, {"content", s.text}};
    else
      c["text"] = echo(i) + s.text;
    if (req_.return_token_ids) c["token_ids"] = s.ids;
    choices.push_back(c);
  }
  ex_->reply(200, "application/json",
             dump_json({{"id", id_},
                        {"object", req_.chat ? "chat.completion" : "text_completion"},
                        {"created", created_},
                        {"model", env_.model_name},
                        {"choices", choices},
                        {"usage", usage()}}));
}

}  // namespace ds
