#include "server/http_transport.h"

#include <sys/resource.h>

#include <atomic>
#include <boost/asio/bind_executor.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http/error.hpp>
#include <boost/beast/http/read.hpp>
#include <boost/beast/http/string_body.hpp>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <optional>
#include <thread>

#include "core/error.h"
#include "core/log.h"

namespace ds {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;
using boost::system::error_code;

namespace {

constexpr size_t kWatchBytes = 64u << 10;   // pipelined input kept while a response runs
constexpr size_t kReadChunk = 16u << 10;    // bytes asked for by one read while not parsing
constexpr double kLingerS = 5;              // a closing connection drains its input this long
constexpr size_t kLingerBytes = 64u << 20;  // and at most this much

std::string status_line(int status) {
  const auto reason = http::obsolete_reason(http::int_to_status(unsigned(status)));
  return "HTTP/1.1 " + std::to_string(status) + " " + std::string(reason) + "\r\n";
}

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

std::string percent_decode(std::string_view s, bool plus_is_space) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    const int hi = s[i] == '%' && i + 2 < s.size() ? hex_digit(s[i + 1]) : -1;
    const int lo = hi >= 0 ? hex_digit(s[i + 2]) : -1;
    if (lo >= 0) {
      out += char(hi * 16 + lo);
      i += 2;
    } else {
      out += plus_is_space && s[i] == '+' ? ' ' : s[i];
    }
  }
  return out;
}

std::map<std::string, std::string> parse_query(std::string_view q) {
  std::map<std::string, std::string> out;
  while (!q.empty()) {
    const size_t amp = q.find('&');
    const std::string_view kv = q.substr(0, amp);
    const size_t eq = kv.find('=');
    if (!kv.empty())
      out[percent_decode(kv.substr(0, eq), true)] =
          eq == std::string_view::npos ? "" : percent_decode(kv.substr(eq + 1), true);
    if (amp == std::string_view::npos) break;
    q.remove_prefix(amp + 1);
  }
  return out;
}

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = char(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// Raises the open-file limit to its hard maximum: each connection is a descriptor.
int raise_fd_limit() {
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return 1024;
  if (rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
    getrlimit(RLIMIT_NOFILE, &rl);
  }
  return rl.rlim_cur == RLIM_INFINITY ? 1 << 20 : int(std::min<rlim_t>(rl.rlim_cur, 1 << 20));
}

}  // namespace

std::string HttpRequest::header(const std::string& lower_name) const {
  auto it = headers.find(lower_name);
  return it == headers.end() ? std::string() : it->second;
}

// Members that sessions touch while the io_context destroys them come before it.
struct HttpServer::Impl {
  HttpLimits limits;
  HttpHandler handler;
  HttpErrorBody error_body;
  std::atomic<int> open{0};
  std::atomic<int> busy{0};
  std::atomic<bool> closing{false};
  net::io_context ioc;
  std::mutex work_mu;  // stop() may come from any thread
  std::optional<net::executor_work_guard<net::io_context::executor_type>> work;  // until stop()
  tcp::acceptor acceptor{net::make_strand(ioc)};
  net::steady_timer retry{acceptor.get_executor()};

  void accept();
};

namespace {

// One connection. Every member is touched on the connection's strand only.
class Session final : public HttpExchange, public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, HttpServer::Impl* srv)
      : socket_(std::move(socket)), timer_(socket_.get_executor()), srv_(srv) {
    ++srv_->open;
  }
  ~Session() override {
    if (responding_) --srv_->busy;
    --srv_->open;
  }

  void start() {
    if (srv_->open > srv_->limits.max_connections)
      return fail(503, "too many open connections; try again later", {{"Retry-After", "1"}});
    read_header();
  }

  void reply(int status, const std::string& content_type, std::string body,
             const HttpHeaders& extra) override {
    if (phase_ != Phase::Responding || started_) return;
    started_ = ended_ = true;
    queue(head(status, content_type, extra) + "Content-Length: " + std::to_string(body.size()) +
          "\r\n\r\n");
    queue(std::move(body));
    flush();
  }

  void begin_stream(int status, const std::string& content_type,
                    const HttpHeaders& extra) override {
    if (phase_ != Phase::Responding || started_) return;
    started_ = true;
    queue(head(status, content_type, extra) + "Transfer-Encoding: chunked\r\n\r\n");
    flush();
  }

  void write(std::string data) override {
    if (phase_ != Phase::Responding || !started_ || ended_ || data.empty()) return;
    char size[32];
    std::snprintf(size, sizeof size, "%zx\r\n", data.size());
    queue(size);
    queue(std::move(data));
    queue("\r\n");
    flush();
  }

  void end_stream() override {
    if (phase_ != Phase::Responding || !started_ || ended_) return;
    ended_ = true;
    queue("0\r\n\r\n");
    flush();
  }

  void on_hangup(std::function<void()> fn) override {
    if (phase_ == Phase::Closed)
      net::post(socket_.get_executor(), std::move(fn));
    else
      hangup_ = std::move(fn);
  }

  void post(std::function<void()> fn) override { net::post(socket_.get_executor(), std::move(fn)); }

 private:
  enum class Phase { Reading, Responding, Closing, Closed };

  const HttpLimits& limits() const { return srv_->limits; }

  void arm(double seconds) {
    const uint64_t gen = ++timer_gen_;
    timer_.expires_after(std::chrono::duration_cast<std::chrono::steady_clock::duration>(
        std::chrono::duration<double>(seconds)));
    timer_.async_wait([self = shared_from_this(), gen](error_code ec) {
      if (!ec && gen == self->timer_gen_) self->close();  // too slow: drop it
    });
  }

  void disarm() {
    ++timer_gen_;
    timer_.cancel();
  }

  void read_header() {
    phase_ = Phase::Reading;
    parser_.emplace();
    parser_->header_limit(uint32_t(std::min<size_t>(limits().max_header_bytes, UINT32_MAX)));
    parser_->body_limit(limits().max_body_bytes);
    arm(first_ ? limits().header_timeout_s : limits().idle_timeout_s);
    http::async_read_header(
        socket_, buf_, *parser_,
        [self = shared_from_this()](error_code ec, size_t) { self->on_header(ec); });
  }

  void on_header(error_code ec) {
    if (phase_ != Phase::Reading) return;
    if (ec) return read_failed(ec);
    if (parser_->is_done()) return dispatch();
    if (lower(parser_->get()[http::field::expect]) == "100-continue") {
      queue("HTTP/1.1 100 Continue\r\n\r\n");
      flush();
    }
    arm(limits().body_timeout_s);
    http::async_read(socket_, buf_, *parser_, [self = shared_from_this()](error_code ec, size_t) {
      if (self->phase_ != Phase::Reading) return;
      if (ec) return self->read_failed(ec);
      self->dispatch();
    });
  }

  void read_failed(error_code ec) {
    disarm();
    if (ec == http::error::header_limit)
      return fail(431, "the request header is larger than the server accepts");
    if (ec == http::error::body_limit)
      return fail(413, "the request body is larger than the server accepts");
    if (ec.category() == http::make_error_code(http::error::bad_method).category() &&
        ec != http::error::end_of_stream && ec != http::error::partial_message)
      return fail(400, "malformed HTTP request");
    close();  // the client went away, or was too slow
  }

  void dispatch() {
    disarm();
    auto& m = parser_->get();
    HttpRequest req;
    req.method = std::string(m.method_string());
    const std::string_view target = m.target();
    const size_t q = target.find('?');
    req.path = percent_decode(target.substr(0, q), false);
    if (q != std::string_view::npos) req.query = parse_query(target.substr(q + 1));
    for (const auto& f : m) req.headers[lower(f.name_string())] = std::string(f.value());
    req.body = std::move(m.body());
    keep_alive_ = m.keep_alive();
    parser_.reset();
    phase_ = Phase::Responding;
    responding_ = true;
    ++srv_->busy;
    watch();
    try {
      srv_->handler(req, shared_from_this());
    } catch (const std::exception& e) {
      log_warn(std::string("http handler: ") + e.what());
      reply(500, "application/json", srv_->error_body(500, "internal error"), {});
    }
  }

  // While a response runs, a pending read notices a client that hangs up. Input that arrives
  // (a pipelined request) stays in buf_ for the next parse.
  void watch() {
    if (watching_ || phase_ != Phase::Responding || buf_.size() >= kWatchBytes) return;
    watching_ = true;
    socket_.async_read_some(buf_.prepare(kReadChunk),
                            [self = shared_from_this()](error_code ec, size_t n) {
                              self->watching_ = false;
                              self->buf_.commit(n);
                              self->after_watch(ec);
                            });
  }

  void after_watch(error_code ec) {
    switch (phase_) {
      case Phase::Responding:
        if (ec) return close();
        return watch();
      case Phase::Reading:  // the response ended: the next request
        return read_header();
      case Phase::Closing:
        return linger();
      case Phase::Closed:
        return;
    }
  }

  std::string head(int status, const std::string& content_type, const HttpHeaders& extra) {
    if (srv_->closing) keep_alive_ = false;
    std::string h = status_line(status) + "Content-Type: " + content_type + "\r\n";
    for (const auto& [k, v] : extra) h += k + ": " + v + "\r\n";
    h += keep_alive_ ? "Connection: keep-alive\r\n" : "Connection: close\r\n";
    return h;
  }

  void queue(std::string s) { out_.push_back(std::move(s)); }

  void flush() {
    if (writing_ || out_.empty() || phase_ == Phase::Closed) return;
    writing_ = true;
    inflight_.clear();
    std::swap(inflight_, out_);
    std::vector<net::const_buffer> bufs;
    bufs.reserve(inflight_.size());
    for (const auto& s : inflight_) bufs.push_back(net::buffer(s));
    if (phase_ != Phase::Reading) arm(limits().write_timeout_s);  // not for "100 Continue"
    net::async_write(socket_, bufs,
                     [self = shared_from_this()](error_code ec, size_t) { self->on_written(ec); });
  }

  void on_written(error_code ec) {
    writing_ = false;
    if (phase_ == Phase::Closed) return;
    if (phase_ != Phase::Reading) disarm();
    if (ec) return close();
    if (!out_.empty()) return flush();
    if (phase_ == Phase::Closing) return linger();
    if (phase_ == Phase::Responding && ended_) end_response();
  }

  void end_response() {
    responding_ = false;
    --srv_->busy;
    hangup_ = nullptr;
    started_ = ended_ = false;
    first_ = false;
    phase_ = keep_alive_ && !srv_->closing ? Phase::Reading : Phase::Closing;
    if (watching_) {
      socket_.cancel();  // its completion moves on (after_watch)
      return;
    }
    if (phase_ == Phase::Reading)
      read_header();
    else
      linger();
  }

  // An answer the transport gives by itself; the connection closes after it.
  void fail(int status, const std::string& message, const HttpHeaders& extra = {}) {
    phase_ = Phase::Closing;
    keep_alive_ = false;
    std::string body = srv_->error_body(status, message);
    queue(head(status, "application/json", extra) +
          "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n");
    queue(std::move(body));
    flush();
  }

  // Closes after reading (and dropping) what the client still sends, for a while: closing
  // with unread input would reset the connection and could lose the answer just written.
  void linger() {
    if (phase_ == Phase::Closed) return;
    phase_ = Phase::Closing;
    error_code ignored;
    socket_.shutdown(tcp::socket::shutdown_send, ignored);
    arm(kLingerS);
    drain();
  }

  void drain() {
    buf_.consume(buf_.size());
    socket_.async_read_some(buf_.prepare(kReadChunk),
                            [self = shared_from_this()](error_code ec, size_t n) {
                              self->drained_ += n;
                              if (ec || self->drained_ > kLingerBytes) return self->close();
                              self->drain();
                            });
  }

  void close() {
    if (phase_ == Phase::Closed) return;
    phase_ = Phase::Closed;
    disarm();
    error_code ignored;
    socket_.shutdown(tcp::socket::shutdown_both, ignored);
    socket_.close(ignored);
    if (responding_) {
      responding_ = false;
      --srv_->busy;
    }
    if (auto fn = std::exchange(hangup_, nullptr)) net::post(socket_.get_executor(), fn);
  }

  tcp::socket socket_;
  net::steady_timer timer_;
  HttpServer::Impl* srv_;
  beast::flat_buffer buf_;
  std::optional<http::request_parser<http::string_body>> parser_;
  Phase phase_ = Phase::Reading;
  uint64_t timer_gen_ = 0;
  bool first_ = true;  // no request read yet
  bool keep_alive_ = true;
  bool responding_ = false;  // counted in busy
  bool started_ = false, ended_ = false;
  bool watching_ = false, writing_ = false;
  size_t drained_ = 0;
  std::vector<std::string> out_, inflight_;
  std::function<void()> hangup_;
};

}  // namespace

void HttpServer::Impl::accept() {
  acceptor.async_accept(net::make_strand(ioc), [this](error_code ec, tcp::socket socket) {
    if (!acceptor.is_open()) return;
    if (ec) {
      // Out of descriptors, most likely: wait instead of spinning, keep the listener.
      log_warn("accept: " + ec.message());
      retry.expires_after(std::chrono::milliseconds(100));
      retry.async_wait([this](error_code e) {
        if (!e) accept();
      });
      return;
    }
    error_code ignored;
    socket.set_option(tcp::no_delay(true), ignored);
    auto s = std::make_shared<Session>(std::move(socket), this);
    s->post([s] { s->start(); });
    accept();
  });
}

HttpServer::HttpServer(HttpLimits limits, HttpHandler handler, HttpErrorBody error_body)
    : impl_(std::make_unique<Impl>()) {
  impl_->limits = limits;
  impl_->handler = std::move(handler);
  impl_->error_body = std::move(error_body);
  impl_->work.emplace(impl_->ioc.get_executor());
}

HttpServer::~HttpServer() {
  stop();
}

int HttpServer::bind(const std::string& host, int port) {
  const int fds = raise_fd_limit();
  int& max_conn = impl_->limits.max_connections;
  if (max_conn > fds - 64) {
    log_warn("--max-connections " + std::to_string(max_conn) + " is over the open-file limit (" +
             std::to_string(fds) + "); using " + std::to_string(std::max(fds - 64, 16)));
    max_conn = std::max(fds - 64, 16);
  }
  const std::string where = host + ":" + std::to_string(port);
  try {
    tcp::resolver resolver(impl_->ioc);
    const auto ep = *resolver.resolve(host, std::to_string(port)).begin();
    auto& a = impl_->acceptor;
    a.open(ep.endpoint().protocol());
    a.set_option(net::socket_base::reuse_address(true));
    a.bind(ep.endpoint());
    a.listen(net::socket_base::max_listen_connections);
    impl_->accept();
    return a.local_endpoint().port();
  } catch (const boost::system::system_error& e) {
    throw Error("cannot listen on " + where + ": " + e.what());
  }
}

void HttpServer::run(int threads) {
  auto loop = [this] {
    for (;;) {
      try {
        impl_->ioc.run();
        return;
      } catch (const std::exception& e) {
        log_warn(std::string("http: ") + e.what());
      }
    }
  };
  std::vector<std::thread> pool;
  for (int i = 1; i < threads; ++i) pool.emplace_back(loop);
  loop();
  for (auto& t : pool) t.join();
}

void HttpServer::stop_accepting() {
  impl_->closing = true;
  net::post(impl_->acceptor.get_executor(), [impl = impl_.get()] {
    error_code ignored;
    impl->acceptor.close(ignored);
    impl->retry.cancel();
  });
}

void HttpServer::stop() {
  std::lock_guard<std::mutex> lock(impl_->work_mu);
  impl_->work.reset();
  impl_->ioc.stop();
}

int HttpServer::open_connections() const {
  return impl_->open;
}

int HttpServer::busy() const {
  return impl_->busy;
}

}  // namespace ds
