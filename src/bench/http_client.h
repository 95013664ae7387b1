// A small blocking HTTP/1.1 client for the online bench (Boost.Beast): one request per call on
// its own connection, its body handed over piece by piece as it arrives.
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace ds {

struct HttpCall {
  std::string origin;  // http://host[:port]
  std::string method = "GET";
  std::string target;  // path and query
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;
  double connect_timeout_s = 10;
  double read_timeout_s = 600;  // between two reads
  // When set, a 200 answer's body goes here as it arrives (return false to stop reading)
  // instead of into HttpReply::body.
  std::function<bool(std::string_view)> on_body;
};

struct HttpReply {
  int status = 0;     // 0: no answer (see error)
  std::string body;   // all of it (non-200 answers, or without on_body)
  std::string error;  // a transport failure
};

HttpReply http_call(const HttpCall& call);

// Percent-encodes a query parameter's value.
std::string url_encode(std::string_view s);

}  // namespace ds
