#include "bench/http_client.h"

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <boost/beast/http/read.hpp>
#include <boost/beast/http/string_body.hpp>
#include <boost/beast/http/write.hpp>
#include <cctype>
#include <chrono>
#include <exception>

namespace ds {
namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;

std::chrono::steady_clock::duration seconds(double s) {
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(s));
}

// "http://host:port" -> {host, port}.
std::pair<std::string, std::string> host_port(const std::string& origin) {
  std::string rest =
      origin.substr(origin.find("://") == std::string::npos ? 0 : origin.find("://") + 3);
  std::string port = "80";
  const size_t bracket = rest.rfind(']');
  const size_t colon = rest.rfind(':');
  if (colon != std::string::npos && (bracket == std::string::npos || colon > bracket)) {
    port = rest.substr(colon + 1);
    rest.resize(colon);
  }
  if (rest.size() >= 2 && rest.front() == '[' && rest.back() == ']')
    rest = rest.substr(1, rest.size() - 2);
  return {rest, port};
}

net::awaitable<void> exchange(const HttpCall& call, HttpReply& out) {
  auto ex = co_await net::this_coro::executor;
  const auto [host, port] = host_port(call.origin);
  tcp::resolver resolver(ex);
  beast::tcp_stream stream(ex);
  stream.expires_after(seconds(call.connect_timeout_s));
  const auto endpoints = co_await resolver.async_resolve(host, port, net::use_awaitable);
  co_await stream.async_connect(endpoints, net::use_awaitable);

  http::request<http::string_body> req{http::string_to_verb(call.method), call.target, 11};
  req.set(http::field::host, host + ":" + port);
  req.set(http::field::connection, "close");
  for (const auto& [k, v] : call.headers) req.set(k, v);
  req.body() = call.body;
  req.prepare_payload();
  stream.expires_after(seconds(call.read_timeout_s));
  co_await http::async_write(stream, req, net::use_awaitable);

  beast::flat_buffer buf;
  http::response_parser<http::string_body> parser;
  parser.body_limit(boost::none);
  co_await http::async_read_header(stream, buf, parser, net::use_awaitable);
  out.status = int(parser.get().result_int());
  const bool piecewise = call.on_body && out.status == 200;
  while (!parser.is_done()) {
    stream.expires_after(seconds(call.read_timeout_s));
    co_await http::async_read_some(stream, buf, parser, net::use_awaitable);
    if (!piecewise) continue;
    std::string& body = parser.get().body();
    if (body.empty()) continue;
    const bool more = call.on_body(body);
    body.clear();  // the parser appends to what is there
    if (!more) co_return;
  }
  if (!piecewise) out.body = std::move(parser.get().body());
}

}  // namespace

HttpReply http_call(const HttpCall& call) {
  HttpReply out;
  net::io_context ioc;
  net::co_spawn(ioc, exchange(call, out), [&](std::exception_ptr e) {
    if (!e) return;
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& x) {
      out.error = call.origin + ": " + x.what();
    }
  });
  ioc.run();
  return out;
}

std::string url_encode(std::string_view s) {
  static const char* hex = "0123456789ABCDEF";
  std::string out;
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
      out += char(c);
    } else {
      out += '%';
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  return out;
}

}  // namespace ds
