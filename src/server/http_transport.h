// The HTTP/1.1 transport under the API server: an event-driven server on Boost.Beast and
// Boost.Asio. A few I/O threads run every connection; each connection is a small state machine
// on its own strand (read header -> read body -> handle -> write -> next request or close), so
// an open connection costs a socket and a buffer, never a thread. Beast stays inside
// http_transport.cpp: handlers see HttpRequest and HttpExchange only.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace ds {

struct HttpLimits {
  size_t max_header_bytes = 16u << 10;
  size_t max_body_bytes = 8u << 20;
  int max_connections = 8192;    // open at once (capped by the process's file limit)
  double header_timeout_s = 10;  // a new connection's request header must arrive within this
  double body_timeout_s = 30;    // and its body within this after the header
  double idle_timeout_s = 5;     // a kept-alive connection's next request, header included
  double write_timeout_s = 30;   // one write to a client that does not read
};

using HttpHeaders = std::vector<std::pair<std::string, std::string>>;

struct HttpRequest {
  std::string method;                          // "GET", "POST", ...
  std::string path;                            // percent-decoded, without the query
  std::map<std::string, std::string> query;    // decoded
  std::map<std::string, std::string> headers;  // names lower-cased
  std::string body;
  std::string header(const std::string& lower_name) const;
};

// One request's response, written from the connection's strand: either reply() once, or
// begin_stream(), write()* and end_stream(). Calls after the client went away do nothing.
class HttpExchange {
 public:
  virtual ~HttpExchange() = default;
  virtual void reply(int status, const std::string& content_type, std::string body,
                     const HttpHeaders& extra = {}) = 0;
  virtual void begin_stream(int status, const std::string& content_type,
                            const HttpHeaders& extra = {}) = 0;
  virtual void write(std::string data) = 0;  // one chunk of a chunked body
  virtual void end_stream() = 0;
  // `fn` runs on the strand if the client goes away (or is dropped) before the response ends.
  virtual void on_hangup(std::function<void()> fn) = 0;
  // Runs `fn` on this connection's strand; safe from any thread.
  virtual void post(std::function<void()> fn) = 0;
};

// Called on the connection's strand; must answer through the exchange, now or later.
using HttpHandler = std::function<void(HttpRequest&, const std::shared_ptr<HttpExchange>&)>;
// The JSON body of an error the transport answers by itself (413, 431, 503, ...).
using HttpErrorBody = std::function<std::string(int status, const std::string& message)>;

class HttpServer {
 public:
  HttpServer(HttpLimits limits, HttpHandler handler, HttpErrorBody error_body);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds and listens; returns the port (port 0: any free one). Throws ds::Error.
  int bind(const std::string& host, int port);
  // Runs the I/O threads (the caller is one of them) until stop().
  void run(int threads);
  // Stops accepting; responses from now on close their connection.
  void stop_accepting();
  // Makes run() return; pending work is dropped.
  void stop();
  int open_connections() const;
  int busy() const;  // requests whose response has not been written in full

 public:
  struct Impl;  // (public so the connections in the .cpp can name it)

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace ds
