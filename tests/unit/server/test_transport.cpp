// The HTTP transport on its own: an in-process server with a test handler, driven by raw
// sockets (pipelining, hang-ups, slow readers, limits).
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <future>
#include <string>
#include <thread>

#include "loopback.h"
#include "server/http_transport.h"

namespace ds {
namespace {

using namespace std::chrono_literals;

// A server on a free port, run by two I/O threads until the test ends.
class Served {
 public:
  Served(HttpLimits limits, HttpHandler handler)
      : http_(limits, std::move(handler), [](int status, const std::string& m) {
          return "{\"status\":" + std::to_string(status) + ",\"message\":\"" + m + "\"}";
        }) {
    port_ = http_.bind("127.0.0.1", 0);
    thread_ = std::thread([this] { http_.run(2); });
  }
  ~Served() {
    http_.stop();
    thread_.join();
  }
  int port() const { return port_; }
  HttpServer& http() { return http_; }

 private:
  HttpServer http_;
  int port_ = 0;
  std::thread thread_;
};

using test::connect_to;

void send_all(int fd, const std::string& s) {
  ASSERT_EQ(send(fd, s.data(), s.size(), MSG_NOSIGNAL), ssize_t(s.size()));
}

// Reads until `until` appears, the peer closes, or 5 s pass.
std::string read_until(int fd, const std::string& until = {}) {
  std::string out;
  char buf[65536];
  while (until.empty() || out.find(until) == std::string::npos) {
    const ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    out.append(buf, size_t(n));
  }
  return out;
}

void echo_path(HttpRequest& req, const std::shared_ptr<HttpExchange>& ex) {
  ex->reply(200, "text/plain", req.method + " " + req.path + " " + req.body);
}

TEST(HttpTransport, PipelinedRequestsAnswerInOrder) {
  Served s({}, echo_path);
  const int fd = connect_to(s.port());
  send_all(fd,
           "GET /a%20b?x=1 HTTP/1.1\r\nHost: h\r\n\r\n"
           "POST /c HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\n\r\nhi"
           "GET /d HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n");
  const std::string out = read_until(fd);
  close(fd);
  const size_t a = out.find("GET /a b "), c = out.find("POST /c hi"), d = out.find("GET /d ");
  ASSERT_NE(a, std::string::npos) << out;
  ASSERT_NE(c, std::string::npos) << out;
  ASSERT_NE(d, std::string::npos) << out;
  EXPECT_LT(a, c);
  EXPECT_LT(c, d);
  EXPECT_NE(out.find("Connection: close"), std::string::npos);
}

TEST(HttpTransport, LimitsAnswerAndClose) {
  HttpLimits lim;
  lim.max_header_bytes = 1024;
  lim.max_body_bytes = 10;
  Served s(lim, echo_path);
  int fd = connect_to(s.port());
  send_all(fd, "GET / HTTP/1.1\r\nX: " + std::string(2000, 'a') + "\r\n\r\n");
  EXPECT_EQ(read_until(fd).rfind("HTTP/1.1 431", 0), 0u);
  close(fd);
  fd = connect_to(s.port());
  send_all(fd, "POST / HTTP/1.1\r\nContent-Length: 11\r\n\r\n01234567890");
  const std::string out = read_until(fd);
  EXPECT_EQ(out.rfind("HTTP/1.1 413", 0), 0u) << out;
  EXPECT_NE(out.find("\"status\":413"), std::string::npos);
  close(fd);
  fd = connect_to(s.port());
  send_all(fd, "NOT HTTP\r\n\r\n");
  EXPECT_EQ(read_until(fd).rfind("HTTP/1.1 400", 0), 0u);
  close(fd);
}

TEST(HttpTransport, MaxConnections) {
  HttpLimits lim;
  lim.max_connections = 3;
  Served s(lim, echo_path);
  int fds[3];
  for (int& fd : fds) fd = connect_to(s.port());
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(s.http().open_connections(), 3);
  const int extra = connect_to(s.port());
  const std::string out = read_until(extra);
  EXPECT_EQ(out.rfind("HTTP/1.1 503", 0), 0u) << out;
  EXPECT_NE(out.find("Retry-After: 1"), std::string::npos);
  close(extra);
  for (int fd : fds) close(fd);
}

// A stream the handler feeds from another thread; the client hangs up, or stops reading.
struct Streamer {
  std::promise<void> hung_up;
  std::atomic<bool> stop{false};
  std::thread feeder;
  ~Streamer() { finish(); }
  void finish() {  // before the server goes: the feeder posts to it
    stop = true;
    if (feeder.joinable()) feeder.join();
  }
  HttpHandler handler(size_t chunk_bytes) {
    return [this, chunk_bytes](HttpRequest& req, const std::shared_ptr<HttpExchange>& ex) {
      if (req.path != "/stream") return echo_path(req, ex);
      ex->on_hangup([this] { hung_up.set_value(); });
      ex->begin_stream(200, "text/event-stream");
      feeder = std::thread([this, ex, chunk_bytes] {
        while (!stop) {
          ex->post([ex, chunk_bytes] { ex->write(std::string(chunk_bytes, 'x')); });
          std::this_thread::sleep_for(1ms);
        }
      });
    };
  }
};

TEST(HttpTransport, HangUpIsNoticed) {
  Streamer st;
  Served s({}, st.handler(10));
  const int fd = connect_to(s.port());
  send_all(fd, "GET /stream HTTP/1.1\r\n\r\n");
  EXPECT_NE(read_until(fd, "xxxx").find("Transfer-Encoding: chunked"), std::string::npos);
  close(fd);
  EXPECT_EQ(st.hung_up.get_future().wait_for(5s), std::future_status::ready);
  st.finish();
}

TEST(HttpTransport, SlowReaderIsDroppedWithoutDelayingOthers) {
  HttpLimits lim;
  lim.write_timeout_s = 0.5;
  Streamer st;
  Served s(lim, st.handler(64 << 10));
  const int slow = connect_to(s.port());
  send_all(slow, "GET /stream HTTP/1.1\r\n\r\n");  // and never reads
  auto hung_up = st.hung_up.get_future();
  for (int i = 0; i < 5; ++i) {  // others are served meanwhile
    const int fd = connect_to(s.port());
    send_all(fd, "GET /ok HTTP/1.1\r\nConnection: close\r\n\r\n");
    EXPECT_NE(read_until(fd).find("GET /ok"), std::string::npos);
    close(fd);
  }
  EXPECT_EQ(hung_up.wait_for(10s), std::future_status::ready);
  st.finish();
  close(slow);
}

TEST(HttpTransport, HalfOpenConnectionsTimeOut) {
  HttpLimits lim;
  lim.header_timeout_s = 0.3;
  Served s(lim, echo_path);
  const int fd = connect_to(s.port());
  send_all(fd, "GET / HTTP/1.1\r\nHost:");
  const auto t = std::chrono::steady_clock::now();
  EXPECT_EQ(read_until(fd), "");  // closed, unanswered
  EXPECT_LT(std::chrono::steady_clock::now() - t, 3s);
  close(fd);
}

}  // namespace
}  // namespace ds
